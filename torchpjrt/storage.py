"""Storages and geometry: the bridge between PyTorch's aliasing memory model and JAX arrays.

A pjrt tensor is a plain `torch.Tensor` whose c10 storage carries (as a Python attribute of
its `UntypedStorage` object) a `Storage`: one immutable `jax.Array` plus a version. Tensors
that alias share the c10 storage, hence the `Storage`. The tensor's own sizes, strides and
storage offset (PyTorch's TensorImpl geometry, set through `set_` on the Meta key) say which
elements of the storage it sees.

Reading a tensor materializes its elements from the storage (identity fast path, else a
jitted strided read cached per storage version). Writing scatters into the storage and
bumps its version.
"""

import ctypes
import functools
import math
import threading
import warnings
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from . import dtypes, fusion, kernel_cache, placement
from .fusion import call

_create_empty = torch._C._acc.create_empty_tensor
_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset
_inference_mode_enabled = torch.is_inference_mode_enabled


class Storage:
    """The device memory behind one c10 storage: a JAX array and a version counter."""

    __slots__ = ("array", "shape", "dtype", "version", "views", "raw", "device", "padding", "appended_along",
                 "tracked_in", "__weakref__")

    def __init__(self, array, dtype: torch.dtype, shape=None, device=0):
        # (the hot path, csrc/hot_ops.cpp new_storage, sets these same slots for its results)
        self.array = array  # None until first written: an uninitialized (empty) storage
        self.device = device  # the pjrt index an uninitialized storage materializes on
        self.tracked_in = 0  # the serial of the fused graph that swaps its value in (fusion.track)
        if type(array) is fusion.Pending:
            fusion.track(self, array)  # swapped for the computed array when the graph runs
        # `shape`, when given with an array, is the array's (the hot path passes it: reading an
        # array's shape is a Python property of JAX's)
        self.shape = tuple(shape) if shape is not None else tuple(array.shape)
        self.dtype = dtype
        self.version = 0
        self.views = None  # {(geometry, dtype): (version, array)} for materialized views
        self.raw = False  # untyped bytes (from torch.load): retyped by the first tensor set on it
        self.padding = None  # (n, B, stride): a padded result's first n of B positions (padding.py)
        self.appended_along = None  # the dim of the cat([x, y]) that made it: a sequence may grow (padding.py)

    @property
    def numel(self):
        return math.prod(self.shape)

    def value(self):
        if self.array is None:
            # PyTorch leaves empty() uninitialized; zeros are one valid content.
            self._hold(_zeros_on(self.device, self.shape, dtypes.to_jax(self.dtype)))
        return self.array

    def replace(self, array):
        self._hold(array)
        shape = array.shape
        if shape != self.shape:
            self.shape = tuple(shape)
            self.padding = None
        self.version += 1
        self.views = None

    def _hold(self, array):
        self.array = array
        if type(array) is fusion.Pending:
            fusion.track(self, array)  # swapped for the computed array when the graph runs


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, device=0):
    default_device()
    # every new storage starts here: a warm process loads these programs rather than tracing them
    return kernel_cache.kept_jit(lambda: jnp.zeros(shape, dtype), "storage.zeros", shape, str(dtype), device)


# Results of programs without inputs (zero fills, `torch.arange(n)`, factories with static
# arguments) are the same at every call, and an array never changes (a write gives its storage a
# new one): up to SHARED_BYTES, they are computed once and shared between storages, so the many
# small fills and factories of autograd, optimizers and models run no program.
SHARED_BYTES = 256 * 1024  # per result
SHARED_KEPT = 256  # results, least recently used dropped: at most 64 MiB held
_shared = OrderedDict()


def shared_result(key, fn):
    """fn()'s results (arrays; fn a program without inputs, `key` what fixes it), computed now
    and, when small, kept for every later call under `key`."""
    out = _shared.get(key)
    if out is not None:
        try:
            _shared.move_to_end(key)
        except KeyError:  # another thread dropped it meanwhile
            pass
        return out
    out = fn()  # run now, even while fused mode records: a graph's pending result cannot be shared
    if sum(getattr(a, "nbytes", SHARED_BYTES + 1) for a in jax.tree_util.tree_leaves(out)) <= SHARED_BYTES:
        _shared[key] = out
        while len(_shared) > SHARED_KEPT:
            try:
                _shared.popitem(last=False)
            except KeyError:
                break
    return out


def is_shared(key) -> bool:
    return key in _shared


