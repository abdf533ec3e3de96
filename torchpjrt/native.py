"""The compiled helper: the C++ sources in csrc/, built with the host's C++ compiler and loaded
with ctypes.

- csrc/device_guard.cpp: several pjrt devices in one process (PyTorch's Python device backend
  can only say "one device, index 0").
- csrc/views.cpp: CPU's own kernels for the view ops that reach the device (as_strided, view,
  _reshape_alias), in place of a trip into Python per view.
- csrc/attention.cpp: scaled_dot_product_attention's backend choice for pjrt tensors (one op
  forward and one backward, attention.py, instead of PyTorch's math path).
- csrc/hot_ops.cpp: strict mode's hot path for functional ops with one result (hot_path.py);
  built only where Python's headers are installed.

It is built, not shipped: a wheel would tie it to one PyTorch build. The build takes about 25 s
(2 cores) once per PyTorch and source version and is kept under $XDG_CACHE_HOME/torchpjrt/native.
The first process on a machine starts it in the background (`start`) and runs with the Python
kernels until it is ready; a caller that needs it at once (a second device) waits for it.
Without a compiler, or with TORCHPJRT_NATIVE=off, the package works as before: Python view
kernels, and pjrt:0 only, where asking for another index says why.
"""

import ctypes
import glob
import hashlib
import os
import shutil
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

import torch

_PYTHON_INCLUDE = sysconfig.get_paths()["include"]
_PYTHON_HEADERS = os.path.exists(os.path.join(_PYTHON_INCLUDE, "Python.h"))
# the hot path calls into Python: without Python's headers the helper is built without it
_SOURCES = sorted(path for path in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "*.cpp"))
                  if _PYTHON_HEADERS or not path.endswith("hot_ops.cpp"))
_lock = threading.Lock()
_library = None
_library_path = None
_failure = None  # why the helper could not be built or loaded
_building = None  # (target, the compiler's process or None for another process's) of a build under way
_BUILD_SECONDS_MAX = 300  # a lock file older than this was left by a build that died


def _build_directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchpjrt", "native")


def _compiler():
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _spawn_build(target: str):
    """Start compiling the sources into `target` in the background: a shell that runs the compiler
    into a temporary file and renames it, so that the build completes even if this process ends
    first. None when another process is building it now (its lock file is fresh)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    lock = target + ".building"
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        try:
            if time.time() - os.path.getmtime(lock) < _BUILD_SECONDS_MAX:
                return None
            os.unlink(lock)  # left by a build that died
        except OSError:
            pass
        return _spawn_build(target)
    torch_dir = os.path.dirname(torch.__file__)
    lib_dir = os.path.join(torch_dir, "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".so")
    os.close(fd)
    flags = [compiler, "-O2", "-std=c++20", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             "-I", os.path.join(torch_dir, "include"),
             "-I", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
             *(["-I", _PYTHON_INCLUDE] if _PYTHON_HEADERS else [])]
    objects = [f"{tmp}.{i}.o" for i in range(len(_SOURCES))]
    link = [compiler, "-shared", *objects, "-L", lib_dir, "-lc10", "-ltorch_cpu",
            *(["-ltorch_python"] if _PYTHON_HEADERS else []), f"-Wl,-rpath,{lib_dir}", "-o", tmp]
    # each source compiles in its own compiler process, all at once (hot_ops.cpp alone takes most
    # of the time: PyTorch's pybind headers), then one link
    quote = shlex.join
    script = "".join(f"{quote([*flags, '-c', source, '-o', obj])} & pids=\"$pids $!\"\n"
                     for source, obj in zip(_SOURCES, objects))
    script += ('status=0; for pid in $pids; do wait $pid || status=1; done\n'
               f'[ $status = 0 ] && {quote(link)} && mv -f {quote([tmp, target])}; status=$?\n'
               f'rm -f {quote([tmp, *objects, lock])}; exit $status\n')
    # at the lowest priority: the process that started it goes on with its own work meanwhile
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    # the compiler's messages go to a file, not a pipe nobody reads while it runs in the background
    with open(target + ".log", "w") as log:
        process = subprocess.Popen([*nice, "/bin/sh", "-c", script], stdout=log, stderr=subprocess.STDOUT)
    process.compiler = os.path.basename(compiler)
    process.log = target + ".log"
    return process


def _build_done(target: str, process, wait: bool) -> bool:
    """Whether the build of `target` (by `process`, or by another process when None) is over;
    raises the compiler's output when it failed."""
    if process is None:
        lock = target + ".building"
        while os.path.exists(lock) and not os.path.exists(target):
            if not wait:
                return False
            try:
                if time.time() - os.path.getmtime(lock) > _BUILD_SECONDS_MAX:
                    break  # its builder died: the caller builds it again
            except OSError:
                pass
            time.sleep(0.1)
        return True
    if not wait and process.poll() is None:
        return False
    if process.wait() != 0:
        try:
            with open(process.log) as f:
                messages = f.read().strip()[-2000:]
        except OSError:
            messages = "(no messages)"
        raise RuntimeError(f"{process.compiler} failed:\n{messages}")
    return True


