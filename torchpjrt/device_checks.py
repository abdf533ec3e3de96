"""Asynchronous device-side checks: errors that need the data, raised without a host round trip.

PyTorch's CPU kernels read an index before using it and raise at once (`x[5]` on two rows is an
IndexError). A device op cannot raise: XLA clamps gathers and drops scatters, so the result
would be silently wrong. As CUDA's device asserts do, an op with a check (`@lower(...,
check=DeviceCheck(...))`) computes, inside its own program, a small vector `[failed, details...]`
next to its result. The vector is kept here with the op and the user's source line, and nothing
waits for it: the next synchronization point (`.item()`, `.cpu()`, `print`, `bool()`,
`torch.pjrt.synchronize()`) reads the vectors and raises the CPU's exception for the first one
that failed. Debug mode checks after every op. Vectors that are already computed are also
read without waiting once a few are pending, which keeps the list short in loops that never
synchronize.

A check reports once: after it has raised, the process goes on as usual.

On by default; TORCHPJRT_DEVICE_CHECKS=0 (or `set_enabled(False)`) compiles kernels without them
(graphs that torch.compile already built keep theirs).
"""

import collections
import os
import threading

import numpy as np

from . import eager, fusion

enabled = os.environ.get("TORCHPJRT_DEVICE_CHECKS", "1").strip().lower() not in ("0", "off", "false")
_pending = collections.deque()  # (vector, DeviceCheck, op name, user frame)
_lock = threading.Lock()
POLL_AFTER = 64  # pending vectors past which finished ones are read without waiting
WAIT_AFTER = 4096  # pending vectors past which the oldest are waited for
stats = collections.Counter()  # recorded, read


def set_enabled(on: bool) -> None:
    """Turn device checks on or off for kernels and graphs compiled from now on."""
    global enabled
    enabled = bool(on)


def record(vector, check, op_name) -> None:
    """Keep `vector` (a device array or a fused-mode Pending) to be read later."""
    with _lock:
        _pending.append((vector, check, op_name, eager.user_frame()))
        stats["recorded"] += 1
        n = len(_pending)
    if n > POLL_AFTER:
        _poll(wait=n > WAIT_AFTER)


def pending() -> int:
    return len(_pending)


def raise_pending() -> None:
    """Read every pending vector (waiting for the device) and raise the first failure."""
    if not _pending:
        return
    with _lock:
        entries = list(_pending)
        _pending.clear()
    _raise_first(entries, [_value(e[0]) for e in entries])


def poll() -> None:
    """Read the vectors the device has finished, without waiting; raise the first failure."""
    if _pending:
        _poll(wait=False)


def _poll(wait: bool) -> None:
    ready = []
    with _lock:
        while _pending:
            vector = _pending[0][0]
            if type(vector) is fusion.Pending:
                if vector.value is None:
                    break  # its graph has not run yet
                vector = vector.value
            if not (wait and len(ready) < WAIT_AFTER // 2) and not vector.is_ready():
                break
            ready.append(_pending.popleft())
    if ready:
        _raise_first(ready, [_value(e[0]) for e in ready])


def _value(vector):
    return fusion.concrete(vector, "device_check")


def _raise_first(entries, arrays) -> None:
    stats["read"] += len(entries)
    for (vector, check, op_name, where), array in zip(entries, arrays):
        values = np.asarray(array).tolist()  # one small copy each (faster than jax.device_get's batch)
        if values[0]:
            error = check.error(*values[1:])
            error.args = (f"{error}\n(torchpjrt: found on the device by {op_name}, called from {where}; "
                          "reported at the next synchronization point)",)
            raise error
