"""The generic kernels: every aten call on a pjrt tensor ends up in one of these.

- lowered:  ops in the lowering table; their in-place (`add_`) and `out=` (`add.out`)
            overloads are derived here, not written per op.
- view:     any op whose schema returns an alias of its input: the same op runs on a meta
            tensor with the input's geometry and the result's sizes/strides/offset become
            a new tensor sharing the input's storage.
- factory, copy, item, resize_, set_: the memory model's own primitives.
- fallback: decompositions from torch._decomp, then (opt-in) a CPU fallback, else a
            NotImplementedError naming the aten overload.
"""

import functools
import math
import os
import re
import threading
import types
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._ops import OpOverload

from . import attention, device_checks, dtypes, eager, fusion, hot_path, kernel_cache, live_programs, native, padding, placement, random_state, storage
from .device import current_device as _current_device
from .ops import TABLE, Lowering

aten = torch.ops.aten

stats = Counter()  # ops dispatched per path, shown by torchpjrt.op_stats()
cpu_fallback_counts = Counter()
decomposed_counts = Counter()  # aten ops run through a torch._decomp decomposition, by name
_warned_fallback = set()
_tls = threading.local()


def cpu_fallback_enabled() -> bool:
    return os.environ.get("TORCHPJRT_CPU_FALLBACK", "0") not in ("", "0", "false", "False")


# ---- schema helpers ------------------------------------------------------------------------

TENSOR, TENSOR_LIST, SCALAR, STATIC, SCALAR_LIST = range(5)


def _arg_kind(arg):
    t = arg.type
    s = str(t)
    if s in ("Tensor", "Optional[Tensor]"):
        return TENSOR
    if s in ("List[Tensor]", "List[Optional[Tensor]]"):
        return TENSOR_LIST
    if s in ("number", "Optional[number]"):
        return SCALAR
    if s == "List[number]":
        return SCALAR_LIST
    return STATIC


# c10::ScalarType numbering, for schema defaults such as `ScalarType dtype=4`
_SCALAR_TYPES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64,
                 5: torch.float16, 6: torch.float32, 7: torch.float64, 9: torch.complex64,
                 10: torch.complex128, 11: torch.bool, 15: torch.bfloat16}


def _default(arg):
    if not arg.has_default_value():
        return None
    v = arg.default_value
    if isinstance(v, int) and not isinstance(v, bool) and "ScalarType" in str(arg.type):
        return _SCALAR_TYPES.get(v, v)
    return v


class Signature:
    """A schema's argument list, precomputed for fast argument normalization."""

    def __init__(self, schema):
        self.schema = schema
        self.names = [a.name for a in schema.arguments]
        self.kinds = [_arg_kind(a) for a in schema.arguments]
        self.kwarg_only = [a.kwarg_only for a in schema.arguments]
        self.defaults = [_default(a) for a in schema.arguments]
        self.written = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
        self.n = len(self.names)

    def values(self, args, kwargs):
        vals = list(args)
        if len(vals) < self.n:
            names, defaults = self.names, self.defaults
            for i in range(len(vals), self.n):
                vals.append(kwargs.get(names[i], defaults[i]))
        return vals

    def split(self, vals):
        """Back to (args, kwargs) for calling the op."""
        args, kwargs = [], {}
        for i, v in enumerate(vals):
            if self.kwarg_only[i]:
                kwargs[self.names[i]] = v
            else:
                args.append(v)
        return args, kwargs


_signatures = {}


def signature(op) -> Signature:
    sig = _signatures.get(op)
    if sig is None:
        sig = _signatures[op] = Signature(op._schema)
    return sig


# ---- meta execution (shape/dtype inference and PyTorch's own error checks) ---------------


def meta_like(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "pjrt":
        if t.device.type == "cpu" and t.dim() == 0:
            # a CPU scalar tensor may join device tensors (as on CUDA); meta kernels would
            # call it a device mismatch
            return torch.empty((), dtype=t.dtype, device="meta")
        return t
    size, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    base = torch.empty((offset + storage.span(size, stride),), dtype=t.dtype, device="meta")
    m = base.as_strided(size, stride, offset)
    if t.requires_grad and _is_leaf(t):
        m.requires_grad_(True)
    return m


def _is_leaf(t):
    # reading is_leaf of a multi-output view (split) whose base was written in place raises
    try:
        return t.is_leaf
    except RuntimeError:
        return False


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return meta_like(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_to_meta(x) for x in v)
    if isinstance(v, torch.device) and v.type == "pjrt":
        return torch.device("meta")
    return v


def _flatten_tensors(res):
    if isinstance(res, torch.Tensor):
        return [res]
    if isinstance(res, (list, tuple)):
        out = []
        for r in res:
            out.extend(_flatten_tensors(r))
        return out
    return []


class _NoMeta(Exception):
    pass


def run_meta(op, sig, vals):
    """Run `op` on meta copies of the arguments: PyTorch's shape/dtype rules and errors."""
    if op in _CUDA_ONLY_META:
        raise _NoMeta()
    mvals = [_to_meta(v) for v in vals]
    fix = _META_ARG_FIXES.get(op)
    if fix is not None:
        fix(sig, mvals)
    margs, mkwargs = sig.split(mvals)
    if "device" in mkwargs and mkwargs["device"] is None and not any(
        isinstance(v, torch.Tensor) for v in vals
    ):
        mkwargs["device"] = "meta"
    try:
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            if op._schema.name.endswith("_"):
                with warnings.catch_warnings():
                    # torch._refs' in-place meta kernels resize their own target when the result
                    # is larger, with out='s warning, before the broadcast check refuses it
                    warnings.filterwarnings("ignore", "An output with one or more elements was resized")
                    return op(*margs, **mkwargs)
            return op(*margs, **mkwargs)
    except NotImplementedError as e:
        raise _NoMeta() from e
    except torch._subclasses.fake_tensor.DynamicOutputShapeException as e:
        raise _NoMeta() from e
    except RuntimeError as e:
        msg = str(e)
        if "Meta" in msg and ("Could not run" in msg or "not implemented" in msg.lower()):
            raise _NoMeta() from e
        if "data-dependent" in msg or "unbacked" in msg or "item()" in msg:
            raise _NoMeta() from e
        raise as_cpu_error(op, e) from None
    except (AssertionError, ValueError) as e:
        raise as_cpu_error(op, e) from None


def _wrap_norm_dims(sig, mvals):
    # torch._refs' vector_norm check indexes the shape with unwrapped negative dims
    i = sig.names.index("dim")
    x, dims = mvals[0], mvals[i]
    if dims is not None and not isinstance(dims, int):
        mvals[i] = [d + x.dim() if -x.dim() <= d < 0 else d for d in dims]


def _cell_biases(sig, mvals):
    # the fused LSTM cell's meta kernel checks the biases' devices without skipping absent ones
    # (nn.LSTM(bias=False)); a bias only adds to the gates, so one of their width stands in
    gates = mvals[0]
    for name in ("input_bias", "hidden_bias"):
        i = sig.names.index(name)
        if mvals[i] is None:
            mvals[i] = gates.new_empty((gates.shape[1],))


_META_ARG_FIXES = {aten.linalg_vector_norm.default: _wrap_norm_dims, aten.linalg_vector_norm.out: _wrap_norm_dims,
                   aten._thnn_fused_lstm_cell.default: _cell_biases}

# meta kernels that check a CUDA kernel's limits (_grouped_mm: bfloat16 only, 16-byte strides),
# which the CPU does not have: the lowering checks what the CPU checks
_CUDA_ONLY_META = frozenset({aten._grouped_mm.default})

# ops whose CPU kernels raise IndexError on an empty reduced dimension (meta: RuntimeError)
_EMPTY_DIM_INDEX_ERRORS = ("aten::amax", "aten::amin", "aten::argmax", "aten::argmin")


def _ints(text):
    return [int(x) for x in text.replace(",", " ").split()]


def as_cpu_error(op, e):
    """The exception PyTorch's CPU kernel raises where a meta kernel (often a Python reference
    implementation) raised `e`: same message, CPU's exception type and wording."""
    msg = str(e)
    name = op._schema.name
    if name in _EMPTY_DIM_INDEX_ERRORS and ("reduction dim" in msg or "zero-size dimension" in msg):
        return IndexError(f"{name.split('::')[1]}(): {msg}")
    m = re.match(r"Attempting to cast from (torch\.\w+) to out tensor with dtype (torch\.\w+)", msg)
    if m:
        src, dst = (getattr(torch, x.split(".")[1]) for x in m.groups())
        return RuntimeError(f"result type {_dtype_name(src)} can't be cast to the desired output type {_dtype_name(dst)}")
    m = re.match(r"Attempting to broadcast a dimension of length (\d+) at (-\d+)! Mismatching argument at index "
                 r"\d+ had torch\.Size\(\[(.*)\]\); but expected shape should be broadcastable to \[(.*)\]", msg)
    if m:
        length, at = int(m.group(1)), int(m.group(2))
        arg_shape, expected = (_ints(g) for g in m.group(3, 4))
        return RuntimeError(f"The size of tensor a ({expected[at]}) must match the size of tensor b ({length}) at "
                            f"non-singleton dimension {max(len(expected), len(arg_shape)) + at}")
    m = re.match(r"(Sizes of tensors must match except in dimension \d+)\. Expected (\d+) in dimension \d+ but got "
                 r"(\d+) for tensor number (\d+) in the list$", msg)
    if m:
        return RuntimeError("{}. Expected size {} but got size {} for tensor number {} in the list.".format(*m.groups()))
    m = re.match(r"a and b must have same reduction dim, but got \[(\d+), (\d+)\] X \[(\d+), (\d+)\]", msg)
    if m:
        return RuntimeError("mat1 and mat2 shapes cannot be multiplied ({}x{} and {}x{})".format(*m.groups()))
    m = re.match(r"output with shape torch\.Size\((\[.*\])\) doesn't match the broadcast shape \((.*)\)$", msg)
    if m:
        return RuntimeError(f"output with shape {m.group(1)} doesn't match the broadcast shape [{m.group(2).rstrip(',')}]")
    if msg == "clamp called but both min and max are none!":
        return RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")  # clamp_ too, as CPU
    if type(e) is RuntimeError:
        return e
    return RuntimeError(msg)  # AssertionError, ValueError: CPU's checks raise RuntimeError


# ---- lowered ops -----------------------------------------------------------------------------


def _device_error(t, first="pjrt:0"):
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{first} and {t.device}!"
    )


