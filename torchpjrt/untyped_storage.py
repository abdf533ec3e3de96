"""`torch.UntypedStorage` methods for pjrt storages.

PyTorch's own storage methods assume device memory reachable through an allocator and a data
pointer. A pjrt storage's bytes live in a `jax.Array` instead (see storage.py), so the
methods that `copy.deepcopy`, `torch.save` and `torch.load(map_location="pjrt")` use are
routed here for pjrt storages; every other storage keeps PyTorch's behaviour. torch.load's
unpickler is given one addition, so that tensors sharing a pjrt storage when saved share one when
loaded (see `_load`).
"""

import functools

import jax
import numpy as np
import torch

from . import device as pjrt_device
from . import device_checks, dtypes, fusion, placement, storage

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


def new_pjrt_storage(st: storage.Storage, device: int = 0) -> torch.UntypedStorage:
    """A fresh c10 storage on pjrt:`device` carrying `st`."""
    t = storage._create_empty((0,), st.dtype)
    if device:
        placement.place(t, device)
    s = t.untyped_storage()
    s._pjrt = st
    storage.give_address(s, st.numel * st.dtype.itemsize)
    return s


def _clone(self):
    if not _is_pjrt(self):
        return _original["clone"](self)
    st = _data(self)
    # arrays are immutable: the copy may share the buffer until one side is written
    return new_pjrt_storage(storage.Storage(st.array, st.dtype, st.shape, st.device), self.device.index or 0)


def _cpu(self):
    if not _is_pjrt(self):
        return _original["cpu"](self)
    st = _data(self)
    flat = np.asarray(fusion.concrete(st.value())).reshape(-1)
    device_checks.raise_pending()
    return dtypes.cpu_tensor_from_numpy(flat, st.dtype).untyped_storage()


def _to_pjrt(self, device=None, non_blocking=False):
    """`storage.pjrt()` (used by torch.load with map_location='pjrt')."""
    index = _index_of(device)
    if _is_pjrt(self) and (self.device.index or 0) == index:
        return self
    if _is_pjrt(self):
        self = _cpu(self)
    raw = np.frombuffer(bytes(self), dtype=np.uint8) if self.nbytes() else np.zeros((0,), np.uint8)
    arr = jax.device_put(raw.copy(), pjrt_device.jax_device(index) if index else storage.default_device())
    st = storage.Storage(arr, torch.uint8)
    st.raw = True  # untyped bytes: takes the dtype of the first tensor set onto it
    return new_pjrt_storage(st, index)


def _index_of(device) -> int:
    """The pjrt index `device` (None, an int, "pjrt:N", a torch.device) names, checked usable."""
    if device is None:
        index = pjrt_device.current_device()
    elif isinstance(device, int):
        index = device
    else:
        d = torch.device(device)
        index = d.index if d.index is not None else pjrt_device.current_device()
    placement.require(index)
    return index


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
    index = _index_of(device)
    if kwargs or len(args) > 1:
        raise TypeError(f"torchpjrt: UntypedStorage(..., device='pjrt') takes a size or a sequence of bytes, "
                        f"got {args!r} {kwargs!r}")
    if args and not isinstance(args[0], int):
        return _to_pjrt(_original["__new__"](cls, *args), index)  # a sequence of byte values
    nbytes = args[0] if args else 0
    if nbytes < 0:
        raise RuntimeError(f"torchpjrt: a storage of {nbytes} bytes: the size must not be negative")
    if nbytes > storage._capacity:
        storage.check_allocation(nbytes)
    st = storage.Storage(None, torch.uint8, (nbytes,), index)
    st.raw = True  # untyped bytes: takes the dtype of the first tensor set onto it
    return new_pjrt_storage(st, index)


def _resize_(self, size):
    if not _is_pjrt(self):
        return _original["resize_"](self, size)
    raise NotImplementedError("torchpjrt: resizing a pjrt UntypedStorage directly is not supported; use Tensor.resize_")


# ---- torch.load: one storage per saved storage -----------------------------------------------
# torch.save writes each storage once, under a key, and every tensor (view, tied weight) or storage
# object on it refers to that key. torch.load reads the key's bytes at its first reference and gives
# the later references the same storage, but only when that storage's data_ptr() is nonzero, its
# test for "allocated" (meta and fake storages are rebuilt per reference). The unpickler below keeps
# every pjrt storage by its key, whatever data_ptr() reports (a storage whose size is 0 has none),
# and types each reference as it was saved.


def _one_storage_per_key(persistent_load):
    """torch.load's `persistent_load`, giving every reference to one saved key one pjrt storage."""
    loaded = {}

    def load(saved_id):
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5):
            return persistent_load(saved_id)
        storage_type, key = saved_id[1], saved_id[2]  # ("storage", type, key, location, numel)
        typed = loaded.get(key)
        if typed is None:
            typed = persistent_load(saved_id)
            if isinstance(typed, torch.storage.TypedStorage) and _is_pjrt(typed._untyped_storage):
                loaded[key] = typed
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if isinstance(typed, torch.storage.TypedStorage) and typed.dtype != dtype:
            # one storage saved through tensors of two dtypes (CPU refuses to save that, but its
            # check compares data pointers): each reference is typed as it was saved, not as the first
            typed = torch.storage.TypedStorage(wrap_storage=typed._untyped_storage, dtype=dtype, _internal=True)
        return typed

    return load


@functools.lru_cache(maxsize=None)
def _unpickler_keeping_storages(base):
    class Unpickler(base):
        def __setattr__(self, name, value):
            # torch.serialization._load sets its persistent_load on the unpickler it made
            if name == "persistent_load":
                value = _one_storage_per_key(value)
            super().__setattr__(name, value)

    Unpickler.__name__ = Unpickler.__qualname__ = base.__name__
    return Unpickler


class _PickleModule:
    """The `pickle_module` torch.serialization._load is given, with its Unpickler keeping storages."""

    def __init__(self, module):
        self._module = module
        self.Unpickler = _unpickler_keeping_storages(module.Unpickler)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _load(zip_file, map_location, pickle_module, *args, **kwargs):
    """torch.serialization._load (torch.load of the zip format, weights_only or not)."""
    return _original["_load"](zip_file, map_location, _PickleModule(pickle_module), *args, **kwargs)


def install():
    cls = torch.UntypedStorage
    for name, fn in (("nbytes", _nbytes), ("size", _size), ("__len__", _len), ("clone", _clone),
                     ("cpu", _cpu), ("copy_", _copy_), ("resize_", _resize_),
                     ("to", _to)):
        if name not in _original:
            _original[name] = getattr(cls, name)
            setattr(cls, name, fn)
    cls.pjrt = _to_pjrt
    if "_load" not in _original:
        _original["_load"] = torch.serialization._load
        torch.serialization._load = _load
    if "__new__" not in _original:
        _original["__new__"] = cls.__new__
        cls.__new__ = staticmethod(_new)
