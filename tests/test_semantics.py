"""PyTorch's memory semantics on pjrt, compared with CPU case by case.

Each case is a function of freshly made input tensors: it may mutate them through views,
in-place ops and out=; its outputs and the final state of every input must equal CPU's.
"""

import pytest
import torch

from conftest import assert_same, to_dev

# every case runs in strict, debug and fused eager mode
pytestmark = pytest.mark.usefixtures("each_eager_mode")


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, 6, generator=g),
        torch.randn(6, generator=g),
        torch.arange(24).reshape(4, 6),
    ]


CASES = {
    # views alias their base
    "write_through_slice": lambda x, y, i: x[1:3].add_(1),
    "write_through_column": lambda x, y, i: x[:, 2].mul_(3),
    "write_through_transpose": lambda x, y, i: x.t().add_(torch.ones(6, 4, device=x.device)),
    "write_through_strided_flat": lambda x, y, i: x.view(-1)[::5].zero_(),
    "chained_views": lambda x, y, i: x[1:].t()[::2].fill_(5.0),
    "diagonal_copy": lambda x, y, i: x.diagonal().copy_(torch.arange(4.0)),
    "unfold_read": lambda x, y, i: x.unfold(1, 3, 2) * 2,
    "expand_read": lambda x, y, i: y.expand(4, 6) + x,
    "expand_then_contiguous": lambda x, y, i: y.unsqueeze(0).expand(3, 6).contiguous(),
    "narrow_write": lambda x, y, i: x.narrow(1, 2, 3).sub_(1),
    "split_write": lambda x, y, i: x.split(2, dim=1)[1].fill_(-1.0),
    "chunk_read": lambda x, y, i: [c.sum() for c in x.chunk(3, dim=1)],
    "unbind_write": lambda x, y, i: x.unbind(0)[2].mul_(0),
    "as_strided_read": lambda x, y, i: x.as_strided((3, 3), (1, 6), 2) + 0,
    "as_strided_write": lambda x, y, i: x.as_strided((2, 2), (7, 1), 1).fill_(9.0),
    "select_write": lambda x, y, i: x.select(1, 4).neg_(),
    "squeeze_unsqueeze_write": lambda x, y, i: x.unsqueeze(0)[0, :, 1:2].squeeze(1).add_(10),
    "permute_reshape_read": lambda x, y, i: x.reshape(2, 2, 6).permute(2, 0, 1).reshape(6, 4) * 1,
    "view_as_base_write": lambda x, y, i: (x.view(24)[3:9].view(2, 3).add_(1), x.sum()),
    "inplace_view_op": lambda x, y, i: x.t_().add_(1),
    "detach_shares_storage": lambda x, y, i: x.detach().mul_(2),
    "data_shares_storage": lambda x, y, i: x.data.add_(1),
    "clone_is_a_copy": lambda x, y, i: (x.clone().add_(1), x),
    "contiguous_of_transpose": lambda x, y, i: x.t().contiguous().view(-1),
    "reshape_of_noncontiguous": lambda x, y, i: x.t().reshape(-1),
    "is_contiguous_and_strides": lambda x, y, i: (x.t().is_contiguous(), x.t().stride(), x[:, 1:].stride()),
    "storage_offset": lambda x, y, i: (x[1:, 2:].storage_offset(), x[2].storage_offset()),
    # out=
    "out_plain": lambda x, y, i: torch.add(x, y, out=torch.empty(4, 6, device=x.device)),
    "out_into_view": lambda x, y, i: torch.mul(x[:, :3], 2, out=x[:, 3:]),
    "out_resized_from_empty": lambda x, y, i: torch.sub(x, 1, out=torch.empty(0, device=x.device)),
    "out_two_results": lambda x, y, i: torch.max(
        x, 1, out=(torch.empty(0, device=x.device), torch.empty(0, dtype=torch.long, device=x.device))
    ),
    # indexing assignment
    "setitem_int": lambda x, y, i: x.__setitem__(0, 5.0),
    "setitem_slice_tensor": lambda x, y, i: x.__setitem__((slice(None), 2), y[:4]),
    "setitem_index_list": lambda x, y, i: x.__setitem__([0, 2], y),
    "setitem_mask": lambda x, y, i: x.__setitem__(x > 0.5, 0.0),
    "setitem_tensor_index_and_slice": lambda x, y, i: x.__setitem__(
        (torch.tensor([3, 1], device=x.device), slice(1, None)), -2.0
    ),
    "index_put_accumulate": lambda x, y, i: x.index_put_(
        (torch.tensor([0, 0, 2], device=x.device),), torch.ones(3, 6, device=x.device), accumulate=True
    ),
    "getitem_advanced": lambda x, y, i: (x[[0, 3, 1]], x[:, [1, 1, 4]], x[x > 0], i[i % 5 == 0]),
    "getitem_ellipsis_none": lambda x, y, i: x[None, ..., 1::2],
    # type promotion
    "int_plus_float_scalar": lambda x, y, i: i + 1.5,
    "int_times_float_tensor": lambda x, y, i: i * x,
    "int_true_divide": lambda x, y, i: i / 4,
    "int_floor_divide": lambda x, y, i: i // 5,
    "float_plus_double_scalar_tensor": lambda x, y, i: x + torch.tensor(2.0, dtype=torch.float64),
    "bool_plus_int": lambda x, y, i: (x > 0) + i,
    "int_sum_is_long": lambda x, y, i: (i.sum(), (x > 0).sum()),
    "float_to_half_and_back": lambda x, y, i: (x.half().float(), x.to(torch.bfloat16), x.double()),
    "comparison_dtypes": lambda x, y, i: (x > y, i == 3, x.eq(0)),
    "inplace_int_by_float_raises": lambda x, y, i: _raises(lambda: i.add_(1.5)),
    "shape_mismatch_raises": lambda x, y, i: _raises(lambda: x + torch.ones(5, device=x.device)),
}


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return "no error"


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_cpu(name):
    fn = CASES[name]
    cpu_inputs = _inputs()
    dev_inputs = [t.to("pjrt") for t in cpu_inputs]
    expected = fn(*cpu_inputs)
    actual = fn(*dev_inputs)
    assert_same(expected, actual)
    for c, d in zip(cpu_inputs, dev_inputs):
        assert_same(c, d)


