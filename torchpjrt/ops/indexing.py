"""Indexing, gathers and scatters, sorting and selection, searching and counting.

Out-of-range indices: PyTorch's CPU kernels raise. A compiled function cannot raise, so the
lowerings follow JAX (gathers clamp, scatters drop) and each carries a DeviceCheck that finds
the first bad index on the device; device_checks.py raises the CPU's exception for it at the
next synchronization point. Negative indices wrap where PyTorch wraps them (advanced
indexing, take, put, index_fill).

Ops whose output shape depends on values (bool-mask indexing, nonzero, masked_select,
unique, bincount) are registered with dynamic_shape=True: they see concrete arrays, read
what they must from the device, and hand the rest to jitted helpers.
"""

import builtins
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from . import DeviceCheck, aten, check_vector, first_bad, first_failure, lower


def _wrap_dim(dim, ndim):
    return dim + max(ndim, 1) if dim < 0 else dim


def _is_mask(index):
    return index is not None and index.dtype in (jnp.bool_, jnp.uint8)


def _index_tuple(indices):
    return tuple(slice(None) if i is None else i for i in indices)


# ---- device checks of index ranges --------------------------------------------------------


def out_of_range(index, low, high, dim=0):
    """The check vector [failed, first bad index, dim, size] of an integer `index` that must lie
    in [low, high) (`high` is the size the message names)."""
    flat = index.reshape(-1).astype(jnp.int64)
    if flat.size == 0:
        return check_vector(False, 0, dim, high)
    failed, position = first_bad((flat < low) | (flat >= high))
    return check_vector(failed, flat[position], dim, high)


def _dim_size(self, dim):
    """Size of `dim` of self, treating a 0-d self as 1-d (as the index_* and scatter ops do)."""
    return self.shape[_wrap_dim(dim, self.ndim)] if self.ndim else 1


def _out_of_bounds(error_type, prefix=""):
    return lambda value, dim, size: error_type(f"{prefix}index {value} is out of bounds for dimension {dim} "
                                               f"with size {size}")


def _out_of_range_in_self(value, dim, size):
    return IndexError("index out of range in self")


def _advanced_index_ranges(self, indices, *rest):
    """x[i, j]: each integer index within [-size, size) of the dimension it indexes. The message
    numbers it as the CPU does: its position among the index tensors (a mask counting as one
    per dimension it covers)."""
    vectors = []
    dim = position = 0
    for i in indices:
        if _is_mask(i):
            dim += i.ndim  # a mask covers as many dims as it has (a 0-d mask none)
            position += i.ndim
            continue
        if i is not None:
            size = self.shape[dim]
            vectors.append(out_of_range(i, -size, size, position))
            position += 1
        dim += 1
    return first_failure(vectors) if vectors else check_vector(False, 0, 0, 0)


ADVANCED_INDEX_CHECK = DeviceCheck(_advanced_index_ranges, _out_of_bounds(IndexError))


def _along_dim(low_wraps):
    """A check of `index` along `dim` of self (index_select, index_add, gather, scatter, ...):
    within [0, size), or [-size, size) when negative indices wrap."""
    def find(self, dim, index, *rest):
        size = _dim_size(self, dim)
        return out_of_range(index, -size if low_wraps else 0, size, _wrap_dim(dim, self.ndim))

    return find


def _index_select_error(value, dim, size):
    if dim == 0:  # CPU's kernels differ by dim: a row copy (IndexError) or a gather (RuntimeError)
        return IndexError("index out of range in self")
    return RuntimeError(f"INDICES element is out of DATA bounds, id={value} axis_dim={size}")


def _flat_range(self, index, *rest):
    return out_of_range(index, -self.size, self.size, 0)


def _flat_error(value, dim, size):
    return IndexError(f"out of range: tried to access index {value} on a tensor of {size} elements.")


GATHER_CHECK = DeviceCheck(_along_dim(False), _out_of_bounds(RuntimeError))


# ---- advanced indexing: x[idx], x[idx] = v ------------------------------------------------


@jax.jit
def _take_indexed(self, indices):
    return self[_index_tuple(indices)]


def _has_mask(self, indices):
    """x[mask] selects a data-dependent number of elements; x[indices] has a known shape."""
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


@lower(aten.index.Tensor, dynamic_shape=_has_mask, check=ADVANCED_INDEX_CHECK)
def index(self, indices):
    indices = list(indices)
    if any(_is_mask(i) for i in indices):
        # the number of selected elements is data: read the masks back (a device sync)
        self, indices = _masks_to_nonzero(self, indices)
    return _take_indexed(self, indices)


lower(aten._unsafe_index.Tensor, dynamic_shape=_has_mask)(index)  # in range by contract: unchecked


def _masks_to_nonzero(self, indices):
    expanded = []
    for i in indices:
        if not _is_mask(i):
            expanded.append(i)
        elif i.ndim == 0:
            # a 0-d mask adds a dimension of length 1 (True) or 0 (False)
            self = jnp.expand_dims(self, len(expanded))
            expanded.append(jnp.nonzero(i.reshape(1))[0])
        else:
            expanded.extend(jnp.nonzero(i))
    return self, expanded


