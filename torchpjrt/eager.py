"""The three eager modes: strict (default), debug, and fused.

- strict: each op is one asynchronous XLA dispatch; PyTorch semantics exactly.
- debug:  each op runs synchronously; errors name the aten op and the user's source line;
          optional NaN/Inf check per op (TORCHPJRT_CHECK_NANS=1) and op log
          (TORCHPJRT_LOG_OPS=1) with shapes, dtypes and time per op.
- fused:  ops are recorded and run as one XLA program at the next observation point
          (see fusion.py).

Chosen with `set_eager_mode`, the `eager_mode` context manager, or TORCHPJRT_EAGER_MODE.
"""

import contextlib
import logging
import os
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import device_checks, fusion, live_programs, storage

MODES = ("strict", "debug", "fused")

_lock = threading.RLock()
_mode = "strict"
debug_enabled = False  # read by every kernel's debug hook (dispatch.instrumented)
check_nans = False
log_ops = False

log = logging.getLogger("torchpjrt.ops")


def _env_flag(name) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def get_eager_mode() -> str:
    return _mode


def set_eager_mode(mode: str, *, max_ops: int = None, compile_after: int = None, check_nans: bool = None,
                   log_ops: bool = None) -> None:
    """Select the eager mode for the whole process.

    max_ops (fused): pending graph size that forces a flush.
    compile_after (fused): times a graph (structure and input shapes) must run before it is
        compiled as one program; the earlier runs go op by op (1: compile every graph at once).
    check_nans, log_ops (debug): as TORCHPJRT_CHECK_NANS / TORCHPJRT_LOG_OPS.
    """
    global _mode, debug_enabled
    if mode not in MODES:
        raise ValueError(f"torchpjrt: unknown eager mode {mode!r}; expected one of {', '.join(MODES)}")
    if max_ops is not None:
        if int(max_ops) < 1:
            raise ValueError(f"torchpjrt: max_ops must be at least 1, got {max_ops}")
        fusion.max_ops = int(max_ops)
    if compile_after is not None:
        if int(compile_after) < 1:
            raise ValueError(f"torchpjrt: compile_after must be at least 1, got {compile_after}")
        fusion.compile_after = int(compile_after)
    _set_debug_options(check_nans, log_ops)
    with _lock:
        fusion.set_recording(mode == "fused")  # leaving fused mode runs what is pending
        _module_boundaries(mode == "fused")
        debug_enabled = mode == "debug"
        _mode = mode
    from . import dispatch

    dispatch.update_view_kernels()  # debug mode logs every op: Python view kernels


def _set_debug_options(nans, ops):
    global check_nans, log_ops
    if nans is not None:
        check_nans = bool(nans)
    if ops is not None:
        log_ops = bool(ops)
        if log_ops and not log.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
        if log_ops:
            log.setLevel(logging.INFO)


@contextlib.contextmanager
def eager_mode(mode: str, **options):
    """`with torchpjrt.eager_mode("fused"): ...` then back to the previous mode and options."""
    previous = _mode
    previous_options = {"max_ops": fusion.max_ops, "compile_after": fusion.compile_after,
                        "check_nans": check_nans, "log_ops": log_ops}
    set_eager_mode(mode, **options)
    try:
        yield
    finally:
        set_eager_mode(previous, **{k: previous_options[k] for k in options})


def eager_stats() -> dict:
    """Ops dispatched, graphs compiled, cache hits/misses, compile seconds, flush reasons."""
    from . import dispatch, hot_path

    fusion.settle_hot_calls()
    s = fusion.stats
    return {
        "mode": _mode,
        "ops_dispatched": dispatch.stats["lowered"] + hot_path.calls(),
        "ops_recorded": s["ops_recorded"] + fusion.pending_ops(),  # counted per graph at its flush
        "ops_pending": fusion.pending_ops(),
        "graphs_compiled": s["graphs_compiled"],
        "graphs_run_op_by_op": s["graphs_run_op_by_op"],
        "compiles_deferred": s["compiles_deferred"],
        "compiles_deferred_in_looks": s["compiles_deferred_in_looks"],  # waiting for a look's verdict
        "cache_hits": s["cache_hits"],
        "cache_misses": s["cache_misses"],
        "cached_graphs": len(fusion._compiled),
        "compile_seconds": s["compile_seconds"],
        "xla_compiles": live_programs.stats["xla_compiles"],  # every path's, since the process started
        "flushes": s["flushes"],
        "ops_passed_through": s["ops_passed_through"],  # run at once in flush-heavy regions
        "passthrough_regions": s["passthrough_regions"],
        "flush_reasons": dict(fusion.flush_reasons),
    }


def reset_eager_stats() -> None:
    fusion.reset_stats()


