"""`torch.autocast("pjrt")`: PyTorch's CUDA autocast policy on the AutocastPrivateUse1 key.

PyTorch registers autocast kernels for CUDA, CPU, XPU, MPS... but none for PrivateUse1, so
without this module any listed op (linear, conv, softmax...) fails inside an autocast region
with "Could not run 'aten::linear' with arguments from the 'Autocastpjrt' backend". Here:

- every op not in the lists falls through to the next key (autograd, then the device);
- the listed ops get Python kernels applying the same cast policies as PyTorch's C++
  wrappers (`WrapFunction_` in ATen/autocast_mode.h) and then redispatch with the autocast
  key excluded, so the casts are recorded by autograd and the op runs once.

The state (`torch.is_autocast_enabled("pjrt")`, `torch.get_autocast_dtype("pjrt")`, nesting,
`enabled=False` regions) is PyTorch's own: `torch.autocast` sets it for any device type.
"""

import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .dispatch import signature

DEVICE = "pjrt"

# ---- the op lists ---------------------------------------------------------------------------
# PyTorch 2.13's CUDA policy: the AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE and AT_FORALL_PROMOTE
# macros of aten/src/ATen/autocast_mode.h, plus what aten/src/ATen/autocast_mode.cpp registers
# for CUDA besides them (the two cudnn convolutions, the banned binary_cross_entropy). A name
# without an overload is the default overload, as in the C++ registrations. The test suite
# checks that these lists name exactly the ops registered on PyTorch's AutocastCUDA key.

# Inputs cast to the autocast dtype (float16 by default, as on CUDA).
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    # autocast_mode.cpp, CUDA only (never reached on pjrt; listed to keep the policy whole)
    "cudnn_convolution", "cudnn_convolution_transpose",
)

# Inputs cast to float32.
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)

# Run in float32 through their `dtype=` argument, when the caller left it unset and the first
# input is eligible; inputs are not cast.
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)

# Overloads without a dtype argument, redispatched to the overload with one (fp32_append_dtype).
FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}

# Run in the widest floating dtype among the inputs.
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)

# Refused inside an autocast region (the message is PyTorch's).
BANNED = {
    "binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
        "safe to autocast."
    ),
}


def policy_of(qualname: str):
    """The cast policy applied to an aten op name such as "linear" or "pow.Scalar", or None."""
    for name, ops in (("lower_precision_fp", LOWER_PRECISION_FP), ("fp32", FP32),
                      ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE), ("fp32_append_dtype", FP32_APPEND_DTYPE),
                      ("promote", PROMOTE), ("banned", BANNED)):
        if qualname in ops:
            return name
    return None


# ---- casting --------------------------------------------------------------------------------

_AUTOCAST_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _no_autocast():
    """The redispatch guard: the op below must not come back to these kernels."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEY)


def _autocast_device_float(t) -> bool:
    """is_autocast_eligible: a floating tensor on the autocast device."""
    return isinstance(t, torch.Tensor) and t.device.type == DEVICE and t.is_floating_point()


def _eligible(t) -> bool:
    """is_eligible: as above, float64 excepted (autocast never touches doubles)."""
    return _autocast_device_float(t) and t.dtype != torch.float64


class _CastCache(threading.local):
    """Low-precision copies of float32 leaf tensors that require grad (model weights), kept
    until the outermost autocast region ends, as PyTorch's cast cache does: a weight used by
    several ops (or in several micro-steps of one region) is cast once. Kept per thread, as
    the autocast state is."""

    def __init__(self):
        self.entries = WeakIdKeyDictionary()


_cache = _CastCache()


def clear_cache() -> None:
    _cache.entries = WeakIdKeyDictionary()


def _cacheable(t, to_type) -> bool:
    return (
        to_type == torch.get_autocast_dtype(DEVICE)
        and t.dtype == torch.float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_autocast_cache_enabled()
        and not torch._C._is_cached_tensor(t)
    )


def cached_cast(t, to_type):
    """`t` in `to_type` if autocast applies to it, else `t` itself (at::autocast::cached_cast)."""
    if not _eligible(t) or t.dtype == to_type:
        return t
    if not _cacheable(t, to_type):
        return t.to(to_type)
    per_dtype = _cache.entries.get(t)
    if per_dtype is None:
        per_dtype = _cache.entries[t] = {}
    hit = per_dtype.get(to_type)
    # keyed by dtype and checked against the version: a nested region with another dtype, or a
    # weight updated in place inside one region, never gets a stale copy
    if hit is not None and hit[0] == t._version:
        return hit[1]
    casted = t.to(to_type)
    per_dtype[to_type] = (t._version, casted)
    return casted


def _cast_value(v, to_type):
    if isinstance(v, torch.Tensor):
        return cached_cast(v, to_type)
    if isinstance(v, (list, tuple)):
        return type(v)(cached_cast(x, to_type) if isinstance(x, torch.Tensor) else x for x in v)
    return v


_TENSOR, _OPTIONAL_TENSOR, _TENSOR_LIST = "Tensor", "Optional[Tensor]", "List[Tensor]"
_CASTABLE = (_TENSOR, _OPTIONAL_TENSOR, _TENSOR_LIST)  # cached_cast overloads; Tensor?[] is not one


class _Args:
    """An op's arguments as a full positional list, for rewriting and calling back."""

    def __init__(self, op):
        self.sig = signature(op)
        self.types = [str(a.type) for a in op._schema.arguments]

    def values(self, args, kwargs):
        return self.sig.values(args, kwargs)

    def call(self, op, vals):
        args, kwargs = self.sig.split(vals)
        return op(*args, **kwargs)


