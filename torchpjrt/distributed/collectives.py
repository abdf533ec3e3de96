"""Collectives as XLA programs: `shard_map` over a mesh of one device per rank of a group.

Each rank passes its local `jax.Array`; it becomes its shard of a global array (sharded on
dim 0, `jax.make_array_from_single_device_arrays`, no copy), the jitted program runs the
XLA collective (psum, all_gather, psum_scatter, all_to_all, ppermute), and the rank's shard
of the output is its result. Programs are compiled once per
(kind, local shape, dtype, group devices, static arguments) and cached.

Every function here takes and returns local arrays and runs asynchronously (JAX dispatch).
"""

import functools
import math
import os
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import torch
import torch.distributed as dist

AXIS = "ranks"

# reduce op names (from torch.distributed.ReduceOp) this module implements
REDUCE_OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor")

_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@functools.lru_cache(maxsize=None)
def _mesh(devices):
    return Mesh(np.array(devices, dtype=object), (AXIS,))


def _shard_program(body, devices, n_in=1, n_out=1, donate=False):
    mesh = _mesh(devices)
    in_specs = (P(AXIS),) * n_in if n_in > 1 else P(AXIS)
    out_specs = (P(AXIS),) * n_out if n_out > 1 else P(AXIS)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(mapped, donate_argnums=(0,) if donate else ())


def _as_global(local, devices):
    """A rank's local array as its shard of a global array split on dim 0 across `devices`."""
    if local.ndim == 0:
        local = local.reshape(1)
    shape = (local.shape[0] * len(devices),) + tuple(local.shape[1:])
    sharding = NamedSharding(_mesh(devices), P(AXIS))
    return jax.make_array_from_single_device_arrays(shape, sharding, [local])


def _local(out):
    return out.addressable_shards[0].data


def _run(program, local, devices, out_shapes):
    outs = program(_as_global(local, devices))
    if not isinstance(outs, tuple):
        outs = (outs,)
    return [_local(o).reshape(s) if _local(o).shape != s else _local(o) for o, s in zip(outs, out_shapes)]


# ---- reductions -------------------------------------------------------------------------


def _is_bool(dtype):
    return dtype == jnp.bool_


def _is_float(dtype):
    return jnp.issubdtype(dtype, jnp.inexact)


def check_reduce_op(op: str, dtype) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"torchpjrt.distributed: reduce op {op!r} is not supported (supported: {REDUCE_OPS})")
    if op == "avg" and not _is_float(dtype):
        raise ValueError(f"torchpjrt.distributed: ReduceOp.AVG needs a floating-point tensor, got {dtype}")
    if op in ("band", "bor", "bxor") and _is_float(dtype):
        raise ValueError(f"torchpjrt.distributed: bitwise ReduceOp.{op.upper()} needs an integer or bool tensor, got {dtype}")
    if op in ("max", "min") and jnp.issubdtype(dtype, jnp.complexfloating):
        raise ValueError(f"torchpjrt.distributed: ReduceOp.{op.upper()} is not defined for complex tensors")


_ELEMENTWISE = {
    "sum": jnp.add, "product": jnp.multiply, "max": jnp.maximum, "min": jnp.minimum,
    "band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor,
}


def _allreduce_block(x, op, n):
    """All-reduce of this rank's block `x` over the mesh axis (inside shard_map)."""
    if _is_bool(x.dtype):
        # torch reduces bools as logic: sum/max/bor = any, product/min/band = all
        as_int = x.astype(jnp.int32)
        if op in ("sum", "max", "bor"):
            return lax.psum(as_int, AXIS) > 0
        if op in ("product", "min", "band"):
            return lax.psum(as_int, AXIS) == n
        return (lax.psum(as_int, AXIS) % 2) == 1  # bxor
    if op == "sum":
        return lax.psum(x, AXIS)
    if op == "avg":
        return lax.psum(x, AXIS) / jnp.asarray(n, x.dtype)
    if op == "max":
        return lax.pmax(x, AXIS)
    if op == "min":
        return lax.pmin(x, AXIS)
    # product and bitwise ops have no XLA all-reduce: gather the blocks, fold locally
    blocks = lax.all_gather(x, AXIS)
    return functools.reduce(_ELEMENTWISE[op], [blocks[i] for i in range(n)])


def _reduce_blocks(stacked, op, n):
    """Fold the leading axis (one block per rank) with `op` (for reduce-scatter fallbacks)."""
    if _is_bool(stacked.dtype):
        as_int = stacked.astype(jnp.int32).sum(0)
        if op in ("sum", "max", "bor"):
            return as_int > 0
        if op in ("product", "min", "band"):
            return as_int == n
        return (as_int % 2) == 1
    if op == "avg":
        return stacked.sum(0) / jnp.asarray(n, stacked.dtype)
    return functools.reduce(_ELEMENTWISE[op], [stacked[i] for i in range(n)])


