"""A view's storage offset is a runtime argument of the programs that read and write it: a loop
over the rows of a buffer (a KV cache, a decode loop, out= into slices) builds its kernels once,
not once per row, and gives the CPU's values."""

import pytest
import torch

import torchpjrt
from torchpjrt import dispatch, fusion, storage


def _programs():
    return (dispatch.stats["compiled"] + storage._reader.cache_info().currsize
            + storage._writer.cache_info().currsize + fusion.stats["graphs_compiled"])


def _decode(device, rows, counts=None):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(16, 16, generator=gen) * 0.1).to(device)
    x = torch.randn(16, generator=gen).to(device)
    cache = torch.zeros(rows, 16, device=device)
    out = torch.zeros(rows, 4, 16, device=device)
    for i in range(1, rows):
        cache[i].copy_(torch.tanh(cache[i - 1] @ w + x))  # read and write at row offsets
        cache[i - 1].mul_(0.5)  # in place on a row
        torch.mm(cache[i - 1 : i + 3].narrow(0, 0, 1).expand(4, 16).contiguous(), w, out=out[i])  # out= into a slice
        out[i, 1:3] += cache[i]  # a strided slice of a row block
        if counts is not None:
            cache.sum().item()  # one fused graph per iteration
            counts.append(_programs())
    return cache.cpu(), out.cpu()


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_one_program_for_every_offset(mode):
    expected = _decode("cpu", 24)
    counts = []
    with torchpjrt.eager_mode(mode):
        got = _decode("pjrt", 24, counts)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    assert counts[-1] == counts[3], counts  # nothing new after the first few rows


@pytest.mark.slow
def test_offsets_near_the_end_of_the_storage_read_right():
    # the last rows of a column view: the strided chunk reaches past the storage, so these
    # offsets stay in the program (lax.dynamic_slice would clamp them)
    base = torch.arange(60.0).reshape(6, 10)
    dev = base.to("pjrt")
    for i in range(6):
        for j in range(10):
            assert torch.equal(dev[i:, j].cpu(), base[i:, j]), (i, j)
            assert torch.equal((dev[i:, j:] * 2).cpu(), base[i:, j:] * 2), (i, j)
    dev[4:, 7].fill_(-1.0)
    base[4:, 7].fill_(-1.0)
    assert torch.equal(dev.cpu(), base)