def _padded_masks(self, indices, values):
    """Bool masks as fixed-length index arrays, so index_put compiles.

    A mask of n elements selecting N of them becomes index arrays of length n whose tail
    points out of bounds (dropped by the scatter). Index arrays and values broadcast
    against the count N along the last advanced dimension; where they have length N there,
    they are padded to n with entries that land on dropped positions.
    """
    masks = [i for i in indices if _is_mask(i)]
    n = max(m.size for m in masks)
    expanded = []
    for i in indices:
        if _is_mask(i):
            i = i.reshape(1) if i.ndim == 0 else i
            expanded.extend(jnp.nonzero(i, size=n, fill_value=tuple(i.shape)))
        elif i is not None and i.ndim and i.shape[-1] != 1:
            expanded.append(_pad_axis(i, -1, n))
        else:
            expanded.append(i)
    arrays = [i for i in expanded if i is not None]
    bshape = jnp.broadcast_shapes(*[a.shape for a in arrays])
    positions = [p for p, i in enumerate(expanded) if i is not None]
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0
    rank = self.ndim - len(positions) + len(bshape)
    axis = start + len(bshape) - 1 - (rank - values.ndim)
    if axis >= 0 and values.shape[axis] != 1:
        values = _pad_axis(values, axis, n)
    return expanded, values


def _pad_axis(x, axis, n):
    axis = axis % x.ndim
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad)


def _add(dtype):
    """The accumulating scatter update: add, or max for bool (CPU's `bool += bool` is an or)."""
    return "max" if dtype == jnp.bool_ else "add"


def _check_index_put_dtype(self, indices, values, accumulate):
    # CPU casts only on its masked_fill path: one bool mask (other entries None), one value
    masked_fill = (not accumulate and values.size == 1 and sum(_is_mask(i) for i in indices) == 1
                   and all(i is None or _is_mask(i) for i in indices))
    if values.dtype != self.dtype and not getattr(values, "weak_type", False) and not masked_fill:
        raise RuntimeError("Index put requires the source and destination dtypes match, got "
                           f"{self.dtype} for the destination and {values.dtype} for the source.")


def _index_put(self, indices, values, accumulate):
    indices = list(indices)
    _check_index_put_dtype(self, indices, jnp.asarray(values), accumulate)
    values = jnp.asarray(values).astype(self.dtype)
    if any(_is_mask(i) for i in indices):
        indices, values = _padded_masks(self, indices, values)
    else:
        _check_values_fit(self, indices, values)
    ref = self.at[_index_tuple(indices)]
    return getattr(ref, _add(self.dtype) if accumulate else "set")(values, mode="drop")


def _check_values_fit(self, indices, values):
    # PyTorch's RuntimeError (JAX's scatter would raise a ValueError while tracing)
    target = jax.eval_shape(lambda x, i: x[_index_tuple(i)], self, indices).shape
    try:
        fits = np.broadcast_shapes(values.shape, target) == tuple(target)
    except ValueError:
        fits = False
    if not fits:
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                           f"indexing result of shape {list(target)}")


@lower(aten.index_put.default, check=ADVANCED_INDEX_CHECK)
def index_put(self, indices, values, accumulate=False):
    return _index_put(self, indices, values, accumulate)


@lower(aten._index_put_impl_.default, mutates=("self",), check=ADVANCED_INDEX_CHECK)
def _index_put_impl_(self, indices, values, accumulate=False, unsafe=False):
    return _index_put(self, indices, values, accumulate)


# ---- index_* along one dimension ------------------------------------------------------------


def _along(dim, index):
    return (slice(None),) * dim + (index,)


def _as_1d(self, index):
    """index_* ops treat a 0-d self as 1-d and take 0-d or 1-d indices."""
    return self.reshape(-1) if self.ndim == 0 else self, index.reshape(-1)


@lower(aten.index_select.default, check=DeviceCheck(_along_dim(False), _index_select_error))
def index_select(self, dim, index):
    x, index = _as_1d(self, index)
    dim = _wrap_dim(dim, self.ndim)
    return x[_along(dim, index)].reshape(_index_shape(self, dim, index))


def _index_shape(self, dim, index):
    if self.ndim == 0:
        return ()
    shape = list(self.shape)
    shape[dim] = index.shape[0]
    return tuple(shape)


def _index_update(self, dim, index, source, how):
    x, index = _as_1d(self, index)
    dim = _wrap_dim(dim, self.ndim)
    source = jnp.asarray(source).astype(self.dtype)
    if self.ndim == 0 or source.ndim == 0:
        source = jnp.broadcast_to(source.reshape(-1) if source.ndim else source, _index_shape(x, dim, index))
    ref = x.at[_along(dim, index)]
    return getattr(ref, how)(source).reshape(self.shape)


