"""Eager kernels and compiled graphs kept on disk as compiled executables.

JAX's persistent cache (compile_cache.py) saves XLA's compile, but finding an entry means
tracing the function and lowering it to StableHLO first, to hash it: some 10 ms an eager op,
most of a warm process's first eager step, and a good part of a restored compiled graph's first
call. This layer keys each eager kernel by what already fixes its program inside a process (the
op and dispatch's kernel key: argument shapes, dtypes, static values), and each compiled graph
by its fingerprint (compile/graph.py), and each graph of fused eager mode by its kernels'
identities and wiring (fusion.py), plus what could change them between processes
(torchpjrt's source, the JAX, jaxlib and torch versions, the device, the device count and XLA's
flags, the default dtype), and stores the serialized executable: a new process loads it without
tracing. Each entry starts with a small header, its arguments' and results' shapes and dtypes:
fused mode reads it to record a kernel without tracing it or loading its executable.

Only single-device programs are kept, and each is loaded onto the device it was built for.
Processes of JAX's multi-process runtime (torch.distributed) do not use it. A loaded
executable checks its arguments' placement on every call (JAX raises ValueError for
another device or sharding): the kernel then falls back to its jitted form, which follows the
arguments as jit does. Entries live under $TORCHPJRT_CACHE_DIR/kernels/<environment tag>;
TORCHPJRT_KERNEL_CACHE=off turns the layer off (JAX's cache alone then).
"""

import functools
import hashlib
import os
import pickle
import tempfile
import threading
from collections import Counter

import jax
import jaxlib
import torch
from jax._src import config as jax_config  # a per-compile override of JAX's cache-write threshold

from . import live_programs, storage

stats = Counter()  # kernel_cache_hits, kernel_cache_misses, kernel_cache_fallbacks, kernel_cache_unstored
_UNSET = object()
_directory = _UNSET
_tag = None
_loading = threading.Lock()
_loaded_by_jax = set()  # kernel keys whose executable came from JAX's persistent cache
_count_lock = threading.Lock()  # kernels may be loaded and compiled side by side (prepare_all)


def _count(name) -> None:
    with _count_lock:
        stats[name] += 1


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A hash of torchpjrt's Python source: a developer's edit (or an upgrade that keeps the
    version string) must not load programs or graphs an earlier source produced."""
    digest = hashlib.sha256()
    package = os.path.dirname(os.path.abspath(__file__))
    for dirpath, dirnames, files in os.walk(package):
        dirnames.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()


def _environment_tag() -> str:
    digest = hashlib.sha256(source_digest().encode())
    device = storage.default_device()
    # XLA's flags (a virtual device count, a TPU runtime's arguments) and the device set shape
    # what an executable may run on; JAX's matmul precision changes the programs themselves, and
    # so do the CPU capability and thread count PyTorch's kernels run with (uint8 interpolation
    # follows the CPU kernel they select)
    digest.update(repr((jax.__version__, jaxlib.__version__, torch.__version__, device.platform,
                        device.device_kind, str(device), jax.process_index(), jax.device_count(),
                        os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
                        jax.config.jax_default_matmul_precision, torch.backends.cpu.get_cpu_capability(),
                        torch.get_num_threads())).encode())
    return digest.hexdigest()[:24]


def directory():
    """Where kernels are kept, or None when the cache is off."""
    global _directory, _tag
    if _directory is _UNSET:
        from . import compile_cache

        root = compile_cache.directory()
        if root is None or os.environ.get("TORCHPJRT_KERNEL_CACHE", "on").strip().lower() in ("0", "off", "false"):
            _directory = None
        else:
            _tag = _environment_tag()
            _directory = os.path.join(root, "kernels", _tag)
            _prune(os.path.join(root, "kernels"), _tag)
    return _directory


STALE_AFTER_S = 14 * 24 * 3600


def _prune(kernels_root, tag) -> None:
    """Each torchpjrt or JAX version (each source edit, for a developer) starts a new tag
    directory: this process marks its own as used and removes the tags no process has used for
    STALE_AFTER_S, so the cache does not grow with every upgrade."""
    import shutil
    import time

    try:
        os.makedirs(os.path.join(kernels_root, tag), exist_ok=True)
        os.utime(os.path.join(kernels_root, tag))
        names = os.listdir(kernels_root)
    except OSError:
        return
    for name in names:
        path = os.path.join(kernels_root, name)
        try:
            if name != tag and time.time() - os.stat(path).st_mtime > STALE_AFTER_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def kept(jitted, identity):
    """`jitted`, kept on disk under `identity` (what fixes its program within a process) when
    the layer is on; as it is otherwise, with no wrapper on the call path."""
    if identity is None or directory() is None:
        return jitted
    return CachedKernel(jitted, identity)


def kept_jit(fn, *identity):
    """jax.jit(fn), kept under `identity` (a name, then everything that fixes its program:
    argument shapes and dtypes, static values, the device): a warm process loads it rather than
    tracing and lowering it again for JAX's own cache."""
    if getattr(fn, "__name__", None) == "<lambda>":  # named for XLA's compile logs and profiles
        fn.__name__ = fn.__qualname__ = identity[0].replace(".", "_")
    return kept(jax.jit(fn), identity)