def _runs_of(identity_name, fn):
    """How many times programs kept under `identity_name` ran during fn()."""
    from torchpjrt import kernel_cache

    runs = [0]
    original = kernel_cache.CachedKernel.__call__

    def counting(self, *args):
        runs[0] += self.identity[0] == identity_name
        return original(self, *args)

    kernel_cache.CachedKernel.__call__ = counting
    try:
        out = fn()
    finally:
        kernel_cache.CachedKernel.__call__ = original
    return out, runs[0]


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_views_in_a_list_are_read_inside_the_op(mode):
    """rotate_half's cat of a tensor's two halves, a stack of rows, an optimizer's foreach over
    views: each view is read by the op's own program (no separate strided read), with the CPU's
    values, and the offset of a row stays an argument."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    calls = [
        lambda t: torch.cat((-t[..., 4:], t[..., :4]), dim=-1),
        lambda t: torch.stack([t[0], t[1].t().t(), t[2, :, :]], 0),
        lambda t: torch.cat([t.transpose(0, 1), t.transpose(0, 1)[:, :2]], 1),
        lambda t: torch._foreach_add([t[0], t[1:3], t[0].t()], [t[1], t[2:4], t[1].t() * 2]),
    ]
    with torchpjrt.eager_mode(mode):
        px = x.to("pjrt")
        for f in calls:
            want = f(x)
            got, reads = _runs_of("storage.read", lambda: f(px))
            for g, w in zip(got if isinstance(got, (list, tuple)) else [got], want if isinstance(want, (list, tuple)) else [want]):
                torch.testing.assert_close(g.cpu(), w)
            assert reads == 0
        # rows at every offset: one program
        before = dispatch.stats["compiled"]
        for i in range(1, 4):
            torch.testing.assert_close(torch.cat([px[i], px[i - 1]]).cpu(), torch.cat([x[i], x[i - 1]]))
        assert dispatch.stats["compiled"] - before <= 1
        # a view read after its base was written sees the new values
        v = px[1:3]
        first = torch.cat([v, v])
        px.add_(1)
        torch.testing.assert_close(torch.cat([v, v]).cpu(), first.cpu() + 1)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_in_place_foreach_on_overlapping_tensors_runs_them_in_turn(mode):
    """CPU applies an in-place foreach op to its tensors one after another: a tensor listed
    twice, or views that share elements, see the earlier writes. One program over the whole
    list would read them all first and lose a write."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    cases = [
        lambda t: torch._foreach_mul_([t[0], t[:, 1]], 3.0),
        lambda t: torch._foreach_mul_([t, t], 3.0),
        lambda t: torch._foreach_add_([t, t[1:]], [t.clone(), t[1:] * 2], alpha=0.5),
        lambda t: torch._foreach_addcdiv_([t[0], t[0]], [t[1], t[2]], [t[3], t[3] + 5], torch.tensor([0.5, 2.0])),
        lambda t: torch._foreach_lerp_([t, t], [t * 2, t * 3], [0.25, 0.75]),
    ]
    with torchpjrt.eager_mode(mode):
        for _ in range(3):  # again once the compiled helper's kernels know the programs
            for i, f in enumerate(cases):
                want, got = x.clone(), x.to("pjrt")
                f(want)
                f(got)
                torch.testing.assert_close(got.cpu(), want, msg=f"case {i}")


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_item_of_a_view_of_a_small_storage_runs_no_program(mode):
    """`.item()` of an element of a small tensor (a loop over the experts a routing hit, over a
    nonzero result's rows) takes it from the storage's host copy: no strided-read program, one
    copy for every element, and a write gives the next read the new values."""
    with torchpjrt.eager_mode(mode):
        for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.complex64):
            x = (torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
            px = x.to("pjrt")
            torch.pjrt.synchronize()
            got, reads = _runs_of("storage.read", lambda: [[px[i, j].item() for j in range(7)] for i in range(5)])
            want = [[x[i, j].item() for j in range(7)] for i in range(5)]
            assert got == want and type(got[1][2]) is type(want[1][2]) and reads == 0, dtype
            assert px.t()[3, 2].item() == x.t()[3, 2].item()
            px[1, 2] = 7
            x[1, 2] = 7
            assert px[1, 2].item() == x[1, 2].item()
        big = torch.arange(10000, device="pjrt")  # a large storage: only the element is read
        assert big[9999].item() == 9999
        hits = torch.tensor([0, 1, 0, 1, 1], device="pjrt").nonzero()
        assert [int(e[0]) for e in hits] == [1, 3, 4]


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_out_into_an_empty_tensor_grows_it_without_a_program(mode):
    """An op writing into an empty `out=` tensor resizes it first: there is nothing to keep, so
    the grown storage is a zero fill (shared when small), with no growing program; a storage
    with elements still keeps them when it grows."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    with torchpjrt.eager_mode(mode):
        px = x.to("pjrt")
        torch.pjrt.synchronize()
        for dtype in (torch.float32, torch.int64):
            out = torch.empty(0, dtype=dtype, device="pjrt")
            _, grows = _runs_of("storage.grow", lambda: torch.cumsum(px.to(dtype), 1, out=out))
            torch.testing.assert_close(out.cpu(), torch.cumsum(x.to(dtype), 1))
            assert grows == 0 and out.shape == (5, 6)
        kept = torch.ones(3, device="pjrt")
        kept.resize_(5)
        assert kept.shape == (5,) and kept[:3].sum().item() == 3
