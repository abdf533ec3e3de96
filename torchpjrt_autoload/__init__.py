"""PyTorch's device-backend autoload entry point for torchpjrt (`torch.backends` group).

`import torch` calls `load()`, which must not import JAX: a plain CPU PyTorch program on a
machine with torchpjrt installed would pay for it (seconds) in every start. So this package
only names the device and leaves a trigger on each way a program can reach it; torchpjrt
itself (and JAX with it) is imported at the first of them:

- an aten op on a pjrt tensor or with device="pjrt" (a PrivateUse1 dispatcher fallback that
  imports torchpjrt and dispatches the op again, now to torchpjrt's kernels);
- any attribute of `torch.pjrt` (a module whose attributes come from torchpjrt.device);
- `Module.to/to_empty/pjrt`, `UntypedStorage(..., device="pjrt")` and storage `.to/.pjrt`,
  `torch.load` with a pjrt `map_location` or pjrt-saved storages, `torch.from_dlpack` of a JAX
  array or onto pjrt, `safetensors` loads onto pjrt, `Tensor.pin_memory()`, and
  `torch.accelerator`'s memory and synchronize functions, which torchpjrt wraps;
- `torch.distributed.init_process_group("pjrt")`, and importing Lightning (which must know the
  "pjrt" accelerator before a Trainer is made).

torchpjrt's own import is the same as `import torchpjrt`: it finishes the registration made
here (device.register, dispatch.register) instead of repeating it.
"""

import functools
import importlib.abc
import importlib.util
import sys
import threading

import torch  # at autoload time torch is being imported; its C part is ready

BACKEND_NAME = "pjrt"
registered = False  # whether load() registered the device (torchpjrt then takes it over)
_lock = threading.RLock()
_delegate = None  # torchpjrt's PrivateUse1 fallback, once it is loaded
_libs = []
_original = {}


def load() -> None:
    """The entry point: register the device name and the triggers, without importing JAX."""
    global registered
    if "torchpjrt" in sys.modules or registered:
        return  # torchpjrt is being imported (it imports torch): its import registers the device
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", BACKEND_NAME):
        return  # another backend holds PrivateUse1: `import torchpjrt` will say so
    _setup_privateuseone_for_python_backend(BACKEND_NAME, backend_module=_DeviceModule("torch." + BACKEND_NAME),
                                            hook=Hooks(), device_guard=DeviceGuard())
    registered = True
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_first_op, dispatch_key="PrivateUse1", with_keyset=True)
    _libs.append(lib)
    _install_triggers()


def ensure_loaded():
    """Imports torchpjrt (once, whichever thread gets here first) and returns it."""
    with _lock:
        import torchpjrt
    return torchpjrt


# ---- what torchpjrt shares with this module ------------------------------------------------


class Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class DeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def take_fallback(fallback) -> bool:
    """torchpjrt's dispatch.register hands over its PrivateUse1 fallback: the one registered here
    calls it from now on (the dispatcher allows one fallback per key). False when this module
    registered none (torchpjrt was imported without autoload)."""
    global _delegate
    if not _libs:
        return False
    _delegate = fallback
    return True


def _first_op(op, keyset, *args, **kwargs):
    if _delegate is None:
        ensure_loaded()
        if _delegate is None:
            raise RuntimeError(f"torchpjrt: {op} ran on pjrt while torchpjrt was still being imported (internal error)")
        # torchpjrt has registered its kernels meanwhile: this op's may be one of them
        return op.redispatch(keyset, *args, **kwargs)
    return _delegate(op, keyset, *args, **kwargs)


class _DeviceModule(type(sys)):
    """`torch.pjrt` until torchpjrt is loaded: each attribute loads it and is torchpjrt.device's."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        ensure_loaded()
        return getattr(sys.modules["torchpjrt.device"], name)


# ---- triggers -------------------------------------------------------------------------------


def _is_pjrt(device) -> bool:
    if device is None:
        return False
    if isinstance(device, dict):  # torch.load's map_location as a dict of location -> location
        return any(_is_pjrt(v) for v in device.values()) or any(_is_pjrt(k) for k in device)
    try:
        return torch.device(device).type == BACKEND_NAME
    except (TypeError, RuntimeError, ValueError):
        return isinstance(device, str) and device.startswith(BACKEND_NAME)


def _on_pjrt_call(owners, name, wants_pjrt):
    """Replaces `name` on every owner that has the first owner's function with one trigger that
    loads torchpjrt first when wants_pjrt(*args, **kwargs) says the call reaches the device, then
    calls what the first owner's `name` is by then (torchpjrt may have put its own there)."""
    owners = owners if isinstance(owners, (list, tuple)) else [owners]
    original = getattr(owners[0], name)

    @functools.wraps(original)
    def trigger(*args, **kwargs):
        if _delegate is None and wants_pjrt(*args, **kwargs):
            ensure_loaded()
            current = getattr(owners[0], name)
            if current is not trigger:
                return current(*args, **kwargs)
        return original(*args, **kwargs)

    for owner in owners:
        if getattr(owner, name, None) is original:
            _original[(owner, name)] = original
            setattr(owner, name, trigger)


def _to_device(*args, **kwargs):
    try:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
    except (TypeError, RuntimeError):
        return False
    return _is_pjrt(device)