def _op_device(on, t):
    """The device of an op's pjrt tensors (`on`, None before the first) after meeting `t`: CUDA's
    error when `t` is on another one."""
    index = t.get_device()
    if on is None or index == on:
        return index
    raise _device_error(t, f"pjrt:{on}")


def _target_index(device):
    """The pjrt index a `device=` argument names (None or "pjrt": the current device), checked
    to exist and be usable; None for another device type (PyTorch's own checks then speak)."""
    if device is None:
        return _current_device()
    d = device if isinstance(device, torch.device) else torch.device(device)
    if d.type != "pjrt":
        return None
    if d.index is None:
        return _current_device()
    placement.require(d.index)
    return d.index


class LoweredKernel:
    """Runs one lowering for one aten overload, compiled once per argument signature.

    `op` is the overload whose semantics (validation, result dtype) apply; `lowering`
    computes the values. For derived in-place/out overloads the lowering is the
    functional op's and only its first `n_inputs` arguments are passed to it.
    """

    def __init__(self, op: OpOverload, lowering: Lowering, n_inputs=None, inplace_of=None, lays_out=False):
        self.op = op
        # new results take the strides PyTorch's meta kernel gives them (channels_last stays
        # channels_last): key -> per output, strides or None for row-major; only for kernels
        # whose results become new tensors
        self.lays_out = lays_out
        self.layouts = {}
        self.sig = signature(op)
        # in-place form of a pointwise op: its result type must cast to the target's (as CPU's
        # TensorIterator checks); other in-place ops run in the target's dtype (cumsum_)
        self.checked_functional = inplace_of if inplace_of is not None and torch.Tag.pointwise in inplace_of.tags \
            else None
        self.lowering = lowering
        self.n_inputs = self.sig.n if n_inputs is None else n_inputs
        self.cache = {}
        self.fused_avals = {}  # key -> output shapes/dtypes, for recording in fused mode
        # key -> the arguments read masked (padding._masked), as (position, element or -1) in
        # the program's arguments: the hot path passes them with their n (hot_path.take_entry)
        self.masked_of = {}
        # an op that also writes arguments whose calls the hot path serves (register): its kernel
        # tells the hot path what each call wrote; no other keeps its written arrays referenced
        self.hot_writes = False
        args = self.sig.schema.arguments
        kinds = _kinds(self.sig, lowering)
        self.plan = [(i, kinds[i]) for i in range(self.n_inputs)]
        self._static_positions = frozenset(i for i, name in enumerate(self.sig.names) if name in lowering.static)
        self._index_lists = frozenset(i for i, a in enumerate(args) if str(a.type) == "List[Optional[Tensor]]")
        # a factory (arange, eye, linspace, ...): its output is a new allocation
        self._factory = "device" in self.sig.names and self.n_inputs == self.sig.n
        self._device_pos = self.sig.names.index("device") if "device" in self.sig.names else None
        # a factory's dtype=None is the default dtype at the call (torch.set_default_dtype)
        self._default_dtype_pos = self.sig.names.index("dtype") if self._factory and "dtype" in self.sig.names else None
        self._call_check, self._signature_check = _ARGUMENT_CHECKS.get(op, (None, None))
        self._random, self._dynamic_shape = lowering.random, lowering.dynamic_shape  # read per call
        self._has_check = lowering.check is not None
        self._checked_numbers = checked_numbers(op, self.sig, kinds)

    def compute(self, vals):
        """The lowering's outputs (a tuple of jax arrays) for normalized argument values."""
        return self.compute_keyed(vals)[0]

    def compute_keyed(self, vals):
        """(outputs, the signature key they were computed under)."""
        if self._call_check is not None:
            self._call_check(vals)
        key = []
        dyn = []
        masked = []
        static_positions = self._static_positions
        multi = placement.multi
        on = None  # with several devices in use: the pjrt index of the op's tensors
        for i, k in self.plan:
            v = vals[i]
            if k == TENSOR:
                try:
                    st = v.untyped_storage()._pjrt
                except AttributeError:
                    self._odd_tensor_arg(v, key, dyn)
                    continue
                if multi:
                    on = _op_device(on, v)
                if _key_tensor(v, st, key, dyn):
                    masked.append((len(dyn) - 1, -1))
            elif k == SCALAR:
                if scalar_is_static(v, i, static_positions):
                    key.append(("s", type(v), v))  # True == 1 == 1.0: the type tells them apart
                else:
                    if isinstance(v, torch.Tensor):
                        v = v.item()
                    key.append(type(v))
                    dyn.append(v)
            elif k == TENSOR_LIST:
                parts = []
                arrays = []
                for t in v:
                    if t is None:
                        parts.append(None)
                        arrays.append(None)
                        continue
                    try:
                        t.untyped_storage()._pjrt  # a host tensor's storage has none
                    except AttributeError:
                        if t.device.type == "pjrt":
                            raise RuntimeError("torchpjrt: this pjrt tensor has no device data (internal error)")
                        if i in self._index_lists and t.dim() > 0:
                            # CPU index tensors are accepted for indexing, as on CUDA
                            parts.append((t.shape, t.dtype))
                            arrays.append(host_to_device(t))
                            continue
                        h = _host_scalar(t)
                        parts.append(("host", h.dtype))
                        arrays.append(h)
                        continue
                    if multi:
                        on = _op_device(on, t)
                    part = []  # a view in a list (rotate_half's cat of two halves) too
                    if _key_tensor(t, t.untyped_storage()._pjrt, part, arrays):
                        masked.append((len(dyn), len(arrays) - 1))
                    parts.append(tuple(part))
                key.append(tuple(parts))
                dyn.append(arrays)
            elif k == SCALAR_LIST and not self.lowering.static:
                # Adam's per-step bias corrections: traced, or every step would recompile
                numbers = _numbers(v)
                key.append(tuple(map(type, numbers)))
                dyn.append(pack_numbers(numbers))
            else:
                key.append(_freeze(v))
        if self._default_dtype_pos is not None and vals[self._default_dtype_pos] is None:
            key.append(torch.get_default_dtype())
        target = None  # a `device=` naming another device than the inputs'
        if self._device_pos is not None:
            # a factory runs on the device it names; a *_like op with device= moves its result
            target = _target_index(vals[self._device_pos]) if (multi or vals[self._device_pos] is not None) else None
            if target is not None and (on is None or target == on):
                on, target = target, None
        if on:
            key.append(("pjrt", on))
        if self._random:
            dyn.append(random_state.next_seed_offset(on or 0))
        checked = self._has_check and device_checks.enabled
        if checked:
            key.append("checked")
        key = tuple(key)
        fn = self.cache.get(key)
        if fn is None:
            live_programs.release_if_due()
            fn = self._build(vals, key)
            if masked:
                self.masked_of[key] = tuple(masked)
        stats["lowered"] += 1
        try:
            if not dyn and not on and not checked and not self._dynamic_shape and (
                    not fusion._recording or storage.is_shared((self.op, key))):
                # no inputs (arange, a factory): one value (fused mode records a new one as before)
                outs = storage.shared_result((self.op, key), fn)
                # the C++ kernel of such an op (hot_path.shares_result) hands the kept result out
                hot_path.stash.last_shared = outs[0] if len(outs) == 1 and storage.is_shared((self.op, key)) else None
            elif on:
                outs = self._run_on(on, fn, key, dyn, vals)
            elif self._dynamic_shape and self.lowering.has_dynamic_shape(vals):
                # data-dependent output shapes (nonzero, unique): the inputs must be known
                outs = fn(*fusion.concrete_tree(dyn))
            elif fusion._recording:
                outs = fusion.record_keyed(self.fused_avals, key, fn, dyn)
            else:
                outs = fn(*dyn)
            if target is not None:
                outs = placement.commit(fusion.concrete_tree(outs), target)
        except TypeError as e:
            raise self._dtype_error(e, vals) from e
        except jax.errors.JaxRuntimeError as e:
            raise fusion.device_error(e) from e
        if checked:
            # the program's last output is the check's vector: read at the next synchronization
            device_checks.record(outs[-1], self.lowering.check, self.op)
            outs = outs[:-1]
        if self._checked_numbers is not None and outs:
            _check_numbers(self._checked_numbers, vals, outs, self.op)
        return outs, key

    def _run_on(self, index, fn, key, dyn, vals):
        """The call on pjrt:`index` > 0 (kept off the one-device path above): the committed
        inputs pick the device; an op with none (a factory) runs under the device's default,
        and its results are committed there."""
        with placement.on(index):
            if self.lowering.dynamic_shape and self.lowering.has_dynamic_shape(vals):
                outs = fn(*fusion.concrete_tree(dyn))
            elif fusion._recording:
                outs = fusion.record_keyed(self.fused_avals, key, fn, dyn)
            else:
                outs = fn(*dyn)
        return placement.commit(outs, index)

    def strides_for(self, key):
        """The strides of each new result for signature `key` (None: row-major), or None."""
        return self.layouts.get(key) if self.layouts else None

    def _dtype_error(self, e, vals):
        """A JAX lowering refusing a dtype (jnp.invert of a float) as CPU says it:
        NotImplementedError("\"bitwise_not\" not implemented for 'Float'")."""
        if "does not accept dtype" not in str(e) and "not supported for dtype" not in str(e):
            return e
        dtype = next((v.dtype for v in vals if isinstance(v, torch.Tensor)), None)
        name = self.op._schema.name.split("::")[1]
        return NotImplementedError(f"\"{name}\" not implemented for '{_dtype_name(dtype)}' on the pjrt device ({e})")

    def _odd_tensor_arg(self, v, key, dyn):
        """A Tensor-typed argument that is None, a Python number, or a CPU scalar tensor."""
        if v is None:
            key.append(None)
        elif not isinstance(v, torch.Tensor):
            # a wrapped Python number (x + 2 arrives as add.Tensor(x, 2))
            if isinstance(v, bool) or v == 1:
                key.append(("s", type(v), v))  # x + 1 and x + 1.0 differ in result dtype
            else:
                key.append(("n", type(v)))
                dyn.append(v)
        elif v.device.type == "pjrt":
            raise RuntimeError("torchpjrt: this pjrt tensor has no device data (internal error)")
        else:
            if v.dim() != 0 and not self.op._schema.name.startswith("aten::_foreach_"):
                raise _device_error(v)  # only scalars (and foreach's CPU `scalars`) may be on the CPU
            h = np.asarray(dtypes.numpy_from_cpu_tensor(v))
            key.append(("host", h.shape, h.dtype))
            dyn.append(h)

    def _build(self, vals, key):
        storage.default_device()  # picks the platform (TORCHPJRT_PLATFORM) before compiling
        if not _native_views_on:
            update_view_kernels()  # the compiled helper may have finished building
        if self.checked_functional is not None:
            _check_inplace_cast(self.checked_functional, vals)
        if self._signature_check is not None:
            self._signature_check(vals)
        expected = meta_out = None
        try:
            meta_out = run_meta(self.op, self.sig, vals)
            expected = [dtypes.to_jax(_corrected_dtype(self.op, vals, m.dtype)) for m in _flatten_tensors(meta_out)]
            if self.n_inputs != self.sig.n:
                expected = None  # out= overloads: the outputs' dtypes are checked on write
        except _NoMeta:
            pass
        except RuntimeError:
            # data-dependent output shapes: PyTorch's meta kernel can refuse them
            if not self.lowering.has_dynamic_shape(vals):
                raise
        if self._factory and meta_out is not None:
            _check_allocation(meta_out)
        orders = None
        if self.lays_out and meta_out is not None and not _returns_list(self.op._schema):
            fix = _LAYOUT_FIXES.get(self.op)
            metas = _flatten_tensors(fix(vals, meta_out) if fix is not None else meta_out)
            orders = [storage.dense_order(m.shape, m.stride()) for m in metas]
            if any(orders):
                self.layouts[key] = [m.stride() if o is not None else None for m, o in zip(metas, orders)]
            else:
                orders = None
        fn = _compile(self.lowering, self.sig, vals[: self.n_inputs], self._static_positions, expected,
                      identity=None if self.lowering.user_code else (self.op.name(), self.op._overloadname, key),
                      orders=orders)
        self.cache[key] = fn
        stats["compiled"] += 1
        return fn


