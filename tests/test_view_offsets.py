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