def _zeros(shape, dtype, device=0):
    if math.prod(shape) * np.dtype(dtype).itemsize <= SHARED_BYTES:
        # made once per shape and shared: copied from the host, where a program would cost a
        # compile (tens of milliseconds) in a first process and a load from disk in a later one
        return shared_result(("storage.zeros", shape, dtype, device),
                             functools.partial(_host_fill, shape, np.zeros((), dtype)[()], device))
    return call(_zeros_fn(shape, dtype, device))


def zeros(shape, dtype):
    """A zero fill on pjrt:0 (shared when small)."""
    return _zeros(tuple(shape), dtype)


@functools.lru_cache(maxsize=None)
def _filled_fn(shape, dtype, number_type):
    default_device()
    # as the fill lowering computes it: the number traced, then cast to the dtype
    return kernel_cache.kept_jit(lambda v: jnp.full(shape, v, dtype), "storage.filled", shape, str(dtype),
                                 number_type.__name__)


def filled(shape, dtype, value):
    """An array of `shape` filled with the Python number `value` on pjrt:0, computed now and
    shared when small (shared_result): copied from the host when the number converts to `dtype`
    exactly (ones, a mask's -inf), as small zero fills are; else by a program."""
    shape = tuple(shape)
    exact = _exactly(value, dtype)
    if exact is not None and math.prod(shape) * np.dtype(dtype).itemsize <= SHARED_BYTES:
        make = functools.partial(_host_fill, shape, exact)
    else:
        make = functools.partial(_filled_fn(shape, dtype, type(value)), value)
    # repr tells -0.0 from 0.0 and keys NaN, which equals nothing
    return shared_result(("storage.filled", shape, dtype, type(value), repr(value)), make)


