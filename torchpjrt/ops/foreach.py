"""The `_foreach_*` ops (torch.optim's foreach=True path): one compiled call per list.

Each lowering maps elementwise.py's per-tensor math over the lists, so foreach and
per-tensor optimizer steps agree (16-bit floats excepted: see _opmath). `Scalar` arguments
arrive traced, `Scalar[]` ones as Python lists.

The in-place overloads (`_foreach_add_.List`) are derived from these by the dispatcher.
"""

import jax
import jax.numpy as jnp

from .. import dtypes
from . import aten, lower
from .elementwise import add, addcdiv, addcmul, clamp_max, clamp_min, div, lerp, mul, pow_tt, sub


def _per_tensor(values, n):
    """One value per tensor: a list (List, ScalarList overloads) as is, else repeated.

    One function serves all overloads of an op: the dispatcher derives in-place kernels from
    the functional overload with the same argument names, which several overloads share
    (`_foreach_mul_.Tensor` from `_foreach_mul.List`)."""
    return values if isinstance(values, (list, tuple)) else [values] * n


_HALF = (jnp.bfloat16, jnp.float16)


def _opmath(fn):
    """16-bit floats compute in float32 and round once, as PyTorch's foreach kernels do
    (`a + alpha * b` rounded at each step differs by an ulp or more)."""

    def up(x):
        return x.astype(jnp.float32) if getattr(x, "dtype", None) in _HALF else x

    return lambda *args: fn(*(up(x) for x in args))


def _binary(fn):
    fn = _opmath(fn)

    def each(self, other, *rest):
        return [fn(a, b, *rest) for a, b in zip(self, _per_tensor(other, len(self)))]

    return each


def _foreach(name):
    return getattr(aten, f"_foreach_{name}")


# ---- binary ---------------------------------------------------------------------------------

for _name, _fn in [
    ("add", add), ("sub", sub), ("mul", mul), ("div", div), ("pow", pow_tt),
    ("maximum", jnp.maximum), ("minimum", jnp.minimum),
    ("clamp_min", clamp_min), ("clamp_max", clamp_max),
]:
    _packet = _foreach(_name)
    _ovs = [ov for ov in ("List", "ScalarList", "Scalar", "Tensor") if ov in _packet.overloads()]
    lower(*[getattr(_packet, ov) for ov in _ovs])(_binary(_fn))


@lower(aten._foreach_pow.ScalarAndTensor)
def foreach_pow_scalar_and_tensor(self, exponent):
    return [pow_tt(self, e) for e in exponent]


# ---- addcmul, addcdiv, lerp --------------------------------------------------------------


def _ternary(fn):
    """The third operand: one value, a list of them, or (Tensor overload) a 1-D tensor of them."""
    fn = _opmath(fn)

    def each(self, tensor1, tensor2, values=1):
        if hasattr(values, "ndim") and values.ndim == 1:
            values = [values[i] for i in range(len(self))]
        return [fn(*xs) for xs in zip(self, tensor1, tensor2, _per_tensor(values, len(self)))]

    return each


for _name, _fn in [("addcmul", addcmul), ("addcdiv", addcdiv)]:
    _packet = _foreach(_name)
    lower(_packet.Scalar, _packet.ScalarList, _packet.Tensor)(_ternary(_fn))


_lerp = _opmath(lerp)


@lower(aten._foreach_lerp.List, aten._foreach_lerp.Scalar, aten._foreach_lerp.ScalarList)
def foreach_lerp(self, tensors1, weight):
    weights = _per_tensor(weight, len(self))
    return [_lerp(s, e, w) for s, e, w in zip(self, tensors1, weights)]


# ---- unary ----------------------------------------------------------------------------------


def _to_float(fn):
    """Float math on integer inputs computes in float32 (the result dtype is PyTorch's)."""
    return lambda x: fn(x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32))


def _keep_int(fn):
    """Rounding ops leave integers as they are."""
    return lambda x: fn(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x


for _name, _fn in [
    ("sqrt", jnp.sqrt), ("rsqrt", jax.lax.rsqrt), ("exp", jnp.exp), ("expm1", jnp.expm1),
    ("log", jnp.log), ("log10", jnp.log10), ("log1p", jnp.log1p), ("log2", jnp.log2),
    ("sin", jnp.sin), ("cos", jnp.cos), ("tan", jnp.tan), ("asin", jnp.arcsin),
    ("acos", jnp.arccos), ("atan", jnp.arctan), ("sinh", jnp.sinh), ("cosh", jnp.cosh),
    ("tanh", jnp.tanh), ("sigmoid", jax.nn.sigmoid), ("erf", jax.scipy.special.erf),
    ("erfc", jax.scipy.special.erfc), ("lgamma", jax.scipy.special.gammaln),
    ("reciprocal", lambda x: 1 / x),
]:
    lower(_foreach(_name).default)(lambda self, fn=_to_float(_fn): [fn(x) for x in self])

for _name, _fn in [
    ("neg", jnp.negative), ("abs", jnp.abs), ("sign", jnp.sign),
    ("floor", _keep_int(jnp.floor)), ("ceil", _keep_int(jnp.ceil)), ("round", _keep_int(jnp.round)),
    ("trunc", _keep_int(jnp.trunc)), ("frac", lambda x: x - jnp.trunc(x)),
]:
    lower(_foreach(_name).default)(lambda self, fn=_fn: [fn(x) for x in self])


@lower(aten._foreach_zero.default)
def foreach_zero(self):
    return [jnp.zeros_like(x) for x in self]


@lower(aten._foreach_copy.default)
def foreach_copy(self, src, non_blocking=False):
    return [jnp.broadcast_to(s.astype(x.dtype), x.shape) for x, s in zip(self, src)]


@lower(aten._foreach_clone.default)
def foreach_clone(self, memory_format=None):
    return list(self)


# ---- reductions -----------------------------------------------------------------------------


@lower(aten._foreach_max.default)
def foreach_max(self):
    return [jnp.max(x) for x in self]


def _accumulate(x, dtype):
    """|x| in the dtype to reduce in: the requested one, else at least float32."""
    x = jnp.abs(x)
    if dtype is not None:
        return x.astype(dtypes.to_jax(dtype))
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _norm(x, ord):
    if ord == 2:
        return jnp.sqrt(jnp.sum(x * x))
    if ord == 1:
        return jnp.sum(x)
    if ord == float("inf"):
        return jnp.max(x, initial=0)
    if ord == float("-inf"):
        return jnp.min(x)
    if ord == 0:
        return jnp.sum(x != 0).astype(x.dtype)
    return jnp.sum(x**ord) ** (1 / ord)


# ord picks the algorithm, so it is static
@lower(aten._foreach_norm.Scalar, static=("ord",))
def foreach_norm(self, ord=2, dtype=None):
    return [_norm(_accumulate(x, dtype), ord) for x in self]


@lower(aten._foreach_powsum.Scalar, static=("ord",))
def foreach_powsum(self, ord=2, dtype=None):
    if ord == 0:
        return [jnp.sum(x != 0).astype(_accumulate(x, dtype).dtype) for x in self]
    return [jnp.sum(_accumulate(x, dtype) ** ord) for x in self]
