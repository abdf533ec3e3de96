"""`torch.UntypedStorage` methods for pjrt storages.

PyTorch's own storage methods assume device memory reachable through an allocator and a data
pointer. A pjrt storage's bytes live in a `jax.Array` instead (see storage.py), so the
methods that `copy.deepcopy`, `torch.save` and `torch.load(map_location="pjrt")` use are
routed here for pjrt storages; every other storage keeps PyTorch's behaviour.
"""

import jax
import numpy as np
import torch

from . import device_checks, dtypes, fusion, storage

_original = {}


def _is_pjrt(s) -> bool:
    return s.device.type == "pjrt"


def _data(s) -> storage.Storage:
    try:
        return s._pjrt
    except AttributeError:
        raise RuntimeError("torchpjrt: this pjrt storage has no device data") from None


def _nbytes(self):
    if not _is_pjrt(self):
        return _original["nbytes"](self)
    st = _data(self)
    return st.numel * st.dtype.itemsize


def _size(self):
    return _nbytes(self) if _is_pjrt(self) else _original["size"](self)


def _len(self):
    return _nbytes(self) if _is_pjrt(self) else _original["__len__"](self)


def new_pjrt_storage(st: storage.Storage) -> torch.UntypedStorage:
    """A fresh c10 storage on pjrt:0 carrying `st`."""
    s = storage._create_empty((0,), st.dtype).untyped_storage()
    s._pjrt = st
    return s


def _data_ptr(self):
    # device bytes have no address here; 0 is what PyTorch's serializer expects then
    return 0 if _is_pjrt(self) else _original["data_ptr"](self)


def _clone(self):
    if not _is_pjrt(self):
        return _original["clone"](self)
    st = _data(self)
    # arrays are immutable: the copy may share the buffer until one side is written
    return new_pjrt_storage(storage.Storage(st.array, st.dtype, st.shape))


def _cpu(self):
    if not _is_pjrt(self):
        return _original["cpu"](self)
    st = _data(self)
    flat = np.asarray(fusion.concrete(st.value())).reshape(-1)
    device_checks.raise_pending()
    return dtypes.cpu_tensor_from_numpy(flat, st.dtype).untyped_storage()


def _to_pjrt(self, device=None, non_blocking=False):
    """`storage.pjrt()` (used by torch.load with map_location='pjrt')."""
    if _is_pjrt(self):
        return self
    if device not in (None, 0) and torch.device(device if not isinstance(device, int) else f"pjrt:{device}").index not in (None, 0):
        raise NotImplementedError("torchpjrt: only pjrt:0 is addressable in one process")
    raw = np.frombuffer(bytes(self), dtype=np.uint8) if self.nbytes() else np.zeros((0,), np.uint8)
    arr = jax.device_put(raw.copy(), storage.default_device())
    st = storage.Storage(arr, torch.uint8)
    st.raw = True  # untyped bytes: takes the dtype of the first tensor set onto it
    return new_pjrt_storage(st)


def _to(self, *, device, non_blocking=False):
    if torch.device(device).type == "pjrt":
        return _to_pjrt(self, torch.device(device).index, non_blocking)
    if _is_pjrt(self):
        if torch.device(device).type == "cpu":
            return _cpu(self)
        raise RuntimeError(f"torchpjrt: cannot move a pjrt storage to {device} directly; go through the CPU")
    return _original["to"](self, device=device, non_blocking=non_blocking)


def _copy_(self, src, non_blocking=False):
    if not (_is_pjrt(self) or _is_pjrt(src)):
        return _original["copy_"](self, src, non_blocking)
    raise NotImplementedError(
        "torchpjrt: UntypedStorage.copy_ with pjrt storages is not supported; copy tensors instead"
    )


def _new(cls, *args, device=None, **kwargs):
    """`torch.UntypedStorage(nbytes, device="pjrt")`: PyTorch's constructor would ask the
    PrivateUse1 allocator for the bytes, which a Python backend does not have. A pjrt storage of
    `nbytes` untyped (zero) bytes instead, refused at the call when the device cannot hold it."""
    if device is None or torch.device(device).type != "pjrt":
        kw = kwargs if device is None else dict(kwargs, device=device)
        return _original["__new__"](cls, *args, **kw)
    index = torch.device(device).index
    if index not in (None, 0):
        raise NotImplementedError("torchpjrt: only pjrt:0 is addressable in one process")
    if kwargs or len(args) > 1:
        raise TypeError(f"torchpjrt: UntypedStorage(..., device='pjrt') takes a size or a sequence of bytes, "
                        f"got {args!r} {kwargs!r}")
    if args and not isinstance(args[0], int):
        return _to_pjrt(_original["__new__"](cls, *args))  # a sequence of byte values
    nbytes = args[0] if args else 0
    if nbytes < 0:
        raise RuntimeError(f"torchpjrt: a storage of {nbytes} bytes: the size must not be negative")
    if nbytes > storage._capacity:
        storage.check_allocation(nbytes)
    st = storage.Storage(None, torch.uint8, (nbytes,))
    st.raw = True  # untyped bytes: takes the dtype of the first tensor set onto it
    return new_pjrt_storage(st)


def _resize_(self, size):
    if not _is_pjrt(self):
        return _original["resize_"](self, size)
    raise NotImplementedError("torchpjrt: resizing a pjrt UntypedStorage directly is not supported; use Tensor.resize_")


def install():
    cls = torch.UntypedStorage
    for name, fn in (("nbytes", _nbytes), ("size", _size), ("__len__", _len), ("clone", _clone),
                     ("cpu", _cpu), ("copy_", _copy_), ("resize_", _resize_),
                     ("data_ptr", _data_ptr), ("to", _to)):
        if name not in _original:
            _original[name] = getattr(cls, name)
            setattr(cls, name, fn)
    cls.pjrt = _to_pjrt
    if "__new__" not in _original:
        _original["__new__"] = cls.__new__
        cls.__new__ = staticmethod(_new)