def _exactly(value, dtype):
    """`value` as a numpy scalar of `dtype` when converting it is exact (so the program's
    conversion would give the same), else None: a bool or an int in range, a float the dtype
    holds exactly (infinities included; NaN and complex dtypes left to the program)."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return np.bool_(value) if value in (0, 1) else None  # (torch.ones: 1.0)
    if np.issubdtype(dt, np.integer):
        if type(value) is float and not value.is_integer():
            return None
        info = np.iinfo(dt)
        return dt.type(int(value)) if info.min <= value <= info.max else None
    if not jnp.issubdtype(dt, jnp.floating) or value != value:
        return None
    number = float(value)
    if type(value) is int and float(number) != value:
        return None  # an int a double does not hold
    with np.errstate(over="ignore"):  # (a number past the dtype's range becomes inf: not exact)
        converted = np.array(number).astype(dt)
    return converted[()] if float(converted) == number else None


def _host_fill(shape, value, device=0):
    """`shape` filled with `value` (a numpy scalar of the dtype) on pjrt:`device`, copied from the host."""
    from .device import jax_device

    return jax.device_put(np.full(shape, value), jax_device(device))


def _zeros_on(device, shape, dtype):
    """A zero fill on pjrt:`device`."""
    return placement.run_on(device, _zeros, shape, dtype, device) if device else _zeros(shape, dtype)


def default_device():
    from .device import jax_device

    return jax_device(0)


def adopt_raw_bytes(t: torch.Tensor) -> None:
    """A tensor was set onto untyped bytes: reinterpret them as the tensor's dtype."""
    st = t.untyped_storage()._pjrt
    if not st.raw or t.dtype == torch.uint8:
        return
    k = t.dtype.itemsize
    n = st.numel
    if n % k:
        raise RuntimeError(f"torchpjrt: {n} bytes do not hold a whole number of {t.dtype}")
    jd = dtypes.to_jax(t.dtype)
    raw = st.value()
    typed = call(_bytes_as(n // k, k, jd, st.shape, _device(raw)), raw)
    st.raw = False
    st.dtype = t.dtype
    st.replace(typed)


@functools.lru_cache(maxsize=4096)
def _bytes_as(n, k, dtype, byte_shape, device):
    identity = ("storage.bytes_as", n, k, str(dtype), byte_shape, device)
    if dtype == jnp.bool_:
        return kernel_cache.kept_jit(lambda b: b.reshape(-1).astype(jnp.bool_), *identity)
    if k == 1:
        return kernel_cache.kept_jit(lambda b: lax.bitcast_convert_type(b.reshape(-1), dtype), *identity)
    return kernel_cache.kept_jit(lambda b: lax.bitcast_convert_type(b.reshape(n, k), dtype), *identity)


def storage_of(t: torch.Tensor) -> Storage:
    try:
        return t.untyped_storage()._pjrt
    except AttributeError:
        if t.device.type != "pjrt":
            raise RuntimeError(f"expected a pjrt tensor, got a tensor on {t.device}") from None
        raise RuntimeError("torchpjrt: this pjrt tensor has no device data (internal error)") from None


def is_identity(t: torch.Tensor, st: Storage) -> bool:
    return t.dtype == st.dtype and t.shape == st.shape and t.storage_offset() == 0 and t.is_contiguous()


def is_reshaped_whole(t: torch.Tensor, st: Storage) -> bool:
    """Whether `t` is all of its storage in another shape (the bias gradient `sum(0, keepdim)`
    viewed flat): an op reads it as a reshape of the array, with no strided read."""
    return t.dtype is st.dtype and t.storage_offset() == 0 and t.is_contiguous() and t.numel() == st.numel \
        and t.shape != st.shape


def read(t: torch.Tensor):
    """The JAX array holding tensor `t`'s elements (shape t.shape, dtype of t)."""
    st = t.untyped_storage()._pjrt
    if t.shape == st.shape and t.dtype == st.dtype and t.storage_offset() == 0 and t.is_contiguous():
        a = st.array
        return a if a is not None else st.value()
    return _read_view(t, st)


def _read_view(t, st):
    geometry = (tuple(t.shape), t.stride(), t.storage_offset())
    key = (geometry, t.dtype)
    views = st.views
    if views is not None:
        hit = views.get(key)
        if hit is not None and hit[0] == st.version:
            return hit[1]
    offset = runtime_offset(st, t)
    base = st.value()
    if offset is None:
        out = call(_reader(st.shape, *geometry[:2], dtypes.to_jax(t.dtype), geometry[2], st.dtype, _device(base)), base)
    else:
        out = call(_reader(st.shape, *geometry[:2], dtypes.to_jax(t.dtype), None, st.dtype, _device(base)), base, offset)
    if type(out) is fusion.Pending:
        return out  # the read is fused into the pending graph; nothing to cache
    if views is None or len(views) > 64:
        st.views = views = {}
    views[key] = (st.version, out)
    return out


def value_of(t: torch.Tensor):
    """A tensor's elements as a JAX array on the device: read from a pjrt tensor, copied from
    a CPU one (PyTorch's conj/neg bits resolved)."""
    if t.device.type == "pjrt":
        return read(t)
    return jnp.asarray(dtypes.numpy_from_cpu_tensor(t))


def write(t: torch.Tensor, value, allow_overlap=False) -> None:
    """Store `value` (broadcastable to t.shape, any dtype) as the elements of tensor `t`.

    A `t` whose elements overlap (a stride-0 dim) raises as PyTorch's in-place ops do, unless
    `allow_overlap` (fill_, index_put_): then the last of the values for one location stays,
    as with CPU's sequential writes."""
    st = t.untyped_storage()._pjrt
    jdtype = dtypes.to_jax(t.dtype)
    if value.dtype != jdtype:
        value = _cast(value, jdtype)
    shape = tuple(t.shape)
    if tuple(value.shape) != shape:
        value = _broadcast(value, shape)
    if t.dtype is st.dtype and t.storage_offset() == 0 and t.is_contiguous() and (shape == st.shape or (
            st.padding is None and not mesh_placements and math.prod(shape) == st.numel)):
        # the whole storage (every in-place op on a plain tensor, each of a foreach op's tensors);
        # all of it in another shape (an in-place op on a reshaped tensor: attention's mask) too,
        # the storage taking that shape: its elements in order are the same either way
        st.replace(_keep_mesh_placement(st.array, value) if mesh_placements else value)
        return
    if t.numel() == 0:
        return
    size, stride = tuple(t.shape), t.stride()
    if any(s > 1 and d == 0 for s, d in zip(size, stride)):
        if not allow_overlap:
            raise RuntimeError(
                "unsupported operation: more than one element of the written-to tensor refers to a "
                "single memory location. Please clone() the tensor before performing the operation."
            )
        overlapping = tuple(s > 1 and d == 0 for s, d in zip(size, stride))
        value = call(_last_along_fn(overlapping, aval_of(value)), value)
        size = tuple(1 if o else s for o, s in zip(overlapping, size))
    offset = runtime_offset(st, t) if size == tuple(t.shape) else None
    base = st.value()
    arguments = (aval_of(value), _device(base))  # a value from the host is not on the storage's device
    if offset is None:
        new = call(_writer(st.shape, size, stride, dtypes.to_jax(st.dtype), t.storage_offset(), arguments), base, value)
    else:
        new = call(_writer(st.shape, size, stride, dtypes.to_jax(st.dtype), None, arguments), base, value, offset)
    st.replace(new)


def _device(x) -> int:
    """The pjrt index of x's device, part of a kept helper's identity (the kernel cache keeps one
    executable per device)."""
    return placement.index_of(x) if placement.multi else 0


def aval_of(x):
    """What fixes a jitted helper's program for argument x: its shape, dtype, weak type and device."""
    dtype = x.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)  # str() of a numpy dtype costs microseconds
    return tuple(x.shape), name, getattr(x, "weak_type", False), _device(x)


_DTYPE_NAMES = {}


@functools.lru_cache(maxsize=4096)
def _last_along_fn(dims, arg):
    index = tuple(slice(-1, None) if d else slice(None) for d in dims)
    return kernel_cache.kept_jit(lambda x: x[index], "storage.last_along", dims, arg)


# set once anything can be placed over a mesh (distributed.spmd loaded, a sharded jax.Array taken
# in by from_jax): until then whole-storage writes skip the placement check below
mesh_placements = False


def _keep_mesh_placement(old, new):
    """A whole-storage write keeps a placement over a mesh (distributed.spmd): copy_ or
    load_state_dict into a sharded parameter must not gather it onto one device."""
    sharding = old.sharding if isinstance(old, jax.Array) else None  # never a Pending's: no flush
    if type(sharding) is jax.sharding.NamedSharding and isinstance(new, jax.Array) and new.sharding != sharding:
        return jax.device_put(new, sharding)
    return new


@functools.lru_cache(maxsize=4096)
def _cast_fn(dtype, arg):
    return kernel_cache.kept_jit(lambda x: x.astype(dtype), "storage.cast", str(dtype), arg)


def _cast(x, dtype):
    return call(_cast_fn(dtype, aval_of(x)), x)


@functools.lru_cache(maxsize=4096)
def _broadcast_fn(shape, arg):
    return kernel_cache.kept_jit(lambda x: jnp.broadcast_to(x, shape), "storage.broadcast", shape, arg)


def _broadcast(x, shape):
    return call(_broadcast_fn(shape, aval_of(x)), x)


# ---- strided reads and writes ------------------------------------------------------------


def _chunk_plan(size, stride):
    """Express a strided view as a slice of a reshaped contiguous chunk, if possible.

    With the view's dims sorted by decreasing stride t0 > t1 > ... (each dividing the one
    before, and each size fitting its slot), element (i0, i1, ...) sits at
    offset + i0*t0 + i1*t1 + ..., which is entry (i0, i1, ..., 0) of the chunk
    flat[offset : offset + s0*t0] reshaped to (s0, t0/t1, t1/t2, ..., t_last).
    Returns (order, chunk_shape, take) or None when the view needs a gather.
    """
    dims = [d for d in range(len(size)) if size[d] != 1 and stride[d] != 0]
    order = sorted(dims, key=lambda d: -stride[d])
    if not order:
        return order, (1,), ()
    chunk_shape = [size[order[0]]]
    take = [size[order[0]]]
    for prev, d in zip(order, order[1:]):
        tp, t = stride[prev], stride[d]
        if t == tp or tp % t or tp // t < size[d]:
            return None
        chunk_shape.append(tp // t)
        take.append(size[d])
    chunk_shape.append(stride[order[-1]])
    return order, tuple(chunk_shape), tuple(take)


def _flat_indices(size, stride, offset):
    idx = jnp.full((), offset, dtype=jnp.int64)
    for d, (s, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = s
        idx = idx + (jnp.arange(s, dtype=jnp.int64) * st).reshape(shape)
    return jnp.broadcast_to(idx, size)


def _padded_flat(base, need):
    flat = base.reshape(-1)
    if need > flat.shape[0]:
        flat = jnp.pad(flat, (0, need - flat.shape[0]))
    return flat


# ---- reinterpreting bytes ------------------------------------------------------------------
# A view may have another dtype than its storage (`x.view(torch.uint8)`, `view_as_real`,
# `.real`): it reads and writes the storage's bytes as its own dtype, as on CPU. XLA bitcasts
# between types of one size; other sizes go through the bytes, and complex numbers through
# their (real, imaginary) parts, which XLA cannot bitcast.


def _to_bytes(flat):
    """The bytes of 1-D array `flat` (little-endian, as the host's memory holds them)."""
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):
        flat = jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1)
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint8)
    if flat.dtype.itemsize == 1:
        return lax.bitcast_convert_type(flat, jnp.uint8)
    return lax.bitcast_convert_type(flat, jnp.uint8).reshape(-1)


