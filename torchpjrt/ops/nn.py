"""Neural-network ops: activations, softmax, normalization, losses, pooling, upsampling.

Formulas follow PyTorch's CPU kernels (same comparisons at the edges, same clamps), so
values match CPU, not just the math. Low-precision floats are computed in float32 (as
CPU's opmath does); the dispatcher casts results back to PyTorch's result dtype.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..dtypes import LOW_PRECISION
from . import TABLE, DeviceCheck, aten, check_vector, first_bad, lower



def _up(x):
    """float32 for bfloat16/float16 arrays (CPU computes these in float)."""
    if hasattr(x, "dtype") and x.dtype in LOW_PRECISION:
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
    if self.dtype == jnp.bool_:
        raise RuntimeError("Boolean inputs not supported for relu")
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
    x = _up(input).reshape(N, group, C // group * HxW)
    mean, var = _moments(x, (2,))
    rstd = lax.rsqrt(var + eps)
    y = ((x - mean) * rstd).reshape(N, C, HxW)
    y = _affine(y, weight, bias, (C, 1)).reshape(input.shape)
    return y, mean.reshape(N, group), rstd.reshape(N, group)


@lower(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    x = _up(input).reshape(N, group, C // group * HxW)
    g = _up(grad_out).reshape(N, C, HxW)
    mean, rstd = mean.reshape(N, group, 1), rstd.reshape(N, group, 1)
    xhat = (x - mean) * rstd
    dx = dw = db = None
    if output_mask[0]:
        gx = g * _up(weight).reshape(C, 1) if weight is not None else g
        dx = _norm_input_grad(gx.reshape(x.shape), xhat, rstd, (2,)).reshape(input.shape)
    if output_mask[1]:
        dw = jnp.sum(g * xhat.reshape(N, C, HxW), (0, 2))
    if output_mask[2]:
        db = jnp.sum(g, (0, 2))
    return dx, dw, db


def _stats_dtype(input, *params):
    """CPU keeps batch-norm statistics in float32 when a low-precision input comes with
    float32 parameters, else in the input's dtype."""
    mixed = input.dtype in LOW_PRECISION and any(p is not None and p.dtype == jnp.float32 for p in params)
    return jnp.float32 if mixed else input.dtype


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(output, save_mean, save_invstd, new running_mean, new running_var), dtypes as CPU's.

    Evaluation mode saves nothing (empty tensors, as CPU) and leaves the stats alone."""
    x = _up(input)
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (-1,) + (1,) * (x.ndim - 2)
    stats_dtype = _stats_dtype(input, weight, bias, running_mean, running_var)
    if not training:
        invstd = lax.rsqrt(_up(running_var) + eps)
        y = _affine((x - _up(running_mean).reshape(shape)) * invstd.reshape(shape), weight, bias, shape)
        empty = jnp.zeros((0,), stats_dtype)
        return y.astype(input.dtype), empty, empty, running_mean, running_var
    mean, var = _moments(x, axes)
    invstd = lax.rsqrt(var + eps)
    y = _affine((x - mean) * invstd, weight, bias, shape)
    mean, var, invstd = mean.reshape(-1), var.reshape(-1), invstd.reshape(-1)
    new_mean = new_var = None
    if running_mean is not None:
        new_mean = ((1 - momentum) * running_mean + momentum * mean).astype(running_mean.dtype)
    if running_var is not None:
        n = math.prod(x.shape[a] for a in axes)
        unbiased = var * (n / max(n - 1, 1))
        new_var = ((1 - momentum) * running_var + momentum * unbiased).astype(running_var.dtype)
    return y.astype(input.dtype), mean.astype(stats_dtype), invstd.astype(stats_dtype), new_mean, new_var


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


def _reserve():
    """The (unused) cuDNN reserve space of the _batch_norm_* ops: empty bytes."""
    return jnp.zeros((0,), jnp.uint8)


@lower(aten._batch_norm_with_update.default, mutates=("running_mean", "running_var"))
def batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    y, mean, invstd, rm, rv = _batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return y, mean, invstd, _reserve(), rm, rv


@lower(aten._batch_norm_with_update_functional.default)
def batch_norm_with_update_functional(input, weight, bias, running_mean, running_var, momentum, eps):
    return batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps)


@lower(aten._batch_norm_no_update.default)
def batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    y, mean, invstd = _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]
    return y, mean, invstd, _reserve()


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


@lower(aten._weight_norm_interface_backward.default)
def weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    # as CPU's kernel: per slice along `dim`, s = sum(grad_w * v), grad_g = s / norm and
    # grad_v = (g / norm) * grad_w - (g / norm) * s / norm^2 * v, in float32 for low precision
    v, gw = _up(saved_v), _up(grad_w)
    dim = dim % v.ndim
    axes = tuple(i for i in range(v.ndim) if i != dim)
    norm = _up(saved_norms).reshape([v.shape[i] if i == dim else 1 for i in range(v.ndim)])
    g = _up(saved_g).reshape(norm.shape)
    s = jnp.sum(gw * v, axes, keepdims=True)
    a = g / norm
    grad_v = a * gw - (a * s / (norm * norm)) * v
    grad_g = (s / norm).reshape(saved_g.shape)
    return grad_v.astype(saved_v.dtype), grad_g.astype(saved_g.dtype)


# ---- recurrent cells ----------------------------------------------------------------------
# nn.LSTM and nn.GRU on a PrivateUse1 device run each step through these fused cells (as on CUDA),
# with the gate products computed by matmuls outside. The workspace is what the backward needs:
# the activated LSTM gates [i, f, g, o]; for GRU [r, z, n, hx, the hidden n-gate product with its
# bias], as CUDA's kernels keep them. In float32 for float16/bfloat16, as CUDA's opmath.


def _cell_gates(input_gates, hidden_gates, input_bias, hidden_bias):
    x, h = _up(input_gates), _up(hidden_gates)
    if input_bias is not None:
        x = x + _up(input_bias)
    if hidden_bias is not None:
        h = h + _up(hidden_bias)
    return x, h


@lower(aten._thnn_fused_lstm_cell.default)
def thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    x, h = _cell_gates(input_gates, hidden_gates, input_bias, hidden_bias)
    i, f, g, o = jnp.split(x + h, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * _up(cx) + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=1)


@lower(aten._thnn_fused_lstm_cell_backward_impl.default)
def thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    if grad_hy is None and grad_cy is None:
        return None, None, None
    i, f, g, o = jnp.split(_up(workspace), 4, axis=1)
    tanh_cy = jnp.tanh(_up(cy))
    ghy = _up(grad_hy) if grad_hy is not None else jnp.zeros_like(tanh_cy)
    gc = ghy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        gc = gc + _up(grad_cy)
    grad_gates = jnp.concatenate([gc * g * (1 - i) * i, gc * _up(cx) * (1 - f) * f, gc * i * (1 - g * g),
                                  ghy * tanh_cy * (1 - o) * o], axis=1)
    return grad_gates, gc * f, jnp.sum(grad_gates, 0) if has_bias else None


@lower(aten._thnn_fused_gru_cell.default)
def thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    x, h = _cell_gates(input_gates, hidden_gates, input_bias, hidden_bias)
    xr, xz, xn = jnp.split(x, 3, axis=1)
    hr, hz, hn = jnp.split(h, 3, axis=1)
    r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
    n = jnp.tanh(xn + r * hn)
    prev = _up(hx)
    hy = n + z * (prev - n)
    dtype = input_gates.dtype  # no meta kernel casts the results back
    return hy.astype(dtype), jnp.concatenate([r, z, n, prev, hn], axis=1).astype(dtype)


@lower(aten._thnn_fused_gru_cell_backward.default)
def thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, prev, hn = jnp.split(_up(workspace), 5, axis=1)
    g = _up(grad_hy)
    gz = g * (prev - n) * (1 - z) * z
    gn = g * (1 - z) * (1 - n * n)
    gr = gn * hn * (1 - r) * r
    grad_input = jnp.concatenate([gr, gz, gn], axis=1)
    grad_hidden = jnp.concatenate([gr, gz, gn * r], axis=1)
    dtype = grad_hy.dtype
    out = [grad_input.astype(dtype), grad_hidden.astype(dtype), (g * z).astype(dtype)]
    if has_bias:
        return (*out, jnp.sum(grad_input, 0).astype(dtype), jnp.sum(grad_hidden, 0).astype(dtype))
    return (*out, None, None)


# ---- losses (reduction: 0 none, 1 mean, 2 sum) --------------------------------------------


def _nll_parts(self, target, weight, ignore_index):
    """Per-element (-weighted picked log-prob, weight), class axis 1 (batched form)."""
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    picked = jnp.take_along_axis(self, jnp.expand_dims(safe, 1), axis=1).squeeze(1)
    w = jnp.ones((), self.dtype) if weight is None else _up(weight)[safe]
    w = jnp.where(valid, w, 0)
    return -picked * w, w


def _batched(self, target):
    """nll on a single sample (C,) with a 0-d target is the batch of one."""
    if self.ndim == 1:
        return self[None], target[None]
    return self, target


def _nll_forward(self, target, weight, reduction, ignore_index):
    x, t = _batched(_up(self), target)
    loss, w = _nll_parts(x, t, weight, ignore_index)
    if reduction == 0:
        return loss.reshape(target.shape), jnp.zeros((), x.dtype)
    total = jnp.sum(w)
    if reduction == 2:
        return jnp.sum(loss), total
    return jnp.sum(loss) / total, total


def _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    x, t = _batched(self, target)
    valid = t != ignore_index
    safe = jnp.where(valid, t, 0)
    w = jnp.ones((), jnp.float32) if weight is None else _up(weight)[safe]
    g = _up(grad_output).reshape(t.shape) if reduction == 0 else _up(grad_output)
    if reduction == 1:
        g = g / total_weight
    per = jnp.where(valid, -w * g, 0)
    hit = jnp.expand_dims(safe, 1) == lax.broadcasted_iota(safe.dtype, x.shape, 1)
    return jnp.where(hit, jnp.expand_dims(per, 1), 0).reshape(self.shape)


def _nll_targets_in_range(self, target, weight, reduction, ignore_index):
    classes = self.shape[-1] if self.ndim == 1 else self.shape[1]
    flat = target.reshape(-1).astype(jnp.int64)
    if flat.size == 0:
        return check_vector(False, 0)
    failed, position = first_bad(((flat < 0) | (flat >= classes)) & (flat != ignore_index))
    return check_vector(failed, flat[position])


@lower(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default,
       check=DeviceCheck(_nll_targets_in_range, lambda target: IndexError(f"Target {target} is out of bounds.")))
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll_forward(self, target, weight, reduction, ignore_index)


@lower(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    return _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)


def _loss_backward(grad_output, self, target, reduction, dloss):
    """grad_output times d(loss)/d(self) per element, with mean's 1/numel."""
    diff = _up(self) - _up(target)
    return _grad_scale(_up(grad_output), reduction, diff.size) * dloss(diff)


