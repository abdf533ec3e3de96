"""Elementwise math, comparisons and logic.

Outputs are cast to PyTorch's result dtype by the dispatcher (from the op's meta kernel),
so these functions may compute with JAX's promotion where that gives the same values.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..dtypes import LOW_PRECISION
from . import DeviceCheck, aten, check_vector, lower


def _is_float(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _is_bool(x):
    return jnp.result_type(x) == jnp.bool_


def _sign(x):
    # CPU's (0 < x) - (x < 0): NaN -> 0 and -0.0 -> 0.0 (jnp.sign keeps both); bool -> itself
    if _is_bool(x) or jnp.iscomplexobj(x):
        return x if _is_bool(x) else jnp.sign(x)
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


def _heaviside(x, values):
    # CPU's x == 0 ? values : x > 0, so a NaN input gives 0 (jnp.heaviside gives NaN)
    return jnp.where(x == 0, values, (x > 0).astype(jnp.result_type(x, values)))


def _same_dtypes(name, x, other):
    """`other`, after checking it has x's dtype (ops whose CPU kernel does not promote)."""
    if jnp.result_type(x) != jnp.result_type(other):
        raise RuntimeError(f"{name} is not yet implemented for tensors with different dtypes.")
    return other


def _scaled(other, alpha):
    if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha == 1:
        return other
    return other * alpha


def _check_alpha(self, other, alpha):
    """CPU's alpha_check, against the result type."""
    dtype = jnp.result_type(self, other)
    kind = jnp.result_type(alpha) if alpha is not None else None
    if kind == jnp.bool_ and dtype != jnp.bool_:
        raise RuntimeError("Boolean alpha only supported for Boolean results.")
    if kind is not None and jnp.issubdtype(kind, jnp.inexact) and not jnp.issubdtype(dtype, jnp.inexact):
        raise RuntimeError("For integral input tensors, argument alpha must not be a floating point number.")


@lower(aten.add.Tensor, aten.add.Scalar)
def add(self, other, alpha=1):
    _check_alpha(self, other, alpha)
    if _is_bool(self) and _is_bool(other):
        return jnp.logical_or(self, other)
    return self + _scaled(other, alpha)


def _no_bool_sub(self, other):
    if _is_bool(self) or _is_bool(other):
        raise RuntimeError(
            "Subtraction, the `-` operator, with a bool tensor is not supported. If you are trying to "
            "invert a mask, use the `~` or `logical_not()` operator instead.")


@lower(aten.sub.Tensor, aten.sub.Scalar)
def sub(self, other, alpha=1):
    _no_bool_sub(self, other)
    _check_alpha(self, other, alpha)
    return self - _scaled(other, alpha)


