"""The persistent compilation cache: compiled XLA programs kept on disk across processes.

Every program torchpjrt compiles (an eager op for one argument signature, a fused graph, a
torch.compile graph) goes through JAX's compiler, whose persistent cache is switched on here,
under $TORCHPJRT_CACHE_DIR (default: $XDG_CACHE_HOME/torchpjrt/xla, else
~/.cache/torchpjrt/xla). A second process that runs the same model then loads its programs
instead of compiling them. TORCHPJRT_CACHE_DIR=off disables it; a cache directory the user
already gave JAX (jax_compilation_cache_dir) is kept.
"""

import os
import tempfile
import threading
from collections import Counter

import jax

stats = Counter()  # persistent cache hits and misses, seen through jax.monitoring
_DISABLED = ("", "0", "off", "false", "False", "none")
_directory = None


def default_directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchpjrt", "xla")


def directory():
    """The cache directory in use, or None when the cache is off."""
    return _directory


def _write_entries_atomically() -> None:
    """JAX's unbounded cache writes an entry in place (no lock without a size limit), so another
    process or thread reading that key meanwhile, as ranks compiling the same program do, can
    load a half-written executable and crash the interpreter. Entries are written to a temporary
    file and renamed into place instead: a reader sees no entry or the whole of it."""
    from jax._src import lru_cache

    original = lru_cache.LRUCache.put
    if getattr(original, "_atomic", False):
        return

    def put(self, key, value):
        if self.eviction_enabled or not isinstance(self.path, type(lru_cache.pathlib.Path("."))) \
                or not os.path.isdir(str(self.path)):
            return original(self, key, value)  # locked (a size limit) or not a local directory
        if not key:
            raise ValueError("key cannot be empty")
        final = os.path.join(str(self.path), f"{key}{lru_cache._CACHE_SUFFIX}")
        if os.path.exists(final):
            return
        fd, tmp = tempfile.mkstemp(dir=str(self.path), prefix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.chmod(tmp, 0o644)  # what JAX's own write gives (mkstemp makes it private)
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    put._atomic = True
    lru_cache.LRUCache.put = put


def configure() -> None:
    global _directory
    jax.monitoring.register_event_listener(_on_event)
    _write_entries_atomically()
    already = jax.config.jax_compilation_cache_dir
    requested = os.environ.get("TORCHPJRT_CACHE_DIR")
    if requested is not None and requested.strip() in _DISABLED:
        _directory = None
        return
    if already and requested is None:
        _directory = already
        return
    path = os.path.abspath(os.path.expanduser(requested or default_directory()))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise RuntimeError(
            f"torchpjrt: cannot create the compilation cache directory {path!r} ({e}); set "
            "TORCHPJRT_CACHE_DIR to a writable directory, or to 'off'"
        ) from None
    jax.config.update("jax_compilation_cache_dir", path)
    # eager ops compile in milliseconds; caching them is what makes a second start fast
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _directory = path


_this_thread = threading.local()  # its own count of hits, for compiles running side by side


def hits_in_this_thread() -> int:
    """Persistent cache hits of the compiles this thread ran (JAX reports them in the thread that
    compiles)."""
    return getattr(_this_thread, "hits", 0)


_count_lock = threading.Lock()  # compiles may run side by side (kernel_cache.prepare_all)


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        with _count_lock:
            stats["persistent_cache_hits"] += 1
        _this_thread.hits = hits_in_this_thread() + 1
    elif event == "/jax/compilation_cache/cache_misses":
        with _count_lock:
            stats["persistent_cache_misses"] += 1
