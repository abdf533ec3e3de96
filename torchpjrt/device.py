"""The `pjrt` PrivateUse1 device: registration, platform choice, and the `torch.pjrt` module.

This module *is* `torch.pjrt` (registered with `torch._register_device_module`), so its
public functions mirror `torch.cuda`'s: is_available, device_count, synchronize, ...

PyTorch's own utilities read these names from a device module (`torch.get_device_module`,
`getattr(torch, device_type)`), and each one here does what it does for CUDA:
torch.utils.checkpoint (`_initialized`, `device`, `get_rng_state`, `set_rng_state`),
torch.random (`fork_rng`: `device_count`, `get_rng_state(device)`, `set_rng_state(state,
device)`; `manual_seed`/`seed`: `_is_in_bad_fork`, `manual_seed_all`), torch.amp
(`get_amp_supported_dtype`), torch.utils.backend_registration and torch._utils
(`current_device`, `device_count`, `is_available`, `get_device_properties`, `device`),
FSDP's and DTensor's device handle and DeviceMesh (`is_initialized`, `set_device`,
`current_device`, `device_count`, `synchronize`, `Stream`, `Event`, `stream`,
`current_stream`, `get_rng_state`, `set_rng_state`, `memory_summary`), torch.distributed's
memory tracker (`memory_stats`, `memory_allocated`, `memory_reserved`, `empty_cache`).
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
_in_bad_fork = False

# torch.utils.checkpoint saves and replays a device's random state only where
# `torch.<device>._initialized` is true; CUDA sets it once its context exists, so that saving
# the state never creates a context by accident. The pjrt generator is a host-side
# (seed, offset) pair (random_state.py) that exists from import on, and reading or setting it
# starts no runtime, so it is always live: checkpointed code that draws random numbers on pjrt
# replays them in its recomputation. (`is_initialized()` says whether the runtime's devices
# have been set up.)
_initialized = True


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
                from .distributed import chips

                chips.prepare()  # under torchrun on a TPU host: this rank's chip, before libtpu starts
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
                from . import placement

                placement.register_devices(len(devs))  # more than one: PyTorch must know them
                _devices = devs
    return _devices


def jax_device(index=None):
    devs = jax_devices()
    i = current_device() if index is None else index
    if i < 0 or i >= len(devs):
        raise RuntimeError(f"pjrt:{i} does not exist: {len(devs)} pjrt device(s) on platform {platform()!r}")
    return devs[i]


# ---- torch.pjrt public functions ------------------------------------------------------


def is_available() -> bool:
    """Whether a pjrt device exists. Without TORCHPJRT_PLATFORM or JAX_PLATFORMS the answer
    is known without starting JAX's runtime (JAX's default backend always has a device, the CPU
    at least), so asking, as `torch.accelerator.is_available()` does in DataLoader and HF
    code, leaves a process that forks workers afterwards without runtime threads to lose."""
    if _devices is None and _requested_platform() is None and not jax.config.jax_platforms:
        return True
    try:
        return len(jax_devices()) > 0
    except RuntimeError:
        return False


def release_probed_runtime() -> bool:
    """Undo a start of JAX's runtime that only probed the devices (is_available, device_count,
    get_device_properties, ... before any computation), so that JAX's multi-process runtime,
    which must start before the devices exist, can still start: frameworks ask about the device
    at import, before init_process_group. Returns whether the runtime is now unstarted; false once
    an array exists or a pjrt op has run (their buffers and programs belong to the started runtime)."""
    global _devices
    from jax._src import xla_bridge

    from . import dispatch

    if not xla_bridge.backends_are_initialized():
        return True
    if jax.live_arrays() or any(dispatch.stats.values()):
        return False
    with _lock:
        xla_bridge._clear_backends()
        jax.clear_caches()
        jax.config.update("jax_default_device", None)
        _devices = None
    return True


def is_initialized() -> bool:
    """Whether this process has set up its pjrt devices (the first tensor computation,
    `torch.pjrt.init()`, ... do); false in a child forked after that (see `_is_in_bad_fork`)."""
    return _devices is not None and not _in_bad_fork


def init() -> None:
    """Set up the pjrt devices now rather than at the first use (like torch.cuda.init)."""
    _lazy_init()


def _lazy_init() -> None:
    if _in_bad_fork:
        raise RuntimeError(
            "torchpjrt: cannot use the pjrt device in a process forked after the parent started "
            "the JAX runtime (its threads do not survive fork); use the 'spawn' start method "
            "(e.g. DataLoader(multiprocessing_context='spawn')) for subprocesses that need pjrt"
        )
    jax_devices()


def _is_in_bad_fork() -> bool:
    """True in a child process forked after the parent started the JAX runtime, whose
    threads and device clients a forked child does not inherit in working order (CUDA's
    contexts do not survive fork either). torch.manual_seed skips the device there."""
    return _in_bad_fork


def _after_fork_in_child():
    global _in_bad_fork
    # JAX's backends_are_initialized() takes a lock another parent thread may have held at
    # the fork (then held forever here): read the backend table without it.
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    if _devices is not None or getattr(xla_bridge, "_backends", None):
        _in_bad_fork = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def device_count() -> int:
    try:
        return len(jax_devices())
    except RuntimeError:
        return 0


def current_device() -> int:
    """The current pjrt device of this thread (as CUDA's, per thread; pjrt:0 at first)."""
    from . import native, placement

    if placement._guard_count:
        return native.library().torchpjrt_current_device()
    return _current_device


def set_device(device) -> None:
    """Make pjrt:N this thread's current device: where `device="pjrt"` puts tensors."""
    global _current_device
    index = _index(device)
    if index < 0:
        return  # like torch.cuda.set_device: a negative index selects nothing
    from . import native, placement

    placement.require(index)
    if placement._guard_count:
        native.library().torchpjrt_set_current_device(index)
    else:
        _current_device = index


class device:
    """Context manager selecting a pjrt device, like torch.cuda.device: `None` or a negative
    index selects nothing (torch.utils.checkpoint and torch._utils enter it per device)."""

    def __init__(self, device):
        self.index = _index(device) if device is not None else -1

    def __enter__(self):
        self.prev = current_device()
        if self.index >= 0:
            set_device(self.index)
        return self

    def __exit__(self, *exc):
        if self.index >= 0:
            set_device(self.prev)
        return False


class device_of(device):
    """Context manager selecting the device of a tensor (no-op for a tensor not on pjrt),
    like torch.cuda.device_of."""

    def __init__(self, obj):
        is_pjrt = isinstance(obj, torch.Tensor) and obj.device.type == BACKEND_NAME
        super().__init__(obj.get_device() if is_pjrt else -1)


def _exchange_device(index: int) -> int:
    """Make `index` current and return the previous current device (-1: change nothing)."""
    prev = current_device()
    if index >= 0:
        set_device(index)
    return prev


def _maybe_exchange_device(index: int) -> int:
    return _exchange_device(index)


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
    """The device index `device` names (an int, "pjrt", "pjrt:N", a torch.device); None and a
    device without an index name the current device."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != BACKEND_NAME:
        raise ValueError(f"Expected a pjrt device, but got: {d}")
    return d.index if d.index is not None else current_device()


def _rng_device_index(device) -> int:
    """The index of an existing pjrt device, for the random-state functions. pjrt:0 is there
    whenever the device is, so naming it sets up no runtime."""
    index = _index(device)
    if index != 0 and not 0 <= index < device_count():
        raise RuntimeError(f"pjrt:{index} does not exist: {device_count()} pjrt device(s)")
    return index


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


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """The runtime's memory statistics as a table (FSDP prints it when it runs out of memory)."""
    stats = memory_stats(device)
    title = f"pjrt memory summary, device {_index(device)} ({platform()})"
    if not stats:
        return f"{title}: the runtime reports no memory statistics on this platform\n"
    width = max(len(k) for k in stats)
    lines = [title] + [f"  {k:<{width}}  {v}" for k, v in sorted(stats.items())]
    return "\n".join(lines) + "\n"


def max_memory_reserved(device=None) -> int:
    s = memory_stats(device)
    return int(s.get("peak_bytes_reserved", s.get("bytes_reserved", s.get("bytes_limit", 0))))


def mem_get_info(device=None) -> tuple:
    """(free, total) bytes of the device, from the runtime's limit and what is in use."""
    s = memory_stats(device)
    if "bytes_limit" not in s:
        raise RuntimeError(
            f"torch.pjrt.mem_get_info: the runtime reports no memory limit on platform {platform()!r}"
        )
    total = int(s["bytes_limit"])
    return max(0, total - int(s.get("bytes_in_use", 0))), total


_warned_reset = False


def reset_peak_memory_stats(device=None) -> None:
    """The runtime keeps one peak per process and cannot reset it: max_memory_allocated() keeps
    reporting the peak since the process started (warned once where the runtime reports one)."""
    global _warned_reset
    if memory_stats(device) and not _warned_reset:
        _warned_reset = True
        import warnings

        warnings.warn(
            "torchpjrt: the runtime's memory statistics cannot be reset; max_memory_allocated() "
            "and max_memory_reserved() keep reporting the peak since the process started",
            stacklevel=2,
        )


def reset_accumulated_memory_stats(device=None) -> None:
    reset_peak_memory_stats(device)


def _host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _DeviceProperties:
    """What the runtime says about one device (torch.pjrt.get_device_properties)."""

    def __init__(self, index):
        dev = jax_device(index)
        stats = dev.memory_stats() or {}
        self.index = index
        self.name = dev.device_kind
        self.platform = dev.platform
        self.type = BACKEND_NAME
        # bytes the runtime lets us allocate; where it reports no limit (CPU), the host's memory
        self.total_memory = int(stats.get("bytes_limit") or _host_memory())

    def __repr__(self):
        return (f"_DeviceProperties(name={self.name!r}, platform={self.platform!r}, "
                f"index={self.index}, total_memory={self.total_memory})")


def get_device_properties(device=None) -> _DeviceProperties:
    return _DeviceProperties(_index(device))


def empty_cache() -> None:
    """Nothing to release: JAX frees a device buffer when its last array is dropped, and
    keeps no cache of freed blocks that this could hand back."""


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """XLA computes bfloat16 on every platform (natively on TPU and recent GPUs, by
    widening where the hardware lacks it), so pjrt tensors always support it."""
    return True


def get_amp_supported_dtype():
    return [torch.bfloat16, torch.float16]


# Random state lives in torchpjrt.random_state; these are the torch.cuda-style entry points.
# Each pjrt device has its own generator, as each CUDA device has (an SPMD program over a mesh
# addressed as pjrt:0 draws from pjrt:0's). Naming a device that does not exist raises.
def manual_seed(seed: int) -> None:
    """Seed the current device's generator."""
    from . import random_state

    random_state.manual_seed(int(seed), current_device())


def manual_seed_all(seed: int) -> None:
    from . import random_state

    random_state.manual_seed_all(int(seed))


def seed() -> None:
    from . import random_state

    random_state.seed(current_device())


def seed_all() -> None:
    from . import random_state

    random_state.seed_all()


def initial_seed() -> int:
    from . import random_state

    return random_state.initial_seed(current_device())


def get_rng_state(device="pjrt") -> torch.Tensor:
    """A device's generator state as a 16-byte uint8 CPU tensor: seed and offset, two
    little-endian uint64 (the layout of CUDA's Philox state, which DTensor reads)."""
    from . import random_state

    return random_state.get_state(_rng_device_index(device))


def set_rng_state(new_state, device="pjrt") -> None:
    from . import random_state

    random_state.set_state(new_state, _rng_device_index(device))


def get_rng_state_all():
    return [get_rng_state(i) for i in range(max(device_count(), 1))]


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


# ---- registration -----------------------------------------------------------------------


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
    import torchpjrt_autoload

    if torchpjrt_autoload.registered:
        # `import torch` named the device already (its lazy torch.pjrt forwarded here): this
        # module becomes torch.pjrt itself
        torch.pjrt = sys.modules[__name__]
        sys.modules["torch." + BACKEND_NAME] = sys.modules[__name__]
        return
    _setup_privateuseone_for_python_backend(
        BACKEND_NAME, backend_module=sys.modules[__name__], hook=torchpjrt_autoload.Hooks(),
        device_guard=torchpjrt_autoload.DeviceGuard(),
    )


# ---- streams and events ----------------------------------------------------------------------
# JAX runs each device's work in dispatch order on one queue, and pjrt storages swap immutable
# arrays instead of overwriting buffers, so work issued on any "stream" is already ordered after
# whatever produced its inputs. These classes give code written for torch.cuda's stream API
# (FSDP2, DDP, user overlap code) the semantics of CUDA's default stream as Python sees it:
# one in-order stream, so waits between streams are no-ops, synchronize waits for the device,
# query answers without waiting whether all work issued so far has finished, and events time
# with the host clock once the device has caught up.


def _idle() -> bool:
    """Whether every computation issued so far has finished, without waiting for any. Fused
    mode's pending graph is submitted first (work queued on a CUDA stream is already
    submitted); the answer covers all work, so an event's query can say False for work
    issued after it was recorded, never True too early."""
    from . import fusion

    fusion.flush("query")
    for a in jax.live_arrays():
        try:
            if not a.is_deleted() and not a.is_ready():
                return False
        except Exception:  # noqa: BLE001 - deleted or donated meanwhile: nothing to wait for
            continue
    return True


class Stream:
    """The pjrt device's single in-order stream (every instance is that stream, as if each
    torch.cuda.Stream were the default stream). `priority` is kept and has no effect."""

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
        return _idle()

    def synchronize(self) -> None:
        synchronize()

    def __eq__(self, other):
        return isinstance(other, Stream) and other.device_index == self.device_index

    def __hash__(self):
        return hash((BACKEND_NAME, self.device_index))

    def __repr__(self):
        return f"torch.pjrt.Stream(device={self.device})"


class Event:
    """A point in the device's single queue: `wait` needs nothing (the queue is in order),
    `synchronize` waits for the device, `query` says whether the device has caught up."""

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
        return _idle()

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