@lower(aten.mse_loss.default)
def mse_loss(self, target, reduction=1):
    return _reduce(jnp.square(_up(self) - _up(target)), reduction)


@lower(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output, self, target, reduction):
    return _loss_backward(grad_output, self, target, reduction, lambda d: 2 * d)


@lower(aten.smooth_l1_loss.default)
def smooth_l1_loss(self, target, reduction=1, beta=1.0):
    z = jnp.abs(_up(self) - _up(target))
    if beta == 0:
        return _reduce(z, reduction)
    return _reduce(jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta), reduction)


@lower(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    def d(x):
        inner = x / beta if beta else jnp.zeros_like(x)
        return jnp.where(x <= -beta, -1, jnp.where(x >= beta, 1, inner))

    return _loss_backward(grad_output, self, target, reduction, d)


@lower(aten.huber_loss.default)
def huber_loss(self, target, reduction=1, delta=1.0):
    z = jnp.abs(_up(self) - _up(target))
    return _reduce(jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta)), reduction)


@lower(aten.huber_loss_backward.default)
def huber_loss_backward(grad_output, self, target, reduction, delta):
    return _loss_backward(grad_output, self, target, reduction,
                          lambda x: jnp.where(x < -delta, -delta, jnp.where(x > delta, delta, x)))


