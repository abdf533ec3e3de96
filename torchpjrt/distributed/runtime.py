"""JAX's multi-process runtime under torch.distributed: start-up, device lookup, liveness.

`init_process_group("pjrt")` starts JAX's distributed runtime once per process
(`jax.distributed.initialize`) with process id = the global torch rank, so every rank's
device is visible to XLA and collectives run as XLA programs over a mesh of those devices.
The coordinator address is agreed through the c10d store: rank 0 picks a free port on
MASTER_ADDR and posts it, the others read it.

Liveness: each rank bumps a counter in the store every `HEARTBEAT_PERIOD_S`; a rank whose
counter stops moving for `dead_after_s()` is reported dead by whoever waits on it (see
process_group.py), well before JAX's own heartbeat timeout would abort the process.
"""

import atexit
import os
import socket
import threading
import time
from datetime import timedelta

import jax
from jax._src import xla_bridge

_COORDINATOR_KEY = "torchpjrt/jax_coordinator"
_HEARTBEAT_KEY = "torchpjrt/alive/{}"
HEARTBEAT_PERIOD_S = 1.0

_lock = threading.Lock()
_state = None  # (rank, world_size) once initialized
_stop_heartbeat = threading.Event()
atexit.register(_stop_heartbeat.set)  # rank 0's store may already be gone at exit


def dead_after_s() -> float:
    """Seconds without a heartbeat after which a peer counts as dead."""
    return float(os.environ.get("TORCHPJRT_DIST_DEAD_AFTER", "10"))


def is_initialized() -> bool:
    return _state is not None


def _root_store(store):
    """The TCPStore under the PrefixStores c10d wraps around it (for clone(), host)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _coordinator_host(store) -> str:
    host = os.environ.get("MASTER_ADDR")
    if host:
        return host
    root = _root_store(store)
    return getattr(root, "host", None) or "127.0.0.1"


def _free_port() -> int:
    # the coordinator listens on every interface, so the port must be free on all of them
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def initialize(store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Start JAX's distributed runtime for this process (idempotent; default group only)."""
    global _state
    with _lock:
        if _state is not None:
            if _state != (rank, world_size):
                raise RuntimeError(
                    f"torchpjrt.distributed: JAX's runtime already runs as rank {_state[0]} of "
                    f"{_state[1]}; it cannot be restarted as rank {rank} of {world_size} in the "
                    "same process (JAX allows one initialization per process)"
                )
            return
        if xla_bridge.backends_are_initialized():
            raise RuntimeError(
                "torchpjrt.distributed: init_process_group('pjrt') must come before the first "
                "pjrt tensor or JAX computation of the process: JAX's multi-process runtime "
                "can only start before its devices are created"
            )
        # XLA's CPU client needs a collectives implementation for cross-process programs;
        # the setting is ignored by GPU/TPU clients.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        host = _coordinator_host(store)
        if rank == 0:
            address = f"{host}:{_free_port()}"
            store.set(_COORDINATOR_KEY, address)
        else:
            address = store.get(_COORDINATOR_KEY).decode()
        kwargs = {}
        platform = os.environ.get("TORCHPJRT_PLATFORM", "")
        local_rank = os.environ.get("LOCAL_RANK")
        if local_rank is not None and platform in ("gpu", "cuda", "rocm"):
            kwargs["local_device_ids"] = [int(local_rank)]  # one accelerator per process
        seconds = max(int(timeout.total_seconds()), 1)
        jax.distributed.initialize(
            address,
            num_processes=world_size,
            process_id=rank,
            initialization_timeout=min(seconds, 300),
            # JAX aborts the process when a peer stops beating; keep that a late backstop
            # behind our own, clearer, store-based detection.
            heartbeat_timeout_seconds=max(int(3 * dead_after_s()), 30),
            **kwargs,
        )
        _state = (rank, world_size)
        _start_heartbeat(store, rank)


def _start_heartbeat(store, rank: int) -> None:
    root = _root_store(store)
    # A private connection: the store client is shared with collectives that block on it.
    beat_store = root.clone() if hasattr(root, "clone") else root
    key = _HEARTBEAT_KEY.format(rank)

    def beat():
        while not _stop_heartbeat.is_set():
            try:
                beat_store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store went away: rank 0 ended; nothing to report to
                return
            _stop_heartbeat.wait(HEARTBEAT_PERIOD_S)

    threading.Thread(target=beat, name="torchpjrt-heartbeat", daemon=True).start()


class LivenessMonitor:
    """Tracks peers' heartbeat counters to tell a slow rank from a dead one."""

    def __init__(self, store, global_ranks):
        self.store = _root_store(store)
        self.global_ranks = list(global_ranks)
        self.last = {}  # global rank -> (counter, local time it last changed)

    def dead_ranks(self, among=None) -> list:
        now = time.monotonic()
        dead = []
        ranks = self.global_ranks if among is None else among
        try:
            # a peer still starting up has no counter yet: it is not dead, just not beating
            ranks = [r for r in ranks if self.store.check([_HEARTBEAT_KEY.format(r)])]
            values = self.store.multi_get([_HEARTBEAT_KEY.format(r) for r in ranks]) if ranks else []
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(
                "torchpjrt.distributed: the c10d store is unreachable (rank 0, which hosts it, "
                f"has probably exited or died): {e}"
            ) from None
        for r, v in zip(ranks, values):
            prev = self.last.get(r)
            if prev is None or prev[0] != v:
                self.last[r] = (v, now)
            elif now - prev[1] > dead_after_s():
                dead.append(r)
        return dead


def process_device(global_rank: int):
    """The device that `pjrt:0` denotes in process `global_rank`."""
    from ..device import jax_devices

    local = jax_devices()[0]
    for d in jax.devices(local.platform):
        if d.process_index == global_rank:
            return d
    raise RuntimeError(f"torchpjrt.distributed: JAX knows no {local.platform} device of process {global_rank}")