def _conv_layout(vals, meta_out):
    """CPU's convolutions give a channels_last result when the input or the weight is
    channels_last (PyTorch's meta kernel says row-major)."""
    x, w = vals[0], vals[1]
    for fmt in (torch.channels_last, torch.channels_last_3d):
        if meta_out.dim() == (4 if fmt is torch.channels_last else 5) and any(
                t.dim() == meta_out.dim() and not t.is_contiguous() and t.is_contiguous(memory_format=fmt)
                for t in (x, w)):
            return meta_out.contiguous(memory_format=fmt)
    return meta_out


_LAYOUT_FIXES = {aten.convolution.default: _conv_layout}


def _warn_byte_mask(vals):
    """CPU's deprecation warning for uint8 masks, at every call as CPU gives it."""
    for i in vals[1]:
        if i is not None and i.dtype == torch.uint8:
            warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead.",
                          UserWarning, stacklevel=5)
            return


def _check_advanced_index(vals):
    """CPU's host-side check of advanced indices, made before PyTorch's meta kernel (which raises
    a RuntimeError where the CPU raises an IndexError); once per signature: a signature that fails
    is never cached, so it fails every time."""
    indices = [i for i in vals[1] if i is not None]
    if any(i.dtype in (torch.bool, torch.uint8) for i in indices):
        return
    shapes = [tuple(i.shape) for i in indices]
    try:
        np.broadcast_shapes(*shapes)
    except ValueError:
        raise IndexError("shape mismatch: indexing tensors could not be broadcast together with shapes "
                         + ", ".join(str(list(s)) for s in shapes)) from None


# (check at every call, check when a signature is compiled) for ops whose CPU kernels check
# their arguments on the host
_ARGUMENT_CHECKS = dict.fromkeys(
    (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default),
    (_warn_byte_mask, _check_advanced_index))


# Number arguments CPU's kernels convert with overflow checks (dtypes.check_number_fits), by op
# name (its in-place, out= and foreach forms alike): name -> {argument: converted to the result's
# type (False) or to the type it computes in, float32 for float16/bfloat16 (True)}. Measured
# against CPU op by op with float16 1e6, int8 300, bfloat16 and float32 1e39, and int64 NaN.
CHECKED_NUMBERS = {
    "fill": {"value": False}, "masked_fill": {"value": False}, "index_fill": {"value": False},
    "scatter": {"value": False}, "clamp": {"min": False, "max": False}, "clamp_min": {"min": False},
    "clamp_max": {"max": False}, "add": {"alpha": False}, "sub": {"alpha": False}, "pow": {"exponent": False},
    "threshold": {"threshold": True, "value": False}, "hardtanh": {"min_val": False, "max_val": False},
    "hardshrink": {"lambd": False}, "addcmul": {"value": True}, "addcdiv": {"value": True},
    "lerp": {"weight": True}, "addmm": {"beta": True, "alpha": True}, "addmv": {"beta": True, "alpha": True},
    "addbmm": {"beta": True, "alpha": True}, "baddbmm": {"beta": True, "alpha": True},
    "addr": {"beta": True, "alpha": True}, "leaky_relu": {"negative_slope": True},
    "elu": {"alpha": True, "scale": True, "input_scale": True}, "softplus": {"beta": True, "threshold": True},
    "_foreach_add": {"alpha": False}, "_foreach_sub": {"alpha": False},
    "_foreach_addcmul": {"value": True, "scalars": True}, "_foreach_addcdiv": {"value": True, "scalars": True},
    "_foreach_lerp": {"weight": True}, "_foreach_clamp_min": {"scalar": False, "scalars": False},
    "_foreach_clamp_max": {"scalar": False, "scalars": False}, "_foreach_maximum": {"scalar": False, "scalars": False},
    "_foreach_minimum": {"scalar": False, "scalars": False},
}


def checked_numbers(op, sig, kinds):
    """((position, in the computing type), ...) of `op`'s number arguments CPU converts with
    overflow checks, or None."""
    table = CHECKED_NUMBERS.get(op._schema.name.removeprefix("aten::").rstrip("_"))
    if table is None:
        return None
    out = tuple((i, table[name]) for i, (name, kind) in enumerate(zip(sig.names, kinds))
                if name in table and kind in (SCALAR, SCALAR_LIST))
    return out or None


def _check_numbers(positions, vals, outs, op):
    """Raise as CPU does when a number argument does not fit the type it is converted to: each
    result's (a foreach op's may differ; CPU's one-element float16/bfloat16 fill_ converts
    unchecked)."""
    first = outs[0]
    if op in _UNCHECKED_SINGLE_FILLS and first.dtype in dtypes.LOW_PRECISION and math.prod(first.shape) == 1:
        return
    for dtype in {dtypes.to_torch(o.dtype) for o in outs}:
        for i, computing in positions:
            target = dtypes.opmath(dtype) if computing else dtype
            v = vals[i]
            for number in (v if isinstance(v, (list, tuple)) else (v,)):
                if number is not None and not isinstance(number, torch.Tensor):
                    dtypes.check_number_fits(number, target)


_UNCHECKED_SINGLE_FILLS = {aten.fill_.Scalar, aten.fill.Scalar}


def _check_inplace_cast(functional, vals):
    fsig = signature(functional)
    try:
        result = _flatten_tensors(run_meta(functional, fsig, vals[: fsig.n]))[0].dtype
    except Exception:  # noqa: BLE001 - the in-place op's own meta run reports invalid arguments
        return
    target = vals[0].dtype
    if result != target and not torch.can_cast(result, target):
        raise RuntimeError(f"result type {_dtype_name(result)} can't be cast to the desired output type "
                           f"{_dtype_name(target)}")


def _corrected_dtype(op, vals, dtype):
    """The result dtype where PyTorch's meta kernel disagrees with its CPU kernel."""
    if op is aten.pow.Tensor_Scalar and vals[0].dtype == torch.bool and isinstance(vals[1], bool):
        return torch.bool  # torch._refs.pow promotes bool to long; CPU keeps bool ** bool bool
    return dtype


def _kinds(sig, lowering):
    """The schema's argument kinds, with the `float` arguments the lowering asks traced
    (`traced=`: an optimizer's learning rate) as scalars."""
    if not lowering.traced:
        return sig.kinds
    return [SCALAR if name in lowering.traced else k for name, k in zip(sig.names, sig.kinds)]


_FLOAT64 = np.dtype(np.float64)


def _numbers(v):
    """A list of numbers argument's values, a 0-dim tensor among them read as its number."""
    return [x.item() if isinstance(x, torch.Tensor) else x for x in v]


def _packs(numbers) -> bool:
    """Whether pack_numbers packs this list: Python floats only (weak float64 once unpacked)."""
    return bool(numbers) and all(type(x) is float for x in numbers)


def pack_numbers(numbers):
    """A traced list of numbers as a program receives it: Python floats (an optimizer's
    per-parameter step sizes) packed into one float64 array, one host-to-device transfer where
    each separate number costs its own (`_foreach_addcdiv_` over 21 tensors: 440-480 us against
    340-390 here); other lists as they are. The program unpacks them (fusion.unpacked_numbers).
    The hot path packs alike (csrc/hot_ops.cpp, 'f' codes)."""
    return np.array(numbers, _FLOAT64) if _packs(numbers) else numbers


def device_number(x):
    """A traced number as a device scalar, weakly typed as jit makes a Python number: the hot path
    keeps one per value (csrc/hot_ops.cpp device_number), where each number cost the call its
    own host-to-device transfer."""
    return jax.device_put(x, storage.default_device())


def scalar_is_static(v, i, static_positions):
    """Scalars are traced (a new learning rate must not recompile) except None, bools, the
    common value 1 (alpha=1), and those a lowering asks to see as Python values."""
    return v is None or isinstance(v, bool) or (type(v) is int and v == 1) or i in static_positions


def _host_scalar(t):
    if t.dim() != 0:
        raise _device_error(t)
    return np.asarray(dtypes.numpy_from_cpu_tensor(t))


def _freeze(v):
    """A hashable key for a static argument. True == 1 == 1.0 in a dict key, and the kernel for
    each differs: plain ints stay as they are, other numbers carry their type."""
    t = type(v)
    if t is int:
        return v
    if t is list or t is tuple:
        return tuple([x if type(x) is int else _freeze(x) for x in v])
    if isinstance(v, torch.Tensor):
        raise TypeError("tensor in a static position")
    if isinstance(v, (bool, int, float)):
        return t, v
    return v