@lower(aten.binary_cross_entropy.default)
def binary_cross_entropy(self, target, weight=None, reduction=1):
    x, t = _up(self), _up(target)
    # CPU clamps each log at -100 so that 0 * log(0) stays finite
    loss = (t - 1) * jnp.maximum(jnp.log1p(-x), -100) - t * jnp.maximum(jnp.log(x), -100)
    if weight is not None:
        loss = loss * _up(weight)
    return _reduce(loss, reduction)


@lower(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    x, t = _up(self), _up(target)
    g = _grad_scale(_up(grad_output), reduction, x.size)
    grad = g * (x - t) / jnp.maximum((1 - x) * x, 1e-12)
    return grad * _up(weight) if weight is not None else grad


@lower(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=1):
    x, t = _up(self), _up(target)
    log_sig = log_sigmoid_forward(x)[0]
    if pos_weight is not None:
        log_sig = log_sig * ((_up(pos_weight) - 1) * t + 1)
    loss = (1 - t) * x - log_sig
    if weight is not None:
        loss = loss * _up(weight)
    return _reduce(loss, reduction)


@lower(aten.soft_margin_loss.default)
def soft_margin_loss(self, target, reduction=1):
    return _reduce(jnp.log1p(jnp.exp(-_up(self) * _up(target))), reduction)


@lower(aten.soft_margin_loss_backward.default)
def soft_margin_loss_backward(grad_output, self, target, reduction):
    x, t = _up(self), _up(target)
    z = jnp.exp(-t * x)
    return -_grad_scale(_up(grad_output), reduction, x.size) * t * z / (1 + z)


def _rows(self):
    """(N, C) view of a (C,) / (N, C) / 0-d (one class) input, and C."""
    c = self.shape[-1] if self.ndim else 1
    return _up(self).reshape(-1, c), c


def _row_grad(grad_output, reduction, n):
    """grad_output as an (N, 1) column (reduction none) or a scaled scalar."""
    g = _up(grad_output)
    return g.reshape(-1, 1) if reduction == 0 else _grad_scale(g, reduction, n)


def _margins(self, target, margin):
    """(N, C) hinge terms margin - x[y] + x[i], the mask i == y, and y."""
    x, _ = _rows(self)
    t = target.reshape(-1)
    is_target = t[:, None] == jnp.arange(x.shape[1])[None]
    picked = jnp.take_along_axis(x, t[:, None], axis=1)
    return margin - picked + x, is_target, t


@lower(aten.multi_margin_loss.default, static=("p",))
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=1):
    z, is_target, t = _margins(self, target, margin)
    h = jnp.where(is_target | (z <= 0), 0, z if p == 1 else z * z)
    if weight is not None:
        h = h * _up(weight)[t][:, None]
    loss = jnp.sum(h, axis=1) / z.shape[1]
    return _reduce(loss.reshape(target.shape), reduction)


@lower(aten.multi_margin_loss_backward.default, static=("p",))
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=1):
    z, is_target, t = _margins(self, target, margin)
    d = jnp.where(is_target | (z <= 0), 0, 1 if p == 1 else 2 * z)
    if weight is not None:
        d = d * _up(weight)[t][:, None]
    d = d - is_target * jnp.sum(d, axis=1, keepdims=True)
    g = _row_grad(grad_output, reduction, z.shape[0])
    return (g * d / z.shape[1]).reshape(self.shape)


def _multilabel_targets(target, n_classes):
    """(N, C) mask of the target classes: the labels before the first -1."""
    t = target.reshape(-1, n_classes)
    valid = jnp.cumprod(t >= 0, axis=1).astype(bool)
    hits = (t[:, :, None] == jnp.arange(n_classes)[None, None]) & valid[:, :, None]
    return jnp.any(hits, axis=1), t, valid


