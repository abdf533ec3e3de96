"""torchpjrt: PyTorch, eager-first, on any XLA device through PJRT, with JAX as the runtime.

    import torch, torchpjrt
    x = torch.randn(4, 8, device="pjrt")
"""

from . import device as _device

_device.register()

from . import accelerator as _accelerator  # noqa: E402

_accelerator.install()  # torch.accelerator's memory/synchronize and pin_memory() on pjrt

from .compile import default_backend as _default_backend  # noqa: E402

_default_backend.install()  # torch.compile(model) of a pjrt model compiles through XLA

from . import compile_cache as _compile_cache  # noqa: E402

_compile_cache.configure()

from . import live_programs as _live_programs  # noqa: E402

_live_programs.install()  # loaded programs are let go before the process runs out of mappings

from . import dispatch as _dispatch  # noqa: E402

_dispatch.register()

from . import untyped_storage as _untyped_storage  # noqa: E402

_untyped_storage.install()

from . import interop as _interop  # noqa: E402

_interop.install()  # DLPack for pjrt tensors, torch.from_dlpack onto pjrt

from . import printing as _printing  # noqa: E402

_printing.install()  # print(tensor) formats a CPU copy: no program per printed shape
from .interop import from_jax, to_jax  # noqa: E402,F401

from . import module_conversion as _module_conversion  # noqa: E402

_module_conversion.install()

from . import eager as _eager  # noqa: E402

_eager.install()

from . import autocast as _autocast  # noqa: E402

_autocast.install()

from . import distributed as _distributed  # noqa: E402,F401  (registers the c10d backend "pjrt")
from .dispatch import cpu_fallback_counts  # noqa: E402,F401
from .device_checks import set_enabled as set_device_checks  # noqa: E402,F401
from .stablehlo_export import ExportError, export, load_exported  # noqa: E402,F401
from .kernels import kernel  # noqa: E402,F401
from .eager import eager_mode, eager_stats, get_eager_mode, reset_eager_stats, set_eager_mode  # noqa: E402,F401
from . import lightning as _lightning  # noqa: E402

_lightning.watch_imports()  # Trainer(accelerator="pjrt") once Lightning is imported
from . import checkpoint as _checkpoint  # noqa: E402

_checkpoint.install()  # safetensors.torch.load_file(..., device="pjrt")
from .checkpoint import load_model, load_safetensors, save_model, save_safetensors  # noqa: E402,F401


def compile_stats() -> dict:
    """torch.compile(backend="pjrt") counters: graphs, recompiles with their reasons, compile
    seconds, graph and XLA program cache hits (see torchpjrt.compile.compile_stats)."""
    from .compile import compile_stats as stats

    return stats()


def op_stats() -> dict:
    """Counts of aten calls per execution path (hot_path, lowered, view, decomposed, cpu_fallback...)."""
    from . import hot_path

    return {**_dispatch.stats, "hot_path": hot_path.calls()}


__all__ = ["to_jax", "from_jax", "compile_stats", "op_stats", "cpu_fallback_counts", "set_device_checks", "kernel", "export", "load_exported", "ExportError", "set_eager_mode", "get_eager_mode", "eager_mode",
           "eager_stats", "reset_eager_stats", "save_safetensors", "load_safetensors",
           "save_model", "load_model"]
