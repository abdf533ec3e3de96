"""Shape ops that copy: concatenation, padding, flips, repeats, and the *_scatter /
*_backward ops autograd uses for views.

View ops (view, slice, select, transpose, expand, ...) never come here: dispatch.py runs
them on the storage's geometry. Start/end/index arguments of the scatter ops are Python
ints, so every slice below is static.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import aten, lower


def _wrap_dim(dim, ndim):
    return dim + max(ndim, 1) if dim < 0 else dim


def _common_dtype(arrays):
    """The dtype PyTorch's type promotion picks for cat: the highest category wins."""

    def category(a):
        d = a.dtype
        if d == jnp.bool_:
            return 0
        if jnp.issubdtype(d, jnp.integer):
            return 1
        if jnp.issubdtype(d, jnp.floating):
            return 2
        return 3

    top = max(category(a) for a in arrays)
    return jnp.result_type(*[a.dtype for a in arrays if category(a) == top])


# ---- concatenation -------------------------------------------------------------------------


@lower(aten.cat.default)
def cat(tensors, dim=0):
    arrays = [jnp.asarray(t) for t in tensors]
    dtype = _common_dtype(arrays)
    # PyTorch skips legacy empty 1-D tensors when concatenating higher-rank ones
    kept = [a for a in arrays if not (a.ndim == 1 and a.shape[0] == 0)] or arrays[:1]
    dim = _wrap_dim(dim, kept[0].ndim)
    return jnp.concatenate([a.astype(dtype) for a in kept], axis=dim)


@lower(aten.stack.default)
def stack(tensors, dim=0):
    arrays = [jnp.asarray(t) for t in tensors]
    dtype = _common_dtype(arrays)
    return jnp.stack([a.astype(dtype) for a in arrays], axis=_wrap_dim(dim, arrays[0].ndim + 1))


# ---- padding -------------------------------------------------------------------------------


def _pairs(ndim, pad):
    """PyTorch's flat pad list (last dim first) as per-dim (lo, hi) pairs."""
    pairs = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        pairs[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return pairs


@lower(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    # lax.pad takes negative amounts too (cropping), as PyTorch does
    config = [(lo, hi, 0) for lo, hi in _pairs(self.ndim, pad)]
    return lax.pad(self, jnp.asarray(value).astype(self.dtype), config)


def _mode_pad(x, padding, source):
    """Pad (or crop, for negative amounts) by gathering: output position k of a dim reads
    input position source(k, n), k counted from the input's first element."""
    for d, (lo, hi) in enumerate(_pairs(x.ndim, padding)):
        if lo or hi:
            n = x.shape[d]
            x = jnp.take(x, source(np.arange(-lo, n + hi), n), axis=d)
    return x


def _reflect(k, n):
    k = np.abs(k)
    return np.where(k > n - 1, 2 * (n - 1) - k, k)


def _replicate(k, n):
    return np.clip(k, 0, n - 1)


def _pad_vjp(pad_fn, grad_output, self, padding):
    _, vjp = jax.vjp(lambda x: pad_fn(x, padding), self)
    return vjp(grad_output.astype(self.dtype))[0]


@lower(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def reflection_pad(self, padding):
    return _mode_pad(self, padding, _reflect)


@lower(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)
def replication_pad(self, padding):
    return _mode_pad(self, padding, _replicate)


@lower(
    aten.reflection_pad1d_backward.default,
    aten.reflection_pad2d_backward.default,
    aten.reflection_pad3d_backward.default,
)
def reflection_pad_backward(grad_output, self, padding):
    return _pad_vjp(reflection_pad, grad_output, self, padding)


@lower(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)
def replication_pad_backward(grad_output, self, padding):
    return _pad_vjp(replication_pad, grad_output, self, padding)


# ---- flips, rolls, repeats ----------------------------------------------------------------


@lower(aten.flip.default)
def flip(self, dims):
    if self.ndim == 0 or not dims:
        return self
    return jnp.flip(self, axis=tuple(_wrap_dim(d, self.ndim) for d in dims))


@lower(aten.roll.default)
def roll(self, shifts, dims=()):
    if not dims:  # roll the flattened tensor
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), axis=tuple(_wrap_dim(d, self.ndim) for d in dims))


@lower(aten.repeat.default)
def repeat(self, repeats):
    return jnp.tile(self, tuple(repeats))


@functools.partial(jax.jit, static_argnums=1)
def _repeat_index(repeats, total):
    return jnp.repeat(jnp.arange(repeats.shape[0]), repeats, total_repeat_length=total)


@lower(aten.repeat_interleave.Tensor, dynamic_shape=True)
def repeat_interleave(repeats, output_size=None):
    if output_size is None:
        output_size = int(jnp.sum(repeats))  # the output length depends on the values
    return _repeat_index(repeats, output_size)


# ---- copies of views -------------------------------------------------------------------------


@lower(aten.narrow_copy.default)
def narrow_copy(self, dim, start, length):
    dim = _wrap_dim(dim, self.ndim)
    if start < 0:
        start += self.shape[dim]
    return lax.slice_in_dim(self, start, start + length, axis=dim)


@lower(aten.split_with_sizes_copy.default)
def split_with_sizes_copy(self, split_sizes, dim=0):
    dim = _wrap_dim(dim, self.ndim)
    bounds = np.cumsum([0, *split_sizes])
    return tuple(lax.slice_in_dim(self, int(a), int(b), axis=dim) for a, b in zip(bounds, bounds[1:]))


@lower(aten.slice_copy.Tensor)
def slice_copy(self, dim=0, start=None, end=None, step=1):
    dim = _wrap_dim(dim, self.ndim)
    return self[_at(self.ndim, dim, _slice(self.shape[dim], start, end, step))]


@lower(aten.select_copy.int)
def select_copy(self, dim, index):
    return self[_at(self.ndim, _wrap_dim(dim, self.ndim), index)]


@lower(aten.split_copy.Tensor)
def split_copy(self, split_size, dim=0):
    dim = _wrap_dim(dim, self.ndim)
    n = self.shape[dim]
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] if split_size else [n]
    return split_with_sizes_copy(self, sizes or [0], dim)


