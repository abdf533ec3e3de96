"""JAX's multi-process runtime under torch.distributed: start-up, device lookup, liveness.

`init_process_group("pjrt")` starts JAX's distributed runtime once per process
(`jax.distributed.initialize`) with process id = the global torch rank, so every rank's
device is visible to XLA and collectives run as XLA programs over a mesh of those devices.
The coordinator address is agreed through the c10d store: rank 0 picks a free port on
MASTER_ADDR and posts it, the others read it.

Liveness: each rank bumps a counter in the store every `HEARTBEAT_PERIOD_S`; a rank whose
counter stops moving for `dead_after_s()` is reported dead by whoever waits on it (see
process_group.py), well before JAX's own heartbeat timeout would abort the process.

Exit: JAX's client, left to itself, leaves through the coordination service's shutdown
barrier, which waits for every process; with one dead, it fails only at JAX's heartbeat
timeout, and a failed barrier aborts the process (SIGABRT), so a surviving rank never exits
with its own code. The client is therefore built without that barrier, and `_leave` (an
atexit hook that runs before JAX's) does its work: it waits for every rank to reach exit
(through JAX's key-value store; a peer whose store heartbeat stopped is not waited for), then
disconnects this process locally. A process that has already seen a peer fail
(`mark_peer_failure`) does not wait at all, so it exits at once with its own exit code.
"""

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import jax

from . import chips

_COORDINATOR_KEY = "torchpjrt/jax_coordinator"
_HEARTBEAT_KEY = "torchpjrt/alive/{}"
_EXIT_DIR = "torchpjrt/exit"  # in JAX's key-value store: one key per rank that reached exit
HEARTBEAT_PERIOD_S = 1.0
EXIT_BARRIER_TIMEOUT_S = 300.0  # JAX's own shutdown barrier timeout

_lock = threading.Lock()
_state = None  # (rank, world_size) once initialized
_stop_heartbeat = threading.Event()
atexit.register(_stop_heartbeat.set)  # rank 0's store may already be gone at exit
_peer_failure = None  # why this process knows the group is broken (a peer died, left or hangs)
_exit_store = None  # a store connection of our own for the liveness check at exit


def mark_peer_failure(reason: str) -> None:
    """Record that a peer died, left or stopped answering: at exit this process no longer waits
    for the others (see `_leave`). The first reason is kept."""
    global _peer_failure
    if _peer_failure is None:
        _peer_failure = reason


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
    global _state, _exit_store
    with _lock:
        if _state is not None:
            if _state != (rank, world_size):
                raise RuntimeError(
                    f"torchpjrt.distributed: JAX's runtime already runs as rank {_state[0]} of "
                    f"{_state[1]}; it cannot be restarted as rank {rank} of {world_size} in the "
                    "same process (JAX allows one initialization per process)"
                )
            return
        from ..device import release_probed_runtime

        if not release_probed_runtime():
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
        chips.prepare()  # TPU: this rank's chip bounds, read when libtpu starts
        local_ids = chips.gpu_local_device_ids()
        if local_ids is not None:
            kwargs["local_device_ids"] = local_ids  # GPU: one per process, by LOCAL_RANK
        seconds = max(int(timeout.total_seconds()), 1)
        with _client_without_shutdown_barrier() as built:
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
        if built:  # else this JAX builds its client its own way: its shutdown barrier stays
            root = _root_store(store)
            _exit_store = root.clone() if hasattr(root, "clone") else root
            # registered after JAX's own exit hook (at `import jax`), so it runs before it
            atexit.register(_leave, rank, world_size)


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


# ---- exit ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _client_without_shutdown_barrier():
    """Let `jax.distributed.initialize` build its client with `shutdown_on_destruction=False`:
    the client's shutdown then disconnects locally instead of entering the coordination
    service's shutdown barrier (which, with a dead peer, ends in an abort; see `_leave`).
    Yields a list that is non-empty once such a client was built."""
    from jax._src import distributed as jax_distributed

    built = []
    real = getattr(jax_distributed, "_jax", None)
    if real is None or not hasattr(real, "get_distributed_runtime_client"):
        yield built
        return

    class _Lib:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def get_distributed_runtime_client(*args, **kw):
            try:
                client = real.get_distributed_runtime_client(*args, shutdown_on_destruction=False, **kw)
            except TypeError:  # a jaxlib without the option: JAX's default client
                return real.get_distributed_runtime_client(*args, **kw)
            built.append(client)
            return client

    jax_distributed._jax = _Lib()
    try:
        yield built
    finally:
        jax_distributed._jax = real