def test_views_share_storage_object():
    x = torch.randn(3, 4, device="pjrt")
    v = x[1:].t()
    assert v._base is x
    assert v.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert type(v) is torch.Tensor


def test_version_counter_check_fires_as_on_cpu():
    def run(device):
        w = torch.randn(3, requires_grad=True, device=device)
        a = w.sigmoid()
        a.mul_(2)  # sigmoid saved its output for backward
        a.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run("cpu")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run("pjrt")


def test_version_counter_bumps_through_views():
    x = torch.zeros(4, device="pjrt")
    v0 = x._version
    x[1:3].add_(1)
    assert x._version > v0


def test_autograd_small_network_matches_cpu():
    torch.manual_seed(0)
    w1, b1, w2 = torch.randn(8, 5), torch.randn(8), torch.randn(3, 8)
    xb = torch.randn(16, 5)

    def grads(device):
        params = [t.detach().clone().to(device).requires_grad_() for t in (w1, b1, w2)]
        h = torch.tanh(xb.to(device) @ params[0].t() + params[1])
        out = (h @ params[2].t()).log_softmax(-1)
        loss = -(out[:, 0].mean()) + (h ** 2).mean()
        loss.backward()
        return [loss] + [p.grad for p in params]

    for c, p in zip(grads("cpu"), grads("pjrt")):
        assert_same(c, p, rtol=1e-5, atol=1e-6)


def test_grad_through_inplace_on_view():
    def run(device):
        a = torch.arange(6.0, device=device).requires_grad_()
        b = a * 1
        b[2:4].mul_(3)
        b.sum().backward()
        return a.grad

    assert_same(run("cpu"), run("pjrt"))


def test_printing_matches_cpu():
    x = torch.arange(6.0).reshape(2, 3)
    s = str(x.to("pjrt"))
    assert s == str(x)[:-1] + ", device='pjrt:0')"


def test_to_and_from_device_roundtrip_dtypes():
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
               torch.int8, torch.uint8, torch.bool):
        x = (torch.randn(3, 5) * 10).to(dt)
        assert torch.equal(x.to("pjrt").cpu(), x), dt


def test_non_blocking_copies():
    x = torch.randn(4, 4)
    y = x.to("pjrt", non_blocking=True)
    torch.pjrt.synchronize()
    assert torch.equal(y.cpu(), x)
    z = torch.empty(4, 4)
    z.copy_(y, non_blocking=True)
    assert torch.equal(z, x)