def install() -> None:
    """Mode from the environment; in fused mode an optimizer step ends a graph."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_after_optimizer_step)
    _set_debug_options(_env_flag("TORCHPJRT_CHECK_NANS"), _env_flag("TORCHPJRT_LOG_OPS"))
    cap = os.environ.get("TORCHPJRT_FUSED_MAX_OPS")
    if cap:
        if not cap.isdigit() or int(cap) < 1:
            raise ValueError(f"torchpjrt: TORCHPJRT_FUSED_MAX_OPS={cap!r}; expected a positive integer")
        fusion.max_ops = int(cap)
    mode = os.environ.get("TORCHPJRT_EAGER_MODE")
    if mode:
        if mode not in MODES:
            raise ValueError(f"torchpjrt: TORCHPJRT_EAGER_MODE={mode!r}; expected one of {', '.join(MODES)}")
        set_eager_mode(mode)
    _backward_on_calling_thread()


def _backward_on_calling_thread() -> None:
    """backward() runs its pjrt work on the thread that calls it (the thread that loaded
    torchpjrt, usually the main one), not on PyTorch's worker thread for the device: handing
    each backward to that thread and waiting for it cost about 95 us a call here (a one-view
    backward: 153 us, 58 on the calling thread; the tiny MLP's fused step lost 0.3-0.5 ms to it).
    pjrt ops only enqueue work, so the worker thread overlaps nothing. This is PyTorch's own
    switch (torch.autograd.set_multithreading_enabled, per thread), so CUDA tensors used on this
    thread run their backward here too; TORCHPJRT_BACKWARD_THREAD=device keeps the worker."""
    where = os.environ.get("TORCHPJRT_BACKWARD_THREAD", "caller")
    if where not in ("caller", "device"):
        raise ValueError(f"torchpjrt: TORCHPJRT_BACKWARD_THREAD={where!r}; expected 'caller' or 'device'")
    if where == "caller":
        torch.autograd.set_multithreading_enabled(False)


_module_hooks = []
_module_depth = threading.local()


def _module_boundaries(on):
    """In fused mode, the end of an inference call of a top-level module ends a graph.

    Training steps are cut by backward() and the optimizer step; an inference loop has neither,
    and without this cut its graphs would be cut only by the size cap, at a different op in
    each iteration, so every graph would be new and compile again.
    """
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    if on and not _module_hooks:
        # these hooks only count depth, so torch.compile's warning about global hooks firing
        # twice for a compiled module does not apply
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        _module_hooks.append(register_module_forward_pre_hook(_enter_module))
        _module_hooks.append(register_module_forward_hook(_exit_module, always_call=True))
    elif not on:
        while _module_hooks:
            _module_hooks.pop().remove()


def _enter_module(module, args):
    _module_depth.n = getattr(_module_depth, "n", 0) + 1


def _exit_module(module, args, output):
    _module_depth.n = depth = getattr(_module_depth, "n", 1) - 1
    if depth == 0 and (not module.training or not torch.is_grad_enabled()) and fusion.recording():
        fusion.flush("module_call")


def _after_optimizer_step(optimizer, args, kwargs):
    # the natural step boundary: graphs cut here have the same structure every step
    if fusion.recording():
        fusion.flush("optimizer_step")
    device_checks.poll()  # checks the device has finished raise here; the others at the next read


# ---- debug mode ------------------------------------------------------------------------------

_PACKAGE_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__package__]))
_depth = threading.local()


def user_frame():
    """'file:line in function' of the innermost caller outside torch and torchpjrt."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_PACKAGE_DIRS) and not name.startswith("<frozen"):
            return f"{name}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return "<unknown>"


def run_debug(op, kernel, args, kwargs):
    """One op in debug mode: synchronous, checked, logged."""
    name = f"{op._schema.name}.{op._overloadname}"
    level = getattr(_depth, "n", 0)
    _depth.n = level + 1
    t0 = time.perf_counter()
    # an in-place or out= op overwrites its own inputs: keep what they held before it ran
    before = _overwritten_inputs(op, args, kwargs) if check_nans and level == 0 else None
    try:
        result = kernel(*args, **kwargs)
        outs = [t for t in _tensors(result) if t.device.type == "pjrt"]
        arrays = [_array_of(t) for t in outs]
        for a in arrays:
            if a is not None:
                try:
                    a.block_until_ready()
                except jax.errors.JaxRuntimeError as e:
                    raise fusion.device_error(e) from e
        if level == 0:
            device_checks.raise_pending()  # an out-of-range index, found on the device: raised now
    except Exception as e:
        if not getattr(e, "_torchpjrt_noted", False):
            e.add_note(f"torchpjrt (debug mode): raised by {name}, called from {user_frame()}")
            e._torchpjrt_noted = True
        raise
    finally:
        _depth.n = level
    elapsed = time.perf_counter() - t0
    if log_ops:
        log.info("%s%s  %s -> %s  %.3f ms", "  " * level, name, _describe(_tensors((args, list(kwargs.values())))),
                 _describe(outs), elapsed * 1e3)
    if check_nans and level == 0:
        _check_finite(op, name, args, kwargs, outs, arrays, before)
    return result


def _array_of(t):
    try:
        return storage.read(t)
    except Exception:  # noqa: BLE001 - e.g. a tensor whose storage is not pjrt-backed yet
        return None


def _tensors(x):
    from .dispatch import _flatten_tensors

    return _flatten_tensors(x)


def _describe(tensors):
    return "(" + ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors) + ")"


