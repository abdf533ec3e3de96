"""`torch.compile(model)` with the default backend on pjrt tensors: compiled by the pjrt backend.

Inductor generates C++/Triton code for CPU and CUDA tensors and fails on pjrt ones (its lowerings
meet a device it has no code generator for), while scripts call torch.compile without naming a
backend. So the default backend's compiler (torch's `_TorchCompileInductorWrapper`) hands each
graph whose tensors are on pjrt to `pjrt_backend`; graphs on other devices stay inductor's.
Inductor's mode and options do not apply to XLA and are ignored for such graphs (said once).
"""

import warnings

import torch

_original_call = None
_warned = False


def _on_pjrt(gm, example_inputs) -> bool:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type == "pjrt":
            return True
    for node in gm.graph.nodes:  # factories with device="pjrt" in a graph without pjrt inputs
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor) and value.device.type == "pjrt":
            return True
    return False


def _call(self, model_, inputs_, *, config_patches=None):
    global _warned
    if not _on_pjrt(model_, inputs_):
        return _original_call(self, model_, inputs_, config_patches=config_patches)
    if (self.config or config_patches) and not _warned:
        _warned = True
        warnings.warn("torchpjrt: a graph on pjrt tensors is compiled by the pjrt backend (XLA); "
                      "inductor's mode and options are ignored for it", stacklevel=2)
    from .backend import pjrt_backend

    return pjrt_backend(model_, inputs_)


def install() -> None:
    global _original_call
    if _original_call is None:
        _original_call = torch._TorchCompileInductorWrapper.__call__
        torch._TorchCompileInductorWrapper.__call__ = _call
