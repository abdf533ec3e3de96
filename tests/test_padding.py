"""Padded storages (torchpjrt/padding.py): data-dependent sizes rounded up to buckets. Every
result is checked against the CPU; the padded positions are filled with NaN where a rule must
mask them, so a rule that let them through would show."""

import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torchpjrt
from torchpjrt import dispatch, padding

pytestmark = pytest.mark.skipif(not padding.enabled, reason="TORCHPJRT_PADDING is off")


def _routed(n_rows=12, keep=7, seed=0):
    """(CPU index, pjrt index): `keep` of `n_rows` positions, row 0 never among them."""
    g = torch.Generator().manual_seed(seed)
    chosen = (torch.randperm(n_rows - 1, generator=g)[:keep] + 1).sort().values
    mask = torch.zeros(n_rows, dtype=torch.bool)
    mask[chosen] = True
    (idx,) = torch.where(mask)
    (pidx,) = torch.where(mask.to("pjrt"))
    return idx, pidx


def _rows(idx, pidx, cols=5, seed=1):
    """Rows of a table gathered by the routed index. Row 0 of the table is NaN: the padded
    positions (nonzero fills them with index 0) hold NaN, the real ones never do."""
    table = torch.randn(12, cols, generator=torch.Generator().manual_seed(seed))
    table[0] = float("nan")
    return table[idx], table.to("pjrt")[pidx]


def _check(got, want, padded=True):
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want, equal_nan=False)
    if padded:
        assert padding.storage_padding_of(got) is not None, "the result lost its padding"


def test_nonzero_where_and_masks_match_cpu_and_are_padded():
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    m = x > 0.3
    px, pm = x.to("pjrt"), m.to("pjrt")
    nz = pm.nonzero()
    assert torch.equal(nz.cpu(), m.nonzero())
    assert padding.storage_padding_of(nz) == (m.sum().item(), 16)
    for got, want in zip(torch.where(pm), torch.where(m)):
        assert torch.equal(got.cpu(), want)
        assert padding.storage_padding_of(got) is not None
    _check(px[pm], x[m])
    _check(px[pm[:, 0]], x[m[:, 0]])
    # a mask that selects everything, or nothing, is exact
    assert torch.equal(torch.ones(3, 3, device="pjrt").nonzero().cpu(), torch.ones(3, 3).nonzero())
    assert torch.zeros(5, device="pjrt").nonzero().shape == (0, 1)


def test_pointwise_keeps_padding_and_broadcasts():
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    b, pb = _rows(idx, pidx, seed=2)
    w = torch.randn(5)
    col = torch.randn(7, 1)
    _check(pa * 2 + 1, a * 2 + 1)
    _check((pa * pb).sigmoid(), (a * b).sigmoid())
    _check(pa + w.to("pjrt"), a + w)
    _check(torch.where(pa > 0, pa, pb), torch.where(a > 0, a, b))
    _check(pa.t().exp(), a.t().exp())
    _check(pa.to(torch.float64) * 3, a.to(torch.float64) * 3)
    # an exact tensor along the padded dimension: computed exactly
    _check(pa + col.to("pjrt"), a + col, padded=False)


def test_padded_storages_are_counted_while_they_live():
    # the rules run only while a padded storage lives (`padding.live`): each result marked padded
    # is counted, and counted out when its storage dies
    start = padding.live
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    results = [pa * 2, (pa * 2).sigmoid(), torch.nonzero(pa > 0)]
    assert padding.live >= start + 4 and all(padding.storage_padding_of(r) for r in results)
    del idx, pidx, a, pa, results
    gc.collect()
    assert padding.live == start


def test_inplace_and_like_factories():
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    b, pb = _rows(idx, pidx, seed=3)
    pa, a = pa.clone(), a.clone()
    pa.mul_(pb).add_(1)
    a.mul_(b).add_(1)
    _check(pa, a)
    _check(torch.zeros_like(pa), torch.zeros_like(a))
    _check(torch.full_like(pa, 2.5), torch.full_like(a, 2.5))
    _check(torch.ones_like(pb).sub_(pb), torch.ones_like(b).sub_(b))
    pa.fill_(3)
    a.fill_(3)
    _check(pa, a)


