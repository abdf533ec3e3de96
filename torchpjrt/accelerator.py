"""What PyTorch's accelerator-generic code gets when the current accelerator is pjrt.

Registering the device makes pjrt `torch.accelerator.current_accelerator()` in every process
that imports torch (the package autoloads), so code that never asks for pjrt meets it too:
HF Trainer and accelerate call `torch.accelerator.empty_cache()`, and `DataLoader(pin_memory=
True)` pins each batch for the current accelerator. PyTorch answers both in C++, through a
device allocator and a pinned-memory allocator that a Python backend cannot register
(`torch._C._acc.PrivateUse1Hooks` overrides only is_available/has_primary_context/is_built),
so unanswered they raise. This module answers them in Python, for pjrt only:

- `torch.accelerator`'s synchronize and memory functions (also reached as
  `torch.accelerator.memory.*`) call the `torch.pjrt` function of the same meaning when the
  current accelerator is pjrt, and the original function otherwise.
- `Tensor.pin_memory()` of a CPU tensor, when it would pin for pjrt: pjrt has no page-locked
  host allocator, so it warns once and returns the tensor as it is, in pageable memory
  (`is_pinned()` stays False). This is what PyTorch does without an accelerator: the
  DataLoader then warns that pinned memory won't be used and yields its batches unpinned.
  Every other call reaches PyTorch's own method with its arguments untouched.
"""

import functools
import threading
import warnings
from collections import OrderedDict

import torch
import torch.accelerator
import torch.accelerator.memory
from torch.accelerator._utils import _get_device_index

from . import device as _pjrt

_original = {}


def _current_is_pjrt() -> bool:
    acc = torch._C._accelerator_getAccelerator()
    return acc is not None and acc.type == _pjrt.BACKEND_NAME


def _index(device) -> int:
    # torch.accelerator's own argument check: an int, or a device of the current accelerator
    return _get_device_index(device, optional=True)


# ---- torch.accelerator on pjrt (positional-only arguments, as PyTorch's) ----------------------


def _synchronize(device=None, /) -> None:
    _pjrt.synchronize(_index(device))


def _empty_cache() -> None:
    _pjrt.empty_cache()


def _empty_host_cache() -> None:
    """No pinned host memory, so no cache of it to release."""


def _memory_stats(device_index=None, /) -> OrderedDict:
    return OrderedDict(sorted(_pjrt.memory_stats(_index(device_index)).items()))


def _memory_allocated(device_index=None, /) -> int:
    return _pjrt.memory_allocated(_index(device_index))


def _max_memory_allocated(device_index=None, /) -> int:
    return _pjrt.max_memory_allocated(_index(device_index))


def _memory_reserved(device_index=None, /) -> int:
    return _pjrt.memory_reserved(_index(device_index))


def _max_memory_reserved(device_index=None, /) -> int:
    return _pjrt.max_memory_reserved(_index(device_index))


def _reset_peak_memory_stats(device_index=None, /) -> None:
    _pjrt.reset_peak_memory_stats(_index(device_index))


def _reset_accumulated_memory_stats(device_index=None, /) -> None:
    _pjrt.reset_accumulated_memory_stats(_index(device_index))


def _get_memory_info(device_index=None, /) -> tuple:
    return _pjrt.mem_get_info(_index(device_index))


_ROUTES = {
    "synchronize": _synchronize,
    "empty_cache": _empty_cache,
    "empty_host_cache": _empty_host_cache,
    "memory_stats": _memory_stats,
    "memory_allocated": _memory_allocated,
    "max_memory_allocated": _max_memory_allocated,
    "memory_reserved": _memory_reserved,
    "max_memory_reserved": _max_memory_reserved,
    "reset_peak_memory_stats": _reset_peak_memory_stats,
    "reset_accumulated_memory_stats": _reset_accumulated_memory_stats,
    "get_memory_info": _get_memory_info,
}


def _routed(original, on_pjrt):
    @functools.wraps(original)
    def fn(*args, **kwargs):
        if _current_is_pjrt():
            return on_pjrt(*args, **kwargs)
        return original(*args, **kwargs)

    return fn


# ---- pinned memory -------------------------------------------------------------------------

_warn_lock = threading.Lock()
_warned_pin = False


def _pins_for_pjrt(args, kwargs) -> bool:
    device = args[0] if args else kwargs.get("device")
    if device is None:
        return _current_is_pjrt()
    try:
        return torch.device(device).type == _pjrt.BACKEND_NAME
    except (RuntimeError, TypeError):
        return False


def _pin_memory(self, *args, **kwargs):
    if self.device.type == "cpu" and _pins_for_pjrt(args, kwargs):
        global _warned_pin
        with _warn_lock:
            warn, _warned_pin = not _warned_pin, True
        if warn:
            warnings.warn(
                "torchpjrt: pjrt has no pinned (page-locked) host memory; pin_memory() leaves "
                "tensors in pageable memory (is_pinned() is False)",
                stacklevel=2,
            )
        return self
    return _original["pin_memory"](self, *args, **kwargs)


def install() -> None:
    """Route torch.accelerator's functions and Tensor.pin_memory for pjrt (done once, and only
    when pjrt is the current accelerator)."""
    if _original or not _current_is_pjrt():
        return
    for name, on_pjrt in _ROUTES.items():
        original = getattr(torch.accelerator.memory, name, None) or getattr(torch.accelerator, name, None)
        if original is None:
            continue
        _original[name] = original
        fn = _routed(original, on_pjrt)
        for module in (torch.accelerator, torch.accelerator.memory):
            if getattr(module, name, None) is original:
                setattr(module, name, fn)
    _original["pin_memory"] = torch.Tensor.pin_memory
    functools.update_wrapper(_pin_memory, _original["pin_memory"])
    torch.Tensor.pin_memory = _pin_memory