def _from_bytes(raw, dtype):
    """1-D uint8 `raw` read as elements of `dtype` (trailing bytes short of an element are padded
    with zeros)."""
    dtype = jnp.dtype(dtype)
    k = dtype.itemsize
    if raw.shape[0] % k:
        raw = jnp.pad(raw, (0, k - raw.shape[0] % k))
    if dtype == jnp.bool_:
        return raw != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        parts = _from_bytes(raw, jnp.finfo(dtype).dtype).reshape(-1, 2)
        return lax.complex(parts[:, 0], parts[:, 1])
    if k == 1:
        return lax.bitcast_convert_type(raw, dtype)
    return lax.bitcast_convert_type(raw.reshape(-1, k), dtype)


def reinterpret(flat, dtype):
    """1-D array `flat`'s bytes as a 1-D array of `dtype`."""
    dtype = jnp.dtype(dtype)
    if flat.dtype == dtype:
        return flat
    return _from_bytes(_to_bytes(flat), dtype)


def _view_dtype(x, dtype):
    """`x` (any shape) read as `dtype` of the same element size."""
    if x.dtype == dtype:
        return x
    if x.dtype == jnp.bool_ or dtype == jnp.bool_:
        return x.astype(dtype)
    if jnp.issubdtype(x.dtype, jnp.complexfloating) or jnp.issubdtype(dtype, jnp.complexfloating):
        return reinterpret(x.reshape(-1), dtype).reshape(x.shape)
    return lax.bitcast_convert_type(x, dtype)


