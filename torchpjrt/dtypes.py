"""Mapping between torch dtypes and JAX/numpy dtypes."""

import jax.numpy as jnp
import numpy as np
import torch

# float types PyTorch's CPU kernels accumulate in float32 (rounding once at the end)
LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

TORCH_TO_JAX = {
    torch.float32: jnp.dtype(jnp.float32),
    torch.float64: jnp.dtype(jnp.float64),
    torch.float16: jnp.dtype(jnp.float16),
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.int64: jnp.dtype(jnp.int64),
    torch.int32: jnp.dtype(jnp.int32),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int8: jnp.dtype(jnp.int8),
    torch.uint8: jnp.dtype(jnp.uint8),
    torch.uint16: jnp.dtype(jnp.uint16),
    torch.uint32: jnp.dtype(jnp.uint32),
    torch.uint64: jnp.dtype(jnp.uint64),
    torch.bool: jnp.dtype(jnp.bool_),
    torch.complex64: jnp.dtype(jnp.complex64),
    torch.complex128: jnp.dtype(jnp.complex128),
    torch.float8_e4m3fn: jnp.dtype(jnp.float8_e4m3fn),
    torch.float8_e5m2: jnp.dtype(jnp.float8_e5m2),
}
JAX_TO_TORCH = {v: k for k, v in TORCH_TO_JAX.items()}


_NO_XLA_TYPE = {torch.complex32: "XLA has no complex type with float16 parts; use torch.complex64"}


def to_jax(dtype: torch.dtype):
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        why = _NO_XLA_TYPE.get(dtype)
        raise TypeError(f"torchpjrt: dtype {dtype} is not supported on the pjrt device"
                        + (f" ({why})" if why else "")) from None


def to_torch(dtype) -> torch.dtype:
    try:
        return JAX_TO_TORCH[dtype]
    except KeyError:
        return JAX_TO_TORCH[np.dtype(dtype)]


# numpy has no bfloat16/float8: host transfers reinterpret those through same-width ints.
_HOST_BITCAST = {
    torch.bfloat16: (torch.int16, np.int16),
    torch.float8_e4m3fn: (torch.int8, np.int8),
    torch.float8_e5m2: (torch.int8, np.int8),
    torch.uint16: (torch.int16, np.int16),
    torch.uint32: (torch.int32, np.int32),
    torch.uint64: (torch.int64, np.int64),
}


def numpy_from_cpu_tensor(t: torch.Tensor, *, to_copy: bool = False) -> np.ndarray:
    """A numpy array (of the matching JAX dtype) holding a CPU tensor's values. With `to_copy`
    (the caller copies it at once) it is borrowed through DLPack: Tensor.numpy() would mark the
    tensor's storage as never resizable again, which x.to("pjrt") must not do to x (CUDA's
    copy does not)."""
    to_jax(t.dtype)  # a dtype the device cannot hold is refused here, by name
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    dtype = t.dtype
    via = _HOST_BITCAST.get(dtype)
    if via is not None:
        t = t.contiguous().view(via[0])
    a = _borrowed(t) if to_copy else None
    if a is None:
        a = t.numpy()
    return a if via is None else a.view(TORCH_TO_JAX[dtype])


def _borrowed(t):
    try:
        return np.from_dlpack(t)
    except (BufferError, TypeError, RuntimeError, ValueError):
        return None  # a layout or dtype DLPack does not carry: Tensor.numpy() reads it


def cpu_tensor_from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    via = _HOST_BITCAST.get(dtype)
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:
        a = a.copy()
    if via is not None:
        return torch.from_numpy(a.view(via[1])).view(dtype)
    return torch.from_numpy(a)