@lower(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(self, other, alpha=1):
    _no_bool_sub(self, other)
    return other - _scaled(self, alpha)


def _bool_as_number(x, other):
    """A bool operand of a product or quotient as 0/1 in the other operand's type. Left bool,
    jnp and XLA turn x * b into select(b, x, 0) (and b / x into select(b, 1 / x, 0)), which
    gives 0 where CPU gives inf * 0 = nan (or 0 / 0 = nan)."""
    if not _is_bool(x) or _is_bool(other):
        return x
    return jnp.asarray(x).astype(jnp.int32).astype(jnp.result_type(other))


@lower(aten.mul.Tensor, aten.mul.Scalar)
def mul(self, other):
    if _is_bool(self) and _is_bool(other):
        return jnp.logical_and(self, other)
    return _bool_as_number(self, other) * _bool_as_number(other, self)


def _to_float32(x):
    # bool goes through int32: XLA rewrites convert(bool a) / b as select(a, 1 / b, 0), which
    # gives 0 where CPU gives 0 / 0 = nan
    x = jnp.asarray(x)
    return (x.astype(jnp.int32) if _is_bool(x) else x).astype(jnp.float32)


def _true_div(a, b):
    a, b = _bool_as_number(a, b), _bool_as_number(b, a)
    if not _is_float(a) and not _is_float(b):
        a = _to_float32(a) if not isinstance(a, (int, float)) else float(a)
        b = _to_float32(b) if not isinstance(b, (int, float)) else float(b)
    return jnp.true_divide(a, b)


@lower(aten.div.Tensor, aten.div.Scalar)
def div(self, other):
    return _true_div(self, other)


def _integer_zero_division(self, other, rounding_mode="floor"):
    """CPU's integer division, floor division, remainder and fmod raise on a zero divisor (checked
    on the device, device_checks.py); float ones and true division give inf or nan."""
    x, y = jnp.asarray(self), jnp.asarray(other)
    dtype = jnp.result_type(self, other)
    out_size = math.prod(jnp.broadcast_shapes(x.shape, y.shape))
    if rounding_mode is None or not jnp.issubdtype(dtype, jnp.integer) or out_size == 0:
        return check_vector(jnp.asarray(False))
    return check_vector(jnp.any(y == 0))


ZERO_DIVISION = DeviceCheck(_integer_zero_division, lambda *details: RuntimeError("ZeroDivisionError"))


@lower(aten.div.Tensor_mode, aten.div.Scalar_mode, static=("other",), check=ZERO_DIVISION)
def div_mode(self, other, rounding_mode=None):
    if rounding_mode is None:
        return _true_div(self, other)
    if rounding_mode == "trunc":
        if _is_float(self) or _is_float(other):
            return jnp.trunc(jnp.true_divide(self, other))
        dtype = jnp.result_type(self, other)  # bool / int64 divides as int64, not as bool
        return lax.div(*jnp.broadcast_arrays(jnp.asarray(self).astype(dtype), jnp.asarray(other).astype(dtype)))
    if rounding_mode == "floor":
        return _floor_divide(self, other)
    raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{rounding_mode}'")


def _floor_divide(a, b):
    if _is_float(a) or _is_float(b):
        return jnp.floor_divide(a, b)
    return jnp.floor_divide(a, b)


@lower(aten.floor_divide.default, aten.floor_divide.Scalar, check=ZERO_DIVISION)
def floor_divide(self, other):
    return _floor_divide(self, other)


@lower(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, check=ZERO_DIVISION)
def remainder(self, other):
    return jnp.remainder(self, other)


@lower(aten.fmod.Tensor, aten.fmod.Scalar, check=ZERO_DIVISION)
def fmod(self, other):
    return jnp.fmod(self, other)


@lower(aten.pow.Tensor_Tensor)
def pow_tt(self, exponent):
    return _pow(self, exponent)


@lower(aten.pow.Tensor_Scalar, static=("exponent",))
def pow_ts(self, exponent):
    if exponent == 2:
        return self * self
    if exponent == 1:
        return self
    if exponent == 0.5 and _is_float(self):
        return jnp.sqrt(self)
    if exponent == -1 and _is_float(self):
        return 1 / self
    return _pow(self, exponent)


@lower(aten.pow.Scalar)
def pow_st(self, exponent):
    return _pow(self, exponent)


def _pow(a, b):
    if _is_bool(a):  # a bool base powers as 0/1, in the result type (bool for a bool exponent)
        dtype = jnp.result_type(a, b)
        return _pow(jnp.asarray(a).astype(jnp.int64), b).astype(dtype)
    if not _is_float(a) and not _is_float(b) and not isinstance(b, float):
        if isinstance(b, int) and b >= 0:
            return lax.integer_pow(a, b)
        return _int_pow(a, b)
    return jnp.power(a, b)


def _int_pow(a, b):
    """Integer power as PyTorch defines it for negative exponents: 1 ** -n = 1,
    (-1) ** -n = +-1, anything else ** -n = 0 (integer division)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a), jnp.asarray(b))
    positive = jnp.power(a, jnp.maximum(b, 0))
    odd = (b % 2) != 0
    negative = jnp.where(a == 1, 1, jnp.where(a == -1, jnp.where(odd, -1, 1), 0)).astype(positive.dtype)
    return jnp.where(b < 0, negative, positive)


@lower(aten.float_power.Tensor_Tensor, aten.float_power.Tensor_Scalar, aten.float_power.Scalar)
def float_power(self, exponent):
    def up(x):
        if isinstance(x, (int, float)):
            return x
        return x.astype(jnp.complex128 if jnp.iscomplexobj(x) else jnp.float64)

    return jnp.power(up(self), up(exponent))


def _unary(op, jfn, to_float=True):
    def f(self):
        if to_float and not _is_float(self):
            self = self.astype(jnp.float32)
        return jfn(self)

    f.__name__ = str(op).replace(".", "_")
    lower(op)(f)


for _op, _fn in [
    (aten.exp.default, jnp.exp),
    (aten.exp2.default, jnp.exp2),
    (aten.expm1.default, jnp.expm1),
    (aten.log.default, jnp.log),
    (aten.log2.default, jnp.log2),
    (aten.log10.default, jnp.log10),
    (aten.log1p.default, jnp.log1p),
    (aten.sqrt.default, jnp.sqrt),
    (aten.rsqrt.default, lax.rsqrt),
    (aten.sin.default, jnp.sin),
    (aten.cos.default, jnp.cos),
    (aten.tan.default, jnp.tan),
    (aten.asin.default, jnp.arcsin),
    (aten.acos.default, jnp.arccos),
    (aten.atan.default, jnp.arctan),
    (aten.sinh.default, jnp.sinh),
    (aten.cosh.default, jnp.cosh),
    (aten.tanh.default, jnp.tanh),
    (aten.asinh.default, jnp.arcsinh),
    (aten.acosh.default, jnp.arccosh),
    (aten.atanh.default, jnp.arctanh),
    (aten.sigmoid.default, jax.nn.sigmoid),
    (aten.erf.default, jax.scipy.special.erf),
    (aten.erfc.default, jax.scipy.special.erfc),
    (aten.erfinv.default, jax.scipy.special.erfinv),
    (aten.lgamma.default, jax.scipy.special.gammaln),
    (aten.i0.default, jax.scipy.special.i0),
    (aten.special_i0e.default, jax.scipy.special.i0e),
    (aten.special_i1.default, jax.scipy.special.i1),
    (aten.special_i1e.default, jax.scipy.special.i1e),
    (aten.sinc.default, jnp.sinc),
    (aten.deg2rad.default, jnp.deg2rad),
    (aten.rad2deg.default, jnp.rad2deg),
    (aten.reciprocal.default, lambda x: 1 / x),
    (aten.special_erfcx.default, jax.scipy.special.erfcx),
    (aten.special_ndtri.default, jax.scipy.special.ndtri),
    (aten.special_ndtr.default, jax.scipy.special.ndtr),
    (aten.special_log_ndtr.default, jax.scipy.special.log_ndtr),
    (aten.special_entr.default, jax.scipy.special.entr),
]:
    _unary(_op, _fn)

for _op, _fn in [
    (aten.neg.default, jnp.negative),
    (aten.abs.default, jnp.abs),
    (aten.sign.default, lambda x: _sign(x)),
    (aten.sgn.default, lambda x: _sign(x)),
    (aten.floor.default, lambda x: jnp.floor(x) if _is_float(x) else x),
    (aten.ceil.default, lambda x: jnp.ceil(x) if _is_float(x) else x),
    (aten.trunc.default, lambda x: jnp.trunc(x) if _is_float(x) else x),
    (aten.frac.default, lambda x: x - jnp.trunc(x)),
    (aten.bitwise_not.default, lambda x: jnp.logical_not(x) if _is_bool(x) else jnp.invert(x)),
    (aten.logical_not.default, jnp.logical_not),
    (aten.isnan.default, jnp.isnan),
    (aten.isinf.default, jnp.isinf),
    (aten.isfinite.default, jnp.isfinite),
    (aten.isposinf.default, jnp.isposinf),
    (aten.isneginf.default, jnp.isneginf),
    (aten.signbit.default, jnp.signbit),
    (aten.positive.default, lambda x: x),
    (aten.conj_physical.default, jnp.conj),
    (aten.angle.default, jnp.angle),
]:
    _unary(_op, _fn, to_float=False)


@lower(aten.round.default)
def round_(self):
    return jnp.round(self) if _is_float(self) else self


@lower(aten.round.decimals, static=("decimals",))
def round_decimals(self, decimals=0):
    return jnp.round(self, decimals)


@lower(aten.logit.default, static=("eps",))
def logit(self, eps=None):
    x = self if _is_float(self) else self.astype(jnp.float32)
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


# ---- binary math --------------------------------------------------------------------------


def _binary(op, jfn):
    lower(op)(lambda self, other: jfn(self, other))


for _op, _fn in [
    (aten.atan2.default, jnp.arctan2),
    (aten.hypot.default, jnp.hypot),
    (aten.logaddexp.default, jnp.logaddexp),
    (aten.logaddexp2.default, jnp.logaddexp2),
    (aten.copysign.Tensor, jnp.copysign),
    (aten.copysign.Scalar, jnp.copysign),
    (aten.nextafter.default, jnp.nextafter),
    (aten.xlogy.Tensor, jax.scipy.special.xlogy),
    (aten.xlogy.Scalar_Self, jax.scipy.special.xlogy),
    (aten.xlogy.Scalar_Other, jax.scipy.special.xlogy),
    (aten.special_xlog1py.default, jax.scipy.special.xlog1py),
    (aten.heaviside.default, lambda x, values: _heaviside(x, _same_dtypes("heaviside", x, values))),
    (aten.fmax.default, jnp.fmax),
    (aten.fmin.default, jnp.fmin),
    (aten.maximum.default, jnp.maximum),
    (aten.minimum.default, jnp.minimum),
    (aten.eq.Tensor, jnp.equal),
    (aten.eq.Scalar, jnp.equal),
    (aten.ne.Tensor, jnp.not_equal),
    (aten.ne.Scalar, jnp.not_equal),
    (aten.lt.Tensor, jnp.less),
    (aten.lt.Scalar, jnp.less),
    (aten.le.Tensor, jnp.less_equal),
    (aten.le.Scalar, jnp.less_equal),
    (aten.gt.Tensor, jnp.greater),
    (aten.gt.Scalar, jnp.greater),
    (aten.ge.Tensor, jnp.greater_equal),
    (aten.ge.Scalar, jnp.greater_equal),
    (aten.logical_and.default, jnp.logical_and),
    (aten.logical_or.default, jnp.logical_or),
    (aten.logical_xor.default, jnp.logical_xor),
    (aten.bitwise_and.Tensor, jnp.bitwise_and),
    (aten.bitwise_and.Scalar, jnp.bitwise_and),
    (aten.bitwise_or.Tensor, jnp.bitwise_or),
    (aten.bitwise_or.Scalar, jnp.bitwise_or),
    (aten.bitwise_xor.Tensor, jnp.bitwise_xor),
    (aten.bitwise_xor.Scalar, jnp.bitwise_xor),
    (aten.bitwise_left_shift.Tensor, jnp.left_shift),
    (aten.bitwise_left_shift.Tensor_Scalar, jnp.left_shift),
    (aten.bitwise_left_shift.Scalar_Tensor, jnp.left_shift),
    (aten.__lshift__.Tensor, jnp.left_shift),
    (aten.__lshift__.Scalar, jnp.left_shift),
    (aten.bitwise_right_shift.Tensor, jnp.right_shift),
    (aten.bitwise_right_shift.Tensor_Scalar, jnp.right_shift),
    (aten.bitwise_right_shift.Scalar_Tensor, jnp.right_shift),
    (aten.__rshift__.Tensor, jnp.right_shift),
    (aten.__rshift__.Scalar, jnp.right_shift),
    (aten.gcd.default, jnp.gcd),
    (aten.lcm.default, jnp.lcm),
]:
    _binary(_op, _fn)


@lower(aten.where.self)
def where(condition, self, other):
    return jnp.where(condition, self, other)


@lower(aten.clamp.default, aten.clamp.Tensor)
def clamp(self, min=None, max=None):
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    # maximum/minimum propagate NaN from the bounds too, as CPU does
    x = self
    if min is not None:
        x = jnp.maximum(x, min)
    if max is not None:
        x = jnp.minimum(x, max)
    return x


@lower(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(self, min):
    return jnp.maximum(self, min)


@lower(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(self, max):
    return jnp.minimum(self, max)


@lower(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(self, end, weight):
    # CPU's formula: from `end` when |weight| >= 0.5 (exact at weight 1; infinities as CPU)
    if _is_bool(self):  # bool self and end with a float weight tensor: computed as numbers
        dtype = jnp.result_type(self, end, weight)
        self, end = self.astype(jnp.int32).astype(dtype), jnp.asarray(end).astype(jnp.int32).astype(dtype)
    dtype = jnp.result_type(self, end, weight)
    if dtype in LOW_PRECISION:
        # computed in float32 and rounded once, as CPU's kernel: a weight beyond float16's range
        # (lerp(a, a, 1e6) is a) must not turn into inf * 0
        self, end, weight = self.astype(jnp.float32), jnp.asarray(end).astype(jnp.float32), \
            jnp.asarray(weight, jnp.float32)
    diff = end - self
    out = jnp.where(jnp.abs(weight) < 0.5, self + weight * diff, end - diff * (1 - weight))
    return out.astype(dtype)


@lower(aten.addcmul.default)
def addcmul(self, tensor1, tensor2, value=1):
    dtype = jnp.result_type(self, tensor1, tensor2)
    if not jnp.issubdtype(dtype, jnp.inexact):
        value = jnp.asarray(value).astype(dtype)  # CPU truncates the scalar to the integer type first
    return self + value * mul(tensor1, tensor2)


@lower(aten.addcdiv.default)
def addcdiv(self, tensor1, tensor2, value=1):
    if not (_is_float(tensor1) or _is_float(tensor2)):
        raise RuntimeError("Integer division with addcdiv is no longer supported, and in a future "
                           "release addcdiv will perform a true division of tensor1 and tensor2.")
    return self + value * (tensor1 / tensor2)


@lower(aten.nan_to_num.default, static=("nan", "posinf", "neginf"))
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    return jnp.nan_to_num(self, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


@lower(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    return jnp.where(mask, jnp.asarray(value, self.dtype), self)


@lower(aten.fill.Scalar, aten.fill.Tensor)
def fill(self, value):
    return jnp.full(self.shape, value, self.dtype)


@lower(aten.zero.default)
def zero(self):
    return jnp.zeros(self.shape, self.dtype)


@lower(aten.clone.default)
def clone(self, memory_format=None):
    return self


# conj() and _neg_view() are views that only flip a math bit, which the storage read does
# not apply; here they are values: reads are right (torch.fft.ifft/hfft and complex backward
# formulas apply _conj to fft results), but the result does not alias its input (is_conj()
# is False and writing into x.conj() leaves x unchanged).
@lower(aten._conj.default)
def conj_view(self):
    return jnp.conj(self)


@lower(aten._neg_view.default)
def neg_view(self):
    return jnp.negative(self)


@lower(aten.frexp.Tensor)
def frexp(self):
    """x = mantissa * 2**exponent with |mantissa| in [0.5, 1); 0, inf and NaN give
    (x, 0) as std::frexp does. Works on the bits, so subnormals come out right even where
    the backend flushes them to zero in float arithmetic (jnp.frexp does not)."""
    x = self.astype(jnp.float32) if self.dtype in LOW_PRECISION else self
    info = jnp.finfo(x.dtype)
    nmant = info.nmant  # stored fraction bits: 23 (float32) / 52 (float64)
    nbits = info.bits
    bias = -info.minexp + 1  # 127 / 1023
    uint = jnp.uint32 if nbits == 32 else jnp.uint64
    sint = jnp.int32 if nbits == 32 else jnp.int64
    bits = lax.bitcast_convert_type(x, uint)
    one = jnp.asarray(1, uint)
    frac_mask = (one << nmant) - one
    exp_field = ((bits >> nmant) & ((one << (nbits - 1 - nmant)) - one)).astype(sint)
    frac = bits & frac_mask
    sign = bits & (one << (nbits - 1))
    subnormal = (exp_field == 0) & (frac != 0)
    special = ((exp_field == 0) & (frac == 0)) | (exp_field == (1 << (nbits - 1 - nmant)) - 1)
    # a subnormal's leading fraction bit becomes the implicit bit: shift it up to position nmant
    width = nbits - lax.clz(frac).astype(sint)  # bit length of frac
    shift = jnp.where(subnormal, nmant + 1 - width, 0).astype(uint)
    frac = jnp.where(subnormal, (frac << shift) & frac_mask, frac)
    exponent = jnp.where(subnormal, width - nmant - bias + 1, exp_field - bias + 1)
    # mantissa: same sign and fraction, the biased exponent of 0.5
    mant_bits = sign | (jnp.asarray(bias - 1, uint) << nmant) | frac
    mantissa = lax.bitcast_convert_type(mant_bits, x.dtype)
    mantissa = jnp.where(special, x, mantissa)
    exponent = jnp.where(special, 0, exponent)
    return mantissa.astype(self.dtype), exponent.astype(jnp.int32)


@lower(aten.alias_copy.default, aten.detach_copy.default)
def alias_copy(self):
    return self


@lower(aten.isclose.default)
def isclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return jnp.isclose(self, other, rtol=rtol, atol=atol, equal_nan=equal_nan)


def _digamma(x):
    # CPU: digamma(+-0) = -+inf (jax gives nan there)
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jax.scipy.special.digamma(x)).astype(x.dtype)


_unary(aten.digamma.default, _digamma)


def _trigamma(x):
    # PyTorch's CPU trigamma: reflection for x < 0.5, six recurrence steps, asymptotic series
    reflect = x < 0.5
    sin_pi_x = jnp.sin(jnp.pi * x)
    result = jnp.where(reflect, -(jnp.pi * jnp.pi) / (sin_pi_x * sin_pi_x), 0).astype(x.dtype)
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflect, -result, result)


def _hurwitz_zeta_int(s, q):
    """zeta(s, q) for an integer s >= 2 as PyTorch's CPU computes it: for q <= 0 the series
    sum_k (q + k)^-s itself (+inf at q = 0, -1, ...), where jax's zeta gives nan. The terms
    with q + k < 1 are summed here, the rest is jax's zeta at the shifted argument."""
    pole = (q <= 0) & (q == jnp.floor(q))  # also q = -inf
    q0 = jnp.where(pole | jnp.isnan(q), 1, q).astype(q.dtype)

    def cond(c):
        return jnp.any(c[0] < 1)

    def body(c):
        q, acc = c
        low = q < 1
        return jnp.where(low, q + 1, q), acc + jnp.where(low, q ** -s, 0).astype(q.dtype)

    shifted, acc = lax.while_loop(cond, body, (q0, jnp.zeros_like(q0)))
    out = acc + jax.scipy.special.zeta(jnp.asarray(s, q.dtype), shifted)
    out = jnp.where(pole, jnp.inf, out)
    return jnp.where(jnp.isnan(q), q, out)


@lower(aten.polygamma.default, static=("n",))
def polygamma(n, self):
    x = self if _is_float(self) else self.astype(jnp.float32)
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    # CPU: (-1)^(n+1) * n! * zeta(n+1, x), defined for negative x too (jax's polygamma is not)
    return (1 if n % 2 else -1) * math.factorial(n) * _hurwitz_zeta_int(n + 1, x)


@lower(aten.mvlgamma.default, static=("p",))
def mvlgamma(self, p):
    return jax.scipy.special.multigammaln(self, p)


# ---- special functions -------------------------------------------------------------------


def _float(x):
    return x if _is_float(x) else jnp.asarray(x).astype(jnp.float32)


@lower(aten.igamma.default)
def igamma(self, other):
    return jax.scipy.special.gammainc(_float(self), _float(other))


@lower(aten.igammac.default)
def igammac(self, other):
    return jax.scipy.special.gammaincc(_float(self), _float(other))


@lower(aten.special_zeta.default)
def special_zeta(self, other):
    return jax.scipy.special.zeta(_float(self), _float(other))


@lower(aten.special_modified_bessel_i0.default)
def special_modified_bessel_i0(self):
    return jax.scipy.special.i0(_float(self))


@lower(aten.special_modified_bessel_i1.default)
def special_modified_bessel_i1(self):
    return jax.scipy.special.i1(_float(self))


@lower(aten.special_spherical_bessel_j0.default)
def special_spherical_bessel_j0(self):
    x = _float(self)
    safe = jnp.where(x == 0, 1, x)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)