@lower(aten._reshape_copy.default)
def _reshape_copy(self, size):
    return self.reshape(tuple(size))


@lower(aten.expand_copy.default)
def expand_copy(self, size, implicit=False):
    lead = len(size) - self.ndim
    shape = [self.shape[i - lead] if s == -1 else s for i, s in enumerate(size)]
    return jnp.broadcast_to(self, tuple(shape))


@lower(aten.permute_copy.default)
def permute_copy(self, dims):
    return jnp.transpose(self, tuple(_wrap_dim(d, self.ndim) for d in dims))


# ---- scatters into views (the backward of slicing) ---------------------------------------------


def _at(ndim, dim, index):
    """An index tuple selecting `index` (an int or slice) along `dim`."""
    return (slice(None),) * dim + (index,) + (slice(None),) * (ndim - dim - 1)


def _slice(dim_size, start, end, step):
    # slice.indices clamps out-of-range bounds the way PyTorch's slice does
    start, end, _ = slice(start, end, step).indices(dim_size)
    return slice(start, max(start, end), step)


@lower(aten.slice_scatter.default)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    dim = _wrap_dim(dim, self.ndim)
    index = _at(self.ndim, dim, _slice(self.shape[dim], start, end, step))
    return self.at[index].set(src.astype(self.dtype))


@lower(aten.slice_backward.default)
def slice_backward(grad_output, input_sizes, dim, start, end, step):
    zeros = jnp.zeros(tuple(input_sizes), grad_output.dtype)
    return slice_scatter(zeros, grad_output, dim, start, end, step)


@lower(aten.select_scatter.default)
def select_scatter(self, src, dim, index):
    dim = _wrap_dim(dim, self.ndim)
    return self.at[_at(self.ndim, dim, index)].set(src.astype(self.dtype))


@lower(aten.select_backward.default)
def select_backward(grad_output, input_sizes, dim, index):
    zeros = jnp.zeros(tuple(input_sizes), grad_output.dtype)
    return select_scatter(zeros, grad_output, dim, index)


@lower(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    dim1, dim2 = _wrap_dim(dim1, self.ndim), _wrap_dim(dim2, self.ndim)
    moved = jnp.moveaxis(self, (dim1, dim2), (-2, -1))
    rows, cols = moved.shape[-2:]
    n = max(0, min(rows + min(offset, 0), cols - max(offset, 0)))
    i = jnp.arange(n)
    # diagonal() puts the diagonal last; src follows that layout
    moved = moved.at[..., i - min(offset, 0), i + max(offset, 0)].set(src.astype(self.dtype))
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))


@lower(aten.diagonal_backward.default)
def diagonal_backward(grad_output, input_sizes, offset, dim1, dim2):
    zeros = jnp.zeros(tuple(input_sizes), grad_output.dtype)
    return diagonal_scatter(zeros, grad_output, offset, dim1, dim2)


def _strided_indices(size, stride, offset):
    idx = np.full(tuple(size), offset, dtype=np.int64)
    for d, (s, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = s
        idx = idx + (np.arange(s, dtype=np.int64) * st).reshape(shape)
    return idx


@lower(aten.as_strided_scatter.default)
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    # the result is a fresh contiguous tensor, so offsets count from its first element
    idx = _strided_indices(size, stride, storage_offset or 0)
    flat = self.reshape(-1).at[idx].set(src.astype(self.dtype))
    return flat.reshape(self.shape)


@lower(aten.unfold_backward.default)
def unfold_backward(grad_in, input_sizes, dim, size, step):
    if len(input_sizes) == 0:
        return grad_in.reshape(())
    dim = _wrap_dim(dim, len(input_sizes))
    length = input_sizes[dim]
    windows = grad_in.shape[dim]
    # element j of window w came from position w * step + j of the unfolded dim
    idx = (np.arange(windows)[:, None] * step + np.arange(size)[None, :]).reshape(-1)
    g = jnp.moveaxis(grad_in, dim, -2)
    g = g.reshape(*g.shape[:-2], windows * size)
    out_shape = (*g.shape[:-1], length)
    out = jnp.zeros(out_shape, grad_in.dtype).at[..., idx].add(g)
    return jnp.moveaxis(out, -1, dim)