def stored(identity) -> bool:
    """Whether a program kept under `identity` is on disk (loading it costs milliseconds, against
    tracing and compiling it)."""
    root = directory()
    # processes of JAX's multi-process runtime compile rather than load (CachedKernel._first_call)
    return root is not None and jax.process_count() == 1 and os.path.exists(_path(root, identity))


def _path(root, identity):
    key = hashlib.sha256(repr((_tag, identity, torch.get_default_dtype())).encode()).hexdigest()
    return os.path.join(root, key[:2], key)


class CachedKernel:
    """A jitted program (an eager kernel, a compiled graph, a storage's zero fill) whose first
    call loads its executable from disk when it can.

    `traceable` is the jitted function, for callers that trace it into a larger program (fused
    eager mode); `identity` is what fixes its program."""

    __slots__ = ("traceable", "identity", "_call", "_prepared", "_shapes", "_digest", "__weakref__")

    def __init__(self, jitted, identity):
        self.traceable = jitted
        self.identity = identity
        self._call = None
        self._prepared = None  # what _first_call gave ahead of the first call (prepare_all)
        self._shapes = _UNSET
        self._digest = None

    def digest(self) -> str:
        """`identity` hashed, once: what stands for this kernel in a larger identity (a fused
        graph's, whose repr would otherwise repeat every node's whole identity: milliseconds to
        hash at each new graph's first sighting)."""
        if self._digest is None:
            self._digest = hashlib.sha256(repr(self.identity).encode()).hexdigest()
        return self._digest

    def stored_shapes(self):
        """(argument treedef, argument signatures, result treedef, result (shape, dtype,
        weak_type)s) of the kept program, read from its entry's small header without loading the
        executable, or None when no entry is kept: fused mode records the kernel's results from
        it instead of tracing the kernel to learn their shapes."""
        if self._shapes is _UNSET:
            self._shapes = None
            root = directory()
            if root is not None:
                try:
                    with open(_path(root, self.identity), "rb") as f:
                        self._shapes = pickle.load(f)
                except Exception:  # no entry, or one this version cannot read (rebuilt on first call)
                    pass
        return self._shapes

    def __call__(self, *args):
        call = self._call
        if call is None:
            live_programs.release_if_due()
            with _loading:  # one load per kernel, and one loader at a time
                call = self._call
                if call is None:
                    call, self._prepared = self._prepared, None
                    if call is None:
                        call = self._first_call(args)
                    self._call = call
                    if call is not self.traceable:
                        live_programs.hold(self)
                        out = self._run(call, args)
                        # the executable's C++ call, which Compiled.__call__ built: no Python
                        # frame of JAX's on later calls
                        if self._call is call and getattr(call, "_call", None) is not None:
                            self._call = call._call
                        return out
        if call is self.traceable:
            return call(*args)
        return self._run(call, args)

    def _run(self, call, args):
        try:
            return call(*args)
        except (TypeError, ValueError):
            # the executable was built for other devices or argument types: jit handles them
            stats["kernel_cache_fallbacks"] += 1
            self._call = self.traceable
            return self.traceable(*args)

    def release(self):
        """Drops the loaded executable (live_programs): the next call loads it again."""
        self._call = None
        self._prepared = None

    def _first_call(self, args):
        root = directory()
        # JAX's multi-process runtime (torch.distributed on pjrt) assigns devices globally:
        # executables stay in the process that compiled them
        if root is None or jax.process_count() > 1 or not _single_device(args):
            return self.traceable
        path = _path(root, self.identity)
        try:
            with open(path, "rb") as f:
                pickle.load(f)  # the header (stored_shapes)
                payload, in_tree, out_tree, device_id = pickle.load(f)
            from jax.experimental.serialize_executable import deserialize_and_load

            _initialize_runtime_handlers()
            # loaded onto its one device: by default JAX would spread it over all the process's
            # devices and then expect one argument shard per device
            client = storage.default_device().client
            device = next(d for d in client.devices() if d.id == device_id)
            compiled = deserialize_and_load(payload, in_tree, out_tree, backend=client, execution_devices=[device])
            live_programs.note_new_programs()
            _count("kernel_cache_hits")
            return compiled
        except FileNotFoundError:
            pass
        except Exception:  # an unreadable entry (other format, damaged): dropped and rebuilt
            try:
                os.remove(path)
            except OSError:
                pass
        from . import compile_cache

        # An executable JAX loaded from its own persistent cache does not serialize whole on
        # XLA:CPU (it fails to run once loaded again), so this compile gets a JAX cache key of
        # its own, one per kernel and environment (a debug-print limit that changes nothing
        # else), and is stored only when XLA really compiled it. JAX does not write it to its
        # own cache: this layer's copy is the one a later process loads.
        salt = 1_000_000 + int(os.path.basename(path)[:6], 16)
        hits = compile_cache.hits_in_this_thread()
        try:
            with jax_config.persistent_cache_min_compile_time_secs(1e12):
                traced = self.traceable.trace(*args)
                compiled = traced.lower().compile(compiler_options={"xla_debug_buffer_assignment_show_max": salt})
        except Exception:  # a runtime refusing the option, an error jit reports as well: jit's path
            _count("kernel_cache_unstored")
            return self.traceable
        _count("kernel_cache_misses")
        if compile_cache.hits_in_this_thread() == hits and path not in _loaded_by_jax:
            _store(path, compiled, _shapes(args, traced.out_avals))
        else:
            _loaded_by_jax.add(path)  # JAX's in-memory cache may hand the same executable back
            _count("kernel_cache_unstored")
        return compiled