@lower(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(self, target, reduction):
    x, c = _rows(self)
    is_target, t, valid = _multilabel_targets(target, c)
    picked = jnp.take_along_axis(x, jnp.where(valid, t, 0), axis=1)
    h = jnp.maximum(1 - picked[:, :, None] + x[:, None, :], 0)
    h = jnp.where(valid[:, :, None] & ~is_target[:, None, :], h, 0)
    loss = (jnp.sum(h, axis=(1, 2)) / c).reshape(self.shape[:-1] if self.ndim > 1 else ())
    return _reduce(loss, reduction), is_target.reshape(target.shape).astype(self.dtype)


@lower(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    x, c = _rows(self)
    is_t, t, valid = _multilabel_targets(target, c)
    safe = jnp.where(valid, t, 0)
    picked = jnp.take_along_axis(x, safe, axis=1)
    active = (1 - picked[:, :, None] + x[:, None, :] > 0) & valid[:, :, None] & ~is_t[:, None, :]
    active = active.astype(x.dtype)
    # each active (label j, class i) pair adds +1 to class i and -1 to label j's class
    d = jnp.sum(active, axis=1)
    d = d - jnp.sum(jax.nn.one_hot(safe, c, dtype=x.dtype) * jnp.sum(active, axis=2)[:, :, None], axis=1)
    return (_row_grad(grad_output, reduction, x.shape[0]) * d / c).reshape(self.shape)


# ---- pooling ------------------------------------------------------------------------------
# Windows are gathered with static index tables: per spatial dim, `pos` (out, k) holds the
# input position each window element reads and `ok` whether it is inside the input.


def _expand(v, n):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _pool_out_size(size, k, s, p, d, ceil_mode):
    """PyTorch's pooling_output_shape."""
    span = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = span // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _sliding(size, k, s, p, d, ceil_mode):
    out = _pool_out_size(size, k, s, p, d, ceil_mode)
    pos = np.arange(out)[:, None] * s - p + np.arange(k)[None] * d
    return pos, (pos >= 0) & (pos < size)


def _adaptive(size, out):
    """Adaptive windows [floor(o*size/out), ceil((o+1)*size/out)), padded to the widest."""
    o = np.arange(out)
    start = (o * size) // out
    end = -((-(o + 1) * size) // out)
    k = int((end - start).max()) if out else 0
    pos = start[:, None] + np.arange(k)[None]
    return pos, pos < end[:, None]


def _window_table(sizes, dims):
    """Flat input index (out..., K) and validity for per-dim (pos, ok) tables."""
    n = len(dims)
    flat = np.zeros((1,) * (2 * n), np.int64)
    ok = np.ones((1,) * (2 * n), bool)
    stride = 1
    for i in reversed(range(n)):
        pos, valid = dims[i]
        shape = [1] * (2 * n)
        shape[i], shape[n + i] = pos.shape
        flat = flat + np.clip(pos, 0, sizes[i] - 1).reshape(shape) * stride
        ok = ok & valid.reshape(shape)
        stride *= sizes[i]
    out = flat.shape[:n]
    return flat.reshape(out + (-1,)), ok.reshape(out + (-1,))


def _gather_windows(x, n, dims, fill):
    """x (..., *spatial) -> (..., *out, K) windows, out-of-input elements set to fill."""
    lead, sizes = x.shape[:-n], x.shape[-n:]
    flat, ok = _window_table(sizes, dims)
    xf = x.reshape(lead + (math.prod(sizes),))
    w = xf[..., jnp.asarray(flat)]
    return jnp.where(jnp.asarray(ok), w, jnp.asarray(fill, x.dtype)), flat


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _max_windows(x, n, dims):
    """(values, flat input indices) of each window's max; NaN wins, ties take the first."""
    w, flat = _gather_windows(x, n, dims, _lowest(x.dtype))
    arg = jnp.argmax(w, axis=-1)
    vals = jnp.take_along_axis(w, arg[..., None], axis=-1)[..., 0]
    table = jnp.broadcast_to(jnp.asarray(flat), arg.shape + flat.shape[-1:])
    return vals, jnp.take_along_axis(table, arg[..., None], axis=-1)[..., 0]


def _scatter_windows(grad_output, self, indices, n):
    """Each output's gradient added at the input position its max came from."""
    lead = self.shape[:-n]
    n_out = math.prod(grad_output.shape[-n:])
    g = _up(grad_output).reshape(lead + (n_out,))
    idx = indices.reshape(lead + (n_out,))
    zeros = jnp.zeros(lead + (math.prod(self.shape[-n:]),), g.dtype)
    rows = tuple(jnp.indices(idx.shape)[:-1])
    return zeros.at[rows + (idx,)].add(g).reshape(self.shape)


def _max_pool_dims(self, n, kernel_size, stride, padding, dilation, ceil_mode):
    k = _expand(kernel_size, n)
    s = _expand(stride, n) if stride else k
    p, d = _expand(padding, n), _expand(dilation, n)
    sizes = self.shape[-n:]
    return [_sliding(sizes[i], k[i], s[i], p[i], d[i], ceil_mode) for i in range(n)]


def _max_pool(self, n, kernel_size, stride, padding, dilation, ceil_mode):
    dims = _max_pool_dims(self, n, kernel_size, stride, padding, dilation, ceil_mode)
    return _max_windows(self, n, dims)


@lower(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 2, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 3, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):
    return _scatter_windows(grad_output, self, indices, 2)


@lower(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):
    return _scatter_windows(grad_output, self, indices, 3)


def _adaptive_dims(self, n, output_size):
    sizes = self.shape[-n:]
    return [_adaptive(sizes[i], output_size[i]) for i in range(n)]


@lower(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(self, output_size):
    return _max_windows(self, 2, _adaptive_dims(self, 2, output_size))


@lower(aten.adaptive_max_pool3d.default)
def adaptive_max_pool3d(self, output_size):
    return _max_windows(self, 3, _adaptive_dims(self, 3, output_size))


@lower(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _scatter_windows(grad_output, self, indices, 2)


@lower(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _scatter_windows(grad_output, self, indices, 3)


def _mean_windows(x, n, dims, divisor):
    w, _ = _gather_windows(_up(x), n, dims, 0)
    return jnp.sum(w, axis=-1) / divisor


def _adaptive_avg(self, n, output_size):
    dims = _adaptive_dims(self, n, output_size)
    _, ok = _window_table(self.shape[-n:], dims)
    return _mean_windows(self, n, dims, jnp.asarray(ok.sum(-1), jnp.float32))


def _adaptive_avg_backward(grad_output, self, n):
    f = lambda x: _adaptive_avg(x, n, grad_output.shape[-n:])
    return jax.vjp(f, _up(self))[1](_up(grad_output))[0]


@lower(aten._adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(self, output_size):
    return _adaptive_avg(self, 2, output_size)


@lower(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(self, output_size):
    return _adaptive_avg(self, 3, output_size)


@lower(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad_output, self):
    return _adaptive_avg_backward(grad_output, self, 2)


@lower(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad_output, self):
    return _adaptive_avg_backward(grad_output, self, 3)


def _avg_divisor(sizes, k, s, p, ceil_mode, count_include_pad, divisor_override):
    """Per-output divisors as CPU computes them (padding counts, the ceil overhang not)."""
    if divisor_override:
        return divisor_override
    div = np.ones((), np.float32)
    for i, size in enumerate(sizes):
        out = _pool_out_size(size, k[i], s[i], p[i], 1, ceil_mode)
        start = np.arange(out) * s[i] - p[i]
        end = np.minimum(start + k[i], size + p[i])
        if not count_include_pad:
            start, end = np.maximum(start, 0), np.minimum(end, size)
        div = np.multiply.outer(div, (end - start).astype(np.float32))
    return jnp.asarray(div)


def _avg_pool(self, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    k = _expand(kernel_size, n)
    s = _expand(stride, n) if stride else k
    p = _expand(padding, n)
    sizes = self.shape[-n:]
    dims = [_sliding(sizes[i], k[i], s[i], p[i], 1, ceil_mode) for i in range(n)]
    div = _avg_divisor(sizes, k, s, p, ceil_mode, count_include_pad, divisor_override)
    return _mean_windows(self, n, dims, div)


def _avg_pool_backward(grad_output, self, n, *args):
    f = lambda x: _avg_pool(x, n, *args)
    return jax.vjp(f, _up(self))[1](_up(grad_output))[0]


@lower(aten.avg_pool2d.default)
def avg_pool2d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lower(aten.avg_pool3d.default)
def avg_pool3d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lower(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    return _avg_pool_backward(grad_output, self, 2, kernel_size, stride, padding, ceil_mode,
                              count_include_pad, divisor_override)


@lower(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    return _avg_pool_backward(grad_output, self, 3, kernel_size, stride, padding, ceil_mode,
                              count_include_pad, divisor_override)


# ---- upsampling ---------------------------------------------------------------------------
# Each spatial axis is resampled on its own, innermost first (the order CPU's kernels
# accumulate in), with source indices and weights computed in numpy the way CPU does
# (float32 arithmetic for float32/bfloat16 inputs; uint8 images in fixed point, as CPU's
# kernel for them, see _fixed_point_taps).


def _opmath(x):
    return np.float64 if x.dtype == jnp.float64 else np.float32


def _scale_value(scale, in_size, out_size, t):
    """compute_scales_value: 1/scale when a scale was given, else in/out."""
    if scale is not None and scale > 0:
        return t(1.0 / scale)
    return t(in_size) / t(out_size)


def _nearest_index(in_size, out_size, scale, exact):
    o = np.arange(out_size)
    if out_size == in_size:
        return o
    if not exact and out_size == 2 * in_size:
        return o >> 1
    s = _scale_value(scale, in_size, out_size, np.float32)
    src = np.float32((o + 0.5) * np.float64(s)) if exact else o.astype(np.float32) * s
    return np.minimum(np.floor(src).astype(np.int64), in_size - 1)


def _resample_axis(x, axis, idx, w):
    """x with `axis` replaced by sum_t x[idx[:, t]] * w[:, t] (w None: a plain gather)."""
    shape = [1] * x.ndim
    shape[axis] = -1
    out = None
    for t in range(idx.shape[1]):
        term = jnp.take(x, jnp.asarray(idx[:, t]), axis=axis)
        if w is not None:
            term = term * jnp.asarray(w[:, t], x.dtype).reshape(shape)
        out = term if out is None else out + term
    return out


def _resample(x, n, taps):
    """x (..., *spatial) with each of its last n axes resampled by its (idx, w), innermost first."""
    for i in reversed(range(n)):
        x = _resample_axis(x, x.ndim - n + i, *taps[i])
    return x


def _nearest(x, output_size, scales, exact):
    n = len(output_size)
    sizes = x.shape[-n:]
    taps = [(_nearest_index(sizes[i], output_size[i], scales[i], exact)[:, None], None) for i in range(n)]
    return _resample(x, n, taps)


def _source_scale(in_size, out_size, align_corners, scale, t):
    if align_corners:
        return t(in_size - 1) / t(out_size - 1) if out_size > 1 else t(0)
    return _scale_value(scale, in_size, out_size, t)


def _source_index(in_size, out_size, align_corners, scale, t, cubic):
    """Real-valued source positions (area_pixel_compute_source_index)."""
    s = _source_scale(in_size, out_size, align_corners, scale, t)
    o = np.arange(out_size).astype(t)
    if align_corners:
        return s * o
    src = s * (o + t(0.5)) - t(0.5)
    return src if cubic else np.maximum(src, t(0))


def _guard(src, in_size, t):
    i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    lam = np.clip(src - i0.astype(t), t(0), t(1)).astype(t)
    return i0, lam


def _linear_taps(in_size, out_size, align_corners, scale, t):
    i0, lam = _guard(_source_index(in_size, out_size, align_corners, scale, t, False), in_size, t)
    i1 = i0 + (i0 < in_size - 1)
    return np.stack([i0, i1], 1), np.stack([t(1) - lam, lam], 1)


def _cubic_coefficients(t):
    """The 4 cubic-convolution weights (A = -0.75) at fraction t; numpy or jax arrays."""
    a = -0.75

    def near(v):  # |v| <= 1
        return ((a + 2) * v - (a + 3)) * v * v + 1

    def far(v):  # 1 < |v| < 2
        return ((a * v - 5 * a) * v + 8 * a) * v - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _cubic_taps(in_size, out_size, align_corners, scale, t):
    i0, lam = _guard(_source_index(in_size, out_size, align_corners, scale, t, True), in_size, t)
    w = np.stack(_cubic_coefficients(lam), 1).astype(t)
    idx = np.clip(i0[:, None] - 1 + np.arange(4)[None], 0, in_size - 1)
    return idx, w


def _linear_filter(x):
    x = np.abs(x)
    return np.where(x < 1, 1 - x, 0)


def _cubic_filter(a):
    """Keys' cubic convolution kernel, in CPU's operation order (cubic_convolution1/2)."""

    def filter_fn(x):
        x = np.abs(x)
        near = ((a + 2) * x - (a + 3)) * x * x + 1
        far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
        return np.where(x < 1, near, np.where(x < 2, far, 0))

    return filter_fn


def _sequential_sum(w):
    """Row sums added left to right, as CPU's loop adds them (numpy's sum pairs them up)."""
    total = np.zeros(w.shape[:1], w.dtype)
    for j in range(w.shape[1]):
        total = total + w[:, j]
    return total


def _aa_weights(filter_fn, interp_size, in_size, out_size, align_corners, scale, t):
    """Antialiased windows: first source index, weights (the filter widened by the downscale
    factor, normalized; zero past the window) and the largest weight."""
    s = _source_scale(in_size, out_size, align_corners, scale, t)
    support = t(interp_size * 0.5) * s if s >= 1 else t(interp_size * 0.5)
    width = int(math.ceil(support)) * 2 + 1
    invscale = t(1) / s if s >= 1 else t(1)
    center = s * (np.arange(out_size) + 0.5).astype(t)
    xmin = np.maximum((center - support + t(0.5)).astype(np.int64), 0)
    xsize = np.clip(np.minimum((center + support + t(0.5)).astype(np.int64), in_size) - xmin, 0, width)
    j = np.arange(width)[None]
    w = filter_fn((j + xmin[:, None] - center[:, None] + t(0.5)) * invscale).astype(t)
    w = np.where(j < xsize[:, None], w, t(0))
    total = _sequential_sum(w)[:, None]
    w = np.where(total != 0, w / np.where(total != 0, total, 1), w).astype(t)
    return xmin, w, float(w.max(initial=0))


def _aa_taps(filter_fn, interp_size):
    """Antialiased taps: the filter widened by the downscale factor, weights normalized."""

    def taps(in_size, out_size, align_corners, scale, t):
        xmin, w, _ = _aa_weights(filter_fn, interp_size, in_size, out_size, align_corners, scale, t)
        return np.clip(xmin[:, None] + np.arange(w.shape[1]), 0, in_size - 1), w

    return taps


def _edge_merged_weights(filter_fn, interp_size, in_size, out_size, align_corners, scale, t):
    """Windows without antialiasing, as CPU's uint8 kernel lays them out: the float path's taps
    with those on source pixels outside the image added to the edge pixel's weight; the largest
    weight counts the partial sums too."""
    i0, lam = _guard(_source_index(in_size, out_size, align_corners, scale, t, interp_size > 2), in_size, t)
    support = interp_size // 2
    first = i0 - support + 1
    xmin = np.maximum(first, 0)
    xsize = np.clip(np.minimum(i0 + support + 1, in_size) - xmin, 0, interp_size)
    rows = np.arange(out_size)
    w = np.zeros((out_size, interp_size), t)
    slot = np.zeros(out_size, np.int64)
    largest = 0.0
    for j in range(interp_size):
        slot = np.where(first + j <= 0, 0, np.where(first + j >= in_size - 1, xsize - 1, slot))
        w[rows, slot] += filter_fn(t(j + 1 - support) - lam)
        largest = max(largest, float(w[rows, slot].max(initial=0)))
        slot = slot + 1
    return xmin, w, largest


def _fixed_point_taps(filter_fn, interp_size, antialias):
    """uint8 taps (CPU's _compute_index_ranges_int16_weights): float64 weights quantized to
    int16 with as many fraction bits as the largest weight leaves room for; None for an axis
    whose size doesn't change (CPU leaves it untouched, whatever the scale)."""
    weights_fn = _aa_weights if antialias else _edge_merged_weights

    def taps(in_size, out_size, align_corners, scale):
        if in_size == out_size:
            return None
        xmin, w, largest = weights_fn(filter_fn, interp_size, in_size, out_size, align_corners, scale, np.float64)
        bits = next((b for b in range(22) if int(0.5 + largest * (1 << (b + 1))) >= 1 << 15), 22)
        v = w * (1 << bits)
        w = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int32)
        used = np.flatnonzero(w.any(0))
        w = w[:, :used[-1] + 1 if used.size else 1]
        return np.clip(xmin[:, None] + np.arange(w.shape[1]), 0, in_size - 1), w, bits

    return taps


def _resample_fixed_point(x, n, taps):
    """uint8 images resampled axis by axis, innermost first: int32 sums, each axis rounded and
    saturated back to uint8 before the next (CPU's Pillow-derived kernel)."""
    x = x.astype(jnp.int32)
    for i in reversed(range(n)):
        if taps[i] is not None:
            idx, w, bits = taps[i]
            acc = _resample_axis(x, x.ndim - n + i, idx, w) + (1 << (bits - 1))
            x = jnp.clip(acc >> bits, 0, 255)
    return x.astype(jnp.uint8)


def _cpu_runs_generic_uint8_kernel(channels):
    # pjrt's oracle is the CPU kernel of this same machine, and which one runs depends on the
    # capability PyTorch detected at startup: with AVX2 (AVX512 reuses the AVX2 kernels) the
    # Pillow-SIMD kernel for up to 4 channels, otherwise the generic separable kernel. Both
    # compute the same values except for the generic kernel's one-pixel-wide quirk below.
    return channels > 4 or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")


def _cpu_thread_share(numel):
    """The elements each thread gets when TensorIterator splits `numel` of them (at::parallel_for
    over OpenMP, grain 32768), or all of them when it doesn't split."""
    grain, threads = 32768, torch.get_num_threads()
    if numel <= grain or threads == 1:
        return numel
    return -(-numel // min(threads, -(-numel // grain)))


def _first_row_of_each_stretch(out):
    """CPU's generic uint8 kernel, resizing the height of a one-pixel-wide image that is not
    channels_last, loops down the height with the first row's source pixels and weights: each
    stretch of rows it is handed (a whole column, or the part of one in a thread's share) gets
    the value of its first row. pjrt sees values, not layouts, and takes every input as not
    channels_last."""
    n, c, h, _ = out.shape
    flat = np.arange(n * c * h)
    share = max(_cpu_thread_share(flat.size), 1)
    first = np.maximum(flat // share * share, flat // h * h)
    return out.reshape(-1)[jnp.asarray(first)].reshape(out.shape)


def _interpolate_uint8(x, output_size, align_corners, scales, fixed_point_taps):
    sizes = x.shape[-2:]
    taps = [fixed_point_taps(sizes[i], output_size[i], align_corners, scales[i]) for i in range(2)]
    out = _resample_fixed_point(x, 2, taps)
    if taps[0] is not None and output_size[1] == 1 and _cpu_runs_generic_uint8_kernel(x.shape[1]):
        out = _first_row_of_each_stretch(out)
    return out


def _interpolate(x, output_size, align_corners, scales, taps_fn, fixed_point_taps=None):
    if x.dtype == jnp.uint8 and fixed_point_taps is not None:
        return _interpolate_uint8(x, output_size, align_corners, scales, fixed_point_taps)
    n = len(output_size)
    xf = x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.integer) else _up(x)
    t = _opmath(xf)
    sizes = x.shape[-n:]
    taps = [taps_fn(sizes[i], output_size[i], align_corners, scales[i], t) for i in range(n)]
    out = _resample(xf, n, taps)
    if jnp.issubdtype(x.dtype, jnp.integer):
        # other integer images: rounded and saturated, never wrapped around (bicubic overshoots)
        info = jnp.iinfo(x.dtype)
        out = jnp.clip(jnp.round(out), info.min, info.max)
    return out


def _transpose(forward, grad_output, input_size):
    """The backward of a linear resampling: its transpose at the input's shape."""
    g = _up(grad_output)
    return jax.linear_transpose(forward, jax.ShapeDtypeStruct(tuple(input_size), g.dtype))(g)[0]


def _nearest_ops(fwd, bwd, exact):
    @lower(fwd)
    def nearest(self, output_size, *scales):
        return _nearest(self, output_size, scales, exact)

    @lower(bwd)
    def nearest_backward(grad_output, output_size, input_size, *scales):
        return _transpose(lambda x: _nearest(x, output_size, scales, exact), grad_output, input_size)


def _interp_ops(fwd, bwd, taps_fn, fixed_point_taps=None):
    @lower(fwd)
    def interp(self, output_size, align_corners, *scales):
        return _interpolate(self, output_size, align_corners, scales, taps_fn, fixed_point_taps)

    @lower(bwd)
    def interp_backward(grad_output, output_size, input_size, align_corners, *scales):
        f = lambda x: _interpolate(x, output_size, align_corners, scales, taps_fn)
        return _transpose(f, grad_output, input_size)


for _d in (1, 2, 3):
    _nearest_ops(getattr(aten, f"upsample_nearest{_d}d").default,
                 getattr(aten, f"upsample_nearest{_d}d_backward").default, exact=False)
    _nearest_ops(getattr(aten, f"_upsample_nearest_exact{_d}d").default,
                 getattr(aten, f"_upsample_nearest_exact{_d}d_backward").default, exact=True)
_interp_ops(aten.upsample_linear1d.default, aten.upsample_linear1d_backward.default, _linear_taps)
_interp_ops(aten.upsample_bilinear2d.default, aten.upsample_bilinear2d_backward.default, _linear_taps,
            _fixed_point_taps(_linear_filter, 2, antialias=False))
_interp_ops(aten.upsample_trilinear3d.default, aten.upsample_trilinear3d_backward.default, _linear_taps)
# uint8 bicubic without antialiasing keeps the float path's A = -0.75; antialiased, Pillow's -0.5
_interp_ops(aten.upsample_bicubic2d.default, aten.upsample_bicubic2d_backward.default, _cubic_taps,
            _fixed_point_taps(_cubic_filter(-0.75), 4, antialias=False))
_interp_ops(aten._upsample_bilinear2d_aa.default, aten._upsample_bilinear2d_aa_backward.default,
            _aa_taps(_linear_filter, 2), _fixed_point_taps(_linear_filter, 2, antialias=True))
_interp_ops(aten._upsample_bicubic2d_aa.default, aten._upsample_bicubic2d_aa_backward.default,
            _aa_taps(_cubic_filter(-0.5), 4), _fixed_point_taps(_cubic_filter(-0.5), 4, antialias=True))


def _vec_output_size(x, output_size, scale_factors):
    """The `.vec` overloads' size rule (PyTorch's compute_output_size): floor(size * scale)."""
    n = len(output_size) if output_size is not None else len(scale_factors)
    if output_size is not None:
        return list(output_size), [None] * n
    return [int(math.floor(s * f)) for s, f in zip(x.shape[-n:], scale_factors)], list(scale_factors)


# Eager execution gets the `.vec` overloads decomposed (they are CompositeImplicit); compiled
# graphs keep them as core aten ops.
@lower(aten.upsample_nearest2d.vec, graph_only=True)
def upsample_nearest2d_vec(input, output_size, scale_factors):
    size, scales = _vec_output_size(input, output_size, scale_factors)
    return TABLE[aten.upsample_nearest2d.default].fn(input, size, *scales)


@lower(aten.upsample_bilinear2d.vec, graph_only=True)
def upsample_bilinear2d_vec(input, output_size, align_corners, scale_factors):
    size, scales = _vec_output_size(input, output_size, scale_factors)
    return TABLE[aten.upsample_bilinear2d.default].fn(input, size, align_corners, *scales)


# ---- im2col / col2im (F.unfold / F.fold) --------------------------------------------------


def _im2col(x, kernel_size, dilation, padding, stride):
    sizes = x.shape[-2:]
    dims = [_sliding(sizes[i], kernel_size[i], stride[i], padding[i], dilation[i], False) for i in range(2)]
    w, _ = _gather_windows(x, 2, dims, 0)  # (..., C, OH, OW, K)
    w = jnp.moveaxis(w, -1, -3)  # (..., C, K, OH, OW)
    lead = w.shape[:-4]
    return w.reshape(lead + (w.shape[-4] * w.shape[-3], w.shape[-2] * w.shape[-1]))


@lower(aten.im2col.default)
def im2col(self, kernel_size, dilation, padding, stride):
    return _im2col(self, kernel_size, dilation, padding, stride)


@lower(aten.col2im.default)
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    # col2im sums overlapping patches back: the transpose of im2col
    channels = self.shape[-2] // (kernel_size[0] * kernel_size[1])
    shape = self.shape[:-2] + (channels,) + tuple(output_size)
    return _transpose(lambda x: _im2col(x, kernel_size, dilation, padding, stride), self, shape)


# ---- grid sampling (F.grid_sample) --------------------------------------------------------
# interpolation_mode: 0 bilinear, 1 nearest, 2 bicubic; padding_mode: 0 zeros, 1 border,
# 2 reflection. The grid's last axis lists coordinates innermost dimension first (x, y, z).


def _unnormalize(coord, size, align_corners):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    c = jnp.abs(coord - low)
    extra, flips = jnp.fmod(c, span), jnp.floor(c / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _pad_coord(coord, size, padding_mode, align_corners):
    """Border clamps into the input; reflection mirrors, then clamps; zeros leaves as is."""
    if padding_mode == 2:
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
    if padding_mode in (1, 2):
        coord = jnp.clip(coord, 0, size - 1)
    # NaN, inf and huge coordinates read nothing (CPU sends them to -100)
    return jnp.where(jnp.isfinite(coord) & (jnp.abs(coord) < 2.0 ** 30), coord, -100.0)


def _sample_points(x, idx):
    """x (N, C, *S) at integer points idx (per spatial dim, (N, *O)); zero outside."""
    n_batch, channels, sizes = x.shape[0], x.shape[1], x.shape[2:]
    inside = jnp.ones(idx[0].shape, bool)
    flat = jnp.zeros(idx[0].shape, jnp.int32)
    for i, size in zip(idx, sizes):
        inside = inside & (i >= 0) & (i < size)
        flat = flat * size + jnp.clip(i, 0, size - 1).astype(jnp.int32)
    vals = jnp.take_along_axis(x.reshape(n_batch, channels, -1), flat.reshape(n_batch, 1, -1), axis=2)
    return jnp.where(inside[:, None], vals.reshape((n_batch, channels) + idx[0].shape[1:]), 0)


def _grid_linear(x, coords):
    """Sum over the 2^n corners, the x weight multiplied first (CPU's order)."""
    n = len(coords)
    low = [jnp.floor(c) for c in coords]
    out = None
    for corner in itertools.product((0, 1), repeat=n):
        w = None
        for i in reversed(range(n)):
            f = coords[i] - low[i] if corner[i] else low[i] + 1 - coords[i]
            w = f if w is None else w * f
        v = _sample_points(x, [(low[i] + corner[i]).astype(jnp.int32) for i in range(n)]) * w[:, None]
        out = v if out is None else out + v
    return out


def _grid_bicubic(x, coords, padding_mode, align_corners):
    """2-d bicubic: each tap's coordinate padded on its own, rows along x first, then y."""
    sizes = x.shape[2:]
    low = [jnp.floor(c) for c in coords]
    wy, wx = (_cubic_coefficients(c - lo) for c, lo in zip(coords, low))

    def tap(i, off):
        c = _pad_coord(low[i] + off, sizes[i], padding_mode, align_corners)
        return jnp.trunc(c).astype(jnp.int32)

    out = None
    for j in range(4):
        row = None
        for i in range(4):
            v = _sample_points(x, [tap(0, j - 1), tap(1, i - 1)]) * wx[i][:, None]
            row = v if row is None else row + v
        out = row * wy[j][:, None] if out is None else out + row * wy[j][:, None]
    return out


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    x, g = _up(input), _up(grid)
    n = x.ndim - 2
    sizes = x.shape[2:]
    raw = [_unnormalize(g[..., n - 1 - i], sizes[i], align_corners) for i in range(n)]
    if interpolation_mode == 2:
        return _grid_bicubic(x, raw, padding_mode, align_corners)
    coords = [_pad_coord(c, size, padding_mode, align_corners) for c, size in zip(raw, sizes)]
    if interpolation_mode == 1:
        return _sample_points(x, [jnp.round(c).astype(jnp.int32) for c in coords])
    return _grid_linear(x, coords)


def _grid_sample_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners,
                          output_mask):
    f = lambda x, g: _grid_sample(x, g, interpolation_mode, padding_mode, align_corners)
    out, vjp = jax.vjp(f, _up(input), _up(grid))
    gi, gg = vjp(_up(grad_output).astype(out.dtype))
    return gi if output_mask[0] else None, gg


@lower(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


@lower(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    return _grid_sample_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners,
                                 output_mask)