def _compile(lowering, sig, vals, static_positions, expected, identity=None, orders=None):
    """A jitted function of the dynamic arguments (tensors, traced scalars); with `identity`
    (what fixes its program: the op and its kernel key), one whose executable is kept on disk.
    `orders` (per new result: a dim order, or None) lays results out in memory order for the
    strides PyTorch gives them (storage.wrap_in_order), in the same program."""
    kinds = _kinds(sig, lowering)
    template = list(vals)
    dynamic = []
    view_readers = {}
    list_readers = {}  # per list argument: per element, its view's reader or None
    packed_lists = {}  # per list of numbers passed packed (pack_numbers): its length
    for i, v in enumerate(vals):
        k = kinds[i]
        if k == TENSOR:
            if isinstance(v, torch.Tensor):
                dynamic.append(i)
                reader = masked_reader(v, _view_reader(v))
                if reader is not None:
                    view_readers[i] = reader
            elif v is not None and not (isinstance(v, bool) or v == 1):
                dynamic.append(i)
            else:
                template[i] = v
        elif k == TENSOR_LIST:
            dynamic.append(i)
            readers = [masked_reader(t, _view_reader(t)) if isinstance(t, torch.Tensor) else None for t in v]
            if any(r is not None for r in readers):
                list_readers[i] = readers
        elif k == SCALAR_LIST and not lowering.static:
            dynamic.append(i)
            numbers = _numbers(v)
            if _packs(numbers):
                packed_lists[i] = len(numbers)
        elif k == SCALAR:
            if not scalar_is_static(v, i, static_positions):
                dynamic.append(i)
            elif isinstance(v, torch.Tensor):
                template[i] = v.item()
        else:
            template[i] = v
    for i in dynamic:
        template[i] = None
    fn = lowering.fn
    random = lowering.random
    check = lowering.check if device_checks.enabled else None
    n_dyn = len(dynamic)

    def run(*dyn):
        full = list(template)
        for pos, v in zip(dynamic, dyn[:n_dyn]):
            full[pos] = v
        for pos, n in packed_lists.items():
            full[pos] = fusion.unpacked_numbers(full[pos], n)
        for pos, reader in view_readers.items():
            full[pos] = reader(full[pos])
        for pos, readers in list_readers.items():
            full[pos] = [x if r is None else r(x) for r, x in zip(readers, full[pos])]
        if random:
            full.append(random_state.key_from_seed_offset(dyn[n_dyn]))
        out = fn(*full)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if expected is not None and len(expected) <= len(outs):
            # the regular outputs come first; a mutating lowering's new argument values follow
            # (they are cast by the write into the argument)
            outs = tuple(
                o.astype(d) if hasattr(o, "dtype") and o.dtype != d else o for o, d in zip(outs, expected)
            ) + outs[len(expected):]
        if orders is not None:
            outs = _laid_out(outs, orders)
        if check is not None:
            outs += (check.find(*full),)
        return outs

    if lowering.has_dynamic_shape(vals):
        return run
    # named after its lowering: XLA's program names, compile logs and profiles then say which op
    run.__name__ = run.__qualname__ = getattr(fn, "__name__", "run")
    return kernel_cache.kept(jax.jit(run), identity)


def _key_tensor(v, st, key, dyn) -> bool:
    """Keys pjrt tensor `v` (of storage `st`) into `key` and its value into `dyn`: the array of a
    whole storage; for a view the storage's array, the view's strided read compiled into the op
    (_view_reader: no separate dispatch), its offset an argument where it can be
    (storage.runtime_offset); a padded view's mark (_key_beyond). True for a view read masked."""
    shape, dtype = v.shape, v.dtype
    key.append(shape)
    key.append(dtype)
    if shape == st.shape and dtype is st.dtype and v.storage_offset() == 0 and v.is_contiguous():
        dyn.append(st.array if st.array is not None else st.value())
    elif storage.is_reshaped_whole(v, st):
        key.append(("reshaped", st.shape))
        dyn.append(st.array if st.array is not None else st.value())
    else:
        offset = storage.runtime_offset(st, v)
        if offset is None:
            key.append((st.shape, st.dtype, v.stride(), v.storage_offset()))
            dyn.append(st.value())
        else:
            key.append((st.shape, st.dtype, v.stride()))
            dyn.append((st.value(), offset))
    return st.padding is not None and _key_beyond(v, key, dyn)


def _key_beyond(t, key, dyn) -> bool:
    """A view of a padded storage that padding.py's rule marked (padding._masked): its positions
    from n on are read as a fill value, in the op's program; n, which changes with the data, is
    an argument next to the view's array."""
    beyond = getattr(t, padding.BEYOND, None)
    if beyond is not None:
        dim, n, fill = beyond
        key.append(("beyond", dim, repr(fill)))  # repr: -0.0 and 0 differ
        dyn[-1] = (dyn[-1], n)
        return True
    return False


def masked_reader(t, reader):
    """`reader` (a view's, or None) for an argument padding.py marked, followed by the fill of its
    positions from n on (as compute_keyed passes it: (array or view argument, n))."""
    beyond = getattr(t, padding.BEYOND, None) if t.device.type == "pjrt" else None
    if beyond is None:
        return reader
    dim, _, fill = beyond

    def read(arg):
        x, n = arg
        return padding.fill_beyond(x if reader is None else reader(x), n, dim, fill)

    return read


def _laid_out(outs, orders):
    """The results transposed into their memory orders: one order per result that is an array
    (a result left out, None, takes none: as _wrap_outputs hands out strides), the rest as they are."""
    pending = iter(orders)
    laid = []
    for o in outs:
        order = next(pending, None) if hasattr(o, "shape") else None
        laid.append(o if order is None else jnp.transpose(o, order))
    return tuple(laid)


def takes_offset(t, st) -> bool:
    """Whether view `t` of storage `st` reaches its op's program as (array, offset), as _key_tensor
    passes it and _view_reader reads it: not all of its storage (in its own shape or another),
    and an offset the program can take as an argument. (The compiled helper learns it so.)"""
    return not storage.is_identity(t, st) and not storage.is_reshaped_whole(t, st) \
        and storage.runtime_offset(st, t) is not None


def _view_reader(t):
    """For a pjrt view argument: the function reading it from its storage's array."""
    if t.device.type != "pjrt":
        return None
    st = t.untyped_storage()._pjrt
    if storage.is_identity(t, st):
        return None
    if storage.is_reshaped_whole(t, st):
        shape = tuple(t.shape)
        return lambda base: base.reshape(shape)
    read = storage.view_read_fn(st.shape, tuple(t.shape), t.stride(), dtypes.to_jax(t.dtype))
    if takes_offset(t, st):
        return lambda base_and_offset: read(*base_and_offset)  # as compute_keyed passes it
    offset = t.storage_offset()
    return lambda base: read(base, offset)


def _returns_list(schema):
    return len(schema.returns) == 1 and str(schema.returns[0].type) == "List[Tensor]"


def _wrap_outputs(schema, outs, vals, sig, mutated_written=(), strides=None):
    """Tensors for the schema's returns: new tensors (laid out with `strides`, one entry per
    new tensor, where given), or the written arguments they alias."""
    rets = schema.returns
    if not rets:
        return None
    if _returns_list(schema):
        return [storage.wrap(o) for o in outs[0]] if isinstance(outs[0], (list, tuple)) else [
            storage.wrap(o) for o in outs
        ]
    results = []
    it = iter(outs)
    laid_out = iter(strides) if strides is not None else None
    for r in rets:
        ai = r.alias_info
        if ai is not None and ai.is_write:
            # returns an argument it wrote (in-place / out=): find that argument
            for i, a in enumerate(sig.schema.arguments):
                if a.alias_info is not None and a.alias_info.before_set == ai.before_set:
                    results.append(vals[i])
                    break
        else:
            o = next(it)
            stride = next(laid_out, None) if laid_out is not None and hasattr(o, "shape") else None
            if stride is not None:
                results.append(storage.wrap_in_order(o, stride))
            else:
                results.append(storage.wrap(o) if hasattr(o, "shape") else o)
    if len(results) == 1:
        return results[0]
    return tuple(results)


def make_functional_kernel(op, lowering):
    # results that alias written arguments keep those arguments' geometry
    k = LoweredKernel(op, lowering, lays_out=not any(r.alias_info is not None and r.alias_info.is_write
                                                     for r in op._schema.returns))
    sig = k.sig
    schema = op._schema
    mutates = [sig.names.index(m) for m in lowering.mutates]
    n_rets = len([r for r in schema.returns if not (r.alias_info and r.alias_info.is_write)])

    if not mutates:
        single = len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
        if single:

            def kernel(*args, **kwargs):
                vals = sig.values(args, kwargs)
                outs, key = k.compute_keyed(vals)
                hot_path.stash.last_call = (k, key)  # the hot kernel may replay it
                strides = k.strides_for(key)
                if strides is None:
                    return storage.wrap(outs[0])
                return storage.wrap_in_order(outs[0], strides[0])

            kernel.reads_beyond = True  # every tensor argument goes through compute_keyed
            return kernel

        def kernel(*args, **kwargs):
            vals = sig.values(args, kwargs)
            outs, key = k.compute_keyed(vals)
            hot_path.stash.last_call = (k, key)  # the hot kernel may replay it (if its results are plain)
            return _wrap_outputs(schema, outs, vals, sig, strides=k.strides_for(key))

        kernel.reads_beyond = True
        return kernel

    allow_overlap = op in _OVERLAPPING_WRITES_ALLOWED

    def mutating_kernel(*args, **kwargs):
        vals = sig.values(args, kwargs)
        outs, key = k.compute_keyed(vals)
        regular, new_values = outs[:n_rets], outs[n_rets:]
        for pos, new in zip(mutates, new_values):
            target = vals[pos]
            if isinstance(target, (list, tuple)):
                for t, nv in zip(target, new):
                    if t is not None:
                        storage.write(t, nv)
            elif target is not None:
                storage.write(target, new, allow_overlap=allow_overlap)
        if k.hot_writes:  # the hot kernel may replay it when each write was plain (batch norm's statistics)
            hot_path.stash.last_call = (k, key, new_values, [vals[pos] for pos in mutates])
        return _wrap_outputs(schema, regular, vals, sig, strides=k.strides_for(key))

    mutating_kernel.reads_beyond = True
    mutating_kernel.lowered = k
    return mutating_kernel


def _targets_overlap(targets) -> bool:
    """Whether tensors an in-place foreach op writes may share elements (the same tensor twice,
    views of one storage whose spans meet)."""
    spans = []
    for t in targets:
        if t is not None and t.numel():
            start = t.data_ptr()  # storages have addresses of their own (storage.give_address)
            last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
            spans.append((start, start + (last + 1) * t.element_size()))
    spans.sort()
    return any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))


def _foreach_in_turn(k, sig, vals, returns_self):
    """An in-place foreach op whose targets overlap, one tensor at a time as CPU runs it: a
    later tensor sees what an earlier one wrote (one program over all would read them all first)."""
    targets = vals[0]
    for j, target in enumerate(targets):
        one = [v[j:j + 1] if kind in (TENSOR_LIST, SCALAR_LIST) or (kind == TENSOR and name == "scalars") else v
               for v, kind, name in zip(vals, sig.kinds, sig.names)]
        outs, _ = k.compute_keyed(one)
        if target is not None:
            storage.write(target, outs[0])
    return targets if returns_self else None


