"""scaled_dot_product_attention on pjrt: one op forward and one backward (the overrideable
attention ops, picked by the compiled helper), with CPU's results; the math path wherever the
fused op does not apply. And silu_backward as one op (its autograd kernel is its own)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile

import torchpjrt
from torchpjrt import native

FUSED = {"aten::_scaled_dot_product_fused_attention_overrideable",
         "aten::_scaled_dot_product_fused_attention_overrideable_backward"}
MATH = "aten::_scaled_dot_product_attention_math"

needs_helper = pytest.mark.skipif(native.library() is None, reason="the compiled helper is not built here")


def _aten_ops(fn):
    with profile() as p:
        out = fn()
    return out, {e.name for e in p.events() if e.name.startswith("aten::")}


def _attend(device, tensors, mask=None, **kwargs):
    """Output and gradients (of the inputs that require them) of one sdpa call and backward."""
    inputs = [t.detach().to(device).requires_grad_(t.requires_grad) for t in tensors]
    m = None if mask is None else mask.detach().to(device).requires_grad_(mask.requires_grad)
    out = F.scaled_dot_product_attention(*inputs, attn_mask=m, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(device, out.dtype))
    grads = [t.grad for t in inputs + ([m] if m is not None else []) if t.requires_grad]
    return [out.detach().cpu()] + [g.cpu() for g in grads]


def _tensors(*shapes, dtype=torch.float32, grad=(True, True, True)):
    gen = torch.Generator().manual_seed(sum(map(sum, shapes)))
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(g) for s, g in zip(shapes, grad)]


B, H, L, S, E = 2, 4, 5, 7, 8
CASES = {
    "plain": (_tensors((B, H, L, E), (B, H, S, E), (B, H, S, E)), None, {}),
    "causal": (_tensors((B, H, L, E), (B, H, S, E), (B, H, S, E)), None, {"is_causal": True}),
    "scale": (_tensors((B, H, L, E), (B, H, S, E), (B, H, S, 3)), None, {"scale": 0.3}),
    "bool_mask": (_tensors((B, H, L, E), (B, H, S, E), (B, H, S, E)),
                  torch.rand(L, S, generator=torch.Generator().manual_seed(3)) > 0.3, {}),
    "float_mask_with_grad": (_tensors((B, H, L, E), (B, H, S, E), (B, H, S, E)),
                             torch.randn(B, 1, L, S, generator=torch.Generator().manual_seed(4)).requires_grad_(), {}),
    "row_masked_entirely": (_tensors((B, H, L, E), (B, H, S, E), (B, H, S, E)),
                            torch.ones(L, S, dtype=torch.bool).index_fill(0, torch.tensor([1]), False), {}),
    "grouped_query": (_tensors((B, H, L, E), (B, 2, S, E), (B, 2, S, E)), None, {"enable_gqa": True}),
    "grouped_causal_longer_query": (_tensors((B, H, 9, E), (B, 2, S, E), (B, 2, S, E)), None,
                                    {"enable_gqa": True, "is_causal": True}),
    "three_dims": (_tensors((H, L, E), (H, S, E), (H, S, E)), None, {}),
    "key_without_grad": (_tensors((B, H, L, E), (B, H, S, E), (B, H, S, E), grad=(True, False, True)), None, {}),
    "float64": (_tensors((B, H, L, E), (B, H, S, E), (B, H, S, E), dtype=torch.float64), None, {}),
}


@needs_helper
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_is_one_op_each_way_with_cpus_results(case):
    tensors, mask, kwargs = CASES[case]
    got, ops = _aten_ops(lambda: _attend("pjrt", tensors, mask, **kwargs))
    assert FUSED <= ops and MATH not in ops, sorted(ops)
    want = _attend("cpu", tensors, mask, **kwargs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@needs_helper
def test_sdpa_bfloat16_and_a_transposed_query_keep_cpus_values_and_layout():
    q, k, v = _tensors((B, H, L, E), (B, H, S, E), (B, H, S, E), dtype=torch.bfloat16)
    for g, w in zip(_attend("pjrt", (q, k, v)), _attend("cpu", (q, k, v))):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    # a query transposed from (batch, length, heads, dim), as transformers' attention makes it:
    # the output is laid out as CPU's, so transposing it back gives a contiguous tensor
    qt = torch.randn(B, L, H, E).transpose(1, 2)
    k, v = torch.randn(B, H, S, E), torch.randn(B, H, S, E)
    out = F.scaled_dot_product_attention(qt.to("pjrt"), k.to("pjrt"), v.to("pjrt"))
    ref = F.scaled_dot_product_attention(qt, k, v)
    assert out.stride() == ref.stride()
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


@needs_helper
@pytest.mark.parametrize("mode", ["fused", "debug"])
def test_sdpa_in_the_other_eager_modes(mode):
    tensors, _, _ = CASES["causal"]
    want = _attend("cpu", tensors, is_causal=True)
    with torchpjrt.eager_mode(mode):
        got, ops = _aten_ops(lambda: _attend("pjrt", tensors, is_causal=True))
    assert FUSED <= ops
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_sdpa_keeps_the_math_path_where_the_fused_op_does_not_apply():
    q, k, v = (t.detach().to("pjrt") for t in CASES["plain"][0])
    # dropout (the math path's random numbers), and a backend list without the overrideable one
    _, ops = _aten_ops(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
    assert MATH in ops and not FUSED & ops
    with sdpa_kernel([SDPBackend.MATH]):
        _, ops = _aten_ops(lambda: F.scaled_dot_product_attention(q, k, v))
    assert MATH in ops and not FUSED & ops
    # fewer key heads without enable_gqa: the math path's own error
    kg = torch.randn(B, 2, S, E)
    with pytest.raises(RuntimeError) as cpu_error:
        F.scaled_dot_product_attention(q.cpu(), kg, kg)
    with pytest.raises(RuntimeError) as pjrt_error:
        F.scaled_dot_product_attention(q, kg.to("pjrt"), kg.to("pjrt"))
    assert str(pjrt_error.value) == str(cpu_error.value)


def test_sdpa_under_torch_compile_matches_cpu():
    q = CASES["causal"][0][0].detach()
    ref = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    compiled = torch.compile(lambda a: F.scaled_dot_product_attention(a, a, a, is_causal=True), backend="pjrt")
    torch.testing.assert_close(compiled(q.to("pjrt")).cpu(), ref, rtol=1e-5, atol=1e-5)
    # the fused op itself in a compiled graph: the graph paths' lowering of it
    direct = torch.compile(
        lambda a: torch.ops.aten._scaled_dot_product_fused_attention_overrideable(a, a, a, None, 0.0, True)[0],
        backend="pjrt")
    torch.testing.assert_close(direct(q.to("pjrt")).cpu(), ref, rtol=1e-5, atol=1e-5)


@needs_helper
def test_sdpa_double_backward_refused_by_name_as_on_cpu():
    q = CASES["plain"][0][0].detach()
    for device in ("cpu", "pjrt"):
        x = q.detach().to(device).requires_grad_()
        (g,) = torch.autograd.grad(F.scaled_dot_product_attention(x, x, x).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="derivative for aten::_scaled_dot_product_.*_backward is not implemented"):
            torch.autograd.grad(g.sum(), x)


def test_silu_backward_is_one_op_and_keeps_double_backward():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 5, dtype=torch.float64)
    xp = x.detach().to("pjrt").requires_grad_()
    y = F.silu(xp)
    (gx,), ops = _aten_ops(lambda: torch.autograd.grad(y, xp, g.to("pjrt")))
    assert "aten::silu_backward" in ops and not {"aten::sigmoid", "aten::mul"} & ops, sorted(ops)
    (want,) = torch.autograd.grad(F.silu(x), x, g)
    torch.testing.assert_close(gx.cpu(), want, rtol=1e-12, atol=1e-12)
    for act in (F.silu, F.mish):
        (first,) = torch.autograd.grad(act(x), x, g, create_graph=True)
        (first_p,) = torch.autograd.grad(act(xp), xp, g.to("pjrt"), create_graph=True)
        torch.testing.assert_close(first_p.cpu(), first.detach(), rtol=1e-12, atol=1e-12)
        (second,) = torch.autograd.grad(first.sum(), x)
        (second_p,) = torch.autograd.grad(first_p.sum(), xp)
        torch.testing.assert_close(second_p.cpu(), second, rtol=1e-10, atol=1e-12)


def test_sdpa_under_inference_mode_vmap_and_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    q = CASES["causal"][0][0].detach()
    ref = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with torch.inference_mode():
        out = F.scaled_dot_product_attention(q.to("pjrt"), q.to("pjrt"), q.to("pjrt"), is_causal=True)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    per_sample = torch.vmap(lambda x: F.scaled_dot_product_attention(x, x, x))
    torch.testing.assert_close(per_sample(q.to("pjrt")).cpu(), per_sample(q), rtol=1e-5, atol=1e-5)
    grads = []
    for device, wrap in (("cpu", lambda f, x: f(x)), ("pjrt", lambda f, x: checkpoint(f, x, use_reentrant=False))):
        x = q.detach().to(device).requires_grad_()
        wrap(lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True), x).pow(2).sum().backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)