def test_matmuls_rows_columns_and_masked_contractions():
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx, cols=5)
    b, pb = _rows(idx, pidx, cols=3, seed=4)
    w = torch.randn(5, 4)
    pw = w.to("pjrt")
    _check(pa @ pw, a @ w)
    _check(pw.t() @ pa.t(), w.t() @ a.t())
    bias = torch.randn(4)
    _check(torch.addmm(bias.to("pjrt"), pa, pw), torch.addmm(bias, a, w))
    # contracted over the padded rows: the NaN padding must not reach the result
    _check(pa.t() @ pb, a.t() @ b, padded=False)
    assert not (pa.t() @ pb).isnan().any()
    ba, pba = a.reshape(7, 1, 5), pa.reshape(7, 1, 5)
    _check(torch.bmm(pba, pba.transpose(1, 2)), torch.bmm(ba, ba.transpose(1, 2)))


def test_sums_keep_or_mask_the_padded_dimension():
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    _check(pa.sum(1), a.sum(1))
    _check(pa.sum(1, keepdim=True), a.sum(1, keepdim=True))
    _check(pa.sum(0), a.sum(0), padded=False)
    _check(pa.sum(), a.sum(), padded=False)
    assert not pa.sum(0).isnan().any()
    _check(pa.mean(1), a.mean(1))
    for dtype in (torch.float32, torch.bfloat16):
        for fn in (lambda t: t.mean(), lambda t: t.mean(0), lambda t: t.mean((0, 1), keepdim=True),
                   lambda t: t.mean(0, dtype=torch.float64)):
            _check(fn(pa.to(dtype)), fn(a.to(dtype)), padded=False)
    for dims, error in (((0, 0), RuntimeError), ((5,), IndexError)):  # refused as on CPU
        with pytest.raises(error):
            a.mean(dims)
        with pytest.raises(error):
            pa.mean(dims)


def test_gathers_and_accumulating_scatters():
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    table = torch.randn(12, 5)
    pt = table.to("pjrt")
    _check(pt[pidx], table[idx])
    _check(pt[pidx, pidx % 5], table[idx, idx % 5])
    _check(pt.index_select(0, pidx), table.index_select(0, idx))
    _check(pt.index_select(1, pidx % 5), table.index_select(1, idx % 5))
    out, pout = torch.zeros(12, 5), torch.zeros(12, 5, device="pjrt")
    out.index_add_(0, idx, a)
    pout.index_add_(0, pidx, pa)
    _check(pout, out, padded=False)
    _check(torch.index_add(pt, 0, pidx, pa), torch.index_add(table, 0, idx, a), padded=False)
    out, pout = torch.zeros(12, 5), torch.zeros(12, 5, device="pjrt")
    out.index_put_((idx,), a, accumulate=True)
    pout.index_put_((pidx,), pa, accumulate=True)
    _check(pout, out, padded=False)
    # not accumulating: exact
    out[idx] = a
    pout[pidx] = pa
    _check(pout, out, padded=False)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_masked_reads_run_inside_the_op(mode):
    """A rule that must mask the padded positions (a contraction over them, a sum, a scatter
    that accumulates, a gather's padded indices) hands the op the padded view marked: the op's
    own program reads it masked, with no program of its own for the mask or the read. The
    NaN in the padding must not reach a result, and float and integer fills do not mix up."""
    from torchpjrt import kernel_cache

    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    b, pb = _rows(idx, pidx, cols=3, seed=4)
    table = torch.randn(12, 5)
    runs = []
    original = kernel_cache.CachedKernel.__call__

    def counting(self, *args):
        runs.append(self.identity[0])
        return original(self, *args)

    kernel_cache.CachedKernel.__call__ = counting
    try:
        with torchpjrt.eager_mode(mode):
            pt = table.to("pjrt")
            pout = torch.zeros(12, 5, device="pjrt")
            got = [pa.t() @ pb, pa.sum(0), pt.index_select(0, pidx), torch.index_add(pt, 0, pidx, pa),
                   pout.index_put_((pidx,), pa, accumulate=True), (pa.t() @ pb).sum(), pa.sum()]
            torch.pjrt.synchronize()
    finally:
        kernel_cache.CachedKernel.__call__ = original
    got = [g.cpu() for g in got]  # reading a padded result's rows to the host is a strided read
    out = torch.zeros(12, 5)
    want = [a.t() @ b, a.sum(0), table.index_select(0, idx), torch.index_add(table, 0, idx, a),
            out.index_put_((idx,), a, accumulate=True), (a.t() @ b).sum(), a.sum()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert "padding.fill_beyond" not in runs and "storage.read" not in runs, [r for r in runs if "." in r[:9]]


def test_cat_and_ops_without_rules_are_exact():
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    _check(torch.cat([pa, pa * 2], 1), torch.cat([a, a * 2], 1))
    _check(torch.cat([pa, pa], 0), torch.cat([a, a], 0), padded=False)
    for fn in (lambda t: t.softmax(0), lambda t: t.cumsum(0), lambda t: t.sort(0).values, lambda t: t.flip(0),
               lambda t: t.mean(0), lambda t: t.amax(0), lambda t: t[1:], lambda t: t.var(0)):
        got, want = fn(pa), fn(a)
        torch.testing.assert_close(got.cpu(), want)


def test_padded_tensors_behave_like_any_tensor():
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    assert pa.is_contiguous() and pa.stride() == a.stride() and pa.storage_offset() == 0
    assert str(pa.cpu()) == str(a)
    assert pa.tolist() == a.tolist()
    assert torch.equal(pa.contiguous().cpu(), a)
    buf = __import__("io").BytesIO()
    torch.save(pa, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf).cpu(), a)