@lower(aten.index_add.default, check=GATHER_CHECK)
def index_add(self, dim, index, source, alpha=1):
    if not (isinstance(alpha, int) and alpha == 1):
        source = source * alpha
    return _index_update(self, dim, index, source, _add(self.dtype))


@lower(aten.index_copy.default, check=DeviceCheck(_along_dim(False), _out_of_bounds(IndexError, "index_copy_(): ")))
def index_copy(self, dim, index, source):
    return _index_update(self, dim, index, source, "set")


@lower(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor,
       check=DeviceCheck(_along_dim(True), _out_of_bounds(IndexError)))
def index_fill(self, dim, index, value):
    x, index = _as_1d(self, index)
    dim = _wrap_dim(dim, self.ndim)
    return x.at[_along(dim, index)].set(jnp.asarray(value).astype(self.dtype)).reshape(self.shape)


# ---- gather / scatter -------------------------------------------------------------------------


def _gather_indices(index, dim):
    """Full index arrays for x[...]: `index` along `dim`, positions elsewhere."""
    return tuple(
        index if d == dim else lax.broadcasted_iota(jnp.int64, index.shape, d) for d in range(index.ndim)
    )


def _scatter_setup(self, dim, index, src):
    # scatter/gather treat 0-d tensors as 1-d
    x = self.reshape(1) if self.ndim == 0 else self
    index = index.reshape(1) if index.ndim == 0 else index
    dim = _wrap_dim(dim, self.ndim)
    src = jnp.asarray(src).astype(self.dtype)
    if src.ndim:
        src = src[tuple(slice(0, s) for s in index.shape)]  # src may be larger than index
    return x, _gather_indices(index, dim), src


@lower(aten.gather.default, check=GATHER_CHECK)
def gather(self, dim, index, sparse_grad=False):
    if index.size == 0:  # PyTorch skips its shape checks for an empty index
        return jnp.zeros(index.shape, self.dtype)
    x, idx, _ = _scatter_setup(self, dim, index, 0)
    return x[idx].reshape(index.shape)


def _scatter(self, dim, index, src, how):
    if index.size == 0:
        return self
    x, idx, src = _scatter_setup(self, dim, index, src)
    return getattr(x.at[idx], how)(src).reshape(self.shape)


@lower(aten.scatter.src, aten.scatter.value, check=GATHER_CHECK)
def scatter(self, dim, index, src):
    return _scatter(self, dim, index, src, "set")


_SCATTER_REDUCE = {"add": "add", "multiply": "multiply", "sum": "add", "prod": "multiply", "amax": "max", "amin": "min"}


@lower(aten.scatter.reduce, aten.scatter.value_reduce, check=GATHER_CHECK)
def scatter_reduce_legacy(self, dim, index, src, reduce):
    return _scatter(self, dim, index, src, _SCATTER_REDUCE[reduce])


@lower(aten.scatter_add.default, check=GATHER_CHECK)
def scatter_add(self, dim, index, src):
    return _scatter(self, dim, index, src, _add(self.dtype))


def _identity(reduce, dtype):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf if reduce == "amax" else jnp.inf, dtype)
    info = jnp.iinfo(dtype) if dtype != jnp.bool_ else None
    if info is None:
        return jnp.array(reduce == "amin", dtype)
    return jnp.array(info.min if reduce == "amax" else info.max, dtype)


def _reduce_into(x, idx, src, reduce, include_self):
    """scatter_reduce / index_reduce: combine src into x at x.at[idx] with `reduce`."""
    counts = jnp.zeros(x.shape, jnp.int64).at[idx].add(1)
    base = x if include_self else jnp.where(counts > 0, _identity(reduce, x.dtype), x)
    out = getattr(base.at[idx], _SCATTER_REDUCE.get(reduce, "add"))(src)
    if reduce in ("amax", "amin") and jnp.issubdtype(x.dtype, jnp.floating):
        # PyTorch propagates NaN through max/min; XLA's scatter max/min may drop it
        nan = jnp.zeros(x.shape, bool).at[idx].max(jnp.isnan(src))
        out = jnp.where(nan, jnp.nan, out)
    if reduce == "mean":
        denom = jnp.maximum(counts + int(include_self), 1).astype(x.dtype)
        out = out / denom if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.floor_divide(out, denom)
    return out


@lower(aten.scatter_reduce.two, check=GATHER_CHECK)
def scatter_reduce(self, dim, index, src, reduce, include_self=True):
    if index.size == 0:
        return self
    x, idx, src = _scatter_setup(self, dim, index, src)
    return _reduce_into(x, idx, src, reduce, include_self).reshape(self.shape)


@lower(aten.index_reduce.default, check=DeviceCheck(_along_dim(False), _out_of_range_in_self))
def index_reduce(self, dim, index, source, reduce, include_self=True):
    x, index = _as_1d(self, index)
    dim = _wrap_dim(dim, self.ndim)
    source = jnp.asarray(source).astype(self.dtype).reshape(_index_shape(x, dim, index))
    out = _reduce_into(x, _along(dim, index), source, reduce, include_self)
    return out.reshape(self.shape)


