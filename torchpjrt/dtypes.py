"""Mapping between torch dtypes and JAX/numpy dtypes."""

import math

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


# ---- numbers converted to a kernel's type ------------------------------------------------
# CPU kernels convert some number arguments (fill_'s value, clamp's bounds, add's alpha) to the
# type they compute in with c10::checked_convert, which raises when the number does not fit:
# `half.fill_(1e6)` and `int8.masked_fill(mask, 300)` raise there, where an unchecked cast would
# give inf or a wrapped integer. These are c10's names for the types in that error.
_CPP_NAMES = {
    torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16", torch.float32: "float", torch.float64: "double",
    torch.int8: "int8_t", torch.uint8: "uint8_t", torch.int16: "int16_t", torch.int32: "int", torch.int64: "int64_t",
    torch.uint16: "uint16_t", torch.uint32: "uint32_t", torch.uint64: "uint64_t",
    torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>",
}
_COMPONENT = {torch.complex64: torch.float32, torch.complex128: torch.float64}
_LIMITS = {}  # dtype -> (lowest, max)


def _limits(dtype):
    limits = _LIMITS.get(dtype)
    if limits is None:
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        limits = _LIMITS[dtype] = (info.min, info.max)
    return limits


def _overflows(value, dtype) -> bool:
    """c10::overflows<dtype>(value): a number that does not fit the type."""
    if isinstance(value, complex):
        if not dtype.is_complex and value.imag != 0:
            return True
        part = _COMPONENT.get(dtype, dtype)
        return _overflows(value.real, part) or _overflows(value.imag, part)
    dtype = _COMPONENT.get(dtype, dtype)
    lowest, highest = _limits(dtype)
    if isinstance(value, float):
        if value != value:
            return not dtype.is_floating_point  # NaN fits a type that has it
        if dtype.is_floating_point and value in (math.inf, -math.inf):
            return False
    elif lowest == 0 and value < 0:
        return -value > highest  # an integer into an unsigned type may wrap around, as in `a - b`
    return value < lowest or value > highest


def check_number_fits(value, dtype: torch.dtype) -> None:
    """Raise as CPU's checked conversion does when the number `value` does not fit `dtype`
    (a bool always fits, and any number fits bool)."""
    if type(value) is bool or dtype is torch.bool or dtype not in _CPP_NAMES:
        return
    if _overflows(value, dtype):
        raise RuntimeError(f"value cannot be converted to type {_CPP_NAMES[dtype]} without overflow")


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The type CPU kernels compute a low-precision float type in (float32)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