def _accelerator_is_pjrt(*args, **kwargs):
    acc = torch._C._accelerator_getAccelerator()
    return acc is not None and acc.type == BACKEND_NAME


# torch.accelerator functions torchpjrt routes for its device (accelerator._ROUTES)
ACCELERATOR_FUNCTIONS = ("synchronize", "empty_cache", "empty_host_cache", "memory_stats", "memory_allocated",
                         "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
                         "reset_accumulated_memory_stats", "get_memory_info")


def _install_triggers() -> None:
    module = torch.nn.Module
    _on_pjrt_call(module, "to", lambda self, *a, **k: _to_device(*a, **k))
    _on_pjrt_call(module, "to_empty", lambda self, *a, device=None, **k: _is_pjrt(device if device is not None else (a[0] if a else None)))
    _on_pjrt_call(module, BACKEND_NAME, lambda *a, **k: True)
    storage = torch.UntypedStorage
    _on_pjrt_call(storage, "to", lambda self, *a, device=None, **k: _is_pjrt(device))

    def storage_to_pjrt(self, *args, **kwargs):  # torchpjrt puts its own UntypedStorage.pjrt here
        ensure_loaded()
        return storage.pjrt(self, *args, **kwargs)

    storage.pjrt = storage_to_pjrt
    original_new = storage.__new__
    _original[(storage, "__new__")] = original_new

    def new(cls, *args, device=None, **kwargs):
        if _delegate is None and _is_pjrt(device):
            ensure_loaded()
            if storage.__new__ is not new:  # torchpjrt's own constructor is in place
                return storage.__new__(cls, *args, device=device, **kwargs)
        if device is None:
            return original_new(cls, *args, **kwargs)
        return original_new(cls, *args, device=device, **kwargs)

    storage.__new__ = staticmethod(new)
    _on_pjrt_call(torch.serialization, "_load", _load_reaches_pjrt)
    _on_pjrt_call([torch, torch.utils.dlpack], "from_dlpack", _from_dlpack_reaches_pjrt)
    _on_pjrt_call(torch.Tensor, "pin_memory", _accelerator_is_pjrt)
    for name in ACCELERATOR_FUNCTIONS:
        owners = [o for o in (torch.accelerator.memory, torch.accelerator) if callable(getattr(o, name, None))]
        if owners:
            _on_pjrt_call(owners, name, _accelerator_is_pjrt)
    if torch.distributed.is_available():
        import torch.distributed as dist

        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True, devices=["pjrt", "cpu"])
    sys.meta_path.insert(0, _AfterImport())


def _load_reaches_pjrt(zip_file, map_location, *args, **kwargs):
    """torch.load onto pjrt: a pjrt map_location, or a callable one (it may return pjrt storages),
    or storages saved from pjrt (their location tags, read from the archive's record names)."""
    if callable(map_location) and not isinstance(map_location, str):
        return True
    if _is_pjrt(map_location):
        return True
    if map_location is not None:
        return False
    try:
        pickle_file = kwargs.get("pickle_file", "data.pkl")
        prefix = next((r for r in zip_file.get_all_records() if r.endswith(pickle_file)), None)
        return prefix is not None and f"{BACKEND_NAME}".encode() in zip_file.get_record(prefix)
    except Exception:  # noqa: BLE001 - an unreadable archive: torch.load reports it itself
        return False


def _from_dlpack_reaches_pjrt(ext_tensor, *args, device=None, **kwargs):
    return _is_pjrt(device) or type(ext_tensor).__module__.split(".")[0] in ("jax", "jaxlib")


def _create_process_group(*args, **kwargs):
    ensure_loaded()
    from torchpjrt.distributed import process_group

    return process_group._create(*args, **kwargs)


def _safetensors_torch_loaded(module) -> None:
    """safetensors.torch: its load_file and safe_open onto pjrt load torchpjrt, whose own
    wrappers then take over (checkpoint.install)."""
    import safetensors

    def open_wants(filename, framework=None, device=None, *a, **k):
        return _is_pjrt(device)

    _on_pjrt_call([safetensors, module], "safe_open", open_wants)
    _on_pjrt_call(module, "load_file", lambda filename, device="cpu", *a, **k: _is_pjrt(device))


def _lightning_loaded(module) -> None:
    ensure_loaded()  # torchpjrt.lightning registers the accelerator with the modules imported so far


_AFTER_IMPORT = {"safetensors.torch": _safetensors_torch_loaded, "lightning": _lightning_loaded,
                 "pytorch_lightning": _lightning_loaded, "lightning_fabric": _lightning_loaded}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a module of _AFTER_IMPORT with the other finders and runs its action once the module
    has run (torchpjrt.lightning uses the same for Lightning's own modules)."""

    def find_spec(self, fullname, path, target=None):
        action = _AFTER_IMPORT.get(fullname)
        if action is None or _delegate is not None:
            return None
        return after_import(self, fullname, action)


def after_import(finder, fullname, action):
    """The spec of `fullname` as the other finders give it, with `action(module)` run after the
    module's own code."""
    sys.meta_path.remove(finder)
    try:
        spec = importlib.util.find_spec(fullname)
    finally:
        sys.meta_path.insert(0, finder)
    if spec is None or spec.loader is None:
        return spec
    loader = spec.loader

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return loader.create_module(spec)

        def exec_module(self, module):
            loader.exec_module(module)
            action(module)

    spec.loader = Loader()
    return spec