PREPARE_THREADS = min(os.cpu_count() or 1, 8)


def prepare_all(calls) -> int:
    """Loads or compiles, in threads of their own, the kernels among `calls` ((CachedKernel,
    arguments) pairs) that have no executable yet, so that their first calls find one. The
    arguments may be abstract (jax.ShapeDtypeStruct with the sharding of the device the call
    will run on): a fused graph's values before it runs. XLA compiles without holding Python's
    lock, so a batch of new kernels (a fused-mode step's first sighting, run op by op) compiles
    in about the time of its longest ones where one after another took their sum. Returns how
    many it prepared."""
    todo, seen = [], set()
    for kernel, args in calls:
        if type(kernel) is CachedKernel and kernel._call is None and kernel._prepared is None \
                and id(kernel) not in seen:
            seen.add(id(kernel))
            todo.append((kernel, args))
    if len(todo) < 2 or PREPARE_THREADS < 2 or directory() is None:
        return 0
    live_programs.release_if_due()
    _initialize_runtime_handlers()  # (once, in this thread: loads in the pool need it)

    def prepare(pair):
        kernel, args = pair
        try:
            return kernel._first_call(args)
        except Exception:  # noqa: BLE001 - the kernel's own first call reports it
            return None

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(PREPARE_THREADS, len(todo)), thread_name_prefix="torchpjrt-prepare") as pool:
        prepared = list(pool.map(prepare, todo))
    done = 0
    with _loading:
        for (kernel, _), call in zip(todo, prepared):
            if call is not None and call is not kernel.traceable and kernel._call is None:
                kernel._prepared = call
                done += 1
    stats["kernels_prepared"] += done
    return done


def _shapes(args, out_avals):
    """CachedKernel.stored_shapes' header for a program called on `args`."""
    from .fusion import signature_of

    leaves, treedef = jax.tree_util.tree_flatten(args)
    avals, out_treedef = jax.tree_util.tree_flatten(out_avals)
    return (treedef, tuple(signature_of(x) for x in leaves), out_treedef,
            [(a.shape, a.dtype, a.weak_type) for a in avals])


_handlers_ready = False


def _initialize_runtime_handlers() -> None:
    """Readies the runtime's custom-call handlers before a stored executable is loaded.

    jaxlib initializes some handlers lazily, while lowering the op that needs them: on CPU the
    LAPACK kernels behind cholesky, inv, solve, eigh, qr, svd are looked up from scipy the
    first time one is lowered. A loaded executable is never lowered, so in a fresh process its
    custom calls would jump through unset pointers (a segfault). JAX's own loader of serialized
    programs (jax.export) calls this same hook for the same reason."""
    global _handlers_ready
    if _handlers_ready:
        return
    from jax._src.export import _export

    _export._ensure_backends_initialized((storage.default_device().platform,))
    _handlers_ready = True


def _single_device(args) -> bool:
    for leaf in jax.tree_util.tree_leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and len(sharding.device_set) != 1:
            return False
    return True


def _store(path, compiled, shapes) -> None:
    from jax.experimental.serialize_executable import serialize

    devices = set()
    for sharding in jax.tree_util.tree_leaves((compiled.input_shardings, compiled.output_shardings)):
        devices |= sharding.device_set
    if len(devices) != 1:  # a program spanning devices (a sharding constraint inside): not kept
        _count("kernel_cache_unstored")
        return
    try:
        # the header first: stored_shapes reads it alone
        data = pickle.dumps(shapes) + pickle.dumps((*serialize(compiled), devices.pop().id))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # written whole or not at all: another process may be reading the same entry
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except Exception:  # an executable the runtime cannot serialize, a full disk: run uncached
        _count("kernel_cache_unstored")