def _leave(rank: int, world_size: int) -> None:
    """atexit: wait for the other ranks to reach exit too (unless a peer already failed or
    dies meanwhile), then disconnect from JAX's coordination service, locally.

    The wait keeps what JAX's shutdown barrier gave: no process leaves while another still
    runs (rank 0 hosts the coordination service; its end would abort the others). Only the
    local disconnect follows, so nothing here can abort the process or change its exit code."""
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    client = state.client
    if client is None:  # jax.distributed.shutdown() was called already
        return
    try:
        if _peer_failure is None and world_size > 1:
            _exit_barrier(client, rank, world_size)
    except Exception as e:  # noqa: BLE001 - never block or fail an exit
        print(f"torchpjrt.distributed: rank {rank} leaves without waiting for the others: {e}",
              file=sys.stderr, flush=True)
    finally:
        _stop_heartbeat.set()
        try:
            if state.preemption_sync_manager is not None:
                state.preemption_sync_manager.shutdown()
                state.preemption_sync_manager = None
            client.shutdown()  # local: no shutdown barrier (see _client_without_shutdown_barrier)
        except Exception:  # noqa: BLE001 - the agent was in error (a peer failed): nothing to undo
            pass
        state.client = None  # JAX's own exit hook then only stops the service (rank 0)


def _exit_barrier(client, rank: int, world_size: int) -> None:
    """Wait until every rank has reached exit, a missing one is dead (no store heartbeat for
    `dead_after_s()`), or EXIT_BARRIER_TIMEOUT_S passes; rank 0, whose process hosts JAX's
    coordination service, then also waits for the others to have passed, so that none is
    still talking to the service when it stops. Uses JAX's key-value store, which lives as
    long as rank 0's process (the c10d store may be gone after destroy_process_group)."""
    others = [r for r in range(world_size) if r != rank]
    monitor = LivenessMonitor(_exit_store, others) if _exit_store is not None else None
    deadline = time.monotonic() + EXIT_BARRIER_TIMEOUT_S
    client.key_value_set(f"{_EXIT_DIR}/arrived/{rank}", "1")
    monitor = _wait_for_keys(client, f"{_EXIT_DIR}/arrived", others, monitor, deadline)
    if rank == 0:
        _wait_for_keys(client, f"{_EXIT_DIR}/passed", others, monitor, deadline)
    else:
        client.key_value_set(f"{_EXIT_DIR}/passed/{rank}", "1")  # only the local disconnect follows


def _wait_for_keys(client, directory: str, ranks, monitor, deadline: float):
    """Poll JAX's key-value `directory` until it holds a key per rank in `ranks`; raises if
    one of the missing ranks is dead or the deadline passes. Returns the monitor (None once
    the c10d store is gone, when only arrival counts)."""
    pause, next_liveness_check = 0.0, time.monotonic() + HEARTBEAT_PERIOD_S
    while True:
        present = {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get(directory)}
        missing = [r for r in ranks if r not in present]
        if not missing:
            return monitor
        now = time.monotonic()
        if now >= next_liveness_check:
            next_liveness_check = now + HEARTBEAT_PERIOD_S
            if monitor is not None:
                try:
                    dead = monitor.dead_ranks(missing)
                except RuntimeError:  # the c10d store is gone: judge by arrival only
                    monitor, dead = None, []
                if dead:
                    raise RuntimeError(f"rank(s) {dead} stopped responding before reaching exit")
            if now > deadline:
                raise RuntimeError(f"rank(s) {missing} did not reach exit within {EXIT_BARRIER_TIMEOUT_S:.0f}s")
        time.sleep(pause)
        pause = min(max(pause * 2, 1e-3), 0.05)