def _lower_precision_fp(op):
    spec = _Args(op)

    def kernel(*args, **kwargs):
        with _no_autocast():
            to_type = torch.get_autocast_dtype(DEVICE)
            vals = spec.values(args, kwargs)
            vals = [_cast_value(v, to_type) if ty in _CASTABLE else v for v, ty in zip(vals, spec.types)]
            return spec.call(op, vals)

    return kernel


def _fp32(op):
    spec = _Args(op)

    def kernel(*args, **kwargs):
        with _no_autocast():
            vals = spec.values(args, kwargs)
            vals = [_cast_value(v, torch.float32) if ty in _CASTABLE else v for v, ty in zip(vals, spec.types)]
            return spec.call(op, vals)

    return kernel


def _fp32_set_opt_dtype(op):
    spec = _Args(op)
    dtype_positions = [i for i, a in enumerate(op._schema.arguments) if str(a.real_type) == "Optional[ScalarType]"]
    if len(dtype_positions) != 1:
        raise AssertionError(f"{op} has no single optional dtype argument")
    position = dtype_positions[0]

    def kernel(*args, **kwargs):
        with _no_autocast():
            vals = spec.values(args, kwargs)
            # an ineligible first input runs unchanged: setting the dtype explicitly could
            # change the op's own promotion
            if _eligible(vals[0]) and vals[position] is None:
                vals[position] = torch.float32
            return spec.call(op, vals)

    return kernel


def _fp32_append_dtype(op, redispatch):
    spec = _Args(op)

    def kernel(*args, **kwargs):
        with _no_autocast():
            vals = spec.values(args, kwargs)
            out_type = torch.float32 if _eligible(vals[0]) else vals[0].dtype
            return redispatch(*vals, dtype=out_type)

    return kernel


def _prioritize(current, t, lower):
    """at::autocast::prioritize: float32 wins over the autocast dtype; doubles are ignored."""
    if not _autocast_device_float(t):
        return current
    nxt = t.dtype
    if nxt == torch.float64:
        return current
    if current == torch.float32 or nxt == torch.float32:
        return torch.float32
    if current == lower and nxt == lower:
        return lower
    raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")


def _promote(op):
    spec = _Args(op)
    # optional tensors (bilinear's bias) do not take part in choosing the type, as in C++,
    # but are cast to it
    voters = [i for i, ty in enumerate(spec.types) if ty in (_TENSOR, _TENSOR_LIST)]

    def kernel(*args, **kwargs):
        with _no_autocast():
            vals = spec.values(args, kwargs)
            to_type = lower = torch.get_autocast_dtype(DEVICE)
            for i in voters:
                for t in vals[i] if spec.types[i] == _TENSOR_LIST else (vals[i],):
                    to_type = _prioritize(to_type, t, lower)
            vals = [_cast_value(v, to_type) if ty in _CASTABLE else v for v, ty in zip(vals, spec.types)]
            return spec.call(op, vals)

    return kernel


def _banned(message):
    def kernel(*args, **kwargs):
        raise RuntimeError(message)

    return kernel


# ---- registration ---------------------------------------------------------------------------


def _op(qualname):
    name, _, overload = qualname.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def kernels() -> dict:
    """qualname -> autocast kernel, for every listed op."""
    table = {}
    for name in LOWER_PRECISION_FP:
        table[name] = _lower_precision_fp(_op(name))
    for name in FP32:
        table[name] = _fp32(_op(name))
    for name in FP32_SET_OPT_DTYPE:
        table[name] = _fp32_set_opt_dtype(_op(name))
    for name, target in FP32_APPEND_DTYPE.items():
        table[name] = _fp32_append_dtype(_op(name), _op(target))
    for name in PROMOTE:
        table[name] = _promote(_op(name))
    for name, message in BANNED.items():
        table[name] = _banned(message)
    return table


_libs = []
_original_clear_autocast_cache = None


def _clear_autocast_cache():
    """torch.clear_autocast_cache, which torch.autocast calls on leaving its outermost region:
    PyTorch's C++ cache and this module's."""
    _original_clear_autocast_cache()
    clear_cache()


def install() -> None:
    global _original_clear_autocast_cache
    if _libs:
        return
    key = "AutocastPrivateUse1"
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, dispatch_key=key)
    lib = torch.library.Library("aten", "IMPL")
    for name, kernel in kernels().items():
        lib.impl(name, kernel, key)
    _libs.extend([fallthrough, lib])
    _original_clear_autocast_cache = torch.clear_autocast_cache
    torch.clear_autocast_cache = _clear_autocast_cache