def make_inplace_kernel(op, functional, lowering):
    """`x.add_(y)`: compute add(x, y), write it into x (PyTorch's checks come from meta)."""
    k = LoweredKernel(op, lowering, inplace_of=functional)
    sig = k.sig
    returns_self = bool(op._schema.returns)
    if sig.kinds[0] == TENSOR_LIST:
        # _foreach_add_(tensors, ...): one result per tensor, and nothing returned

        def list_kernel(*args, **kwargs):
            vals = sig.values(args, kwargs)
            if _targets_overlap(vals[0]):
                return _foreach_in_turn(k, sig, vals, returns_self)
            outs, key = k.compute_keyed(vals)
            for t, o in zip(vals[0], outs):
                storage.write(t, o)
            hot_path.stash.last_call = (k, key, outs, vals[0])  # the hot kernel may replay plain writes
            return vals[0] if returns_self else None

        return list_kernel

    allow_overlap = op in _OVERLAPPING_WRITES_ALLOWED
    constant_fill = op in CONSTANT_FILLS

    def kernel(*args, **kwargs):
        vals = sig.values(args, kwargs)
        if constant_fill and _fill_whole(k, vals):
            return vals[0]
        outs, key = k.compute_keyed(vals)
        out = outs[0]
        self = vals[0]
        if tuple(out.shape) != tuple(self.shape):
            _check_inplace_broadcast(tuple(out.shape), tuple(self.shape))
        storage.write(self, out, allow_overlap=allow_overlap)
        hot_path.stash.last_call = (k, key, outs, (self,))  # the hot kernel may replay it if the write was plain
        return self

    kernel.reads_beyond = True
    return kernel


# zero_() and fill_(number) of a whole storage: its new array depends on nothing but the shape,
# the dtype and the number, so small ones are shared results (storage.shared_result) and run no
# program after the first (torch.zeros, ones_like, full: empty + fill_; autograd's seed gradient)
CONSTANT_FILLS = {aten.zero_.default, aten.fill_.Scalar}


def _fill_whole(k, vals) -> bool:
    """Fill the whole storage of `vals[0]` from a shared result; False when it is not a whole
    storage (a view, several devices) or the fill is too large. A padded storage's rule hands
    its whole storage here (padding._pointwise_inplace): it keeps its padding."""
    self = vals[0]
    st = getattr(self.untyped_storage(), "_pjrt", None)
    if st is None or placement.multi or storage.mesh_placements \
            or not storage.is_identity(self, st) or st.numel * self.dtype.itemsize > storage.SHARED_BYTES:
        return False
    if len(vals) == 1:
        array = storage.zeros(st.shape, dtypes.to_jax(self.dtype))
    else:
        value = vals[1]
        if type(value) not in (bool, int, float):
            return False
        array = storage.filled(st.shape, dtypes.to_jax(self.dtype), value)
        _check_numbers(k._checked_numbers, vals, (array,), k.op)
    st.replace(array)
    hot_path.stash.last_fill = array  # the C++ kernel gives it to the next such fill
    return True


def _check_inplace_broadcast(result_shape, self_shape):
    """An in-place op cannot grow its target: `small.remainder_(large)` raises as on CPU."""
    try:
        if np.broadcast_shapes(result_shape, self_shape) == self_shape:
            return
    except ValueError:
        pass
    raise RuntimeError(f"output with shape {list(self_shape)} doesn't match the broadcast shape {list(result_shape)}")


# CPU's fill_ and index_put_ write into tensors whose elements overlap (an expanded tensor);
# other in-place ops raise
_OVERLAPPING_WRITES_ALLOWED = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.index_put_.default,
                               aten._index_put_impl_.default}


def make_out_kernel(op, functional, lowering):
    """`torch.add(x, y, out=z)`: compute add(x, y), resize z as PyTorch does, write it."""
    fsig = signature(functional)
    k = LoweredKernel(op, lowering, n_inputs=fsig.n)
    sig = k.sig
    out_positions = [i for i in range(sig.n) if sig.written[i]]
    schema = op._schema

    if len(out_positions) == 1 and sig.kinds[out_positions[0]] == TENSOR_LIST:
        # _foreach_add.List_out(..., out=[...]): one result per output tensor, returns nothing

        def list_kernel(*args, **kwargs):
            vals = sig.values(args, kwargs)
            outs = k.compute(vals)
            for t, value in zip(vals[out_positions[0]], outs):
                write_out(t, value)
            return None if not schema.returns else vals[out_positions[0]]

        return list_kernel

    check_dtype = _OUT_DTYPE_CHECKS.get(schema.name.split("::")[1])

    def kernel(*args, **kwargs):
        vals = sig.values(args, kwargs)
        outs = k.compute(vals)
        if check_dtype is not None:
            for pos, value in zip(out_positions, outs):
                check_dtype(schema.name.split("::")[1], dtypes.to_torch(value.dtype), vals[pos].dtype)
        for pos, value in zip(out_positions, outs):
            write_out(vals[pos], value)
        if len(out_positions) == 1:
            return vals[out_positions[0]]
        return tuple(vals[p] for p in out_positions)

    return kernel


def _exact_out_dtype(name, result, out):
    if out != result:
        raise RuntimeError(f"Expected out tensor to have dtype {_dtype_name(result)}, but got {_dtype_name(out)} "
                           f"instead ({name})")


def _bool_out_dtype(name, result, out):
    if out not in (torch.bool, torch.uint8):
        raise RuntimeError(f"{name} only supports bool tensor for result, got: {_dtype_name(out)}")


def _long_out_dtype(name, result, out):
    if out != torch.int64:
        raise RuntimeError(f"{name}: Expected out tensor to have scalar type Long but got scalar type{_dtype_name(out)}")


# out= overloads whose CPU kernels require the out tensor's dtype (others cast the result
# into it when torch.can_cast allows, checked by write_out)
_OUT_DTYPE_CHECKS = {
    "nonzero": _long_out_dtype,
    **dict.fromkeys(("neg", "bitwise_not", "isnan", "isinf", "conj_physical", "round", "nan_to_num", "zero",
                     "clone", "sum", "prod", "amax", "amin", "index_select"), _exact_out_dtype),
    "all": _bool_out_dtype,
    "any": _bool_out_dtype,
}


def write_out(target, value):
    """Write a result into an `out=` tensor, resizing it the way PyTorch does."""
    if target.device.type != "pjrt":
        raise _device_error(target)
    if placement.multi:
        computed_on = placement.index_of(value)
        if computed_on != target.get_device():
            raise _device_error(target, f"pjrt:{computed_on}")
    if tuple(target.shape) != tuple(value.shape):
        if target.numel() != 0:
            warnings.warn(
                f"An output with one or more elements was resized since it had shape "
                f"{list(target.shape)}, which does not match the required output shape "
                f"{list(value.shape)}. This behavior is deprecated, and in a future PyTorch "
                "release outputs will not be resized unless they have zero elements. You can "
                "explicitly reuse an out tensor t by resizing it, inplace, to zero elements "
                "with t.resize_(0).",
                UserWarning,
                stacklevel=4,
            )
        storage.resize(target, value.shape)
    dt = dtypes.to_torch(value.dtype)
    if dt != target.dtype and not torch.can_cast(dt, target.dtype):
        raise RuntimeError(f"result type {_dtype_name(dt)} can't be cast to the desired output type {_dtype_name(target.dtype)}")
    storage.write(target, value)


def _dtype_name(dt):
    """c10's name for a dtype, as PyTorch's messages print it (Float, Long, ...)."""
    return {torch.float32: "Float", torch.float64: "Double", torch.int64: "Long", torch.int32: "Int",
            torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
            torch.float16: "Half", torch.bfloat16: "BFloat16", torch.complex64: "ComplexFloat",
            torch.complex128: "ComplexDouble"}.get(dt, str(dt).removeprefix("torch."))


# ---- views --------------------------------------------------------------------------------


def _is_view_op(op) -> bool:
    schema = op._schema
    if not schema.returns:
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def make_view_kernel(op):
    """A view op's kernel: the geometry PyTorch's meta kernel gives, kept per input geometry and
    arguments, applied to the same storage (no device work)."""
    plans = {}

    def view_kernel(*args, **kwargs):
        self = args[0]
        try:
            key = (self.shape, self.stride(), self.storage_offset(), self.dtype, _freeze(args[1:]),
                   tuple(sorted((k, _freeze(v)) for k, v in kwargs.items())) if kwargs else ())
            plan = plans.get(key)
        except TypeError:
            key = plan = None
        if plan is None:
            plan = _view_plan(op, args, kwargs)
            if key is not None:
                plans[key] = plan
        is_list, geoms = plan
        stats["view"] += 1
        if op is aten.as_strided.default:
            _check_in_storage(self, *geoms[0])
        if is_list:
            return [storage.alias(self, *g) for g in geoms]
        return storage.alias(self, *geoms[0])

    return view_kernel


def _check_in_storage(base, size, stride, offset, dtype):
    """CPU's check that an as_strided view stays inside its storage (the meta kernel that made the
    plan only sees the input view's extent)."""
    itemsize = dtype.itemsize
    need = itemsize * (offset + storage.span(size, stride)) if all(size) else 0
    have = base.untyped_storage().nbytes()
    if need > have:
        raise RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and "
                           f"itemsize {itemsize} requiring a storage size of {need} are out of bounds for storage of "
                           f"size {have}")


def _view_plan(op, args, kwargs):
    margs = [_to_meta(a) for a in args]
    mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    try:
        with torch.no_grad():
            res = op(*margs, **mkwargs)
    except (AssertionError, ValueError) as e:
        raise as_cpu_error(op, e) from None
    is_list = isinstance(res, (list, tuple))
    return is_list, [(tuple(r.shape), r.stride(), r.storage_offset(), r.dtype) for r in (res if is_list else [res])]


def inplace_view_kernel(op, args, kwargs):
    self = args[0]
    m = meta_like(self)
    try:
        with torch.no_grad():
            op(m, *[_to_meta(a) for a in args[1:]], **{k: _to_meta(v) for k, v in kwargs.items()})
    except (RuntimeError, AssertionError, ValueError) as e:
        raise as_cpu_error(op, e) from None
    storage.set_geometry(self, tuple(m.shape), m.stride(), m.storage_offset())
    return self


