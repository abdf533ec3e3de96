"""Value semantics of view ops, for the graph paths (torch.compile, fused eager).

In a functionalized graph a view op is just a function of its input's values. Eager
execution never calls these: there, views alias storage (dispatch.make_view_kernel).
"""

import math

import jax.numpy as jnp
from jax import lax

from ..dtypes import to_jax
from . import aten, lower


def _dim(d, n):
    return d + n if d < 0 else d


@lower(aten.view.default, aten._unsafe_view.default, aten.reshape.default, view=True)
def view(self, size):
    return jnp.reshape(self, tuple(size))


@lower(aten._reshape_alias.default, view=True)
def reshape_alias(self, size, stride):
    return jnp.reshape(self, tuple(size))


@lower(aten.view.dtype, view=True)
def view_dtype(self, dtype):
    from ..storage import _view_dtype, reinterpret

    target = to_jax(dtype)
    if target.itemsize == self.dtype.itemsize:
        return _view_dtype(self, target)
    # another element size: each row's bytes regrouped (PyTorch checked that the last dim is
    # contiguous and that its bytes divide)
    return reinterpret(self.reshape(-1), target).reshape(self.shape[:-1] + (-1,))


@lower(aten.alias.default, aten.detach.default, aten.lift_fresh.default, view=True)
def alias(self):
    return self


@lower(aten.t.default, view=True)
def t(self):
    return self.T if self.ndim == 2 else self


@lower(aten.transpose.int, view=True)
def transpose(self, dim0, dim1):
    return jnp.swapaxes(self, dim0, dim1) if self.ndim else self


@lower(aten.permute.default, view=True)
def permute(self, dims):
    return jnp.transpose(self, [_dim(d, self.ndim) for d in dims])


@lower(aten.expand.default, view=True)
def expand(self, size, implicit=False):
    lead = len(size) - self.ndim
    shape = tuple(self.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(self, shape)


@lower(aten.slice.Tensor, view=True)
def slice_(self, dim=0, start=None, end=None, step=1):
    if self.ndim == 0:
        return self
    d = _dim(dim, self.ndim)
    n = self.shape[d]
    start, end, _ = slice(start, end, step).indices(n)
    end = max(end, start)
    return lax.slice_in_dim(self, start, end, step, axis=d)


@lower(aten.select.int, view=True)
def select(self, dim, index):
    d = _dim(dim, self.ndim)
    i = index + self.shape[d] if index < 0 else index
    return lax.index_in_dim(self, i, axis=d, keepdims=False)


@lower(aten.unsqueeze.default, view=True)
def unsqueeze(self, dim):
    return jnp.expand_dims(self, _dim(dim, self.ndim + 1))


@lower(aten.squeeze.default, view=True)
def squeeze(self):
    return jnp.squeeze(self)


@lower(aten.squeeze.dim, view=True)
def squeeze_dim(self, dim):
    if self.ndim == 0:
        return self
    d = _dim(dim, self.ndim)
    return jnp.squeeze(self, d) if self.shape[d] == 1 else self


@lower(aten.squeeze.dims, view=True)
def squeeze_dims(self, dim):
    if self.ndim == 0:
        return self
    dims = tuple(_dim(d, self.ndim) for d in dim if self.shape[_dim(d, self.ndim)] == 1)
    return jnp.squeeze(self, dims) if dims else self


@lower(aten.split.Tensor, view=True)
def split(self, split_size, dim=0):
    d = _dim(dim, self.ndim)
    n = self.shape[d]
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] if split_size else [n]
    return split_with_sizes(self, sizes or [0], d)


@lower(aten.split_with_sizes.default, view=True)
def split_with_sizes(self, split_sizes, dim=0):
    d = _dim(dim, self.ndim)
    out, start = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(self, start, start + s, axis=d))
        start += s
    return out


@lower(aten.unbind.int, view=True)
def unbind(self, dim=0):
    d = _dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, axis=d, keepdims=False) for i in range(self.shape[d])]


@lower(aten.diagonal.default, view=True)
def diagonal(self, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(self, offset, _dim(dim1, self.ndim), _dim(dim2, self.ndim))


@lower(aten.unfold.default, view=True)
def unfold(self, dimension, size, step):
    if self.ndim == 0:
        return self.reshape(1)
    d = _dim(dimension, self.ndim)
    n = (self.shape[d] - size) // step + 1
    idx = jnp.arange(n)[:, None] * step + jnp.arange(size)[None, :]
    x = jnp.take(self, idx, axis=d)  # (..., n, size, ...) at d, d+1
    return jnp.moveaxis(x, d + 1, -1)


@lower(aten.as_strided.default, view=True)
def as_strided(self, size, stride, storage_offset=None):
    # relative to the input's own contiguous layout (graph inputs of as_strided are bases)
    flat = self.reshape(-1)
    idx = jnp.full((), storage_offset or 0, jnp.int64)
    for d, (s, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = s
        idx = idx + (jnp.arange(s, dtype=jnp.int64) * st).reshape(shape)
    if math.prod(size) == 0:
        return jnp.zeros(tuple(size), self.dtype)
    return flat[jnp.broadcast_to(idx, tuple(size))]


@lower(aten.view_as_real.default, view=True)
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@lower(aten.view_as_complex.default, view=True)
def view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])


@lower(aten.real.default, view=True)
def real(self):
    return jnp.real(self)


@lower(aten.imag.default, view=True)
def imag(self):
    return jnp.imag(self)
