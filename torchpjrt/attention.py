"""scaled_dot_product_attention in eager modes: one op forward and one backward.

PyTorch runs attention on a device without an attention backend through its math path: about
a dozen ops forward (the causal mask built, q and k scaled, two matmuls, a softmax, grouped keys
repeated) and more backward, each a program of its own in strict mode. Once the compiled helper
is loaded, its backend choice (csrc/attention.cpp) sends plain pjrt tensors to the
"overrideable" attention ops instead, whose kernels are here: each one program, keyed like a
lowered op (views among the arguments read inside it), its results laid out as PyTorch's meta
kernel lays them (the output like the query: a transposed query gives an output that is
contiguous once transposed back). The math is ops/attention.py's, which the graph paths lower
these ops with too. Dropout, tensor subclasses (DTensor), functorch transforms, forward-mode
gradients and inputs the math path would refuse keep the math path.
`TORCHPJRT_ATTENTION=math` keeps it for every call.
"""

import functools
import os

import jax.numpy as jnp

from . import storage
from .ops import Lowering, aten
from .ops.attention import attention, attention_backward

FORWARD = aten._scaled_dot_product_fused_attention_overrideable.default
BACKWARD = aten._scaled_dot_product_fused_attention_overrideable_backward.default


def wanted() -> bool:
    return os.environ.get("TORCHPJRT_ATTENTION", "fused").strip().lower() != "math"


def adopt(library) -> None:
    """Turn on the helper's backend choice (native.when_loaded calls this once it is loaded)."""
    if wanted():
        library.torchpjrt_native_attention(1)


def _forward(query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask, scale):
    return attention(query, key, value, attn_bias, is_causal, scale)


def _backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
              max_k, dropout_p, is_causal, philox_seed, philox_offset, scale):
    grads = attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, is_causal, scale)
    # one result per input the meta kernel gives a gradient (zeros for those not asked for,
    # which the kernel hands back as None)
    return tuple(g if g is not None else jnp.zeros(x.shape, x.dtype)
                 for g, x in zip(grads, (query, key, value, attn_bias)) if x is not None)


@functools.cache
def _kernels():
    from .dispatch import LoweredKernel

    return (LoweredKernel(FORWARD, Lowering(_forward), lays_out=True),
            LoweredKernel(BACKWARD, Lowering(_backward), lays_out=True))


def _wrapped(outs, strides):
    strides = strides or [None] * len(outs)
    return [storage.wrap(o) if s is None else storage.wrap_in_order(o, s) for o, s in zip(outs, strides)]


def forward_kernel(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                   scale=None):
    if dropout_p or return_debug_mask:
        raise NotImplementedError("torchpjrt: _scaled_dot_product_fused_attention_overrideable takes no dropout and "
                                  "no debug mask on pjrt (scaled_dot_product_attention runs those through its math path)")
    kernel = _kernels()[0]
    outs, signature = kernel.compute_keyed([query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask, scale])
    out, logsumexp = _wrapped(outs, kernel.strides_for(signature))
    # the sequence offsets, seed, offset and debug mask of the kernels with dropout: none here
    return out, logsumexp, None, None, query.shape[-2], key.shape[-2], None, None, None


def backward_kernel(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q, cum_seq_k,
                    max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    kernel = _kernels()[1]
    mask = tuple(bool(m) for m in grad_input_mask)
    outs, signature = kernel.compute_keyed([grad_out, query, key, value, attn_bias, mask, out, logsumexp, cum_seq_q,
                                            cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                                            philox_offset, scale])
    grads = _wrapped(outs, kernel.strides_for(signature)) + [None]
    return tuple(g if wanted_grad else None for g, wanted_grad in zip(grads, mask))
