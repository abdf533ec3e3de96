"""The pjrt accelerator for Lightning: `Trainer(accelerator="pjrt", devices=N)` and
`Fabric(accelerator="pjrt")`.

Lightning accepts only accelerator names in its registries. torchpjrt does not depend on
Lightning: when `lightning.pytorch.accelerators` (or `lightning.fabric.accelerators`,
`pytorch_lightning.accelerators`) is imported in a process where torchpjrt is loaded (importing
Lightning loads it, see torchpjrt_autoload), the accelerator is added to that registry (`watch_imports`).

Devices: pjrt runs one device per process. `devices=1` trains on pjrt:0 in the process;
`devices=N` with N > 1 is Lightning's DDP over N processes (its launcher starts them), each on its
own pjrt:0, with the c10d backend "pjrt" (torch.distributed's default for the device).

Lightning's automatic strategy choice puts a one-device run of any accelerator but CUDA and MPS
on the CPU (`_AcceleratorConnector._choose_strategy`, `_Connector._choose_strategy` for Fabric:
the single-device branch takes "cpu" instead of the accelerator's device), and its DDP strategy
opens a CUDA stream for any device that is not the CPU. For the pjrt accelerator the automatic
choice (`strategy="auto"`, the default) is pjrt:0 for one device and DDP without CUDA streams for
several; every other choice is Lightning's.
"""

import importlib.abc
import sys

import torch
import torchpjrt_autoload

_REGISTRIES = {
    "lightning.pytorch.accelerators": "lightning.pytorch.accelerators.accelerator",
    "pytorch_lightning.accelerators": "pytorch_lightning.accelerators.accelerator",
    "lightning.fabric.accelerators": "lightning.fabric.accelerators.accelerator",
    "lightning_fabric.accelerators": "lightning_fabric.accelerators.accelerator",
}


def _parse_devices(devices) -> int:
    """Lightning's `devices=` for pjrt: a count, "auto"/-1 (every device), or a list of indices."""
    if isinstance(devices, str):
        devices = devices.strip()
        if devices in ("auto", "-1"):
            return torch.pjrt.device_count()
        if "," in devices:
            devices = [int(d) for d in devices.split(",") if d.strip()]
        else:
            devices = int(devices)
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if not isinstance(devices, int) or devices == 0 or devices < -1:
        raise ValueError(f"torchpjrt: devices={devices!r} for the pjrt accelerator: give a positive count, "
                         "-1 or 'auto'")
    return torch.pjrt.device_count() if devices == -1 else devices


def _make_accelerator(base):
    class PjrtAccelerator(base):
        """Lightning accelerator for the torchpjrt device (XLA through PJRT, JAX as runtime)."""

        def setup_device(self, device: torch.device) -> None:
            if device.type != "pjrt":
                raise ValueError(f"torchpjrt: the pjrt accelerator got device {device}, expected pjrt")
            torch.pjrt.set_device(device.index or 0)

        def teardown(self) -> None:
            pass

        def get_device_stats(self, device) -> dict:
            return dict(torch.pjrt.memory_stats(device))

        @staticmethod
        def parse_devices(devices) -> int:
            return _parse_devices(devices)

        @staticmethod
        def get_parallel_devices(devices) -> list:
            # one pjrt device per process: every process of a multi-device run uses its pjrt:0
            return [torch.device("pjrt", 0)] * _parse_devices(devices)

        @staticmethod
        def auto_device_count() -> int:
            return torch.pjrt.device_count()

        @staticmethod
        def is_available() -> bool:
            return torch.pjrt.is_available()

        @staticmethod
        def name() -> str:
            return "pjrt"

        @classmethod
        def register_accelerators(cls, accelerator_registry) -> None:
            accelerator_registry.register("pjrt", cls, description=cls.__doc__, override=True)

    return PjrtAccelerator


def register(package: str) -> None:
    """Add the pjrt accelerator to the registry of an imported Lightning `package`."""
    module = sys.modules[package]
    base = sys.modules[_REGISTRIES[package]].Accelerator
    accelerator = _make_accelerator(base)
    accelerator.__module__ = __name__
    module.PjrtAccelerator = accelerator
    accelerator.register_accelerators(_registry_of(module))


def _registry_of(module):
    return getattr(module, "AcceleratorRegistry", None) or module.ACCELERATOR_REGISTRY


_CONNECTORS = ("lightning.pytorch.trainer.connectors.accelerator_connector",
               "pytorch_lightning.trainer.connectors.accelerator_connector",
               "lightning.fabric.connector", "lightning_fabric.connector")


def _is_pjrt(flag) -> bool:
    return flag == "pjrt" or type(flag).__name__ == "PjrtAccelerator"


def place_single_device_runs(package: str) -> None:
    """Make an imported Lightning connector module choose pjrt:0 for a one-device pjrt run."""
    module = sys.modules[package]
    connector = getattr(module, "_AcceleratorConnector", None) or module._Connector
    choose = connector._choose_strategy
    if getattr(choose, "_pjrt", False):
        return

    def _choose_strategy(self):
        if not _is_pjrt(self._accelerator_flag):
            return choose(self)
        if self._num_nodes_flag <= 1 and len(self._parallel_devices) <= 1:
            return module.SingleDeviceStrategy(device=torch.device("pjrt", 0))
        chosen = choose(self)
        if chosen in ("ddp", "ddp_fork") and hasattr(module, "DDPStrategy"):
            return _ddp_strategy(module.DDPStrategy)(start_method="popen" if chosen == "ddp" else "fork")
        return chosen

    _choose_strategy._pjrt = True
    connector._choose_strategy = _choose_strategy


def _ddp_strategy(base):
    class PjrtDDPStrategy(base):
        """Lightning's DDP on pjrt: one pjrt device per process, so DistributedDataParallel gets no
        device_ids (Lightning's own DDP takes any non-CPU device for CUDA and opens a CUDA stream)."""

        def determine_ddp_device_ids(self):
            return None

    return PjrtDDPStrategy


_ON_IMPORT = {**{package: register for package in _REGISTRIES},
              **{package: place_single_device_runs for package in _CONNECTORS}}


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds a Lightning module of _ON_IMPORT with the other finders and runs its action once the
    module has run."""

    def find_spec(self, fullname, path, target=None):
        action = _ON_IMPORT.get(fullname)
        if action is None:
            return None
        return torchpjrt_autoload.after_import(self, fullname, lambda module: action(fullname))


def watch_imports() -> None:
    for package, action in _ON_IMPORT.items():
        if package in sys.modules:  # imported before torchpjrt
            action(package)
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
