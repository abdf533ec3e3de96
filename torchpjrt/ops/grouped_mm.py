"""Grouped matrix products of mixture-of-experts layers, as one ragged dot.

`transformers` computes the experts of its MoE models (Mixtral, Qwen-MoE, ...) with its own
custom op `transformers::grouped_mm_fallback`: rows of `input` sorted by expert, `offs` the
running end of each expert's rows, row block i multiplied by `weight[i]`. Its implementation
reads `offs` on the host and loops over experts, which a compiled graph cannot hold;
`lax.ragged_dot` is the same product with the group sizes as data.
"""

import jax
import jax.numpy as jnp
from jax import lax

from . import lower_by_name


def _group_sizes(offs):
    ends = offs.astype(jnp.int32)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


@lower_by_name("transformers::grouped_mm_fallback.default")
def grouped_mm(input, weight, offs):
    # rows past offs[-1] belong to no expert: ragged_dot leaves them zero, as the loop does
    out = lax.ragged_dot(input, weight, _group_sizes(offs), preferred_element_type=jnp.float32)
    return out.astype(input.dtype)


@lower_by_name("transformers::grouped_mm_fallback_backward.default")
def grouped_mm_backward(input, weight, offs, grad_output):
    _, pullback = jax.vjp(lambda x, w: grouped_mm(x, w, offs), input, weight)
    return pullback(grad_output.astype(input.dtype))