def _all_finite(a) -> bool:
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return True
    return bool(_finite(a))


@jax.jit
def _finite(a):
    return jnp.isfinite(a).all()


_arg_roles = {}


def _roles(op):
    """Per schema argument: (name, written by the op, an out= argument)."""
    roles = _arg_roles.get(op)
    if roles is None:
        roles = _arg_roles[op] = tuple(
            (a.name, a.alias_info is not None and a.alias_info.is_write, a.is_out) for a in op._schema.arguments
        )
    return roles


def _by_role(op, args, kwargs):
    """(value, written, is_out) for each argument passed; unknown ones count as read-only inputs."""
    roles = _roles(op)
    by_name = {r[0]: r for r in roles}
    for i, v in enumerate(args):
        yield (v,) + (roles[i][1:] if i < len(roles) else (False, False))
    for k, v in kwargs.items():
        yield (v,) + (by_name[k][1:] if k in by_name else (False, False))


def _storage_key(t):
    try:
        return id(t.untyped_storage()._pjrt)
    except Exception:  # noqa: BLE001 - not pjrt-backed
        return None


def _overwritten_inputs(op, args, kwargs):
    """{id(tensor): array before the op} for the pjrt inputs sharing storage with a tensor the
    op writes (self of an in-place op, out=). None when the op writes nothing.

    After the op these hold its result, so reading them then would take a NaN the op made for
    one it was given. JAX arrays are immutable: this keeps a reference, and for a view it is the
    read the op itself makes (cached per storage version)."""
    written = {_storage_key(t) for v, w, _ in _by_role(op, args, kwargs) if w
               for t in _tensors(v) if t.device.type == "pjrt"}
    written.discard(None)
    if not written:
        return None
    return {id(t): _array_of(t) for v, _, is_out in _by_role(op, args, kwargs) if not is_out
            for t in _tensors(v) if t.device.type == "pjrt" and _storage_key(t) in written}


def _nonfinite_scalar(v) -> bool:
    if isinstance(v, (list, tuple)):
        return any(_nonfinite_scalar(x) for x in v)
    if isinstance(v, (float, complex, np.floating, np.complexfloating)):
        return not np.isfinite(v)
    return False


def _tensor_finite(t, before) -> bool:
    if not (t.is_floating_point() or t.is_complex()):
        return True
    if t.device.type == "pjrt":
        a = before[id(t)] if before is not None and id(t) in before else _array_of(t)
        return a is None or _all_finite(a)
    if t.device.type == "meta":
        return True
    return bool(torch.isfinite(t).all())  # a host tensor: the user's data


def _check_finite(op, name, args, kwargs, outs, arrays, before):
    """Name the op that *produced* a NaN/Inf: one whose inputs were all finite.

    NaN/Inf the user supplied is data, not a fault: an op is not blamed when any input holds
    one (a host tensor being copied in, or a pjrt one an earlier op was already blamed for),
    when a scalar argument is one (full/fill_/masked_fill with -inf, as attention masks do), or
    when it has no tensor inputs at all (a factory: its values are its arguments). A written
    argument counts with what it held before the op; the old contents of out= are not inputs.
    """
    if not outs and before is not None:  # an in-place op that returns nothing (_foreach_add_)
        outs = [t for v, w, _ in _by_role(op, args, kwargs) if w for t in _tensors(v) if t.device.type == "pjrt"]
        arrays = [_array_of(t) for t in outs]
    bad = [i for i, a in enumerate(arrays) if a is not None and not _all_finite(a)]
    if not bad:
        return
    inputs = [t for v, _, is_out in _by_role(op, args, kwargs) if not is_out for t in _tensors(v)]
    if not inputs:
        return  # a factory (empty, scalar_tensor, linspace, ...): its values are the user's
    if any(_nonfinite_scalar(v) for v in list(args) + list(kwargs.values())):
        return  # an explicit inf/nan scalar (masked_fill(mask, -inf), fill_(inf))
    if not all(_tensor_finite(t, before) for t in inputs):
        return  # the NaN/Inf came in: from the host, or from an op already reported
    i = bad[0]
    raise RuntimeError(
        f"torchpjrt: {name} produced NaN/Inf in output {i} ({_describe([outs[i]])[1:-1]}) from finite "
        f"inputs, called from {user_frame()} (TORCHPJRT_CHECK_NANS=1)"
    )

