"""Errors that PyTorch's device-generic tests found differing from the CPU's: the exception type
and message (and warnings) a pjrt call gives match the CPU's, in every eager mode; layouts pjrt
cannot hold are a NotImplementedError that names them."""

import warnings

import pytest
import torch

import torchpjrt  # noqa: F401

pytestmark = pytest.mark.usefixtures("each_eager_mode")


def outcome(fn, device):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn(device)
            torch.pjrt.synchronize()
            result = ("ok",)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            result = (type(e).__name__, str(e).split("\n")[0])
    # PyTorch's C++ warnings end with where they were raised
    return result, sorted({str(w.message).split(" (Triggered internally")[0] for w in caught
                           if "deprecated" in str(w.message)})


CASES = {
    "nonzero into a float out=": lambda d: torch.nonzero(torch.tensor([1, 0, 2], device=d), out=torch.empty(0, device=d)),
    "nonzero into an int32 out=": lambda d: torch.nonzero(torch.tensor([1, 0], device=d),
                                                          out=torch.empty(0, dtype=torch.int32, device=d)),
    "in-place op broadcasting into a smaller tensor": lambda d: torch.ones(3, device=d).remainder_(torch.ones(2, 3, device=d)),
    "in-place pow broadcasting": lambda d: torch.ones(1, 3, device=d).pow_(torch.ones(4, 1, device=d)),
    "indices that do not broadcast": lambda d: torch.ones(3, 4, device=d)[torch.tensor([0, 1], device=d),
                                                                         torch.tensor([0, 1, 2], device=d)],
    "index_put_ with indices that do not broadcast": lambda d: torch.zeros(3, 4, device=d).index_put_(
        (torch.tensor([0, 1], device=d), torch.tensor([0, 1, 2], device=d)), torch.tensor(1.0, device=d)),
    "uint8 mask (deprecated)": lambda d: torch.ones(3, device=d)[torch.tensor([1, 0, 1], dtype=torch.uint8, device=d)],
    "in-place op that fits": lambda d: torch.ones(2, 3, device=d).remainder_(torch.ones(3, device=d)),
    "clamp without bounds": lambda d: torch.clamp(torch.ones(3, device=d)),
    "clamp_ without bounds": lambda d: torch.ones(3, device=d).clamp_(),
}


@pytest.mark.parametrize("name", list(CASES))
def test_error_matches_cpu(name):
    assert outcome(CASES[name], "pjrt") == outcome(CASES[name], "cpu")


def test_quantized_and_sparse_tensors_are_clear_errors():
    x = torch.ones(2, 3, device="pjrt")
    with pytest.raises(NotImplementedError, match="quantized tensors are not supported on the pjrt device"):
        torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)
    with pytest.raises(NotImplementedError, match="quantized tensors are not supported on the pjrt device"):
        torch._empty_affine_quantized([2, 3], scale=0.1, zero_point=0, dtype=torch.quint8, device="pjrt")
    with pytest.raises(NotImplementedError, match="quantized tensors are not supported on the pjrt device"):
        torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8).to("pjrt")
    with pytest.raises(NotImplementedError, match="sparse layouts .* are not supported on the pjrt device"):
        x.to_sparse()
    with pytest.raises(NotImplementedError, match="sparse layouts .* are not supported on the pjrt device"):
        x.to_sparse_csr()
    # sparse tensors assembled from pjrt parts: their ops reach the sparse dispatch keys
    csr = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([1.0, 2.0]),
                                  size=(2, 2), device="pjrt")
    with pytest.raises(NotImplementedError, match="sparse layouts .* are not supported on the pjrt device"):
        csr @ torch.ones(2, 2, device="pjrt")
    with pytest.raises(NotImplementedError, match="sparse layouts .* are not supported on the pjrt device"):
        torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 1]]), torch.tensor([1.0, 2.0]), size=(2, 2), device="pjrt")