def _in_view_elements(base, dtype):
    """The storage array `base` as the flat elements a view of `dtype` indexes: itself when the
    element sizes agree, else its bytes regrouped."""
    if jnp.dtype(dtype).itemsize == base.dtype.itemsize:
        return base
    return reinterpret(base.reshape(-1), dtype)


# A view's storage offset is a runtime argument of the programs that read or write it, so that
# one program serves every offset of a geometry (rows of a buffer written in a loop, a KV cache,
# the slices an op's out= lands in) instead of one compile per offset. Only offsets whose chunk
# lies within the storage qualify: lax.dynamic_slice would clamp the others (they pad the
# storage and keep the offset in the program).


@functools.lru_cache(maxsize=4096)
def _offset_limit(base_shape, base_itemsize, size, stride, itemsize):
    """The largest offset at which a view of this geometry can take its offset at run time."""
    n = math.prod(base_shape) * base_itemsize // itemsize  # the storage in the view's elements
    plan = _chunk_plan(size, stride)
    if plan is None:  # a gather: a valid view's indices lie within the storage at any offset
        return n
    return n - math.prod(plan[1])


def runtime_offset(st, t):
    """View `t`'s storage offset as a program argument (numpy int64), or None when it must be
    compiled into the program."""
    offset = t.storage_offset()
    limit = _offset_limit(st.shape, st.dtype.itemsize, tuple(t.shape), t.stride(), t.dtype.itemsize)
    return np.int64(offset) if offset <= limit else None


@functools.lru_cache(maxsize=4096)
def view_read_fn(base_shape, size, stride, dtype):
    """read(base, offset): a view's elements from its storage's array. `offset` is an int, or a
    traced one at most _offset_limit."""
    plan = _chunk_plan(size, stride)
    numel = math.prod(size)

    def read(base, offset):
        if numel == 0:
            return jnp.zeros(size, dtype)
        base = _in_view_elements(base, dtype)
        if plan is None:
            flat = base.reshape(-1)
            return _view_dtype(flat[_flat_indices(size, stride, offset)], dtype)
        order, chunk_shape, take = plan
        length = math.prod(chunk_shape)
        flat = _padded_flat(base, offset + length) if isinstance(offset, int) else base.reshape(-1)
        chunk = lax.dynamic_slice(flat, (offset,), (length,)).reshape(chunk_shape)
        x = chunk[tuple(slice(0, k) for k in take) + (0,)]
        # x's axes follow `order`; put them back in the view's dim order, then add the
        # size-1 and broadcast (stride-0) dims.
        x = jnp.transpose(x, np.argsort(order)) if order else x.reshape(())
        kept = sorted(order)
        x = x.reshape([size[d] if d in kept else 1 for d in range(len(size))])
        return _view_dtype(jnp.broadcast_to(x, size), dtype)

    return read


