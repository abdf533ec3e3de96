"""Neural-network ops: activations, softmax, normalization, losses, pooling, upsampling.

Formulas follow PyTorch's CPU kernels (same comparisons at the edges, same clamps), so
values match CPU, not just the math. Low-precision floats are computed in float32 (as
CPU's opmath does); the dispatcher casts results back to PyTorch's result dtype.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import aten, lower

_LOW = (jnp.bfloat16, jnp.float16)


def _up(x):
    """float32 for bfloat16/float16 arrays (CPU computes these in float)."""
    if hasattr(x, "dtype") and x.dtype in _LOW:
        return x.astype(jnp.float32)
    return x


def _reduce(loss, reduction):
    if reduction == 1:
        return jnp.mean(loss)
    if reduction == 2:
        return jnp.sum(loss)
    return loss


def _grad_scale(grad, reduction, numel):
    """The upstream gradient as each element sees it (mean divides by the count)."""
    return grad / numel if reduction == 1 else grad


# ---- activations --------------------------------------------------------------------------


@lower(aten.relu.default)
def relu(self):
    return jnp.maximum(self, jnp.zeros((), self.dtype))


@lower(aten.threshold.default)
def threshold(self, threshold, value):
    return jnp.where(self <= threshold, value, self)


@lower(aten.threshold_backward.default)
def threshold_backward(grad_output, self, threshold):
    return jnp.where(self <= threshold, 0, grad_output)


_SQRT1_2 = 1 / math.sqrt(2)
_GELU_BETA = math.sqrt(2) * (2 / math.sqrt(math.pi)) * 0.5
_GELU_KAPPA = 0.044715


@lower(aten.gelu.default)
def gelu(self, approximate="none"):
    x = _up(self)
    if approximate == "tanh":
        return 0.5 * x * (1 + jnp.tanh(_GELU_BETA * (x + _GELU_KAPPA * x * x * x)))
    return x * 0.5 * (1 + jax.scipy.special.erf(x * _SQRT1_2))


@lower(aten.gelu_backward.default)
def gelu_backward(grad_output, self, approximate="none"):
    x, g = _up(self), _up(grad_output)
    if approximate == "tanh":
        inner = _GELU_BETA * (x + _GELU_KAPPA * x * x * x)
        t = jnp.tanh(inner)
        left = 0.5 * x
        right_d = left * (1 - t * t) * _GELU_BETA * (1 + 3 * _GELU_KAPPA * x * x)
        return g * (0.5 * (1 + t) + right_d)
    cdf = 0.5 * (1 + jax.scipy.special.erf(x * _SQRT1_2))
    pdf = jnp.exp(-0.5 * x * x) * (_SQRT1_2 / math.sqrt(math.pi))
    return g * (cdf + x * pdf)


@lower(aten.silu.default)
def silu(self):
    x = _up(self)
    return x / (1 + jnp.exp(-x))


@lower(aten.silu_backward.default)
def silu_backward(grad_output, self):
    x = _up(self)
    s = 1 / (1 + jnp.exp(-x))
    return _up(grad_output) * s * (1 + x * (1 - s))


@lower(aten.sigmoid_backward.default)
def sigmoid_backward(grad_output, output):
    y = _up(output)
    return _up(grad_output) * (1 - y) * y


@lower(aten.tanh_backward.default)
def tanh_backward(grad_output, output):
    y = _up(output)
    return _up(grad_output) * (1 - y * y)


@lower(aten.softplus.default)
def softplus(self, beta=1, threshold=20):
    x = _up(self)
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


@lower(aten.softplus_backward.default)
def softplus_backward(grad_output, self, beta, threshold):
    x, g = _up(self), _up(grad_output)
    z = jnp.exp(x * beta)
    return jnp.where(x * beta > threshold, g, g * z / (z + 1))


@lower(aten.elu.default)
def elu(self, alpha=1, scale=1, input_scale=1):
    x = _up(self)
    return jnp.where(x <= 0, jnp.expm1(x * input_scale) * alpha * scale, x * scale)


@lower(aten.celu.default)
def celu(self, alpha=1.0):
    return elu(self, alpha, 1, 1 / alpha)


@lower(aten.elu_backward.default)
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    y, g = _up(self_or_result), _up(grad_output)
    if is_result:
        neg = g * input_scale * (y + alpha * scale)
    else:
        neg = g * input_scale * alpha * scale * jnp.exp(y * input_scale)
    return jnp.where(y <= 0, neg, g * scale)


@lower(aten.leaky_relu.default)
def leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * negative_slope)


@lower(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    return jnp.where(self > 0, grad_output, grad_output * negative_slope)


@lower(aten.hardtanh.default)
def hardtanh(self, min_val=-1, max_val=1):
    return jnp.where(self < min_val, min_val, jnp.where(self > max_val, max_val, self))


@lower(aten.hardtanh_backward.default)
def hardtanh_backward(grad_output, self, min_val, max_val):
    return jnp.where((self <= min_val) | (self >= max_val), 0, grad_output)


@lower(aten.hardsigmoid.default)
def hardsigmoid(self):
    return jnp.clip(_up(self) + 3, 0, 6) / 6


@lower(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad_output, self):
    return jnp.where((self > -3) & (self < 3), _up(grad_output) / 6, 0)


@lower(aten.hardswish.default)
def hardswish(self):
    x = _up(self)
    return x * jnp.clip(x + 3, 0, 6) / 6


@lower(aten.hardswish_backward.default)
def hardswish_backward(grad_output, self):
    x, g = _up(self), _up(grad_output)
    return jnp.where(x < -3, 0, jnp.where(x <= 3, g * (x / 3 + 0.5), g))


@lower(aten.mish.default)
def mish(self):
    x = _up(self)
    return x * jnp.tanh(jax.nn.softplus(x))


@lower(aten.mish_backward.default)
def mish_backward(grad_output, self):
    x = _up(self)
    s = jax.nn.sigmoid(x)
    t = jnp.tanh(jax.nn.softplus(x))
    return _up(grad_output) * (t + x * s * (1 - t * t))


@lower(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(self):
    x = _up(self)
    z = jnp.exp(-jnp.abs(x))
    return jnp.minimum(x, 0) - jnp.log1p(z), z


@lower(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad_output, self, buffer):
    # the buffer is exp(-|x|); recomputed so any buffer (even an empty one) works
    x = _up(self)
    z = jnp.exp(-jnp.abs(x))
    neg = x < 0
    return (jnp.where(neg, 1, 0) - jnp.where(neg, 1, -1) * (z / (1 + z))) * _up(grad_output)


def _halves(x, dim):
    return jnp.split(x, 2, axis=dim)


@lower(aten.glu.default)
def glu(self, dim=-1):
    a, b = _halves(_up(self), dim)
    return a * jax.nn.sigmoid(b)


@lower(aten.glu_backward.default)
def glu_backward(grad_output, self, dim):
    a, b = _halves(_up(self), dim)
    s = jax.nn.sigmoid(b)
    g = _up(grad_output)
    return jnp.concatenate([g * s, g * a * s * (1 - s)], axis=dim)


@lower(aten._prelu_kernel.default)
def prelu_kernel(self, weight):
    return jnp.where(self > 0, self, weight * self)


@lower(aten._prelu_kernel_backward.default)
def prelu_kernel_backward(grad_output, self, weight):
    # both gradients have the broadcast shape; autograd sums the weight's down
    pos = self > 0
    shape = jnp.broadcast_shapes(self.shape, weight.shape)
    gx = jnp.where(pos, grad_output, weight * grad_output)
    gw = jnp.where(pos, 0, self * grad_output)
    return jnp.broadcast_to(gx, shape), jnp.broadcast_to(gw, shape)


# ---- softmax ------------------------------------------------------------------------------


def _axis(x, dim):
    """The softmax axis; a 0-d tensor is one element (None: over everything)."""
    return None if x.ndim == 0 else dim


@lower(aten._softmax.default)
def softmax(self, dim, half_to_float):
    return jax.nn.softmax(_up(self), axis=_axis(self, dim))


@lower(aten._log_softmax.default)
def log_softmax(self, dim, half_to_float):
    return jax.nn.log_softmax(_up(self), axis=_axis(self, dim))


@lower(aten._safe_softmax.default)
def safe_softmax(self, dim, dtype=None):
    # rows that are all -inf (fully masked attention) give zeros, not NaN
    x, axis = _up(self), _axis(self, dim)
    masked = jnp.all(x == -jnp.inf, axis=axis, keepdims=True)
    return jnp.where(masked, 0, jax.nn.softmax(x, axis=axis))


@lower(aten._softmax_backward_data.default)
def softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y, axis = _up(grad_output), _up(output), _axis(output, dim)
    return y * (g - jnp.sum(g * y, axis=axis, keepdims=True))


@lower(aten._log_softmax_backward_data.default)
def log_softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y, axis = _up(grad_output), _up(output), _axis(output, dim)
    return g - jnp.exp(y) * jnp.sum(g, axis=axis, keepdims=True)


# ---- normalization ------------------------------------------------------------------------


def _moments(x, axes):
    """Mean and biased variance (two-pass, as CPU's kernels are accurate to)."""
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    return mean, var


def _affine(y, weight, bias, shape):
    if weight is not None:
        y = y * _up(weight).reshape(shape)
    if bias is not None:
        y = y + _up(bias).reshape(shape)
    return y


@lower(aten.native_layer_norm.default)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    x = _up(input)
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean, var = _moments(x, axes)
    rstd = lax.rsqrt(var + eps)
    return _affine((x - mean) * rstd, weight, bias, tuple(normalized_shape)), mean, rstd


def _norm_input_grad(g, xhat, rstd, axes):
    """d/dx of (x - mean) * rstd given g = dL/dxhat, over the normalized axes."""
    return rstd * (g - jnp.mean(g, axes, keepdims=True) - xhat * jnp.mean(g * xhat, axes, keepdims=True))


@lower(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    x, g = _up(input), _up(grad_out)
    k = len(normalized_shape)
    axes = tuple(range(x.ndim - k, x.ndim))
    batch_axes = tuple(range(x.ndim - k))
    xhat = (x - mean) * rstd
    gx = g * _up(weight).reshape(tuple(normalized_shape)) if weight is not None else g
    dx = _norm_input_grad(gx, xhat, rstd, axes) if output_mask[0] else None
    dw = jnp.sum(g * xhat, batch_axes) if output_mask[1] else None
    db = jnp.sum(g, batch_axes) if output_mask[2] else None
    return dx, dw, db


@lower(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = _up(input).reshape(N, group, -1)
    mean, var = _moments(x, (2,))
    rstd = lax.rsqrt(var + eps)
    y = ((x - mean) * rstd).reshape(N, C, HxW)
    y = _affine(y, weight, bias, (C, 1)).reshape(input.shape)
    return y, mean.reshape(N, group), rstd.reshape(N, group)


@lower(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    x = _up(input).reshape(N, group, -1)
    g = _up(grad_out).reshape(N, C, HxW)
    mean, rstd = mean.reshape(N, group, 1), rstd.reshape(N, group, 1)
    xhat = (x - mean) * rstd
    dx = dw = db = None
    if output_mask[0]:
        gx = g * _up(weight).reshape(C, 1) if weight is not None else g
        dx = _norm_input_grad(gx.reshape(N, group, -1), xhat, rstd, (2,)).reshape(input.shape)
    if output_mask[1]:
        dw = jnp.sum(g * xhat.reshape(N, C, HxW), (0, 2))
    if output_mask[2]:
        db = jnp.sum(g, (0, 2))
    return dx, dw, db


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(output, save_mean, save_invstd, new running_mean, new running_var).

    Evaluation mode saves nothing (empty tensors, as CPU) and leaves the stats alone."""
    x = _up(input)
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (-1,) + (1,) * (x.ndim - 2)
    if not training:
        invstd = lax.rsqrt(_up(running_var) + eps)
        y = (x - _up(running_mean).reshape(shape)) * invstd.reshape(shape)
        empty = jnp.zeros((0,), x.dtype)
        return _affine(y, weight, bias, shape), empty, empty, running_mean, running_var
    mean, var = _moments(x, axes)
    invstd = lax.rsqrt(var + eps)
    y = _affine((x - mean) * invstd, weight, bias, shape)
    mean, var, invstd = mean.reshape(-1), var.reshape(-1), invstd.reshape(-1)
    new_mean = new_var = None
    if running_mean is not None:
        new_mean = ((1 - momentum) * running_mean + momentum * mean).astype(running_mean.dtype)
    if running_var is not None:
        n = x.size // x.shape[1]
        unbiased = var * (n / max(n - 1, 1))
        new_var = ((1 - momentum) * running_var + momentum * unbiased).astype(running_var.dtype)
    return y, mean, invstd, new_mean, new_var


@lower(aten.native_batch_norm.default, mutates=("running_mean", "running_var"))
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@lower(aten._native_batch_norm_legit.default, mutates=("running_mean", "running_var"))
def native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@lower(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    return _batch_norm(input, weight, bias, None, None, training, momentum, eps)[:3]


@lower(aten._native_batch_norm_legit_functional.default)
def native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@lower(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


def _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                         train, eps, output_mask):
    x, g = _up(input), _up(grad_out)
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (-1,) + (1,) * (x.ndim - 2)
    if train:
        mean, invstd = _up(save_mean), _up(save_invstd)
    else:
        mean, invstd = _up(running_mean), lax.rsqrt(_up(running_var) + eps)
    mean, invstd = mean.reshape(shape), invstd.reshape(shape)
    xhat = (x - mean) * invstd
    w = _up(weight).reshape(shape) if weight is not None else 1
    dx = dw = db = None
    if output_mask[0]:
        dx = w * _norm_input_grad(g, xhat, invstd, axes) if train else g * invstd * w
    if output_mask[1]:
        dw = jnp.sum(g * xhat, axes)
    if output_mask[2]:
        db = jnp.sum(g, axes)
    return dx, dw, db


@lower(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                               train, eps, output_mask):
    return _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                                train, eps, output_mask)


@lower(aten.batch_norm_backward.default)
def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps,
                        output_mask, reserve):
    # save_var holds the inverse standard deviation, as native_batch_norm's save_invstd
    return _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var,
                                update, eps, output_mask)
