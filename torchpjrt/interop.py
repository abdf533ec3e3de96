"""pjrt tensors and JAX arrays, both ways, without copies; DLPack for pjrt tensors.

A pjrt tensor's storage holds a `jax.Array` (storage.py), so the bridge is the array itself:

- `to_jax(t)` is the array holding t's elements: the storage's own array for a tensor that covers
  its whole storage contiguously (no copy), else the view's elements read out (one copy, cached
  per storage version). jax.Arrays are immutable: a later in-place write to `t` gives its storage
  a new array and leaves the returned one as it was.
- `from_jax(a)` is a new pjrt tensor whose storage holds `a` itself. Writing to the tensor
  replaces its storage's array; `a` never changes.

DLPack: `Tensor.__dlpack__` / `__dlpack_device__` of a pjrt tensor export its JAX array's buffer
(CPU and GPU platforms; the TPU runtime has no DLPack), so `jnp.from_dlpack(t)` and other
consumers read it in place. `torch.from_dlpack` gives a pjrt tensor for a pjrt tensor (sharing its
storage, as for any torch tensor), for a `jax.Array` on an accelerator that pjrt uses, and for any
DLPack producer when asked with `device="pjrt"`; everything else is PyTorch's.
"""

import functools

import jax
import jax.numpy as jnp
import torch

from . import dtypes, fusion, storage

_original = {}


def to_jax(t: torch.Tensor) -> jax.Array:
    """The `jax.Array` holding pjrt tensor `t`'s elements (shape, dtype and values of `t`)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "pjrt":
        raise TypeError(f"torchpjrt.to_jax: expected a pjrt tensor, got {_describe(t)}")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    value = fusion.concrete(storage.read(t), "to_jax")
    from . import device_checks

    device_checks.raise_pending()  # a failed check means these values must not be used
    return value


def from_jax(array) -> torch.Tensor:
    """A new pjrt tensor holding `array` (a jax.Array on a pjrt device: no copy; on another device
    of this process: copied to the current pjrt device)."""
    if not isinstance(array, jax.Array):
        raise TypeError(f"torchpjrt.from_jax: expected a jax.Array, got {type(array).__name__}")
    from . import placement

    dtype = dtypes.to_torch(array.dtype)
    if not _is_pjrt_array(array):
        from .device import current_device, jax_device

        placement.require(current_device())
        array = jax.device_put(array, jax_device())
    else:
        placement.require(placement.index_of(array))
    if isinstance(array.sharding, jax.sharding.NamedSharding):
        storage.mesh_placements = True  # writes into it keep its placement (storage.write)
    return storage.wrap(array, dtype)


def _describe(x):
    return f"a tensor on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__


# ---- DLPack ----------------------------------------------------------------------------------


def _check_exportable(t):
    # what PyTorch refuses for every device
    if t.requires_grad:
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
    if t.is_conj():
        raise BufferError("Can't export tensors with the conjugate bit set")


def _dlpack(self, *, stream=-1, max_version=None, dl_device=None, copy=None):
    if self.device.type != "pjrt":
        return _original["__dlpack__"](self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)
    _check_exportable(self)
    array = to_jax(self)
    kwargs = {"max_version": max_version, "dl_device": dl_device, "copy": copy}
    if stream not in (-1, None):
        kwargs["stream"] = stream
    try:
        return array.__dlpack__(**kwargs)
    except Exception as e:  # noqa: BLE001 - the runtime's own reason, with what to do instead
        raise BufferError(f"torchpjrt: DLPack export from the {array.devices().pop().platform} platform failed "
                          f"({e}); torchpjrt.to_jax(tensor) gives the jax.Array itself") from e


@functools.lru_cache(maxsize=None)
def _device_of(index):
    from .device import jax_device

    device = jax_device(index)
    try:
        return jax.device_put(jnp.zeros((), jnp.float32), device).__dlpack_device__()
    except Exception as e:  # noqa: BLE001
        raise BufferError(f"torchpjrt: the {device.platform} platform has no DLPack device ({e})") from e


def _dlpack_device(self):
    if self.device.type != "pjrt":
        return _original["__dlpack_device__"](self)
    return _device_of(self.device.index or 0)


def _to_dlpack(tensor):
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "pjrt":
        return _dlpack(tensor)
    return _original["to_dlpack"](tensor)


def _from_dlpack(ext_tensor, *, device=None, copy=None):
    to_pjrt = device is not None and torch.device(device).type == "pjrt"
    if isinstance(ext_tensor, torch.Tensor) and ext_tensor.device.type == "pjrt":
        if not to_pjrt and device is not None:
            return ext_tensor.detach().to(device, copy=bool(copy))
        if copy:
            return ext_tensor.detach().clone()
        # as for any torch tensor: a new tensor on the same memory, outside autograd
        return storage.alias(ext_tensor, tuple(ext_tensor.shape), ext_tensor.stride(), ext_tensor.storage_offset())
    on_accelerator = isinstance(ext_tensor, jax.Array) and all(d.platform != "cpu" for d in ext_tensor.devices())
    if to_pjrt or (device is None and on_accelerator and _is_pjrt_array(ext_tensor)):
        array = ext_tensor if isinstance(ext_tensor, jax.Array) else jnp.from_dlpack(ext_tensor, copy=copy)
        return from_jax(jnp.array(array, copy=True) if copy else array)
    kwargs = {} if device is None else {"device": device}
    if copy is not None:
        kwargs["copy"] = copy
    return _original["from_dlpack"](ext_tensor, **kwargs)


def _is_pjrt_array(array) -> bool:
    from .device import jax_devices

    return array.devices() <= set(jax_devices())


def install() -> None:
    if _original:
        return
    _original["__dlpack__"] = torch.Tensor.__dlpack__
    _original["__dlpack_device__"] = torch.Tensor.__dlpack_device__
    _original["to_dlpack"] = torch.utils.dlpack.to_dlpack
    _original["from_dlpack"] = torch.utils.dlpack.from_dlpack
    torch.Tensor.__dlpack__ = _dlpack
    torch.Tensor.__dlpack_device__ = _dlpack_device
    torch.utils.dlpack.to_dlpack = torch.to_dlpack = _to_dlpack
    torch.utils.dlpack.from_dlpack = torch.from_dlpack = _from_dlpack