@functools.lru_cache(maxsize=4096)
def _reader(base_shape, size, stride, dtype, static_offset=None, base_dtype=None, device=0):
    """read(base, offset), or read(base) at `static_offset`: compiled into the program (an
    argument of the jitted function would be traced in fused mode)."""
    read = view_read_fn(base_shape, size, stride, dtype)
    identity = ("storage.read", base_shape, size, stride, str(dtype), static_offset, str(base_dtype), device)
    if static_offset is None:
        return kernel_cache.kept_jit(read, *identity)
    return kernel_cache.kept_jit(lambda base: read(base, static_offset), *identity)


@functools.lru_cache(maxsize=4096)
def _writer(base_shape, size, stride, storage_dtype, static_offset=None, arguments=None):
    """write(base, value, offset), or write(base, value) at `static_offset`: the storage's array
    with the view's elements set to value."""
    plan = _chunk_plan(size, stride)
    base_numel = math.prod(base_shape)

    def write_elements(flat, value, offset):
        """`flat` (1-D, of value's dtype) with the view's elements set to `value`."""
        if plan is None:
            return flat.at[_flat_indices(size, stride, offset)].set(value)
        order, chunk_shape, take = plan
        length = math.prod(chunk_shape)
        n = flat.shape[0]
        if static_offset is not None:
            flat = _padded_flat(flat, offset + length)
        chunk = lax.dynamic_slice(flat, (offset,), (length,)).reshape(chunk_shape)
        v = value.reshape([size[d] for d in sorted(order)]) if order else value.reshape(())
        if order:
            v = jnp.transpose(v, np.argsort(np.argsort(order)))
        chunk = chunk.at[tuple(slice(0, k) for k in take) + (0,)].set(v)
        return lax.dynamic_update_slice(flat, chunk.reshape(-1), (offset,))[:n]

    def write(base, value, offset):
        if value.dtype.itemsize != jnp.dtype(storage_dtype).itemsize:
            # a view of another element size: write its elements into the storage's bytes
            new = write_elements(reinterpret(base.reshape(-1), value.dtype), value, offset)
            return reinterpret(new, storage_dtype)[:base_numel].reshape(base_shape)
        value = _view_dtype(value, storage_dtype)
        return write_elements(base.reshape(-1), value, offset)[:base_numel].reshape(base_shape)

    identity = ("storage.write", base_shape, size, stride, str(storage_dtype), static_offset, arguments)
    if static_offset is None:
        return kernel_cache.kept_jit(write, *identity)
    return kernel_cache.kept_jit(lambda base, value: write(base, value, static_offset), *identity)


# ---- making tensors -----------------------------------------------------------------------


def wrap(array, dtype: torch.dtype = None) -> torch.Tensor:
    """A new pjrt tensor owning `array`."""
    if dtype is None:
        dtype = dtypes.to_torch(array.dtype)
    t = _create_empty(array.shape, dtype)
    if placement.multi:
        index = placement.index_of(array)
        if index:
            placement.place(t, index)
    s = t.untyped_storage()
    s._pjrt = Storage(array, dtype)
    give_address(s, t.numel() * dtype.itemsize)
    return t


def dense_order(size, stride):
    """For strides that lay `size` out densely in another dim order than row-major (channels_last,
    a transpose's clone): the dims from outermost to innermost in memory; None for row-major
    strides and for strides that are not a dense permutation (those are stored row-major)."""
    size, stride = tuple(size), tuple(stride)
    if stride == contiguous_strides(size) or 0 in size:
        return None
    order = tuple(sorted(range(len(size)), key=lambda d: -stride[d]))
    expected = 1
    for d in reversed(order):
        if size[d] != 1 and stride[d] != expected:
            return None
        expected *= size[d]
    return order


@functools.lru_cache(maxsize=4096)
def _to_order_fn(order, arg):
    return kernel_cache.kept_jit(lambda x: jnp.transpose(x, order), "storage.to_order", order, arg)


def wrap_laid_out(array, dtype: torch.dtype, stride) -> torch.Tensor:
    """A new pjrt tensor with `array`'s values and the given strides (as PyTorch's kernels lay out
    their results: channels_last in, channels_last out). The storage holds the elements in memory
    order; strides that are not a dense permutation give a row-major tensor."""
    order = dense_order(array.shape, stride)
    if order is None:
        return wrap(array, dtype)
    return wrap_in_order(call(_to_order_fn(order, aval_of(array)), array), stride, dtype)


def wrap_in_order(array, stride, dtype: torch.dtype = None) -> torch.Tensor:
    """A new pjrt tensor with the given strides (a dense permutation) over `array`, which holds
    its elements in memory order already: outermost dim first, as dense_order sorts them (a
    kernel laid it out in its own program: no separate transpose)."""
    order = sorted(range(len(stride)), key=lambda d: -stride[d])
    size = [0] * len(order)
    for i, d in enumerate(order):
        size[d] = array.shape[i]
    t = wrap(array, dtype)
    set_geometry(t, tuple(size), tuple(stride), 0)
    return t


