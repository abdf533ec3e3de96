"""Module moves to and from the pjrt device keep each Parameter the same Python object.

`nn.Module.to("cuda")` updates a parameter in place (`param.data = new`, and
`param.grad.data = new_grad`): the Parameter object stays the one an optimizer built before
the move holds, and a weight tied between two modules (GPT-2's embedding and LM head) stays
one Parameter. PyTorch allows that in-place update only between its built-in dense backends
(`torch._has_compatible_shallow_copy_type`); for a PrivateUse1 device `Module._apply` makes a
new Parameter instead, so an optimizer built first (accelerate's quicktour: optimizer, then
`model.to(device)`) steps the old CPU tensors, which never get gradients, and the model never
trains.

`param.data = t` cannot cross that type check from Python; moving the converted tensor's
TensorImpl into the existing Python object can (`torch._C._swap_tensor_impl`, the core of
`torch.utils.swap_tensors`). After PyTorch's own `_apply` has built the new Parameter, each
module gets its old Parameter object back, now holding the converted tensor. The object's
class, `__dict__`, weak references and Python hooks stay with it (the hooks are registered
again on the new tensor); `requires_grad` comes with the converted Parameter; the version
counter keeps its value and `.grad` keeps its object, as `param.data = ...` and
`param.grad.data = ...` do on CUDA. An autograd graph recorded before the move refuses to run
backward into the moved Parameter, as PyTorch's own swap does.

Only what CUDA keeps is kept: Parameters moved between dense devices when one side is pjrt.
CPU-only programs, `meta` tensors, `torch.__future__.set_overwrite_module_params_on_conversion`
(new Parameters wanted) and `set_swap_module_params_on_conversion` (PyTorch swaps) are left to
PyTorch. Buffers become new tensors, as on CUDA (`_buffers[k] = fn(buf)`); a Parameter or
buffer shared between modules stays shared.
"""

import sys
import threading
import warnings

import torch

_state = threading.local()
_original_apply = torch.nn.Module._apply
_set_version = torch._C._autograd._unsafe_set_version_counter
_stand_in = {}  # dtype -> empty CPU tensor standing for a pjrt tensor in the type check


def _shared_slots(module):
    """(device before the move, places) for each Parameter or buffer held in several places."""
    slots = {}
    for mod in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None:
                    slots.setdefault(id(t), (t.device.type, []))[1].append((mod, kind, name))
    return [(device, entries) for device, entries in slots.values() if len(entries) > 1]


def _as_dense(t):
    """`t`, or for a pjrt tensor a CPU tensor of its dtype: the pjrt device counts as one of
    the dense backends `_has_compatible_shallow_copy_type` accepts."""
    if t.device.type != "pjrt":
        return t
    s = _stand_in.get(t.dtype)
    if s is None:
        s = _stand_in[t.dtype] = torch.empty(0, dtype=t.dtype)
    return s


def _kept_on_cuda(old, new) -> bool:
    """Whether `Module._apply` would have updated `old` in place were pjrt a CUDA device."""
    if "pjrt" not in (old.device.type, new.device.type):
        return False
    if type(new) not in (torch.Tensor, torch.nn.Parameter):
        return False  # a tensor subclass: PyTorch's own rules apply
    if torch.__future__.get_overwrite_module_params_on_conversion():
        return False
    return torch._has_compatible_shallow_copy_type(_as_dense(old), _as_dense(new))


def _stale_graph(grad_outputs):
    raise RuntimeError(
        "torchpjrt: backward reached a Parameter through a graph recorded before its module "
        "moved to another device; run forward again after the move")


def _poison_accumulator(t):
    """Make an autograd graph recorded before the move fail loudly instead of accumulating
    into the tensor the Parameter no longer holds. The accumulator holds its tensor, so one
    exists only if the tensor has another owner."""
    if not t.requires_grad or t._use_count() < 2:
        return
    before = t._use_count()
    node = torch.autograd.graph.get_gradient_edge(t).node
    if t._use_count() == before:  # an existing accumulator, not one made by the lookup
        node.register_prehook(_stale_graph)


def _owned(t, alone) -> bool:
    """Whether only the caller's name holds `t`: the converted grad is `fn`'s own result, which
    `fn` may have kept. `alone` is a tensor only the caller holds, passed the same way: what a
    reference count includes varies (Dynamo's frame hook adds one per frame a value is passed
    through)."""
    return _references(t) <= _references(alone) and t._use_count() == 1


def _references(t) -> int:
    return sys.getrefcount(t)


def _adopt(old, new):
    """Make `old` hold `new`'s tensor (and grad), as `old.data = new` would; `new` is left
    holding `old`'s former tensor. Raises RuntimeError, changing nothing, if it cannot."""
    version = old._version
    old_grad, new_grad = old.grad, new.grad
    old.grad = None
    new.grad = None
    try:
        torch._C._swap_tensor_impl(old, new)
    except RuntimeError:
        old.grad = old_grad
        new.grad = new_grad
        raise
    _poison_accumulator(new)  # `new` now holds the tensor a graph before the move reaches
    _keep_version(old, version)
    if old._backward_hooks is not None:  # hooks live on the tensor: register them on this one
        old._backward_hooks = old._backward_hooks
    if old._post_accumulate_grad_hooks is not None:
        old._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks
    if new_grad is None:
        return
    grad_version = old_grad._version
    try:
        alone = torch.empty(0)
        if not _owned(new_grad, alone):
            raise RuntimeError
        torch._C._swap_tensor_impl(old_grad, new_grad)
    except RuntimeError:
        old.grad = new_grad  # the grad moves as a new tensor
        return
    _keep_version(old_grad, grad_version)
    old.grad = old_grad


def _keep_version(t, version):
    with torch._C.DisableTorchFunctionSubclass():  # UninitializedParameter refuses every call
        inference = t.is_inference()
    if not inference:  # a tensor made under torch.inference_mode has no version counter to set
        _set_version((t,), (version,))


def _keep_parameters(module, before):
    params = module._parameters
    for key, old in before.items():
        new = params.get(key)
        if new is None or new is old or not _kept_on_cuda(old, new):
            continue
        target = new.device
        try:
            _adopt(old, new)
        except RuntimeError as e:
            warnings.warn(
                f"torchpjrt: {module._get_name()}.{key} moved to {target} as a new Parameter "
                f"({e}); an optimizer built before the move does not update it: build it after",
                stacklevel=4)
            continue
        params[key] = old


def _apply(self, fn, recurse=True):
    before = {k: p for k, p in self._parameters.items() if p is not None}
    if getattr(_state, "active", False):
        result = _original_apply(self, fn, recurse)
        _keep_parameters(self, before)
        return result
    shared = _shared_slots(self) if recurse else []
    _state.active = True
    try:
        result = _original_apply(self, fn, recurse)
        _keep_parameters(self, before)
    finally:
        _state.active = False
    for device, entries in shared:  # places that shared a tensor share the converted one
        mod, kind, name = entries[0]
        first = getattr(mod, kind)[name]
        if first is None or "pjrt" not in (device, first.device.type):
            continue
        for other_mod, other_kind, other_name in entries[1:]:
            getattr(other_mod, other_kind)[other_name] = first
    return result


def install():
    torch.nn.Module._apply = _apply
