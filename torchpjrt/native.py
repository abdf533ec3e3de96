"""The one compiled helper: csrc/device_guard.cpp, built on first need with the host's C++
compiler and loaded with ctypes.

PyTorch's Python device backend can only say "one device, index 0" (see the source file), so
several pjrt devices in one process need a few lines of C++ against PyTorch's c10 headers.
It is built, not shipped: a wheel would tie it to one PyTorch build, and the build takes a few
seconds once per PyTorch and source version (kept under $XDG_CACHE_HOME/torchpjrt/native).
Without a compiler the package works as before with pjrt:0 only, and asking for another index
says why.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading

import torch

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "device_guard.cpp")
_lock = threading.Lock()
_library = None
_failure = None  # why the helper could not be built or loaded


def _build_directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchpjrt", "native")


def _compiler():
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(target: str) -> None:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
    torch_dir = os.path.dirname(torch.__file__)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".so")
    os.close(fd)
    command = [compiler, "-O2", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               "-I", os.path.join(torch_dir, "include"), _SOURCE, "-L", os.path.join(torch_dir, "lib"), "-lc10",
               f"-Wl,-rpath,{os.path.join(torch_dir, 'lib')}", "-o", tmp]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(command[:1])} failed:\n{done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)  # whole or not at all: another process may load the same path


def _target() -> str:
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + repr((torch.__version__, torch.__file__, sys.version,
                                        sysconfig.get_platform())).encode()).hexdigest()[:20]
    return os.path.join(_build_directory(), key, "device_guard.so")


def library():
    """The loaded helper, or None (then `failure()` says why)."""
    global _library, _failure
    if _library is not None or _failure is not None:
        return _library
    with _lock:
        if _library is not None or _failure is not None:
            return _library
        if os.environ.get("TORCHPJRT_NATIVE", "on").strip().lower() in ("0", "off", "false"):
            _failure = "TORCHPJRT_NATIVE=off"
            return None
        try:
            target = _target()
            if not os.path.exists(target):
                try:
                    _build(target)
                except OSError:  # a cache directory we cannot write: build in a private one
                    target = os.path.join(tempfile.mkdtemp(prefix="torchpjrt-native-"), "device_guard.so")
                    _build(target)
            lib = ctypes.CDLL(target)
            lib.torchpjrt_place.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.torchpjrt_place.restype = None
            lib.torchpjrt_register_guard.argtypes = [ctypes.c_int]
            lib.torchpjrt_current_device.restype = ctypes.c_int
            lib.torchpjrt_set_current_device.argtypes = [ctypes.c_int]
            _library = lib
        except Exception as e:  # noqa: BLE001 - any failure leaves the package working on pjrt:0
            _failure = f"{type(e).__name__}: {e}"
    return _library


def failure():
    return _failure
