"""A bound on the compiled programs a process keeps loaded.

An XLA:CPU executable is machine code in memory mappings of its own (about three per program),
and Linux caps the mappings of a process (vm.max_map_count, 65530 by default). A long-lived
process that meets many shapes (a sweep over sizes, a sequence growing by one token per step,
a test suite) loads tens of thousands of programs; past the cap the next program's mmap fails
inside XLA and the interpreter dies with a segfault. So the process counts the programs it
compiles or loads and, every CHECK_EVERY of them, reads how many mappings it holds: past
RELEASE_AT of the cap it lets go of every loaded program (JAX's caches and the kernels'
loaded executables). The programs still in use come back on their next call, from the kernel
cache or JAX's persistent cache. The release itself runs at a point where no program of this
thread is being traced or compiled (`release_if_due`).
"""

import threading
import weakref

import jax
from jax._src import core as jax_core  # trace_state_clean: whether a trace is in progress

CHECK_EVERY = 256  # new programs between two readings of the mapping count
RELEASE_AT = 0.5  # of vm.max_map_count
stats = {"releases": 0, "programs_seen": 0, "xla_compiles": 0}

_lock = threading.Lock()
_count_lock = threading.Lock()
_new_since_check = 0
_due = False
_holders = weakref.WeakSet()  # objects holding a loaded executable, with a release() method
_limit = None


def _map_limit():
    """The mapping count past which loaded programs are released, or 0 where there is no such cap."""
    global _limit
    if _limit is None:
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                _limit = int(int(f.read()) * RELEASE_AT)
            _mapping_count()
        except (OSError, ValueError):
            _limit = 0  # not Linux: executables are not bounded by a mapping count there
    return _limit


def _mapping_count() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def note_new_programs(n: int = 1) -> None:
    """Counts programs just compiled or loaded; every CHECK_EVERY, checks the mapping count."""
    global _new_since_check, _due
    with _count_lock:  # (programs may be compiled and loaded side by side: kernel_cache.prepare_all)
        stats["programs_seen"] += n
        _new_since_check += n
        if _new_since_check < CHECK_EVERY:
            return
        _new_since_check = 0
    limit = _map_limit()
    if limit and _mapping_count() > limit:
        _due = True


def hold(holder) -> None:
    """`holder` keeps a loaded executable until its release() is called."""
    _holders.add(holder)


def release_if_due() -> None:
    """Lets go of every loaded program when the mapping count asked for it. Call only where
    this thread is not inside a JAX trace or compile."""
    global _due
    if not _due or not jax_core.trace_state_clean():
        return
    with _lock:
        if not _due:
            return
        _due = False
        for holder in list(_holders):
            holder.release()
        _holders.clear()
        jax.clear_caches()
        stats["releases"] += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
    # fired for each XLA compile or load from JAX's persistent cache: a new executable
    if event == "/jax/core/compile/backend_compile_duration":
        with _count_lock:
            stats["xla_compiles"] += 1
        note_new_programs()


def install() -> None:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