f16 = torch.float16
NUMBERS_CPU_CHECKS = {
    # name: (fn(device, number), a number that fits, one CPU refuses ("without overflow"))
    "fill_ float16": (lambda d, v: torch.ones(3, dtype=f16, device=d).fill_(v), 2.0, 1e6),
    "fill_ int64 NaN": (lambda d, v: torch.ones(3, dtype=torch.int64, device=d).fill_(v), 2.0, float("nan")),
    "full int8": (lambda d, v: torch.full((3,), v, dtype=torch.int8, device=d), 100, 300),
    "full float32": (lambda d, v: torch.full((2, 3), v, device=d), 1e38, 1e39),
    "zeros_like then fill_ uint8 from a negative float": (
        lambda d, v: torch.zeros_like(torch.ones(3, dtype=torch.uint8, device=d)).fill_(v), 3.0, -1.0),
    "fill_ of a view": (lambda d, v: torch.ones(4, dtype=f16, device=d)[1:].fill_(v), 2.0, 70000.0),
    "masked_fill float16": (lambda d, v: torch.ones(3, dtype=f16, device=d).masked_fill(
        torch.tensor([True, False, True], device=d), v), -1e4, -1e9),
    "index_fill int8": (lambda d, v: torch.ones(3, dtype=torch.int8, device=d).index_fill(
        0, torch.tensor([0], device=d), v), 5, 300),
    "clamp float16": (lambda d, v: torch.ones(3, dtype=f16, device=d).clamp(max=v), 2.0, 1e6),
    "clamp_ int8": (lambda d, v: torch.ones(3, dtype=torch.int8, device=d).clamp_(min=v), 2, -300),
    "add alpha int8": (lambda d, v: torch.ones(3, dtype=torch.int8, device=d).add(
        torch.ones(3, dtype=torch.int8, device=d), alpha=v), 2, 300),
    "add_ alpha bfloat16": (lambda d, v: torch.ones(3, dtype=torch.bfloat16, device=d).add_(
        torch.ones(3, dtype=torch.bfloat16, device=d), alpha=v), -0.5, 1e39),
    "pow float16": (lambda d, v: torch.ones(3, dtype=f16, device=d).pow(v), 2.5, 1e6),
    "addcmul int8 (computing type)": (lambda d, v: torch.ones(3, dtype=torch.int8, device=d).addcmul(
        torch.ones(3, dtype=torch.int8, device=d), torch.ones(3, dtype=torch.int8, device=d), value=v), 2, 300),
    "addcmul float16 fits its computing type": (lambda d, v: torch.ones(3, dtype=f16, device=d).addcmul(
        torch.ones(3, dtype=f16, device=d), torch.ones(3, dtype=f16, device=d), value=v), 2.0, 1e6),
    "_foreach_add_ alpha int8": (lambda d, v: torch._foreach_add_(
        [torch.ones(3, dtype=torch.int8, device=d)], [torch.ones(3, dtype=torch.int8, device=d)], alpha=v), 2, 300),
    "_foreach_addcdiv_ per-tensor values": (lambda d, v: torch._foreach_addcdiv_(
        [torch.ones(3, device=d), torch.ones(2, device=d)], [torch.ones(3, device=d), torch.ones(2, device=d)],
        [torch.ones(3, device=d), torch.ones(2, device=d)], [0.5, v]), -0.1, 1e39),
    "hardtanh float16": (lambda d, v: torch.nn.functional.hardtanh(torch.ones(3, dtype=f16, device=d), -v, v), 2.0, 1e5),
}


@pytest.mark.parametrize("name", list(NUMBERS_CPU_CHECKS))
def test_numbers_that_do_not_fit_raise_as_on_cpu(name):
    """CPU converts these number arguments with overflow checks: `half.fill_(1e6)` raises there
    where a plain cast would give inf. The same call with fitting numbers runs first, several
    times, so that the compiled hot path serves the call that must raise."""
    fn, fits, refused = NUMBERS_CPU_CHECKS[name]
    for _ in range(3):
        assert outcome(lambda d: fn(d, fits), "pjrt") == outcome(lambda d: fn(d, fits), "cpu") == (("ok",), [])
    expected = outcome(lambda d: fn(d, refused), "cpu")
    if name.endswith("fits its computing type"):
        assert expected == (("ok",), [])
    else:
        assert "without overflow" in expected[0][1]
    assert outcome(lambda d: fn(d, refused), "pjrt") == expected