# ---- masks ---------------------------------------------------------------------------------------


def _broadcast_shapes(name, a, b):
    try:
        return jnp.broadcast_shapes(a, b)
    except ValueError as e:  # PyTorch's broadcasting error is a RuntimeError
        raise RuntimeError(f"{name}: shapes {tuple(a)} and {tuple(b)} are not broadcastable") from e


@lower(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    shape = _broadcast_shapes("masked_scatter", self.shape, mask.shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    flat = jnp.broadcast_to(self, shape).reshape(-1)
    src = source.reshape(-1).astype(self.dtype)
    if src.size == 0:
        return flat.reshape(shape)
    # the k-th selected position takes the k-th source element
    pos = jnp.cumsum(flat_mask.astype(jnp.int64)) - 1
    taken = src[jnp.clip(pos, 0, src.size - 1)]
    return jnp.where(flat_mask, taken, flat).reshape(shape)


@lower(aten.masked_select.default, dynamic_shape=True)
def masked_select(self, mask):
    shape = _broadcast_shapes("masked_select", self.shape, mask.shape)
    return jnp.broadcast_to(self, shape)[jnp.broadcast_to(mask, shape)]


@lower(aten.nonzero.default, dynamic_shape=True)
def nonzero(self):
    if self.ndim == 0:
        return jnp.zeros((int(self != 0), 0), jnp.int64)
    return jnp.argwhere(self).astype(jnp.int64)


@lower(aten.nonzero_static.default)
def nonzero_static(self, size, fill_value=-1):
    if self.size == 0:  # jnp.nonzero ignores fill_value for empty input
        return jnp.full((size, self.ndim), fill_value, jnp.int64)
    x = self.reshape(1) if self.ndim == 0 else self
    found = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(found, axis=-1)[:, : self.ndim].astype(jnp.int64)


# ---- flat take / put -------------------------------------------------------------------------


@lower(aten.take.default, check=DeviceCheck(_flat_range, _flat_error))
def take(self, index):
    return self.reshape(-1)[index]


@lower(aten.put.default, check=DeviceCheck(_flat_range, _flat_error))
def put(self, index, source, accumulate=False):
    ref = self.reshape(-1).at[index.reshape(-1)]
    src = source.reshape(-1).astype(self.dtype)
    return getattr(ref, _add(self.dtype) if accumulate else "set")(src).reshape(self.shape)


# ---- sorting and selection ------------------------------------------------------------------

_INT_OF_WIDTH = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _sort_key(x, descending=False):
    """An integer key whose ascending order is PyTorch's order for x.

    PyTorch sorts NaN above +inf and treats -0.0 == 0.0; the key maps floats to
    order-preserving integers after making those two cases canonical.
    """
    if x.dtype == jnp.bool_:
        key = x.astype(jnp.uint8)
    elif jnp.issubdtype(x.dtype, jnp.floating):
        x = jnp.where(jnp.isnan(x), jnp.array(jnp.nan, x.dtype), x)
        x = jnp.where(x == 0, jnp.zeros((), x.dtype), x)
        bits = lax.bitcast_convert_type(x, _INT_OF_WIDTH[x.dtype.itemsize])
        key = jnp.where(bits < 0, bits ^ jnp.iinfo(bits.dtype).max, bits)
    else:
        key = x
    return ~key if descending else key


def _sort(x, dim, descending):
    """(values, indices): a stable sort along dim in PyTorch's order."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    iota = lax.broadcasted_iota(jnp.int64, x.shape, dim)
    _, perm = lax.sort((_sort_key(x, descending), iota), dimension=dim, is_stable=True, num_keys=1)
    return jnp.take_along_axis(x, perm, axis=dim), perm


@lower(aten.sort.default)
def sort(self, dim=-1, descending=False):
    return _sort(self, _wrap_dim(dim, self.ndim), descending)


@lower(aten.sort.stable)
def sort_stable(self, stable, dim=-1, descending=False):
    return _sort(self, _wrap_dim(dim, self.ndim), descending)


@lower(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    dim = _wrap_dim(dim, self.ndim)
    # lax.top_k takes the largest keys along the last axis, lower index first on ties
    key = jnp.moveaxis(_sort_key(self, descending=not largest), dim, -1)
    _, idx = lax.top_k(key, k)
    idx = jnp.moveaxis(idx, -1, dim)
    return jnp.take_along_axis(self, idx, axis=dim), idx


def _pick(values, perm, dim, position, keepdim):
    """values/indices at `position` (an int or an array broadcast along dim) after a sort."""
    position = jnp.expand_dims(jnp.asarray(position), dim) if jnp.ndim(position) else position
    if jnp.ndim(position) == 0:
        v = lax.dynamic_index_in_dim(values, position, dim, keepdims=True)
        i = lax.dynamic_index_in_dim(perm, position, dim, keepdims=True)
    else:
        v = jnp.take_along_axis(values, position, axis=dim)
        i = jnp.take_along_axis(perm, position, axis=dim)
    if not keepdim:
        v, i = jnp.squeeze(v, dim), jnp.squeeze(i, dim)
    return v, i


def _reduce_setup(self, dim):
    x = self.reshape(1) if self.ndim == 0 else self
    return x, _wrap_dim(dim, self.ndim)


def _squeeze_0d(self, outs):
    return tuple(o.reshape(()) for o in outs) if self.ndim == 0 else outs


@lower(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    x, dim = _reduce_setup(self, dim)
    values, perm = _sort(x, dim, False)
    return _squeeze_0d(self, _pick(values, perm, dim, k - 1, keepdim))


def _median(x, dim, keepdim, ignore_nan):
    """The lower median; NaN (the first NaN's index) if a slice has one, unless ignored."""
    values, perm = _sort(x, dim, False)
    n = x.shape[dim]
    reduced = tuple(s for d, s in enumerate(x.shape) if d != dim)
    if jnp.issubdtype(x.dtype, jnp.floating):
        valid = jnp.sum(~jnp.isnan(x), axis=dim)
    else:
        valid = jnp.full(reduced, n)
    # NaNs sort last: the first NaN sits at position `valid`
    position = jnp.maximum(valid - 1, 0) // 2 if ignore_nan else jnp.where(valid < n, valid, (n - 1) // 2)
    return _pick(values, perm, dim, position, keepdim)


@lower(aten.median.default)
def median(self):
    return _median(self.reshape(-1), 0, False, False)[0]


@lower(aten.nanmedian.default)
def nanmedian(self):
    return _median(self.reshape(-1), 0, False, True)[0]


@lower(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    x, dim = _reduce_setup(self, dim)
    return _squeeze_0d(self, _median(x, dim, keepdim, False))


@lower(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    x, dim = _reduce_setup(self, dim)
    return _squeeze_0d(self, _median(x, dim, keepdim, True))


@lower(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    x, dim = _reduce_setup(self, dim)
    values, perm = _sort(x, dim, False)
    # length of the run of equal values ending at each sorted position
    n = x.shape[dim]
    iota = lax.broadcasted_iota(jnp.int64, x.shape, dim)
    prev = jnp.concatenate([lax.slice_in_dim(values, 0, 1, axis=dim), lax.slice_in_dim(values, 0, n - 1, axis=dim)], dim)
    starts = jnp.where((values != prev) | (iota == 0), iota, 0)
    run = iota - lax.cummax(starts, axis=dim) + 1
    # the first longest run in sorted order holds the smallest most frequent value
    end = jnp.argmax(run, axis=dim)
    return _squeeze_0d(self, _pick(values, perm, dim, end, keepdim))


# ---- unique ----------------------------------------------------------------------------------


def _empty_index():
    return jnp.zeros((0,), jnp.int64)


@lower(aten._unique2.default, dynamic_shape=True)
def unique2(self, sorted=True, return_inverse=False, return_counts=False):
    # always sorted: PyTorch's CPU kernel sorts too
    values, inverse, counts = jnp.unique(self.reshape(-1), return_inverse=True, return_counts=True, equal_nan=False)
    return (
        values,
        inverse.reshape(self.shape) if return_inverse else _empty_index(),
        counts if return_counts else _empty_index(),
    )


@lower(aten._unique.default, dynamic_shape=True)
def unique(self, sorted=True, return_inverse=False):
    return unique2(self, sorted, return_inverse)[:2]


@lower(aten.unique_dim.default, dynamic_shape=True)
def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    dim = _wrap_dim(dim, self.ndim)
    values, inverse, counts = jnp.unique(self, axis=dim, return_inverse=True, return_counts=True, equal_nan=False)
    return (
        values,
        inverse.reshape(-1) if return_inverse else _empty_index(),
        counts if return_counts else _empty_index(),
    )


@lower(aten.unique_consecutive.default, dynamic_shape=True)
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    x = self.reshape(-1) if dim is None else jnp.moveaxis(self, _wrap_dim(dim, self.ndim), 0)
    n = x.shape[0]
    if n == 0:
        return self, jnp.zeros(self.shape if dim is None else (0,), jnp.int64), _empty_index()
    changed = jnp.any((x[1:] != x[:-1]).reshape(n - 1, int(np.prod(x.shape[1:]))), axis=1)
    new_run = jnp.concatenate([jnp.ones((1,), bool), changed])
    starts = np.flatnonzero(np.asarray(new_run))  # the number of runs is data
    values = x[starts]
    if dim is not None:
        values = jnp.moveaxis(values, 0, _wrap_dim(dim, self.ndim))
    inverse = jnp.cumsum(new_run.astype(jnp.int64)) - 1
    counts = jnp.diff(jnp.asarray(np.append(starts, n)))
    return (
        values,
        inverse.reshape(self.shape if dim is None else (n,)) if return_inverse else _empty_index(),
        counts if return_counts else _empty_index(),
    )


# ---- searching and counting --------------------------------------------------------------------


def _searchsorted(sorted_sequence, values, side, sorter):
    seq = sorted_sequence
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    dtype = jnp.promote_types(seq.dtype, values.dtype)
    seq, values = seq.astype(dtype), values.astype(dtype)
    if values.size == 0:
        return jnp.zeros(values.shape, jnp.int64)
    if seq.ndim == 1:
        return jnp.searchsorted(seq, values, side=side)
    # one sorted row per leading index
    rows = seq.reshape(-1, seq.shape[-1])
    out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(rows, values.reshape(rows.shape[0], -1))
    return out.reshape(values.shape)


@lower(aten.searchsorted.Tensor)
def searchsorted(sorted_sequence, self, out_int32=False, right=False, side=None, sorter=None):
    return _searchsorted(sorted_sequence, self, side or ("right" if right else "left"), sorter)


@lower(aten.searchsorted.Scalar)
def searchsorted_scalar(sorted_sequence, self, out_int32=False, right=False, side=None, sorter=None):
    value = jnp.asarray(self)
    return _searchsorted(sorted_sequence, value, side or ("right" if right else "left"), sorter)


@lower(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(self, boundaries, out_int32=False, right=False):
    return _searchsorted(boundaries, jnp.asarray(self), "right" if right else "left", None)


@lower(aten.histc.default)
def histc(self, bins=100, min=0, max=0):
    x = self.reshape(-1)
    lo, hi = jnp.asarray(min, jnp.float64), jnp.asarray(max, jnp.float64)
    if x.size:
        # min == max: use the data's range
        same = lo == hi
        lo = jnp.where(same, jnp.min(x).astype(jnp.float64), lo)
        hi = jnp.where(same, jnp.max(x).astype(jnp.float64), hi)
    lo, hi = _widen_empty_range(lo, hi, x.dtype)
    # edges and arithmetic in the input dtype, as PyTorch's linear-interpolation kernel
    lo, hi = lo.astype(x.dtype), hi.astype(x.dtype)
    pos = jnp.floor((x - lo) * jnp.asarray(bins, x.dtype) / (hi - lo)).astype(jnp.int64)
    pos = jnp.where(pos == bins, bins - 1, pos)
    inside = (x >= lo) & (x <= hi)
    return jnp.zeros((bins,), x.dtype).at[jnp.where(inside, pos, bins)].add(1, mode="drop")


def _widen_empty_range(lo, hi, dtype):
    same = lo == hi
    if dtype in (jnp.float32, jnp.float64):
        down = jnp.minimum(jnp.nextafter(lo.astype(dtype), -jnp.inf).astype(jnp.float64), lo - 1)
        up = jnp.maximum(jnp.nextafter(hi.astype(dtype), jnp.inf).astype(jnp.float64), hi + 1)
    else:
        down, up = lo - 1, hi + 1
    return jnp.where(same, down, lo), jnp.where(same, up, hi)


# ---- histogram / histogramdd ------------------------------------------------------------------
# Each column d of the (N, D) input is binned against its own edges. As CPU's kernel: values
# outside [first edge, last edge] (and NaN) are skipped, a value in bin i satisfies
# edges[i] <= x < edges[i+1], and the last edge belongs to the last bin.


_builtin_range = builtins.range  # `range` is an argument name below


def _cpu_linspace(lo, hi, steps, dtype):
    # CPU's linspace: the step in the output dtype, the first half counted up from `lo` and the
    # second half down from `hi`, so both ends are exact
    lo, hi = jnp.asarray(lo).astype(dtype), jnp.asarray(hi).astype(dtype)
    if steps == 1:
        return lo[None]
    step = (hi - lo) / jnp.asarray(steps - 1, dtype)
    idx = jnp.arange(steps)
    up = lo + step * idx.astype(dtype)
    down = hi - step * (steps - idx - 1).astype(dtype)
    return jnp.where(idx < steps // 2, up, down)


def _histogramdd_edges(x, bins, range):
    """Edges (one array per column of the (N, D) input) for bin counts."""
    d = x.shape[1]
    if isinstance(bins, int):
        bins = [bins] * d
    edges = []
    for dim in _builtin_range(d):
        if range is not None:
            lo, hi = jnp.asarray(range[2 * dim], jnp.float64), jnp.asarray(range[2 * dim + 1], jnp.float64)
        elif x.shape[0]:
            lo, hi = jnp.min(x[:, dim]).astype(jnp.float64), jnp.max(x[:, dim]).astype(jnp.float64)
        else:
            lo, hi = jnp.asarray(0.0, jnp.float64), jnp.asarray(1.0, jnp.float64)
        # an empty range widens by half a unit each way, as NumPy
        same = lo == hi
        lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
        edges.append(_cpu_linspace(lo, hi, bins[dim] + 1, x.dtype))
    return edges


def _histogramdd_counts(x, edges, weight, density):
    n, d = x.shape
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros((n,), jnp.int64)
    inside = jnp.ones((n,), bool)
    for dim, e in enumerate(edges):
        v = x[:, dim]
        nb = e.shape[0] - 1
        inside = inside & (v >= e[0]) & (v <= e[-1])
        pos = jnp.searchsorted(e, v, side="right") - 1
        pos = jnp.clip(jnp.where(pos == nb, nb - 1, pos), 0, max(nb - 1, 0))
        flat = flat * nb + pos
    total = math.prod(shape)
    w = jnp.ones((n,), x.dtype) if weight is None else weight.reshape(-1).astype(x.dtype)
    hist = jnp.zeros((total,), x.dtype).at[jnp.where(inside, flat, total)].add(w, mode="drop")
    hist = hist.reshape(shape)
    if density:
        hist = hist / jnp.sum(hist)
        for dim, e in enumerate(edges):
            widths = (e[1:] - e[:-1]).reshape([-1 if i == dim else 1 for i in _builtin_range(d)])
            hist = hist / widths
    return hist


@lower(aten.histogram.bin_ct, static=("bins", "range"))
def histogram_bin_ct(self, bins=100, range=None, weight=None, density=False):
    x = self.reshape(-1, 1)
    edges = _histogramdd_edges(x, [bins], range)
    return _histogramdd_counts(x, edges, weight, density), edges[0]


@lower(aten.histogram.bins_tensor)
def histogram_bins_tensor(self, bins, weight=None, density=False):
    x = self.reshape(-1, 1)
    return _histogramdd_counts(x, [bins.astype(x.dtype)], weight, density), bins


@lower(aten._histogramdd_bin_edges.default, static=("bins", "range"))
def _histogramdd_bin_edges(self, bins, range=None, weight=None, density=False):
    x = self.reshape(-1, self.shape[-1])
    return list(_histogramdd_edges(x, list(bins), range))


@lower(aten._histogramdd_from_bin_cts.default, static=("bins", "range"))
def _histogramdd_from_bin_cts(self, bins, range=None, weight=None, density=False):
    x = self.reshape(-1, self.shape[-1])
    return _histogramdd_counts(x, _histogramdd_edges(x, list(bins), range), weight, density)


@lower(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(self, bins, weight=None, density=False):
    x = self.reshape(-1, self.shape[-1])
    return _histogramdd_counts(x, [b.astype(x.dtype) for b in bins], weight, density)


@lower(aten.bincount.default, dynamic_shape=True)
def bincount(self, weights=None, minlength=0):
    if self.size and int(jnp.min(self)) < 0:  # the values are read here anyway (the length is data)
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    length = max(int(jnp.max(self)) + 1 if self.size else 0, minlength)
    if weights is None:
        return jnp.bincount(self, length=length).astype(jnp.int64)
    # PyTorch keeps float weights' dtype and accumulates anything else in double
    dtype = jnp.float32 if weights.dtype == jnp.float32 else jnp.float64
    return jnp.bincount(self, weights.astype(dtype), length=length)


# ---- embedding -----------------------------------------------------------------------------------


@lower(aten.embedding.default,
       check=DeviceCheck(lambda weight, indices, *rest: out_of_range(indices, 0, weight.shape[0]),
                         _out_of_range_in_self))
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return weight[indices]


@lower(aten.embedding_renorm_.default, mutates=("self",))
def embedding_renorm_(self, indices, max_norm, norm_type):
    # rows looked up by `indices` whose norm exceeds max_norm are scaled down in place
    flat = indices.reshape(-1)
    rows = self[flat]
    norms = jnp.linalg.norm(rows.astype(jnp.float64), ord=norm_type, axis=1)
    scale = jnp.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)
    return self.at[flat].set((rows * scale[:, None].astype(self.dtype)).astype(self.dtype))


@lower(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat = indices.reshape(-1)
    grad = grad_output.reshape(flat.shape[0], -1)
    keep = flat != padding_idx
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grad.dtype).at[flat].add(1)
        grad = grad / counts[flat][:, None]
    grad = jnp.where(keep[:, None], grad, 0)
    return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[flat].add(grad)


# ---- embedding_bag ---------------------------------------------------------------------------------
# modes: 0 sum, 1 mean, 2 max. A negative padding_idx means none (F.embedding_bag normalizes it).


def _bag_ids(n, offsets, num_bags):
    # bag b holds positions [offsets[b], offsets[b+1]); the last bag runs to the end
    # (with include_last_offset the final offset is ignored, as on CPU)
    pos = jnp.arange(n)
    bag = jnp.searchsorted(offsets[:num_bags], pos, side="right") - 1
    return jnp.where(bag < 0, num_bags, bag)  # before the first offset: in no bag (dropped)


def _per_position(values, bag):
    """values[bag] for each index position; zero for positions in no bag (bag == len(values))."""
    picked = values[jnp.minimum(bag, values.shape[0] - 1)]
    in_bag = (bag < values.shape[0]).reshape(bag.shape + (1,) * (picked.ndim - 1))
    return jnp.where(in_bag, picked, 0)


def _bag_keep(indices, padding_idx):
    return indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)


def _bag_indices_in_range(weight, indices, *rest):
    flat = indices.reshape(-1).astype(jnp.int64)
    if flat.size == 0:
        return check_vector(False, 0, 0, weight.shape[0])
    failed, position = first_bad((flat < 0) | (flat >= weight.shape[0]))
    return check_vector(failed, position, flat[position], weight.shape[0])


def _bag_index_error(position, value, rows):
    return RuntimeError(f"Index {position} of input takes value {value} which is not in the valid range [0, {rows})")


@lower(
    aten._embedding_bag.default,
    aten._embedding_bag_forward_only.default,
    static=("mode", "padding_idx"),
    check=DeviceCheck(_bag_indices_in_range, _bag_index_error),
)
def _embedding_bag(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    if indices.ndim == 2:
        # 2-D input: one bag per row
        b, l = indices.shape
        offsets = jnp.arange(0, b * l, max(l, 1), dtype=indices.dtype)
        indices = indices.reshape(-1)
        include_last_offset = False
    num_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    n = indices.shape[0]
    bag = _bag_ids(n, offsets, num_bags)
    keep = _bag_keep(indices, padding_idx)
    rows = weight[indices]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    count = jax.ops.segment_sum(keep.astype(indices.dtype), bag, num_bags)
    if mode == 2:
        neg = jnp.asarray(-jnp.inf, rows.dtype)
        best = jax.ops.segment_max(jnp.where(keep[:, None], rows, neg), bag, num_bags)
        empty = (count == 0)[:, None]
        out = jnp.where(empty, 0, best).astype(weight.dtype)
        # the first position (per feature) holding the bag's maximum, as CPU's strict `>`
        is_max = keep[:, None] & (rows == best[jnp.minimum(bag, num_bags - 1)])
        first = jax.ops.segment_min(jnp.where(is_max, jnp.arange(n)[:, None], n), bag, num_bags)
        max_idx = jnp.where(empty | (first >= n), 0, indices[jnp.minimum(first, max(n - 1, 0))] if n else 0)
        return out, bag.astype(indices.dtype), count, max_idx.astype(indices.dtype)
    out = jax.ops.segment_sum(jnp.where(keep[:, None], rows, 0), bag, num_bags)
    if mode == 1:
        out = jnp.where(count[:, None] == 0, 0, out / jnp.maximum(count, 1)[:, None].astype(out.dtype))
    return out.astype(weight.dtype), bag.astype(indices.dtype), count, count


@lower(aten._embedding_bag_dense_backward.default, static=("num_weights", "mode", "padding_idx"))
def _embedding_bag_dense_backward(
    grad,
    indices,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights,
    padding_idx=-1,
):
    dim = grad.shape[1]
    if mode == 2:
        # each bag's gradient goes to the row that held the maximum, per feature
        valid = (bag_size > 0)[:, None]
        cols = jnp.broadcast_to(jnp.arange(dim), maximum_indices.shape)
        return (
            jnp.zeros((num_weights, dim), grad.dtype)
            .at[maximum_indices, cols]
            .add(jnp.where(valid, grad, 0))
        )
    flat = indices.reshape(-1)
    bag = offset2bag.reshape(-1)
    g = _per_position(grad, bag)
    if mode == 1:
        g = g / jnp.maximum(bag_size[jnp.minimum(bag, grad.shape[0] - 1)], 1)[:, None].astype(g.dtype)
    if per_sample_weights is not None:
        g = g * per_sample_weights.reshape(-1)[:, None].astype(g.dtype)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[flat].add(1)
        g = g / counts[flat][:, None]
    g = jnp.where(_bag_keep(flat, padding_idx)[:, None], g, 0)
    return jnp.zeros((num_weights, dim), grad.dtype).at[flat].add(g)


@lower(aten._embedding_bag_backward.default, static=("num_weights", "mode", "padding_idx"))
def _embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    sparse,
    per_sample_weights,
    padding_idx=-1,
):
    if offset2bag.size != indices.size:
        # CPU's sum fast path leaves offset2bag empty: rebuild it from the offsets
        offset2bag = _bag_ids(indices.size, offsets, grad.shape[0])
    return _embedding_bag_dense_backward(
        grad, indices, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq,
        mode, per_sample_weights, padding_idx,
    )


@lower(aten._embedding_bag_per_sample_weights_backward.default, static=("mode", "padding_idx"))
def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    # d out[bag(i)] / d w_i = weight[indices[i]]
    flat = indices.reshape(-1)
    if offset2bag.size != flat.size:
        offset2bag = _bag_ids(flat.size, offsets, grad.shape[0])
    bag = offset2bag.reshape(-1)
    g = _per_position(grad, bag)
    out = jnp.sum(g * weight[flat].astype(g.dtype), axis=1)
    return jnp.where(_bag_keep(flat, padding_idx), out, 0).astype(grad.dtype)
