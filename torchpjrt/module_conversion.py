"""Keep shared (tied) parameters shared when a module moves to the pjrt device.

`nn.Module.to("cuda")` updates parameters in place (`param.data = new`), so a weight tied
between two modules (GPT-2's embedding and LM head) stays one Parameter. PyTorch allows that
in-place update only between its built-in dense backends; for a PrivateUse1 device it makes a
new Parameter per module instead, silently untying the weights. This wrapper restores the
sharing PyTorch's own devices give: after the conversion, every place that shared one
Parameter (or buffer) before shares the converted one.
"""

import threading

import torch

_state = threading.local()
_original_apply = torch.nn.Module._apply


def _shared_slots(module):
    slots = {}
    for mod in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None:
                    slots.setdefault(id(t), []).append((mod, kind, name))
    return [entries for entries in slots.values() if len(entries) > 1]


def _apply(self, fn, recurse=True):
    if getattr(_state, "active", False):
        return _original_apply(self, fn, recurse)
    shared = _shared_slots(self) if recurse else []
    _state.active = True
    try:
        result = _original_apply(self, fn, recurse)
    finally:
        _state.active = False
    for entries in shared:
        mod, kind, name = entries[0]
        first = getattr(mod, kind)[name]
        if first is None or first.device.type != "pjrt":
            continue
        for other_mod, other_kind, other_name in entries[1:]:
            getattr(other_mod, other_kind)[other_name] = first
    return result


def install():
    torch.nn.Module._apply = _apply