# ---- native view kernels -----------------------------------------------------------------
# Composite kernels reduce t(), transpose, slicing, expand, detach, ... to as_strided, view and
# _reshape_alias. The compiled helper (csrc/views.cpp) registers CPU's kernels for those three:
# the geometry and errors of the Python view kernel above without a trip into Python. Debug
# mode keeps the Python kernels (it logs and times every op), as does a process without the
# helper. The first process on a machine runs with them until the helper's build is done.

_NATIVE_VIEW_OPS = frozenset({aten.as_strided.default, aten.view.default, aten._reshape_alias.default})
_native_views_on = False
native_views_wanted = True  # False: the Python kernels even with the helper loaded (tests compare both)
_python_views = None  # the Library with the Python kernels of _NATIVE_VIEW_OPS, while those are used


def native_views_enabled() -> bool:
    return _native_views_on


def update_view_kernels() -> None:
    """Register the native view kernels when the helper is loaded and debug mode is off, the
    Python ones otherwise. Called outside any view op's call (a kernel is never replaced while
    it runs)."""
    global _native_views_on, _python_views
    if not _libs:
        return  # before register(): it calls this at its end
    with _register_lock:
        lib = native.start()  # also started for its device guard (placement) in debug mode
        wanted = native_views_wanted and not eager.debug_enabled and storage.storage_words_known()
        if lib is not None and wanted:
            if not _native_views_on:
                if _python_views is not None:
                    _python_views._destroy()
                    _python_views = None
                lib.torchpjrt_native_views(1)
                _native_views_on = True
            return
        if _native_views_on:
            native.library().torchpjrt_native_views(0)
            _native_views_on = False
        if _python_views is None:
            views = torch.library.Library("aten", "IMPL")
            for op in _NATIVE_VIEW_OPS:
                views.impl(_qualname(op), _instrumented(op, make_view_kernel(op)), "PrivateUse1")
            _python_views = views


# ---- the fallback for everything not registered directly ------------------------------


def _functional_of(op):
    """The functional overload an in-place or out= overload computes, or None."""
    schema = op._schema
    name = schema.name.split("::")[1]
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not written:
        return None
    packet_name = name
    if name.endswith("_") and not schema.arguments[0].kwarg_only and written[0] is schema.arguments[0]:
        packet_name = name[:-1]
        keep = [a.name for a in schema.arguments]
    elif all(a.kwarg_only for a in written):
        keep = [a.name for a in schema.arguments if not (a.alias_info is not None and a.alias_info.is_write)]
    else:
        return None
    packet = getattr(aten, packet_name, None)
    if packet is None:
        return None
    overloads = packet.overloads()
    if op._overloadname in overloads:  # _foreach_mul_.Tensor -> _foreach_mul.Tensor, not .List
        overloads = [op._overloadname] + [o for o in overloads if o != op._overloadname]
    for ov in overloads:
        cand = getattr(packet, ov)
        cs = cand._schema
        if cand is op or any(a.alias_info is not None and a.alias_info.is_write for a in cs.arguments):
            continue
        if [a.name for a in cs.arguments] == keep:
            return cand
    return None


def _in_progress():
    s = getattr(_tls, "active", None)
    if s is None:
        s = _tls.active = set()
    return s


def fallback(keyset, op, *args, **kwargs):
    handler = _handlers.get(op)
    if handler is None:
        handler = _handlers[op] = _classify(op)
        if isinstance(handler, _direct):
            _register_direct(op, handler.kernel)
    if eager.debug_enabled:
        return eager.run_debug(op, lambda *a, **k: handler(op, a, k), args, kwargs)
    return handler(op, args, kwargs)


def _classify(op):
    if op in TABLE and TABLE[op].eager:
        return _direct(make_functional_kernel(op, TABLE[op]))
    if torch.Tag.inplace_view in op.tags:
        return inplace_view_kernel
    if _is_view_op(op) or op in (aten._unsafe_view.default, aten.lift_fresh.default):
        return _direct(make_view_kernel(op))
    functional = _functional_of(op)
    if functional is not None and functional in TABLE and TABLE[functional].eager:
        return _direct(derived_kernel(op, functional))
    return _slow_path


def derived_kernel(op, functional):
    first = op._schema.arguments[0]
    if first.alias_info is not None and first.alias_info.is_write and not first.kwarg_only:
        return make_inplace_kernel(op, functional, TABLE[functional])
    return make_out_kernel(op, functional, TABLE[functional])


class _direct:
    """A handler that calls a kernel of the op's own (registered for the op once found)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, op, args, kwargs):
        return self.kernel(*args, **kwargs)


_registered_late = set()
_register_lock = threading.Lock()


def _register_direct(op, kernel):
    """Register the kernel the fallback found for `op` as the op's PrivateUse1 kernel, so that
    later calls skip the boxed fallback (op lookups hash the OpOverload in Python). An op that
    reaches the fallback has no composite kernel that a backend kernel would shadow."""
    with _register_lock:
        if op in _registered_late or not _libs or op.namespace != "aten" or op in _NATIVE_VIEW_OPS:
            return
        _registered_late.add(op)
        _libs[0].impl(_qualname(op), _instrumented(op, kernel), "PrivateUse1")


def _slow_path(op, args, kwargs):
    """Ops with no lowering: a decomposition, else write-through of a functional op, else
    the opt-in CPU fallback, else a clear error."""
    active = _in_progress()
    if op in active:
        return _unsupported(op, args, kwargs)
    active.add(op)
    try:
        decomp = _decomposition(op)
        if decomp is not None:
            result = decomp(*args, **kwargs)
            if result is not NotImplemented:  # some decompositions decline some inputs
                stats["decomposed"] += 1
                decomposed_counts[str(op)] += 1
                return result
        functional = _functional_of(op)
        if functional is not None and functional not in active:
            return _via_functional(op, functional, args, kwargs)
        return _unsupported(op, args, kwargs)
    finally:
        active.discard(op)


def _decomposition(op):
    from torch._decomp import decomposition_table

    from .transformer_fast_path import DECOMPOSITIONS

    return DECOMPOSITIONS.get(op) or decomposition_table.get(op)


def _via_functional(op, functional, args, kwargs):
    """In-place / out= of an op without a lowering: run the functional op, write back."""
    sig = signature(op)
    vals = sig.values(args, kwargs)
    fsig = signature(functional)
    if sig.names[: fsig.n] == fsig.names:
        fvals = vals[: fsig.n]
    else:
        fvals = [vals[sig.names.index(n)] for n in fsig.names]
    fargs, fkwargs = fsig.split(fvals)
    with torch._C._AutoDispatchBelowAutograd():
        result = functional(*fargs, **fkwargs)
    results = _flatten_tensors(result)
    targets = [vals[i] for i in range(sig.n) if sig.written[i]]
    stats["via_functional"] += 1
    if targets and targets[0] is vals[0] and not sig.kwarg_only[0]:
        for t, r in zip(targets, results):
            if t.shape != r.shape:  # an in-place op never resizes its target
                _check_inplace_broadcast(tuple(r.shape), tuple(t.shape))
            storage.write(t, storage.value_of(r))
        return vals[0]
    for t, r in zip(targets, results):
        write_out(t, storage.value_of(r))
    return targets[0] if len(targets) == 1 else tuple(targets)


# layouts and tensor kinds pjrt cannot hold: the ops that make them say so by name
_UNSUPPORTED_KINDS = (
    (("quantize_per", "dequantize", "_make_per_", "fake_quantize", "int_repr", "q_"),
     "quantized tensors are not supported on the pjrt device (quantize on the CPU, or keep "
     "integer codes and scales as plain tensors)"),
    (("_to_sparse", "to_sparse", "sparse_", "_sparse", "_coalesce", "_to_dense", "to_dense"),
     "sparse layouts (COO, CSR, CSC, BSR, BSC) are not supported on the pjrt device: only the strided layout is"),
)


def _quantized_unsupported(keyset, op, *args, **kwargs):
    raise NotImplementedError(f"torchpjrt: {_UNSUPPORTED_KINDS[0][1]} ('{op._schema.name}.{op._overloadname}')")


def _sparse_unsupported(keyset, op, *args, **kwargs):
    raise NotImplementedError(f"torchpjrt: {_UNSUPPORTED_KINDS[1][1]} ('{op._schema.name}.{op._overloadname}')")


def _unsupported(op, args, kwargs):
    if cpu_fallback_enabled():
        return cpu_fallback(op, args, kwargs)
    name = op._schema.name.split("::")[1]
    for prefixes, why in _UNSUPPORTED_KINDS:
        if name.startswith(prefixes):
            raise NotImplementedError(f"torchpjrt: {why} ('{op._schema.name}.{op._overloadname}')")
    raise NotImplementedError(
        f"torchpjrt: the aten operator '{op._schema.name}.{op._overloadname}' "
        f"({op._schema}) has no lowering for the pjrt device. Set TORCHPJRT_CPU_FALLBACK=1 to run "
        "unsupported operators on the CPU (slow; counted and warned once per operator)."
    )


# ---- opt-in CPU fallback -------------------------------------------------------------------


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    host = _view_from_host_copy(t)
    if host is not None:
        device_checks.raise_pending()
        return host
    arr = fusion.concrete(storage.read(t))
    if not getattr(arr, "is_fully_addressable", True):
        # sharded over several processes' devices (spmd): every process gathers the whole value
        from jax.experimental import multihost_utils

        arr = multihost_utils.process_allgather(arr, tiled=True)
    try:
        arr = np.asarray(arr)
    except jax.errors.JaxRuntimeError as e:  # an asynchronous failure (out of memory) shows here
        raise fusion.device_error(e) from e
    device_checks.raise_pending()
    return dtypes.cpu_tensor_from_numpy(arr, t.dtype).reshape(t.shape)


VIEW_FROM_HOST_BYTES = 64 * 1024  # a view's storage copied whole to read it, up to this or 4x the view


def _view_from_host_copy(t: torch.Tensor):
    """A view of a small storage (`x[0]`, `x.t()`, `x.diagonal()` printed or copied to the CPU),
    taken from a host copy of its whole storage: reading it on the device would compile a
    strided-read program for each geometry (tens of milliseconds the first time, in code whose
    views keep changing). None for a whole storage, a larger one, a view with another dtype than
    its storage's, or a geometry that reaches past it (the device path raises CPU's errors)."""
    st = getattr(t.untyped_storage(), "_pjrt", None)
    if st is None or st.raw or t.dtype is not st.dtype or storage.is_identity(t, st) or t.numel() == 0:
        return None
    numel = st.numel
    if numel * t.element_size() > max(VIEW_FROM_HOST_BYTES, 4 * t.numel() * t.element_size()):
        return None
    offset = t.storage_offset()
    last = offset + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    if offset < 0 or last >= numel or any(stride < 0 for stride in t.stride()):
        return None
    arr = fusion.concrete(st.value())
    if not getattr(arr, "is_fully_addressable", True):
        return None
    try:
        flat = np.asarray(arr).reshape(-1)
    except jax.errors.JaxRuntimeError as e:  # an asynchronous failure (out of memory) shows here
        raise fusion.device_error(e) from e
    view = np.lib.stride_tricks.as_strided(flat[offset:], t.shape, [s * flat.itemsize for s in t.stride()],
                                           writeable=False)
    return dtypes.cpu_tensor_from_numpy(view, t.dtype).reshape(t.shape)  # (numpy makes a 0-d view 1-d)


def to_pjrt(t: torch.Tensor) -> torch.Tensor:
    _default_device()  # sets jax_default_device to the chosen platform's first device
    # uncommitted: jit may move it next to arrays sharded over a mesh (distributed.spmd)
    arr = jax.device_put(dtypes.numpy_from_cpu_tensor(t.contiguous()))
    return storage.wrap(arr, t.dtype)


def _default_device():
    from .device import jax_device

    return jax_device(0)


def cpu_fallback(op, args, kwargs):
    name = f"{op._schema.name}.{op._overloadname}"
    cpu_fallback_counts[name] += 1
    stats["cpu_fallback"] += 1
    if name not in _warned_fallback:
        _warned_fallback.add(name)
        warnings.warn(f"torchpjrt: {name} is not supported on pjrt; running it on the CPU", stacklevel=3)

    def conv(v):
        if isinstance(v, torch.Tensor) and v.device.type == "pjrt":
            return to_cpu(v)
        if isinstance(v, (list, tuple)):
            return type(v)(conv(x) for x in v)
        if isinstance(v, torch.device) and v.type == "pjrt":
            return torch.device("cpu")
        return v

    sig = signature(op)
    vals = sig.values(args, kwargs)
    cvals = [conv(v) for v in vals]
    cargs, ckwargs = sig.split(cvals)
    result = op(*cargs, **ckwargs)
    # write back mutated arguments
    for i in range(sig.n):
        if sig.written[i] and isinstance(vals[i], torch.Tensor) and vals[i].device.type == "pjrt":
            if tuple(vals[i].shape) != tuple(cvals[i].shape):
                storage.resize(vals[i], cvals[i].shape)
            storage.write(vals[i], storage.value_of(cvals[i]))

    def back(r):
        if isinstance(r, torch.Tensor):
            for i in range(sig.n):
                if isinstance(cvals[i], torch.Tensor) and r is cvals[i]:
                    return vals[i]
            return to_pjrt(r)
        if isinstance(r, (list, tuple)):
            return type(r)(back(x) for x in r)
        return r

    return back(result)


_handlers = {}


# ---- the memory model's own primitives: factories, copies, item, resize_, set_ -----------


def _check_device(device) -> int:
    """The pjrt index a factory's `device=` names (0 for another type: the dispatcher only
    sends pjrt ones here)."""
    index = _target_index(device)
    return 0 if index is None else index


def _check_allocation(meta_out):
    """A factory's outputs (meta tensors) that the device cannot hold raise at the call, as empty()
    does, before anything runs (fused mode would record them and fail only when its graph runs).
    Checked once per compiled signature: the signature fixes the output shapes."""
    nbytes = sum(m.numel() * m.dtype.itemsize for m in _flatten_tensors(meta_out))
    if nbytes > storage._capacity:
        storage.check_allocation(nbytes)


def _format_strides(size, memory_format):
    """The strides PyTorch gives `size` in `memory_format` (channels_last, channels_last_3d)."""
    return torch.empty(size, memory_format=memory_format, device="meta").stride()


def k_empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    index = _check_device(device)
    size = tuple(int(s) for s in size)
    if any(s < 0 for s in size):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(size)}: {list(size)}")
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        return k_empty_strided(size, _format_strides(size, memory_format), dtype=dtype, device=device)
    return storage.empty(size, dtype or torch.get_default_dtype(), index)


def k_empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    index = _check_device(device)
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    dtype = dtype or torch.get_default_dtype()
    if stride == storage.contiguous_strides(size):
        return storage.empty(size, dtype, index)
    base = storage.empty((storage.span(size, stride),), dtype, index)
    storage.set_geometry(base, size, stride, 0)
    return base


def host_to_device(t: torch.Tensor, index: int = 0):
    """A JAX array on pjrt:`index` holding a CPU tensor's values (copied)."""
    a = np.array(dtypes.numpy_from_cpu_tensor(t, to_copy=True), copy=True)
    _default_device()  # sets jax_default_device to the chosen platform's first device
    if index:
        from .device import jax_device

        return jax.device_put(a, jax_device(index))  # committed: the ops on it run there
    # uncommitted: jit may move it next to arrays sharded over a mesh (distributed.spmd)
    return jax.device_put(a)