def empty(shape, dtype: torch.dtype, device: int = 0) -> torch.Tensor:
    """A new pjrt tensor on pjrt:`device` whose storage is not yet materialized."""
    shape = tuple(shape)
    dtypes.to_jax(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > _capacity:
        check_allocation(nbytes, shape)
    t = _create_empty(shape, dtype)
    if device:
        placement.place(t, device)
    s = t.untyped_storage()
    s._pjrt = Storage(None, dtype, shape, device)
    give_address(s, nbytes)
    return t


# ---- addresses ---------------------------------------------------------------------------
# PyTorch and the libraries on it tell storages apart by data_ptr(): torch.save, safetensors'
# and transformers' shared-tensor checks, checkpointers deciding what changed. A pjrt storage's
# bytes are a jax.Array with no host address, and PyTorch's Python backend gives every storage a
# null pointer. So each storage gets an address of its own from a range no host memory uses
# (above 2**60: beyond the virtual address space of x86-64 and arm64), written into the c10
# storage's data pointer; views are base + offset x element size as PyTorch computes them. The
# address is never dereferenced: only pjrt kernels touch pjrt storages. A storage keeps its
# address for its life; addresses are never reused.

_ADDRESS_BASE = 1 << 60
_ADDRESS_ALIGN = 256
_next_address = _ADDRESS_BASE
_address_lock = threading.Lock()


def _find_storage_words():
    """Byte offsets of the data pointer and of the size in bytes inside a c10 StorageImpl, read
    off CPU storages whose values are known; (None, None) if this PyTorch lays storages out
    otherwise."""
    probes = [torch.UntypedStorage(n) for n in (72, 1160)]
    words = [(ctypes.c_uint64 * 12).from_address(p._cdata) for p in probes]
    pointer = next((i * 8 for i, w in enumerate(words[0]) if w == probes[0].data_ptr()), None)
    size = next((i * 8 for i in range(12) if all(w[i] == p.nbytes() for w, p in zip(words, probes))), None)
    if pointer is None or size is None:
        warnings.warn("torchpjrt: cannot find the data pointer of a c10 storage in this PyTorch build; "
                      "pjrt storages report data_ptr() == 0", RuntimeWarning, stacklevel=2)
        return None, None
    return pointer, size


_DATA_POINTER_OFFSET, _SIZE_OFFSET = _find_storage_words()
# the process's memory as 8-byte words from address 8 on: writing a storage's two words by index
# costs a fraction of building a ctypes array at its address for each new storage
_WORDS = ctypes.c_uint64 * (1 << 56)
_MEMORY = _WORDS.from_address(8) if _DATA_POINTER_OFFSET is not None else None
_SIZE_WORD = (_SIZE_OFFSET - _DATA_POINTER_OFFSET) // 8 if _SIZE_OFFSET is not None else None


def give_address(s: torch.UntypedStorage, nbytes: int) -> None:
    """Give the c10 storage `s` a fresh address for `nbytes` bytes (0 for none, as on CPU), and
    `nbytes` as its size (what CPU's view kernels check a view against)."""
    global _next_address
    if _MEMORY is None:
        return
    address = 0
    if nbytes:
        with _address_lock:
            address = _next_address
            _next_address += -(-nbytes // _ADDRESS_ALIGN) * _ADDRESS_ALIGN
    word = (s._cdata + _DATA_POINTER_OFFSET - 8) >> 3
    _MEMORY[word] = address
    _MEMORY[word + _SIZE_WORD] = nbytes


def storage_words_known() -> bool:
    """Whether pjrt storages carry their address and size (else CPU's view kernels are not used)."""
    return _DATA_POINTER_OFFSET is not None


# ---- what the device can hold ------------------------------------------------------------
# A storage larger than the device's memory can never be allocated: like the CPU allocator,
# refuse it when it is asked for (empty() allocates lazily, fused mode records lazily, so the
# runtime would only fail at first use). Callers compare the bytes they need with `_capacity`
# (one integer comparison) and call check_allocation only when it is exceeded; it is 0 until
# the first allocation measures the device.

_capacity = 0
_capacity_source = None


def check_allocation(nbytes: int, shape=None) -> None:
    """Raise torch.OutOfMemoryError if `nbytes` exceed what the device can hold (for a
    contiguous `shape` whose byte count overflows int64, PyTorch's RuntimeError)."""
    global _capacity, _capacity_source
    if shape is not None and nbytes >= 2**63:
        raise RuntimeError(f"Storage size calculation overflowed with sizes={list(shape)}")
    if _capacity_source is None:
        _capacity, _capacity_source = device_capacity()
    if nbytes > _capacity:
        raise torch.OutOfMemoryError(
            f"pjrt: not enough memory: you tried to allocate {nbytes} bytes, but pjrt:0 "
            f"({default_device().platform}) holds at most {_capacity} bytes ({_capacity_source})."
        )


def device_capacity():
    """(bytes, where the figure comes from): the runtime's memory limit for the device where it
    reports one (GPU, TPU: memory_stats()["bytes_limit"]), else the host's physical memory."""
    try:
        stats = default_device().memory_stats()
    except Exception:  # noqa: BLE001 - a plugin without memory statistics
        stats = None
    limit = int((stats or {}).get("bytes_limit") or 0)
    if limit > 0:
        return limit, "the device's memory limit"
    from .device import _host_memory

    return _host_memory(), "the host's physical memory"


def alias(base: torch.Tensor, size, stride, offset, dtype: torch.dtype = None) -> torch.Tensor:
    """A new pjrt tensor sharing `base`'s storage with the given geometry (a view)."""
    if _inference_mode_enabled() != base.is_inference():
        # a view is an inference tensor exactly when its base is, in inference mode or not (as
        # CPU's views copy their base's dispatch keys); a tensor made here would otherwise follow
        # the mode, and autograd then fails to give a normal base's view its version counter
        with torch.inference_mode(base.is_inference()):
            t = _create_empty((0,), dtype or base.dtype)
            if placement.multi:
                _place_like(t, base)
            _set_storage.redispatch(_META, t, base.untyped_storage(), offset, size, stride)
        return t
    t = _create_empty((0,), dtype or base.dtype)
    if placement.multi:
        _place_like(t, base)
    _set_storage.redispatch(_META, t, base.untyped_storage(), offset, size, stride)
    return t


def _place_like(t, base):
    """A fresh tensor about to be set onto `base`'s storage must be on its device first (set_
    refuses a storage of another device)."""
    index = base.get_device()
    if index > 0:
        placement.place(t, index)


def set_geometry(t: torch.Tensor, size, stride, offset) -> None:
    """Change `t`'s sizes/strides/offset in place (metadata only)."""
    _set_storage.redispatch(_META, t, t.untyped_storage(), offset, size, stride)


def resize(t: torch.Tensor, size) -> None:
    """PyTorch's resize_: keep the storage, grow it (zero-filled) if it is too small."""
    size = tuple(int(s) for s in size)
    st = t.untyped_storage()._pjrt
    st.padding = None  # the storage's positions past a padded result may now be elements
    offset = t.storage_offset() if math.prod(size) else 0
    need = offset + math.prod(size)
    if need > st.numel:
        if need * st.dtype.itemsize > _capacity:
            check_allocation(need * st.dtype.itemsize)
        if st.array is None or st.numel == 0:
            # nothing to keep (an out= tensor made empty, resized by the op): a zero fill, shared
            # when small, and no program
            st.replace(_zeros_on(st.device if st.array is None else _device(st.array), (need,), dtypes.to_jax(st.dtype)))
        else:
            old = st.value()
            st.replace(call(_grow_fn(st.numel, need, dtypes.to_jax(st.dtype), st.shape, _device(old)), old))
        give_address(t.untyped_storage(), need * st.dtype.itemsize)  # reallocated, as on CPU
    stride = contiguous_strides(size)
    set_geometry(t, size, stride, offset)


@functools.lru_cache(maxsize=4096)
def _grow_fn(old_n, new_n, dtype, old_shape, device):
    return kernel_cache.kept_jit(lambda x: jnp.concatenate([x.reshape(-1), jnp.zeros((new_n - old_n,), dtype)]),
                                 "storage.grow", old_n, new_n, str(dtype), old_shape, device)


def span(size, stride) -> int:
    """Elements from a strided tensor's first to its last, inclusive (0 for an empty one)."""
    return 1 + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0


def contiguous_strides(size):
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


# ---- synchronization -----------------------------------------------------------------------


def synchronize_all():
    """Block until every live device array is computed (dispatch is asynchronous)."""
    fusion.flush("synchronize")
    for a in jax.live_arrays():
        try:
            a.block_until_ready()
        except Exception:  # noqa: BLE001 - a deleted or donated buffer has nothing to wait for
            pass
    from . import device_checks

    device_checks.raise_pending()