def test_numpy_raises_like_cuda():
    with pytest.raises(TypeError, match="pjrt"):
        torch.ones(2, device="pjrt").numpy()


def test_tensor_constructor_and_item():
    t = torch.tensor([[1, 2], [3, 4]], device="pjrt")
    assert t.device.type == "pjrt" and t.dtype == torch.int64
    assert t.sum().item() == 10
    assert bool(t.max() == 4)
    assert t.tolist() == [[1, 2], [3, 4]]


def test_cpu_non_scalar_with_pjrt_raises_device_mismatch():
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3, device="pjrt") + torch.ones(3)


def test_cpu_scalar_tensor_with_pjrt_is_allowed():
    out = torch.ones(3, device="pjrt") * torch.tensor(2.0)
    assert torch.equal(out.cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize("device_fn", ["zeros", "ones", "empty", "rand", "randn"])
def test_factories(device_fn):
    t = getattr(torch, device_fn)(2, 3, device="pjrt")
    assert t.shape == (2, 3) and t.device.type == "pjrt" and t.dtype == torch.float32
    assert t.cpu().shape == (2, 3)


def test_factory_values_match_cpu():
    cases = [
        lambda d: torch.full((2, 3), 7, device=d),
        lambda d: torch.arange(10, device=d),
        lambda d: torch.arange(0, 1, 0.125, device=d),
        lambda d: torch.linspace(0, 1, 5, device=d),
        lambda d: torch.eye(3, device=d),
        lambda d: torch.eye(2, 4, dtype=torch.int64, device=d),
        lambda d: torch.zeros_like(torch.ones(2, 2, device=d), dtype=torch.int32),
        lambda d: torch.ones(2, 2, device=d).new_full((3,), 2.5),
        lambda d: torch.ones(2, 2, device=d).new_zeros((1, 2)),
        lambda d: torch.full_like(torch.ones(2, device=d), 3),
    ]
    for case in cases:
        assert_same(case("cpu"), case("pjrt"))


def test_factories_follow_the_default_dtype_of_each_call():
    """A factory's dtype=None is the default dtype at the call: after a float32 call, the same
    arguments under set_default_dtype(float64) gave the kept float32 result (arange, linspace)."""
    cases = [lambda d: torch.arange(5.0, device=d), lambda d: torch.arange(0.5, 3.0, device=d),
             lambda d: torch.linspace(0, 1, 5, device=d), lambda d: torch.eye(2, device=d),
             lambda d: torch.full((2,), 1.5, device=d)]
    for case in cases:
        assert case("pjrt").dtype == torch.float32
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for case in cases:
            for _ in range(2):
                assert_same(case("cpu"), case("pjrt"))
    finally:
        torch.set_default_dtype(before)


def test_programs_without_inputs_run_once_and_their_results_stay_apart(each_eager_mode):
    """`torch.arange(n)`, `torch.zeros`, `torch.eye` with static arguments give the same values
    every call: strict mode runs each program once and shares its small result. A write to one
    result (in place, through a view, a transpose in place) must not reach another."""
    from torchpjrt import kernel_cache

    runs = []
    original = kernel_cache.CachedKernel.__call__

    def counting(self, *args):
        runs.append(self.identity[0])
        return original(self, *args)

    for round in range(3):
        kernel_cache.CachedKernel.__call__ = counting
        try:
            a, b = torch.arange(10, device="pjrt"), torch.arange(10, device="pjrt")
        finally:
            kernel_cache.CachedKernel.__call__ = original
        if round and each_eager_mode == "strict":
            assert "aten::arange.start_step" not in runs, runs
        a.add_(1)
        assert b.tolist() == list(range(10)) and a.tolist() == list(range(1, 11))
        z = torch.zeros(3, 4, device="pjrt")
        z[1] = 5
        assert torch.zeros(3, 4, device="pjrt").sum().item() == 0 and z.sum().item() == 20
        e = torch.eye(3, device="pjrt")
        e.t_()[0, 1] = 7
        assert torch.eye(3, device="pjrt").sum().item() == 3
        r1, r2 = torch.randn(3, device="pjrt"), torch.randn(3, device="pjrt")
        assert not torch.equal(r1, r2)  # random factories are not constants
        runs.clear()


def test_whole_storage_fills_run_once_and_their_results_stay_apart(each_eager_mode):
    """zero_() and fill_(number) of a whole small storage (torch.zeros, ones_like, full, the
    seed gradient of backward) take a shared result: after the first call no program runs.
    Each fill value keeps its own result (-0.0 and 0.0, NaN, ints and floats), a write to one
    tensor reaches no other, and a fill of a view writes only the view."""
    from torchpjrt import kernel_cache

    runs = []
    original = kernel_cache.CachedKernel.__call__

    def counting(self, *args):
        runs.append(self.identity[0])
        return original(self, *args)

    def fills(device):
        return [torch.zeros(3, 4, device=device), torch.ones(3, 4, device=device),
                torch.full((3, 4), 2.5, device=device), torch.full((3, 4), -0.0, device=device),
                torch.full((3, 4), 0.0, device=device), torch.full((3,), float("nan"), device=device),
                torch.full((3,), 7, dtype=torch.int64, device=device), torch.full((3,), 7.9, dtype=torch.int32, device=device),
                torch.full((2,), True, device=device), torch.zeros_like(torch.empty(5, dtype=torch.float16, device=device)),
                torch.empty(2, 2, device=device).fill_(-3), torch.ones(4, device=device).zero_()]

    for round in range(3):
        kernel_cache.CachedKernel.__call__ = counting
        try:
            made = fills("pjrt")
        finally:
            kernel_cache.CachedKernel.__call__ = original
        if round:
            assert runs == [], runs
        for cpu, pjrt in zip(fills("cpu"), made):
            assert_same(cpu, pjrt)
        assert torch.signbit(made[3]).all() and not torch.signbit(made[4]).any()
        made[1].add_(1)
        made[2][0] = 9
        assert torch.ones(3, 4, device="pjrt").sum().item() == 12
        assert torch.full((3, 4), 2.5, device="pjrt").sum().item() == 30
        row = torch.zeros(3, 4, device="pjrt")
        row[1].fill_(5)
        assert row.sum().item() == 20 and torch.zeros(3, 4, device="pjrt").sum().item() == 0
        runs.clear()


def test_low_precision_lerp_computes_in_float32_as_cpu():
    """CPU's lerp of float16/bfloat16 computes in float32 and rounds once: a weight beyond
    float16's range (lerp(a, a, 1e6) is a) gives no inf * 0."""
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        a, b, w = torch.randn(64, dtype=dtype), torch.randn(64, dtype=dtype), torch.rand(64, dtype=dtype)
        for weight in (0.3, 0.7, -2.0, 1e6):
            assert_same(torch.lerp(a, b, weight), torch.lerp(to_dev(a), to_dev(b), weight), rtol=0, atol=0)
        assert_same(torch.lerp(a, a, 1e6), torch.lerp(to_dev(a), to_dev(a), 1e6), rtol=0, atol=0)
        assert_same(torch.lerp(a, b, w), torch.lerp(to_dev(a), to_dev(b), to_dev(w)), rtol=0, atol=0)


def test_printing_compiles_nothing_and_keeps_the_suffixes():
    from torchpjrt import live_programs, printing

    torch.manual_seed(0)
    cases = [torch.randn(23, 41), torch.randn(5, dtype=torch.complex64).conj(), torch.tensor([7, -3, 2]),
             torch.tensor([float("nan"), float("inf"), -0.0]), torch.randn(3, 7, dtype=torch.bfloat16),
             torch.randn(2, 3000), torch.empty(0, 3), torch.tensor(2.5)]
    def words(text):  # the same numbers, laid out the same; the pjrt suffix may wrap the line
        return " ".join(text.split()).replace(", device='pjrt:0'", "")

    before = live_programs.stats["xla_compiles"]
    for x in cases:
        assert words(str(x.to("pjrt"))) == words(str(x))
    assert live_programs.stats["xla_compiles"] == before  # formatted from a CPU copy
    w = torch.randn(3).to("pjrt").requires_grad_()
    assert str(w * 2).endswith("device='pjrt:0', grad_fn=<MulBackward0>)") and "requires_grad=True" in str(w)
    # a tensor too large to copy whole is summarized on the device, as PyTorch does it
    big = torch.randn(70, 70)
    old = printing.COPIED_ELEMENTS
    printing.COPIED_ELEMENTS = 100
    try:
        assert words(str(big.to("pjrt"))) == words(str(big))
    finally:
        printing.COPIED_ELEMENTS = old