@functools.lru_cache(maxsize=1024)
def _allreduce_program(devices, shape, dtype, op, donate):
    n = len(devices)
    return _shard_program(lambda x: _allreduce_block(x, op, n), devices, donate=donate)


def all_reduce(local, devices, op, donate=False):
    check_reduce_op(op, local.dtype)
    program = _allreduce_program(devices, local.shape, local.dtype, op, donate)
    return _run(program, local, devices, [local.shape])[0]


# On the CPU platform a device buffer is host memory, and XLA:CPU's own cross-process
# all-reduce is several times slower than gloo's (a plain two-process jax psum of 64 MB takes
# 2-3x gloo's time). There the reduction goes through the group's gloo group instead: one copy
# out of the immutable array into a torch tensor gloo reduces in place, handed back to JAX
# without a copy. GPU and TPU keep XLA's collectives. TORCHPJRT_CPU_COLLECTIVES=xla keeps XLA's
# on the CPU too.
_GLOO_OPS = {
    "sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
    "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}


def reduces_on_host(devices, op, dtype) -> bool:
    """Whether all_reduce of `dtype` by `op` over `devices` goes through gloo (see above)."""
    return (devices[0].platform == "cpu" and op in _GLOO_OPS and not _is_bool(dtype)
            and not jnp.issubdtype(dtype, jnp.complexfloating)
            and os.environ.get("TORCHPJRT_CPU_COLLECTIVES", "gloo") != "xla")


class _HostBuffers:
    """64-byte-aligned host buffers for the reduced results, used again once JAX lets go of them.

    A fresh 64 MB buffer costs 16,384 page faults on its first write, about as long as copying
    into it; a result handed to JAX keeps its buffer until the array dies, and then the buffer
    returns here with its pages mapped (a finalizer on the numpy array torch's storage holds).
    At most `keep_bytes` are kept idle."""

    def __init__(self, keep_bytes=512 << 20):
        self._free = {}  # nbytes -> [raw uint8 arrays]
        self._idle = 0
        self._keep = keep_bytes
        self._lock = threading.Lock()

    def take(self, nbytes):
        with self._lock:
            found = self._free.get(nbytes)
            if found:
                self._idle -= nbytes
                return found.pop()
        return np.empty(nbytes + 64, np.uint8)

    def give_back(self, raw, nbytes):
        with self._lock:
            if self._idle + nbytes <= self._keep:
                self._free.setdefault(nbytes, []).append(raw)
                self._idle += nbytes


_host_buffers = _HostBuffers()


def _host_copy(local, torch_dtype):
    """A writable copy of a CPU-platform array as a torch tensor, 64-byte aligned so that JAX
    takes it back without copying, in a buffer that returns to _host_buffers when its last user
    (the JAX array made from it) is gone."""
    src = np.asarray(local)  # the device buffer itself, read-only
    raw = _host_buffers.take(src.nbytes)
    start = -raw.ctypes.data % 64
    dst = raw[start:start + src.nbytes].view(src.dtype).reshape(src.shape)
    np.copyto(dst, src)
    held = dst.view(_UINT_OF_SIZE[src.dtype.itemsize])
    # torch's storage holds `held` until the DLPack consumer (the JAX array) releases it
    weakref.finalize(held, _host_buffers.give_back, raw, src.nbytes)
    return torch.from_numpy(held).view(torch_dtype)


def host_all_reduce(local, torch_dtype, gloo_group, op, device):
    check_reduce_op(op, local.dtype)
    host = _host_copy(local, torch_dtype)  # the array stays immutable: gloo reduces a copy
    options = dist.AllreduceOptions()
    options.reduceOp = _GLOO_OPS[op]
    gloo_group.allreduce([host], options).wait()
    out = jax.dlpack.from_dlpack(host)
    if out.devices() != {device}:
        out = jax.device_put(out, device)
    return out


# ---- broadcast --------------------------------------------------------------------------


def _bitcast_dtype(dtype):
    if _is_bool(dtype) or jnp.issubdtype(dtype, jnp.complexfloating):
        return None
    return _UINT_OF_SIZE.get(jnp.dtype(dtype).itemsize)


@functools.lru_cache(maxsize=1024)
def _broadcast_program(devices, shape, dtype, root):
    bits = _bitcast_dtype(dtype)

    def body(x):
        is_root = lax.axis_index(AXIS) == root
        if bits is None:  # bool, complex: gather and pick the root's block (n x traffic)
            return lax.all_gather(x, AXIS)[root]
        # A sum where every rank but the root adds zero bits moves the root's exact bit
        # pattern (-0.0, NaN payloads included) with all-reduce traffic.
        b = lax.bitcast_convert_type(x, bits)
        b = lax.psum(jnp.where(is_root, b, jnp.zeros_like(b)), AXIS)
        return lax.bitcast_convert_type(b, dtype)

    return _shard_program(body, devices)


def broadcast(local, devices, root):
    program = _broadcast_program(devices, local.shape, local.dtype, root)
    return _run(program, local, devices, [local.shape])[0]


# ---- all-gather, reduce-scatter, all-to-all ------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _all_gather_program(devices, shape, dtype, n_outputs):
    n = len(devices)
    flat = (math.prod(shape),) if len(shape) == 0 else shape

    def body(x):
        gathered = lax.all_gather(x.reshape(flat) if len(shape) == 0 else x, AXIS)  # (n, *shape)
        if n_outputs == 1:
            return gathered.reshape((n * flat[0],) + tuple(flat[1:]))
        return tuple(gathered[i].reshape(flat) for i in range(n))

    return _shard_program(body, devices, n_out=n_outputs)


def all_gather(local, devices, out_shape):
    """The concatenation (dim 0) of every rank's `local`, reshaped to `out_shape`."""
    program = _all_gather_program(devices, local.shape, local.dtype, 1)
    return _run(program, local, devices, [tuple(out_shape)])[0]


def all_gather_list(local, devices):
    """Every rank's `local`, one array per rank."""
    n = len(devices)
    program = _all_gather_program(devices, local.shape, local.dtype, n)
    return _run(program, local, devices, [local.shape] * n)


@functools.lru_cache(maxsize=1024)
def _reduce_scatter_program(devices, shape, dtype, op, out_shape):
    n = len(devices)
    chunk = (shape[0] // n,) + tuple(shape[1:])

    def body(x):
        if op in ("sum", "avg") and not _is_bool(x.dtype):
            y = lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
            if op == "avg":
                y = y / jnp.asarray(n, y.dtype)
        else:
            # no XLA reduce-scatter for this op: exchange blocks, fold them locally
            blocks = lax.all_to_all(x, AXIS, 0, 0, tiled=True).reshape((n,) + chunk)
            y = _reduce_blocks(blocks, op, n)
        return y.reshape(out_shape)

    return _shard_program(body, devices)


def reduce_scatter(local, devices, op, out_shape):
    """Reduce every rank's `local` (dim 0 = n equal blocks); rank i keeps reduced block i."""
    check_reduce_op(op, local.dtype)
    n = len(devices)
    if local.ndim == 0 or local.shape[0] % n:
        raise ValueError(
            f"torchpjrt.distributed: reduce_scatter input of shape {tuple(local.shape)} does not split "
            f"into {n} equal blocks along dim 0"
        )
    program = _reduce_scatter_program(devices, local.shape, local.dtype, op, tuple(out_shape))
    return _run(program, local, devices, [tuple(out_shape)])[0]


@functools.lru_cache(maxsize=1024)
def _all_to_all_program(devices, shape, dtype):
    return _shard_program(lambda x: lax.all_to_all(x, AXIS, 0, 0, tiled=True), devices)


def all_to_all(local, devices):
    """Rank i sends block j (dim 0 split into n equal blocks) to rank j; blocks arrive in rank order."""
    n = len(devices)
    if local.ndim == 0 or local.shape[0] % n:
        raise ValueError(
            f"torchpjrt.distributed: all_to_all input of shape {tuple(local.shape)} does not split "
            f"into {n} equal blocks along dim 0"
        )
    program = _all_to_all_program(devices, local.shape, local.dtype)
    return _run(program, local, devices, [local.shape])[0]


@functools.lru_cache(maxsize=1024)
def _scatter_program(devices, shape, dtype, root):
    n = len(devices)
    chunk = (shape[0] // n,) + tuple(shape[1:])

    def body(x):
        received = lax.all_to_all(x, AXIS, 0, 0, tiled=True).reshape((n,) + chunk)
        return received[root]

    return _shard_program(body, devices)


def scatter(local, devices, root):
    """Block i of the root's `local` (dim 0 split in n) goes to rank i; others pass zeros of that shape."""
    program = _scatter_program(devices, local.shape, local.dtype, root)
    n = len(devices)
    return _run(program, local, devices, [(local.shape[0] // n,) + tuple(local.shape[1:])])[0]


# ---- point to point -----------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _send_program(devices, shape, dtype):
    # devices = (sender, receiver): the sender's block moves to the receiver
    return _shard_program(lambda x: lax.ppermute(x, AXIS, perm=[(0, 1)]), devices)


def send_recv(local, sender, receiver):
    """Both the sender (its data) and the receiver (a buffer of the same shape) call this."""
    devices = (sender, receiver)
    program = _send_program(devices, local.shape, local.dtype)
    return _run(program, local, devices, [local.shape])[0]
