"""Grouped matrix products of mixture-of-experts layers, as one ragged dot.

`transformers` computes the experts of its MoE models (Mixtral, Qwen-MoE, ...) with
`torch.nn.functional.grouped_mm` (aten._grouped_mm) where PyTorch has it, else with its own
custom op `transformers::grouped_mm_fallback`: rows of `input` sorted by expert, `offs` the
running end of each expert's rows, row block i multiplied by `weight[i]`. PyTorch's and
transformers' own implementations read `offs` on the host and loop over the experts, one
matmul per expert at a size the routing picks, which compiles anew at each new size and
cannot live in a compiled graph; `lax.ragged_dot_general` is the same product with the group
sizes as data, one program for every routing.
"""

import jax
import jax.numpy as jnp
from jax import lax

from ..dtypes import to_jax
from . import aten, lower, lower_by_name


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


_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _ragged(lhs, rhs, sizes, contracting, lhs_ragged, rhs_group):
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contracting, ((), ())), lhs_ragged_dimensions=[lhs_ragged],
        rhs_group_dimensions=rhs_group)
    return lax.ragged_dot_general(lhs, rhs, sizes, numbers, precision=lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)


@lower(aten._grouped_mm.default)
def grouped_mm_aten(self, mat2, offs=None, bias=None, out_dtype=None):
    """PyTorch's four forms: 2d x 3d (rows of `self` grouped: MoE forward), 3d x 2d (columns of
    `mat2` grouped), 2d x 2d (the contraction grouped: the weight gradient, one product per
    group) and 3d x 3d (a bmm). Rows or columns past offs[-1] are zero (CPU leaves them unset)."""
    for name, m in (("mat_a", self), ("mat_b", mat2)):
        if m.dtype not in _FLOATS:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {m.dtype}")
        if m.ndim not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    if self.dtype != mat2.dtype:
        raise RuntimeError(f"_grouped_mm: expected mat_a and mat_b to have the same dtype, but got "
                           f"{self.dtype} and {mat2.dtype}")
    a2, b2 = self.ndim == 2, mat2.ndim == 2
    if not (a2 and b2) and self.shape[-1] != mat2.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if (offs is not None) != (a2 or b2):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None and (offs.ndim != 1 or offs.dtype != jnp.int32):
        raise RuntimeError("offs has to be 1D" if offs.ndim != 1 else "Offsets have to be int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if out_dtype is not None and to_jax(out_dtype) != self.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if a2 and not b2 and offs.shape[0] != mat2.shape[0] or b2 and not a2 and offs.shape[0] != self.shape[0]:
        raise RuntimeError("matrix batch sizes have to match")
    if not a2 and not b2 and self.shape[0] != mat2.shape[0]:
        raise RuntimeError("batched dimension has to match")
    if not a2 and not b2:
        out = jnp.matmul(self, mat2, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    elif a2 and not b2:  # (M, K) x (G, K, N) -> (M, N)
        out = _ragged(self, mat2, _group_sizes(offs), ((1,), (1,)), 0, [0])
    elif b2 and not a2:  # (G, M, K) x (K, N) -> (M, N): the transpose of the form above
        out = _ragged(mat2.T, self, _group_sizes(offs), ((1,), (2,)), 0, [0]).T
    else:  # (M, K) x (K, N), K grouped -> (G, M, N)
        out = _ragged(self, mat2, _group_sizes(offs), ((1,), (0,)), 1, [])
    return out.astype(self.dtype)