def device_value(t: torch.Tensor, index: int):
    """Tensor `t`'s elements as an array on pjrt:`index`: read, copied from the host, or moved
    from another pjrt device (after its pending work)."""
    if t.device.type != "pjrt":
        return host_to_device(t, index)
    value = storage.read(t)
    if placement.multi and t.get_device() != index:
        value = placement.commit(fusion.concrete(value, "device_copy"), index)
    return value


def k_copy_(self, src, non_blocking=False):
    if self.device.type == "pjrt":
        value = device_value(src, max(self.get_device(), 0))
        _check_broadcast(tuple(value.shape), tuple(self.shape))
        storage.write(self, value)
        return self
    if self.device.type == "cpu":
        self.copy_(to_cpu(src))
        return self
    raise RuntimeError(f"torchpjrt: copy from {src.device} to {self.device} is not supported")


def _check_broadcast(src_shape, dst_shape):
    if src_shape == dst_shape:
        return
    try:
        ok = np.broadcast_shapes(src_shape, dst_shape) == dst_shape
    except ValueError:
        ok = False
    if not ok:
        raise RuntimeError(
            f"The size of tensor a ({dst_shape[-1] if dst_shape else 1}) must match the size of "
            f"tensor b ({src_shape[-1] if src_shape else 1}) at non-singleton dimension "
            f"{len(dst_shape) - 1}" if len(src_shape) <= len(dst_shape)
            else f"output with shape {list(dst_shape)} doesn't match the broadcast shape {list(src_shape)}"
        )


def k_copy_from(self, dst, non_blocking=False):
    k_copy_(dst, self, non_blocking)
    return dst


def k_copy_from_and_resize(self, dst):
    if tuple(dst.shape) != tuple(self.shape):
        if dst.device.type == "pjrt":
            storage.resize(dst, self.shape)
        else:
            dst.resize_(self.shape)
    k_copy_(dst, self)
    return dst


def k_to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
              memory_format=None):
    if device is None and not pin_memory and layout in (None, torch.strided) \
            and memory_format in (None, torch.preserve_format) and self.device.type == "pjrt" and not placement.multi:
        # a cast on the device (`x.half()`, `x.float()`, autocast's casts): an op like any other,
        # one program keyed by its argument, which the hot path replays
        return _cast_kernel()(self, dtype=dtype, layout=layout, non_blocking=non_blocking, memory_format=memory_format)
    dtype = dtype or self.dtype
    target = torch.device(device) if device is not None else self.device
    stride = _copy_strides(self, memory_format)
    if target.type == "pjrt":
        index = _check_device(target)  # "pjrt" alone: the current device, as CUDA's ensure_has_index
        order = storage.dense_order(self.shape, stride) if stride is not None and self.device.type == "cpu" else None
        if order is not None:
            # a transposed or channels-last CPU tensor: laid out in memory order (and cast) on the
            # host, where the device would run a transpose program compiled per shape
            value = host_to_device(self.permute(order).to(dtype), index)
            return storage.wrap_in_order(value, stride, dtype)
        value = device_value(self, index)
        jd = dtypes.to_jax(dtype)
        if value.dtype != jd:
            value = storage._cast(value, jd)
        return storage.wrap(value, dtype) if stride is None else storage.wrap_laid_out(value, dtype, stride)
    if target.type == "cpu":
        t = to_cpu(self)
        if dtype != t.dtype:
            t = t.to(dtype)
        if stride is not None:
            t = torch.empty_strided(t.shape, stride, dtype=t.dtype).copy_(t)
        if pin_memory:
            t = t.pin_memory()
        return t
    raise RuntimeError(f"torchpjrt: cannot copy a pjrt tensor to {target} directly; go through .cpu()")


@functools.cache
def _cast_kernel():
    """The functional kernel of `_to_copy`'s lowering (a cast), for casts on the device."""
    return make_functional_kernel(aten._to_copy.default, TABLE[aten._to_copy.default])


def _copy_strides(self, memory_format):
    """The strides of a copy of `self` in `memory_format` (None: row-major), as PyTorch's
    empty_like: preserve_format keeps a dense tensor's strides (channels_last, a transpose)."""
    if memory_format in (None, torch.preserve_format):
        if self.is_contiguous() or storage.dense_order(self.shape, self.stride()) is None:
            return None
        return self.stride()
    if memory_format == torch.contiguous_format:
        return None
    return _format_strides(tuple(self.shape), memory_format)


_ITEM_FROM_HOST_COPY = 4096  # storages up to this many elements are copied whole for .item()


def k_local_scalar_dense(self):
    if self.numel() != 1:
        raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to Scalar")
    stats["host_read"] += 1
    try:
        st = self.untyped_storage()._pjrt
        if self.dtype is st.dtype and st.numel <= _ITEM_FROM_HOST_COPY:
            # the element from the storage's host copy (jax keeps it with the array, which a write
            # replaces): the loop over a routing's experts reads each from one copy, and a view
            # needs no strided-read program
            host = np.asarray(fusion.concrete(st.value(), "item"))
            value = host.reshape(-1)[self.storage_offset()].item()
        else:
            value = np.asarray(fusion.concrete(storage.read(self), "item")).reshape(()).item()
    except jax.errors.JaxRuntimeError as e:  # an asynchronous failure (out of memory) shows here
        raise fusion.device_error(e) from e
    device_checks.raise_pending()
    return value


def k_equal(self, other):
    if self.device != other.device:
        raise _device_error(other if other.device.type != "pjrt" else self, str(self.device))
    if self.shape != other.shape:
        return False
    a, b = storage.read(self), storage.read(other)
    equal = bool(fusion.concrete(fusion.call(_array_equal(storage.aval_of(a), storage.aval_of(b)), a, b), "item"))
    device_checks.raise_pending()
    return equal


