"""Factories that reach the backend: arange, linspace, logspace, eye, tril/triu_indices.

Most factories (zeros, ones, full, scalar_tensor, rand...) arrive as empty + fill_/zero_/
uniform_; the ones here would otherwise be computed by an `out=` kernel or a CPU-only one.
`dtype`/`layout`/`device`/`pin_memory` arrive as Python values. A None dtype means PyTorch's
default (the dispatcher casts to the meta kernel's result dtype), but values that depend on
the dtype (integer truncation) are computed for it here.
"""

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .. import dtypes
from . import aten, lower


def schema_dtype(dtype):
    """A dtype argument as a torch.dtype: schema defaults arrive as c10 ScalarType numbers
    (aten's only one is 4, Long, in randint/randperm/tril_indices/triu_indices)."""
    return torch.int64 if dtype == 4 and not isinstance(dtype, torch.dtype) else dtype


@lower(aten._to_copy.default, graph_only=True)
def to_copy(self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    """Casts in compiled graphs (autocast's among them). Eager keeps dispatch.k_to_copy; a copy
    to another device makes the graph run eagerly (compile/graph.py)."""
    return self if dtype is None else self.astype(dtypes.to_jax(schema_dtype(dtype)))


def _default_float(dtype):
    return dtypes.to_jax(dtype or torch.get_default_dtype())


def _is_int(jdtype):
    return jnp.issubdtype(jdtype, jnp.integer) or jdtype == jnp.bool_


# Uninitialized memory in compiled graphs (AOTAutograd's backward allocates with
# empty_permuted): zeros are one valid content. Eager keeps its lazily-zeroed storage and
# PyTorch's strides.
@lower(aten.empty.memory_format, graph_only=True)
def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), _default_float(dtype))


@lower(aten.empty_permuted.default, graph_only=True)
def empty_permuted(size, physical_layout, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _default_float(dtype))


@lower(aten.empty_strided.default, graph_only=True)
def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _default_float(dtype))


# In eager execution these arrive decomposed (empty + fill_, clone); compiled graphs keep them.
@lower(aten.full.default, graph_only=True)
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    value = jnp.asarray(fill_value)
    return jnp.full(tuple(size), value, dtypes.to_jax(dtype) if dtype is not None else value.dtype)


@lower(aten.full_like.default, graph_only=True)
def full_like(self, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(self.shape, fill_value, dtypes.to_jax(schema_dtype(dtype)) if dtype is not None else self.dtype)


@lower(aten.copy.default, graph_only=True)
def copy(self, src, non_blocking=False):
    """The functional copy_ of compiled graphs: `src`'s values in `self`'s shape and dtype."""
    return jnp.broadcast_to(src, self.shape).astype(self.dtype)


@lower(aten.scalar_tensor.default, graph_only=True)
def scalar_tensor(s, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s, _default_float(dtype))


@lower(aten.lift_fresh_copy.default, graph_only=True)
def lift_fresh_copy(self):
    return jnp.array(self, copy=True)


# The length depends on the values, so start/end/step are static.
@lower(aten.arange.start_step, static=("start", "end", "step"))
def arange(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    # PyTorch's own rules for the length and the inferred dtype (they differ per dtype)
    meta = torch.arange(start, end, step, dtype=dtype, device="meta")
    out = dtypes.to_jax(meta.dtype)
    # like PyTorch's CPU kernel: start + i*step in int64 for integers, float64 otherwise
    if _is_int(out):
        start, step, acc = int(start), int(step), jnp.int64
    else:
        acc = jnp.float64
    return (start + step * jnp.arange(meta.numel(), dtype=acc)).astype(out)


# torch.arange(end) and torch.arange(start, end): ATen's composite kernels of these two fill an
# empty tensor through arange.start_out (a decomposition, a resize_ and a copy_ on this backend)
@lower(aten.arange.default, static=("end",))
def arange_to(end, dtype=None, layout=None, device=None, pin_memory=None):
    return arange(0, end, 1, dtype)


@lower(aten.arange.start, static=("start", "end"))
def arange_from(start, end, dtype=None, layout=None, device=None, pin_memory=None):
    return arange(start, end, 1, dtype)


def _linspace(start, end, steps, dtype):
    """PyTorch's CPU linspace: the first half counts up from start, the rest down from end."""
    start, end = jnp.asarray(start), jnp.asarray(end)
    if dtype is None and (jnp.iscomplexobj(start) or jnp.iscomplexobj(end)):
        out = jnp.promote_types(_default_float(None), jnp.complex64)
    else:
        out = _default_float(dtype)
    acc = jnp.complex128 if jnp.issubdtype(out, jnp.complexfloating) else jnp.float64
    if _is_int(out):  # integer outputs use integer start/end and a float step
        start, end = jnp.trunc(start.real), jnp.trunc(end.real)
    start, end = start.astype(acc), end.astype(acc)
    if steps == 1:
        return jnp.broadcast_to(start, (1,)).astype(out)
    idx = jnp.arange(steps, dtype=jnp.float64)
    # XLA turns `x / constant` into the inexact `x * (1 / constant)` (49 / 49 != 1, and integer
    # outputs truncate); the barrier keeps the true division PyTorch does
    step = (end - start) / lax.optimization_barrier(jnp.float64(steps - 1))
    values = jnp.where(idx < steps // 2, start + step * idx, end - step * (steps - 1 - idx))
    return values.astype(out)


@lower(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar,
       aten.linspace.Scalar_Tensor)
def linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    return _linspace(start, end, steps, dtype)


@lower(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar,
       aten.logspace.Scalar_Tensor)
def logspace(start, end, steps, base=10.0, dtype=None, layout=None, device=None, pin_memory=None):
    out = _default_float(dtype)
    if _is_int(out):  # PyTorch truncates the exponents for integer outputs
        start, end = jnp.trunc(jnp.asarray(start)), jnp.trunc(jnp.asarray(end))
    return jnp.power(base, _linspace(start, end, steps, torch.float64)).astype(out)


@lower(aten.eye.default)
def eye(n, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, dtype=_default_float(dtype))


@lower(aten.eye.m)
def eye_m(n, m, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m, dtype=_default_float(dtype))


def _indices(np_fn, row, col, offset, dtype):
    """Constant (row, col) index pairs, in NumPy's order (PyTorch's too: row-major)."""
    rows, cols = np_fn(row, offset, col)
    out = dtypes.to_jax(schema_dtype(dtype) or torch.int64)
    return jnp.asarray(np.stack([rows, cols]).reshape(2, -1), out)


@lower(aten.tril_indices.default)
def tril_indices(row, col, offset=0, dtype=torch.int64, layout=None, device=None, pin_memory=None):
    return _indices(np.tril_indices, row, col, offset, dtype)


@lower(aten.triu_indices.default)
def triu_indices(row, col, offset=0, dtype=torch.int64, layout=None, device=None, pin_memory=None):
    return _indices(np.triu_indices, row, col, offset, dtype)


# A plain zero tensor: pjrt has no ZeroTensor, and zeros are what it reads as.
@lower(aten._efficientzerotensor.default)
def efficientzerotensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _default_float(dtype))
