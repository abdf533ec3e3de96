"""Several pjrt devices in one process: which device a tensor is on, and keeping it there.

`pjrt:N` is the process's N-th JAX device of the chosen platform (device.jax_devices()).
PyTorch's Python device backend makes every tensor on pjrt:0; the compiled helper (native.py)
gives the device a real device guard (a device count, a current device per thread) and moves a
new tensor to another index. A program that only uses pjrt:0 pays nothing: `multi` stays off
until the first tensor lands on another index. From then on:

- a new tensor takes the device its JAX array is on (`index_of`), a view its base's;
- every array of a tensor on pjrt:N (N > 0) is committed to device N: jit then runs each op
  where its inputs are, and an op with no device inputs (a factory, a random draw) runs under
  that device's JAX default and is committed there (`run_on`);
- the kernels an op compiles are keyed by device (dispatch), so each device has its own
  executables, and fused mode keeps one pending graph per device (fusion);
- tensors of one op must share a device, as on CUDA (dispatch's `_op_device`).
"""

import contextlib
import os
import threading

import jax

from . import fusion, native

multi = False  # whether any tensor has been placed on an index other than 0
_lock = threading.Lock()
_tls = threading.local()  # .index: the device of the factory op being recorded or run
_guard_count = 0  # devices the compiled device guard reports (0: PyTorch's Python guard, one device)
_engine_devices = None  # pjrt devices PyTorch's autograd engine has worker threads for, if started
_index_by_sharding = {}


def _adopt_guard(lib) -> None:
    """The compiled helper is loaded: its device guard replaces the Python one even for one
    device. PyTorch asks the guard for the device type hundreds of times a backward pass, each a
    call into Python with the Python guard."""
    global _guard_count
    with _lock:
        if not _guard_count:
            lib.torchpjrt_register_guard(1)
            _guard_count = 1


native.when_loaded(_adopt_guard)


def register_devices(count: int) -> None:
    """The runtime has `count` devices: with more than one, give PyTorch the compiled device guard
    (before its autograd engine sizes its per-device threads at the first backward)."""
    global _guard_count, _engine_devices
    if count <= 1 or _guard_count >= count:
        return
    lib = native.library()
    if lib is None:
        return
    _engine_devices = _autograd_worker_devices()
    lib.torchpjrt_register_guard(count)
    _guard_count = count


def _autograd_worker_devices():
    """How many device worker threads PyTorch's autograd engine started (it names them
    pt_autograd_<device>), or None when it has not started them yet (or this OS does not say)."""
    names = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
    except OSError:
        return None
    workers = [n for n in names if n.startswith("pt_autograd_")]
    return len(workers) or None


def require(index: int) -> None:
    """Check that a tensor can live on pjrt:`index` in this process, and switch `multi` on."""
    global multi
    if index == 0 or (multi and index < _guard_count):
        return
    from . import device

    count = device.device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"pjrt:{index} does not exist: {count} pjrt device(s) on platform {device.platform()!r}")
    if not _guard_count:
        raise RuntimeError(
            f"torchpjrt: pjrt:{index} needs torchpjrt's compiled device helper, which is not available "
            f"({native.failure()}); with it missing only pjrt:0 holds tensors in one process "
            "(or run one process per device under torchrun)")
    if _engine_devices is not None and index >= _engine_devices:
        _backward_in_calling_thread()
    with _lock:
        multi = True


def _backward_in_calling_thread() -> None:
    """PyTorch's autograd engine made its per-device worker threads at the process's first
    backward, before the pjrt runtime said how many devices there are, and it never adds any: a
    backward reaching pjrt:N without a thread would fail its internal check. Backward passes then
    run in the thread that starts them (the engine's own single-threaded mode, which it keeps
    per thread), for every device."""
    import torch
    import torch.autograd.graph as graph

    original = graph._engine_run_backward
    if getattr(original, "_pjrt_calling_thread", False):
        return

    def run_backward(*args, **kwargs):
        with torch.autograd.set_multithreading_enabled(False):
            return original(*args, **kwargs)

    run_backward._pjrt_calling_thread = True
    graph._engine_run_backward = run_backward
    torch.autograd._engine_run_backward = run_backward


def place(t, index: int) -> None:
    """Move the new tensor `t` (alone on its storage) to pjrt:`index`."""
    native.library().torchpjrt_place(t._cdata, index)


def index_of(array) -> int:
    """The pjrt index of the device holding `array` (a jax.Array or a fused-mode Pending); 0 for
    an array spread over several devices (an SPMD mesh is addressed as pjrt:0)."""
    if type(array) is fusion.Pending:  # the device of the graph that computes it
        return array.graph.device
    if not isinstance(array, jax.Array):
        return 0
    sharding = array.sharding
    index = _index_by_sharding.get(sharding)
    if index is None:
        devices = sharding.device_set
        index = 0
        if len(devices) == 1:
            from .device import jax_devices

            dev = next(iter(devices))
            index = next((i for i, d in enumerate(jax_devices()) if d == dev), 0)
        _index_by_sharding[sharding] = index
    return index


def ambient() -> int:
    """The device of the factory op being run or recorded on this thread (0 outside one)."""
    return getattr(_tls, "index", 0)


@contextlib.contextmanager
def on(index: int):
    """Run or record device-input-free computations for pjrt:`index`."""
    from .device import jax_device

    previous = getattr(_tls, "index", 0)
    _tls.index = index
    try:
        with jax.default_device(jax_device(index)):
            yield
    finally:
        _tls.index = previous


def commit(tree, index: int):
    """`tree`'s arrays committed to pjrt:`index` (a no-op move where they already are)."""
    from .device import jax_device

    dev = jax_device(index)
    return jax.tree_util.tree_map(
        lambda a: jax.device_put(a, dev) if isinstance(a, jax.Array) else a, tree)  # a Pending is none


def run_on(index: int, fn, *args):
    """`fn(*args)` for an op with no device inputs on pjrt:`index`: run (or recorded) there."""
    with on(index):
        out = fn(*args)
    return commit(out, index)