def _expert_loop(h, top_idx, top_w, w1, w2, n_experts):
    """transformers' eager mixture-of-experts loop (Mixtral's), as a function."""
    out = torch.zeros_like(h)
    mask = F.one_hot(top_idx, num_classes=n_experts).permute(2, 1, 0)
    for e in range(n_experts):
        pos, tok = torch.where(mask[e])
        gate, up = F.linear(h[tok], w1[e]).chunk(2, dim=-1)
        cur = F.linear(F.silu(gate) * up, w2[e]) * top_w[tok, pos, None]
        out.index_add_(0, tok, cur)
    return out


def _moe_step(device, seed, weights, tokens=32, experts=4):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, 16, generator=g).to(device).requires_grad_()
    probs = torch.randn(tokens, experts, generator=g).softmax(-1).to(device)
    top_w, top_idx = probs.topk(2, -1)
    w1, w2 = (w.clone().to(device).requires_grad_() for w in weights)
    loss = _expert_loop(h, top_idx, top_w, w1, w2, experts).square().sum()
    loss.backward()
    return [t.detach().cpu() for t in (loss, h.grad, w1.grad, w2.grad)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_expert_loop_trains_like_cpu(mode):
    torch.manual_seed(0)
    weights = (torch.randn(4, 48, 16) * 0.1, torch.randn(4, 16, 24) * 0.1)
    torchpjrt.set_eager_mode(mode)
    try:
        for seed in range(4):
            for got, want in zip(_moe_step("pjrt", seed, weights), _moe_step("cpu", seed, weights)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        torchpjrt.set_eager_mode("strict")


@pytest.mark.slow
def test_sizes_in_one_bucket_compile_nothing_new():
    """Routed sizes 9..16 share bucket 16: after the first, no kernel compiles, forward or
    backward."""
    torch.manual_seed(0)
    table = torch.randn(20, 8, device="pjrt", requires_grad=True)
    w = torch.randn(8, 8, device="pjrt", requires_grad=True)

    def step(n):
        mask = torch.zeros(20, dtype=torch.bool)
        mask[1:n + 1] = True
        (idx,) = torch.where(mask.to("pjrt"))
        rows = F.silu(table[idx] @ w) * 2
        out = torch.zeros(20, 8, device="pjrt").index_add(0, idx, rows)
        out.sum().backward()
        return out

    step(9)
    step(9)  # the gradients' accumulation (add_) compiles at the second step
    before = dispatch.stats["compiled"]
    for n in range(10, 17):
        step(n)
    assert dispatch.stats["compiled"] == before
    step(17)  # the next bucket
    assert dispatch.stats["compiled"] > before


def test_bucket_sizes():
    # sizes that can reach 256 and more start at 64; smaller limits start lower, from 8
    assert [padding.bucket(n, 1000) for n in (1, 64, 65, 128, 129, 600)] == [64, 64, 128, 128, 256, 1000]
    assert [padding.bucket(n, 100) for n in (1, 16, 17, 33)] == [16, 16, 32, 64]
    assert [padding.bucket(n, 30) for n in (1, 8, 9, 17)] == [8, 8, 16, 30]
    assert padding.bucket(5, 6) == 6


@pytest.mark.slow
def test_padding_off_gives_exact_sizes():
    code = ("import torch, torchpjrt; from torchpjrt import padding\n"
            "m = torch.tensor([1, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1], dtype=torch.bool).to('pjrt')\n"
            "nz = m.nonzero(); assert padding.storage_padding_of(nz) is None, nz\n"
            "assert nz.untyped_storage().nbytes() == nz.numel() * 8\n"
            "assert torch.equal(nz.cpu(), m.cpu().nonzero()); print('ok')")
    env = dict(os.environ, TORCHPJRT_PADDING="off")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_masked_select_and_dtype_conversions():
    torch.manual_seed(0)
    x, m = torch.randn(4, 6), torch.tensor([True, False, True, True, False, False])
    px, pm = x.to("pjrt"), m.to("pjrt")
    _check(torch.masked_select(px, pm), torch.masked_select(x, m))
    sel = px[px > 0]
    _check(sel.to(torch.bfloat16), x[x > 0].to(torch.bfloat16))
    _check(sel.double().sum(0, keepdim=True), x[x > 0].double().sum(0, keepdim=True), padded=False)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_a_reshaped_padded_index_repeated(mode):
    """`mask.nonzero().squeeze(1).float()` in a loop: the cast reads all of the padded (B, 1)
    storage in another shape, which its program takes without an offset; fused mode's recording
    of its later calls passed one (the second iteration failed)."""
    mask = torch.arange(40) < 5
    with torchpjrt.eager_mode(mode):
        for _ in range(3):
            pm = mask.to("pjrt")
            got = pm.nonzero().squeeze(1).float()
            assert got.sum().item() == 10.0
            _check(got, mask.nonzero().squeeze(1).float())


def test_resize_forgets_the_padding():
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    pa, a = pa.clone(), a.clone()
    assert padding.storage_padding_of(pa) is not None
    alias = pa[:]
    pa.resize_(8, 5)  # grows into the padded positions: they are elements now
    pa[7] = 0
    assert padding.storage_padding_of(alias) is None
    alias.add_(1)
    torch.testing.assert_close(pa[:7].cpu(), a + 1)
    assert pa[7].eq(0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_masked_cross_entropy_trains_like_cpu(reduction):
    """The loss of the selected tokens only (masked language modelling's pattern)."""
    torch.manual_seed(0)
    logits, labels = torch.randn(20, 7), torch.randint(0, 7, (20,))
    labels[3] = -100
    keep = torch.rand(20) > 0.4
    results = []
    for device in ("cpu", "pjrt"):
        x = logits.clone().to(device).requires_grad_()
        m, y = keep.to(device), labels.to(device)
        loss = F.cross_entropy(x[m], y[m], reduction=reduction)
        if device == "pjrt" and reduction == "none":
            assert padding.storage_padding_of(loss) is not None
        loss.sum().backward()
        results.append((loss.detach().cpu(), x.grad.cpu()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)
    idx, pidx = _routed()
    a, pa = _rows(idx, pidx)
    _check(pa.softmax(1), a.softmax(1))
    _check(pa.t().log_softmax(0), a.t().log_softmax(0))


@pytest.mark.slow
def test_masked_loss_sizes_in_one_bucket_compile_nothing_new():
    torch.manual_seed(0)
    x = torch.randn(20, 7, device="pjrt", requires_grad=True)
    y = torch.randint(0, 7, (20,), device="pjrt")

    def step(n):
        m = torch.zeros(20, dtype=torch.bool)
        m[:n] = True
        m = m.to("pjrt")
        F.cross_entropy(x[m], y[m]).backward()

    step(9)
    step(9)
    before = dispatch.stats["compiled"]
    for n in (10, 12, 15, 16):
        step(n)
    assert dispatch.stats["compiled"] == before


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_a_sequence_grown_a_token_at_a_time_compiles_per_bucket(mode):
    """generate()'s input_ids: cat([seq, token], -1) each step. From the second append on, the
    sequence lives in a bucket-sized storage and pointwise ops on it and ops on views of its
    positions run the bucket's program; the values, sizes and contiguity are the CPU's."""
    with torchpjrt.eager_mode(mode, **({"compile_after": 1} if mode == "fused" else {})):
        seq, want = torch.arange(5).reshape(1, 5).to("pjrt"), torch.arange(5).reshape(1, 5)
        compiled = []
        for step in range(70):
            token = (seq[:, -1:] * 7 + step) % 11  # a view of the sequence's last position
            want = torch.cat([want, (want[:, -1:] * 7 + step) % 11], -1)
            before = dispatch.stats["compiled"]
            seq = torch.cat([seq, token], dim=-1)
            done = bool((seq[:, -1] == 3).any())  # an end-of-sequence check on the last token
            compiled.append(dispatch.stats["compiled"] - before)
            assert done == bool((want[:, -1] == 3).any())
        assert torch.equal(seq.cpu(), want) and seq.is_contiguous() and seq.shape == (1, 75)
        assert padding.storage_padding_of(seq) == (75, 128)
        # lengths 7..64 share bucket 64 and 65..75 bucket 128: once each bucket's first append
        # compiled, nothing more does
        assert sum(compiled[4:59]) == 0 and sum(compiled[62:]) == 0, compiled


def test_only_a_repeated_append_of_a_batch_of_one_is_padded():
    one = torch.cat([torch.zeros(1, 3, device="pjrt"), torch.ones(1, 1, device="pjrt")], 1)
    assert padding.storage_padding_of(one) is None  # a single cat stays exact
    two = torch.cat([one, torch.ones(1, 1, device="pjrt")], 1)
    assert padding.storage_padding_of(two) == (5, 64) and two.stride() == (64, 1)
    # its strides are the CPU's but for the dimension of size 1, which addresses nothing
    assert two.is_contiguous() and torch.equal(two.cpu(), torch.tensor([[0.0, 0, 0, 1, 1]]))
    rows = torch.cat([torch.zeros(2, 3, device="pjrt"), torch.ones(2, 1, device="pjrt")], 1)
    rows = torch.cat([rows, rows[:, :1]], 1)  # a batch of two: its strides would differ, so exact
    assert padding.storage_padding_of(rows) is None and rows.stride() == (5, 1)
    mixed = torch.cat([two, torch.ones(1, 1, dtype=torch.int64, device="pjrt")], 1)  # promotes: exact
    assert mixed.dtype == torch.float32 and padding.storage_padding_of(mixed) is None
    assert torch.equal(mixed.cpu(), torch.tensor([[0.0, 0, 0, 1, 1, 1]]))


def test_gradients_flow_through_a_grown_sequence():
    w = torch.randn(1, 3, requires_grad=True)
    pw = w.detach().to("pjrt").requires_grad_()
    for x, grad in ((w, None), (pw, None)):
        seq = x * 1
        for i in range(6):
            seq = torch.cat([seq, seq[:, -1:] * 0.5 + i], 1)
        (seq * torch.arange(9.0, device=seq.device)).sum().backward()
    torch.testing.assert_close(pw.grad.cpu(), w.grad)
    assert padding.storage_padding_of(seq) == (9, 64)