@functools.lru_cache(maxsize=None)
def _array_equal(a, b):
    """torch.equal's program for arrays of these avals, kept: a warm process loads it."""
    return kernel_cache.kept_jit(lambda x, y: jnp.all(x == y), "dispatch.array_equal", a, b)


def k_resize_(self, size, *, memory_format=None):
    if any(int(s) < 0 for s in size):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(size)}: {list(size)}")
    storage.resize(self, size)
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        # the storage keeps its elements; the tensor takes the format's strides, as on CPU
        storage.set_geometry(self, tuple(self.shape), _format_strides(tuple(self.shape), memory_format),
                             self.storage_offset())
    return self


def k_set_source_tensor(self, source):
    _set.source_Tensor.redispatch(storage._META, self, source)
    return self


def k_set_source_storage(self, source):
    _check_pjrt_storage(source)
    _set.source_Storage.redispatch(storage._META, self, source)
    storage.adopt_raw_bytes(self)
    return self


def k_set_source_storage_offset(self, source, storage_offset, size, stride=()):
    _check_pjrt_storage(source)
    _set.source_Storage_storage_offset.redispatch(storage._META, self, source, storage_offset, size, stride)
    storage.adopt_raw_bytes(self)
    return self


def _check_pjrt_storage(source):
    if not hasattr(source, "_pjrt"):
        raise RuntimeError(
            f"torchpjrt: cannot set a pjrt tensor onto a storage on {source.device} without device data"
        )


def k_set_empty(self):
    fresh = storage.empty((0,), self.dtype, max(self.get_device(), 0))
    return k_set_source_tensor(self, fresh)


_set = aten.set_

SPECIAL_KERNELS = {
    "empty.memory_format": k_empty,
    "empty_strided": k_empty_strided,
    "copy_": k_copy_,
    "_copy_from": k_copy_from,
    "_copy_from_and_resize": k_copy_from_and_resize,
    "_to_copy": k_to_copy,
    "_local_scalar_dense": k_local_scalar_dense,
    "equal": k_equal,
    "resize_": k_resize_,
    "set_.source_Tensor": k_set_source_tensor,
    "set_.source_Storage": k_set_source_storage,
    "set_.source_Storage_storage_offset": k_set_source_storage_offset,
    "set_": k_set_empty,
    "empty_like": padding.empty_like,
    "_scaled_dot_product_fused_attention_overrideable": attention.forward_kernel,
    "_scaled_dot_product_fused_attention_overrideable_backward": attention.backward_kernel,
}


# ---- registration -------------------------------------------------------------------------

_libs = []


def _qualname(op):
    name = op._schema.name.split("::")[1]
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def derived_overloads(op):
    """The in-place and out= overloads whose functional form is `op`."""
    name = op._schema.name.split("::")[1]
    found = []
    for packet_name in (name, name + "_"):
        packet = getattr(aten, packet_name, None)
        if packet is None:
            continue
        for ov in packet.overloads():
            cand = getattr(packet, ov)
            if cand is not op and cand not in TABLE and _functional_of(cand) is op:
                found.append(cand)
    return found


def _is_composite_implicit(op) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _decomposition_carries_autograd(op) -> bool:
    """Whether `op`'s autograd comes from its composite decomposition. Not so for an op with an
    autograd kernel of its own (silu_backward, mish_backward: derivatives.yaml entries): the
    decomposition serves only backends without a kernel, so a backend kernel keeps autograd and
    runs one program where the decomposition ran seven."""
    return _is_composite_implicit(op) and not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd")


def _inplace_view_ops():
    """Metadata-only in-place ops (t_, transpose_, as_strided_, ...). Their composite kernels
    would bounds-check against the c10 storage, which holds no bytes here."""
    found = []
    for name in ("as_strided_", "t_", "transpose_", "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_"):
        packet = getattr(aten, name)
        found.extend(getattr(packet, ov) for ov in packet.overloads())
    return found


def _bound(handler, op):
    def kernel(*args, **kwargs):
        return handler(op, args, kwargs)

    return kernel


def _instrumented(op, kernel):
    """`kernel` as registered: in debug mode it runs under eager.run_debug."""

    def registered(*args, **kwargs):
        if eager.debug_enabled:
            return eager.run_debug(op, kernel, args, kwargs)
        return kernel(*args, **kwargs)

    return registered


def _registered(op, lowering, kernel):
    """`kernel` as registered (`_instrumented`), with its rule for padded storages (padding.py)
    where `op` has one: the rule's wrapper runs only while padded storages are alive (one frame
    less per op otherwise)."""
    rule = padding.rule_for(op, lowering)
    if rule is None:
        return _instrumented(op, kernel)
    padded = padding.aware(op, kernel, rule, signature(op))
    if op in padding.PRODUCERS:
        return _instrumented(op, padded)

    def registered(*args, **kwargs):
        if eager.debug_enabled:
            return eager.run_debug(op, padded, args, kwargs)
        if padding.live:
            return padded(*args, **kwargs)
        return kernel(*args, **kwargs)

    return registered


def _op_named(qualname):
    name, _, overload = qualname.partition(".")
    return getattr(getattr(aten, name), overload or "default")


def register():
    from .ops import load_all

    load_all()
    lib = torch.library.Library("aten", "IMPL")
    _libs.append(lib)
    hot = hot_path.start()
    for name, fn in SPECIAL_KERNELS.items():
        op = _op_named(name)
        if name == "_to_copy" and hot is not None:
            # its casts on the device are served by the hot path: `self` keyed (padded too: its
            # rule widens it), every other argument static (a `device=` it cannot key sends the
            # call to k_to_copy)
            hot_path.register(op, name, "p" + "s" * (len(op._schema.arguments) - 1), _registered(op, None, fn))
            continue
        if name in hot_path.FACTORIES and hot is not None:
            hot_path.register_factory(name, _registered(op, None, fn))
            continue
        lib.impl(name, _registered(op, None, fn), "PrivateUse1")
    for op in _inplace_view_ops():
        lib.impl(_qualname(op), _instrumented(op, _bound(inplace_view_kernel, op)), "PrivateUse1")
    for op, lowering in TABLE.items():
        if not lowering.eager or _qualname(op) in SPECIAL_KERNELS:
            continue
        if _decomposition_carries_autograd(op):
            # a backend kernel would shadow the decomposition that carries autograd;
            # such lowerings serve the graph paths only
            continue
        functional = make_functional_kernel(op, lowering)
        kernel = _registered(op, lowering, functional)
        sig = signature(op)
        shares = hot is not None and hot_path.shares_result(op, lowering, sig)
        writes_first = hot is not None and hot_path.writes_first_alone(op, lowering)
        code = hot_path.codes(op, lowering, sig, _kinds(sig, lowering), _ARGUMENT_CHECKS.get(op, (None,))[0] is not None,
                              inplace=writes_first) if hot is not None and not shares else None
        if shares:
            hot_path.register_factory(_qualname(op), kernel, hot_path.SHARED_RESULT)
        elif code is None:
            lib.impl(_qualname(op), kernel, "PrivateUse1")
        else:
            # the C++ kernel calls `kernel` for what it does not serve
            hot_path.register(op, _qualname(op), code, kernel, inplace=writes_first, check=lowering.check)
            if "w" in code or writes_first:
                functional.lowered.hot_writes = True
        for derived in derived_overloads(op):
            if _qualname(derived) in SPECIAL_KERNELS or _decomposition_carries_autograd(derived):
                continue
            kernel = _registered(derived, lowering, derived_kernel(derived, op))
            sig = signature(derived)
            code = hot_path.codes(derived, lowering, sig, _kinds(sig, lowering),
                                  _ARGUMENT_CHECKS.get(derived, (None,))[0] is not None, inplace=True) \
                if hot is not None and sig.kinds[0] in (TENSOR, TENSOR_LIST) else None
            if code is None and hot is not None and _qualname(derived) in hot_path.FACTORIES:
                hot_path.register_factory(_qualname(derived), kernel)  # zero_, fill_: shared fills
            elif code is None:
                lib.impl(_qualname(derived), kernel, "PrivateUse1")
            else:
                hot_path.register(derived, _qualname(derived), code, kernel, inplace=True, check=lowering.check)
    fb = torch.library.Library("_", "IMPL")
    _libs.append(fb)
    import torchpjrt_autoload

    if not torchpjrt_autoload.take_fallback(fallback):  # autoload's fallback calls this one from now on
        fb.fallback(fallback, dispatch_key="PrivateUse1", with_keyset=True)
    # a quantized tensor on pjrt (torch._empty_affine_quantized(..., device="pjrt"), what
    # quantize_per_tensor makes) reaches the QuantizedPrivateUse1 key: refused by name, instead of
    # the dispatcher's list of backends
    fb.fallback(_quantized_unsupported, dispatch_key="QuantizedPrivateUse1", with_keyset=True)
    # sparse tensors built from pjrt parts (torch.sparse_csr_tensor(..., device="pjrt")): their
    # ops reach the sparse keys, refused by name too
    for key in ("SparsePrivateUse1", "SparseCsrPrivateUse1"):
        fb.fallback(_sparse_unsupported, dispatch_key=key, with_keyset=True)
    update_view_kernels()
    native.when_loaded(attention.adopt)  # its ops have their kernels now
    outside_dynamo(_instrumented(None, None), _registered_with_rule_code(), fallback, _quantized_unsupported,
                   _sparse_unsupported, torchpjrt_autoload._first_op)


def _registered_with_rule_code():
    """The code of `_registered`'s wrapper for ops with a padding rule (one code for them all)."""
    for const in _registered.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "registered":
            return const
    raise AssertionError("dispatch._registered has no inner `registered`")


def outside_dynamo(*kernels):
    """Dynamo leaves the device's kernels, and all they call (JAX included), to run as they are
    (the dispatcher's Python kernels here, the compiled helper's callbacks in hot_path).

    After a graph break, Dynamo's frame hook stays on while the rest of the user's frame runs
    eagerly, and it would try to compile every Python frame the dispatcher enters: our kernels,
    their storage code and JAX, which it cannot trace (nn.RNN under torch.compile failed so).
    The device's ops are opaque to Dynamo, as a CPU kernel is. Set per code object on the
    C extension's frame hook, so that nothing imports torch._dynamo for it."""
    eval_frame = torch._C._dynamo.eval_frame
    strategy = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
    for kernel in kernels:
        code = kernel if isinstance(kernel, types.CodeType) else kernel.__code__
        eval_frame.set_code_exec_strategy(code, strategy)