def _target() -> str:
    digest = hashlib.sha256()
    for path in _SOURCES:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(repr((torch.__version__, torch.__file__, sys.version, sysconfig.get_platform())).encode())
    return os.path.join(_build_directory(), digest.hexdigest()[:20], "torchpjrt_native.so")


def _disabled() -> bool:
    return os.environ.get("TORCHPJRT_NATIVE", "on").strip().lower() in ("0", "off", "false")


def _load(path: str):
    lib = ctypes.CDLL(path)
    lib.torchpjrt_place.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.torchpjrt_place.restype = None
    lib.torchpjrt_register_guard.argtypes = [ctypes.c_int]
    lib.torchpjrt_current_device.restype = ctypes.c_int
    lib.torchpjrt_set_current_device.argtypes = [ctypes.c_int]
    lib.torchpjrt_native_views.argtypes = [ctypes.c_int]
    lib.torchpjrt_native_views.restype = None
    lib.torchpjrt_native_attention.argtypes = [ctypes.c_int]
    lib.torchpjrt_native_attention.restype = None
    return lib


def _settle(wait: bool):
    """Load the helper, building it first if needed: in the background when `wait` is false
    (then None until a later call finds the build done)."""
    global _library, _library_path, _failure, _building
    with _lock:
        if _library is not None or _failure is not None:
            return _library
        if _disabled():
            _failure = "TORCHPJRT_NATIVE=off"
            return None
        try:
            if _building is None:
                target = _target()
                if not os.path.exists(target):
                    try:
                        _building = (target, _spawn_build(target))
                    except OSError:  # a cache directory we cannot write: build in a private one
                        target = os.path.join(tempfile.mkdtemp(prefix="torchpjrt-native-"), os.path.basename(target))
                        _building = (target, _spawn_build(target))
            if _building is not None:
                target, process = _building
                if not _build_done(target, process, wait):
                    return None
                _building = None
                if not os.path.exists(target):  # another process's build failed: build here
                    _building = (target, _spawn_build(target))
                    if not _build_done(target, _building[1], wait):
                        return None
                    _building = None
            _library = _load(target)
            _library_path = target
        except Exception as e:  # noqa: BLE001 - any failure leaves the package on its Python kernels
            _building = None
            _failure = f"{type(e).__name__}: {e}"
            return None
    for adopt in _when_loaded:
        adopt(_library)
    return _library


_when_loaded = []  # what to do with the helper once it is loaded (placement: its device guard)


def when_loaded(adopt) -> None:
    """Call adopt(library) once the helper is loaded (now, if it is)."""
    _when_loaded.append(adopt)
    if _library is not None:
        adopt(_library)


def start():
    """The helper if it is ready now; otherwise start building it in the background (once) and
    return None. Call again to pick it up."""
    if _library is not None or _failure is not None:
        return _library
    return _settle(wait=False)


def library():
    """The loaded helper, waiting for its build if one is under way; None when it cannot be
    built or loaded (then `failure()` says why)."""
    if _library is not None or _failure is not None:
        return _library
    return _settle(wait=True)


def loaded_path():
    """The file the loaded helper came from (None until it is loaded)."""
    return _library_path


def failure():
    return _failure
