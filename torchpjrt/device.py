"""The `pjrt` PrivateUse1 device: registration, platform choice, and the `torch.pjrt` module.

This module *is* `torch.pjrt` (registered with `torch._register_device_module`), so its
public functions mirror `torch.cuda`'s: is_available, device_count, synchronize, ...
"""

import os
import sys
import threading

import jax

jax.config.update("jax_enable_x64", True)  # int64 / float64 must behave as in PyTorch

import torch  # noqa: E402
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend  # noqa: E402

BACKEND_NAME = "pjrt"

_lock = threading.Lock()
_devices = None
_current_device = 0


def _requested_platform():
    return os.environ.get("TORCHPJRT_PLATFORM") or None


def jax_devices():
    """This process's JAX devices of the chosen platform; `pjrt:N` is `jax_devices()[N]`.

    Local devices, not `jax.devices()`: under JAX's multi-process runtime (torch.distributed)
    the global list holds every process's devices, and a tensor can live only on our own."""
    global _devices
    if _devices is None:
        with _lock:
            if _devices is None:
                platform = _requested_platform()
                try:
                    devs = jax.local_devices(backend=platform)
                except RuntimeError as e:
                    raise RuntimeError(
                        f"torchpjrt: TORCHPJRT_PLATFORM={platform!r} is not available to JAX "
                        f"({e}). Install the matching jax extra (jax[tpu], jax[cuda]) or unset "
                        "TORCHPJRT_PLATFORM to use JAX's default backend."
                    ) from None
                # computations whose inputs are not yet on a device (factories) go here too
                jax.config.update("jax_default_device", devs[0])
                _devices = devs
    return _devices


def jax_device(index=None):
    devs = jax_devices()
    i = _current_device if index is None else index
    if i < 0 or i >= len(devs):
        raise RuntimeError(f"pjrt:{i} does not exist: {len(devs)} pjrt device(s) on platform {platform()!r}")
    return devs[i]


# ---- torch.pjrt public functions ------------------------------------------------------


def is_available() -> bool:
    try:
        return len(jax_devices()) > 0
    except RuntimeError:
        return False


def is_initialized() -> bool:
    return _devices is not None


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    try:
        return len(jax_devices())
    except RuntimeError:
        return 0


def current_device() -> int:
    return _current_device


def set_device(device) -> None:
    global _current_device
    index = torch.device(device).index if not isinstance(device, int) else device
    if index is None:
        index = 0
    if index != 0:
        raise NotImplementedError(
            "torchpjrt: only pjrt:0 can hold tensors in one process for now; run one process "
            "per device (torch.distributed) to use several devices"
        )
    _current_device = index


class device:
    """Context manager selecting a pjrt device, like torch.cuda.device."""

    def __init__(self, device):
        self.index = _index(device) if device is not None else None

    def __enter__(self):
        self.prev = _current_device
        if self.index is not None:
            set_device(self.index)
        return self

    def __exit__(self, *exc):
        set_device(self.prev)
        return False


def platform() -> str:
    """The JAX platform of the pjrt devices: 'cpu', 'gpu', 'tpu', ..."""
    return jax_devices()[0].platform


def get_device_name(device=None) -> str:
    return jax_device(_index(device)).device_kind


def synchronize(device=None) -> None:
    """Wait until every queued computation has finished."""
    from . import storage

    storage.synchronize_all()


def _index(device):
    if device is None:
        return _current_device
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index or 0


def memory_stats(device=None) -> dict:
    """The runtime's memory statistics ({} where the platform reports none, like CPU)."""
    stats = jax_device(_index(device)).memory_stats()
    return dict(stats) if stats else {}


def memory_allocated(device=None) -> int:
    return int(memory_stats(device).get("bytes_in_use", 0))


def max_memory_allocated(device=None) -> int:
    return int(memory_stats(device).get("peak_bytes_in_use", 0))


def memory_reserved(device=None) -> int:
    s = memory_stats(device)
    return int(s.get("bytes_reserved", s.get("bytes_limit", 0)))


def empty_cache() -> None:
    pass


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype():
    return [torch.bfloat16, torch.float16]


# Random state lives in torchpjrt.random_state; these are the torch.cuda-style entry points.
def manual_seed(seed: int) -> None:
    from . import random_state

    random_state.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    from . import random_state

    random_state.seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    from . import random_state

    return random_state.initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    from . import random_state

    return random_state.get_state()


def set_rng_state(new_state, device=None) -> None:
    from . import random_state

    random_state.set_state(new_state)


def get_rng_state_all():
    return [get_rng_state()]


def set_rng_state_all(states) -> None:
    set_rng_state(states[0])


# ---- registration -----------------------------------------------------------------------


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


_registered = False


def register():
    global _registered
    if _registered:
        return
    _registered = True
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", BACKEND_NAME):
        raise RuntimeError(
            "torchpjrt: the PrivateUse1 device is already taken by "
            f"{torch._C._get_privateuse1_backend_name()!r}"
        )
    _setup_privateuseone_for_python_backend(
        BACKEND_NAME, backend_module=sys.modules[__name__], hook=_Hooks(), device_guard=_DeviceGuard()
    )


# ---- streams and events ----------------------------------------------------------------------
# JAX runs each device's work in dispatch order on one queue, and pjrt storages swap immutable
# arrays instead of overwriting buffers, so work issued on any "stream" is already ordered after
# whatever produced its inputs. These classes give code written for torch.cuda's stream API
# (FSDP2, DDP, user overlap code) that one in-order stream: waits are no-ops, synchronize
# waits for the device, and events time with the host clock once the device has caught up.


class Stream:
    """The pjrt device's single in-order stream (every instance is that stream)."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device_index = _index(device)
        self.priority = priority

    @property
    def device(self):
        return torch.device(BACKEND_NAME, self.device_index)

    device_type = BACKEND_NAME

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        synchronize()

    def __eq__(self, other):
        return isinstance(other, Stream) and other.device_index == self.device_index

    def __hash__(self):
        return hash((BACKEND_NAME, self.device_index))

    def __repr__(self):
        return f"torch.pjrt.Stream(device={self.device})"


class Event:
    """A point in the device's single queue."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing
        self._time = None

    def record(self, stream=None) -> None:
        if self.enable_timing:
            synchronize()  # the queue has drained up to here, so host time marks the event
        self._time = __import__("time").perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        synchronize()

    def elapsed_time(self, end_event) -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("torch.pjrt.Event.elapsed_time: both events must be recorded first")
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("torch.pjrt.Event.elapsed_time: create both events with enable_timing=True")
        return (end_event._time - self._time) * 1000.0


def current_stream(device=None) -> Stream:
    return Stream(device)


def default_stream(device=None) -> Stream:
    return Stream(device)


def set_stream(stream) -> None:
    pass  # there is only the one stream


class StreamContext:
    """`with torch.pjrt.stream(s):` — work stays on the single in-order stream."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


def stream(stream) -> StreamContext:
    return StreamContext(stream)
