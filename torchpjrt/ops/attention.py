"""Scaled dot-product attention as one computation: the math of PyTorch's math path
(`_scaled_dot_product_attention_math`), for the "overrideable" attention ops that pjrt tensors
take (see torchpjrt/attention.py and csrc/attention.cpp).

Keys and values with fewer heads than the query serve groups of query heads (grouped-query
attention, as `repeat_interleave` gives them to the math path); a causal mask is aligned top-left;
a row whose every score is masked gives zeros, as `_safe_softmax` does. Low-precision inputs are
computed in float32 and the output returned in their dtype.
"""

import math

import jax
import jax.numpy as jnp

from . import aten, lower
from .nn import _up


def attention(query, key, value, bias, is_causal, scale):
    """(output, logsumexp over the keys in float32) of softmax(q kᵀ · scale + mask) v; the
    logsumexp (batch, heads, length) as PyTorch's meta kernel shapes it, 1 batch for 3-D inputs."""
    q, k, v = _up(query), _up(key), _up(value)
    groups = q.shape[-3] // k.shape[-3]
    if groups != 1:
        k, v = jnp.repeat(k, groups, axis=-3), jnp.repeat(v, groups, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) * scale
    length, source = scores.shape[-2:]
    if is_causal:
        scores = jnp.where(jnp.tril(jnp.ones((length, source), bool)), scores, -jnp.inf)
    if bias is not None:
        scores = scores + _up(bias)
    # softmax is the same for any shift: the row's max (a constant to differentiation), 0 for a
    # row masked entirely, whose weights are all 0 and give zeros, not NaN (nor NaN gradients)
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    top = jnp.where(jnp.isneginf(top), 0.0, top)
    weights = jnp.exp(scores - top)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total == 0, 1.0, total)
    out = jnp.matmul(probs, v).astype(query.dtype)
    logsumexp = (jnp.log(total) + top)[..., 0].astype(jnp.float32)
    return out, logsumexp if logsumexp.ndim == 3 else logsumexp[None]


def attention_backward(grad_out, query, key, value, bias, grad_input_mask, is_causal, scale):
    """The gradients of `attention`'s output for the inputs grad_input_mask asks for (query,
    key, value, bias; None for the others), in their dtypes."""
    inputs = (query, key, value) + ((bias,) if bias is not None else ())

    def forward(*xs):
        return attention(xs[0], xs[1], xs[2], xs[3] if bias is not None else None, is_causal, scale)[0]

    _, pullback = jax.vjp(forward, *inputs)
    grads = pullback(grad_out.astype(query.dtype))
    return tuple(g.astype(x.dtype) if wanted else None
                 for g, x, wanted in zip(grads, inputs, grad_input_mask))


@lower(aten._scaled_dot_product_fused_attention_overrideable.default, graph_only=True)
def fused_attention(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                    scale=None):
    if dropout_p:
        raise NotImplementedError("torchpjrt: the fused attention op takes no dropout (the math path does)")
    out, logsumexp = attention(query, key, value, attn_bias, is_causal, scale)
    nothing = jnp.zeros((0,), jnp.int64)
    return (out, logsumexp, nothing, nothing, query.shape[-2], key.shape[-2],
            jnp.zeros((), jnp.int64), jnp.zeros((), jnp.int64), nothing)


@lower(aten._scaled_dot_product_fused_attention_overrideable_backward.default, graph_only=True)
def fused_attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                             cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, scale=None):
    return attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, is_causal, scale)
