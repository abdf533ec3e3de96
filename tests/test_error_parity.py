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
