"""Convolution (1d/2d/3d, grouped, dilated, transposed) and its backward.

Every form is one lax.conv_general_dilated: a transposed convolution is the gradient of
a convolution, i.e. a convolution of the stride-dilated input with the flipped kernel whose
in/out channels are swapped per group. HIGHEST precision keeps float32 exact (no TF32 or
bfloat16 passes on accelerators), so results match PyTorch's CPU kernels.
"""

import jax
import jax.numpy as jnp
from jax import lax

from ..dtypes import LOW_PRECISION
from . import aten, lower



def _dimension_numbers(n):
    if not 1 <= n <= 3:
        raise NotImplementedError(f"torchpjrt: {n}-d convolution")
    sp = "DHW"[3 - n:]
    return ("NC" + sp, "OI" + sp, "NC" + sp)


def _transposed_kernel(weight, groups):
    """(C_in, C_out/g, k...) of a transposed conv -> (C_out, C_in/g, k...) flipped."""
    c_in, c_out_g = weight.shape[:2]
    k = weight.shape[2:]
    w = weight.reshape((groups, c_in // groups, c_out_g) + k)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * c_out_g, c_in // groups) + k)
    return jnp.flip(w, axis=tuple(range(2, w.ndim)))


def _expand(v, n):
    """An int list of one value stands for all spatial dims."""
    v = list(v)
    return v * n if len(v) == 1 else v


def _check_geometry(stride, padding, dilation):
    """ATen's ConvParams checks (convolution.default skips the composite that makes them)."""
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported")
    if any(d <= 0 for d in dilation):
        raise RuntimeError("dilation should be greater than zero")


def _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups):
    n = input.ndim - 2
    stride, padding, dilation = _expand(stride, n), _expand(padding, n), _expand(dilation, n)
    _check_geometry(stride, padding, dilation)
    kwargs = dict(
        dimension_numbers=_dimension_numbers(n),
        feature_group_count=groups,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32 if input.dtype in LOW_PRECISION else None,
    )
    if not transposed:
        pads = [(p, p) for p in padding]
        return lax.conv_general_dilated(input, weight, tuple(stride), pads, rhs_dilation=tuple(dilation), **kwargs)
    # the stride becomes input dilation; padding d*(k-1)-p each side (+output_padding after)
    geometry = zip(weight.shape[2:], padding, dilation, _expand(output_padding, n))
    pads = [(d * (k - 1) - p, d * (k - 1) - p + op) for k, p, d, op in geometry]
    return lax.conv_general_dilated(input, _transposed_kernel(weight, groups), (1,) * n, pads,
                                    lhs_dilation=tuple(stride), rhs_dilation=tuple(dilation), **kwargs)


@lower(aten.convolution.default)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out


@lower(aten.convolution_backward.default)
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    def f(x, w):
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)

    out, vjp = jax.vjp(f, input, weight)
    grad = grad_output.astype(out.dtype)  # float32 for low-precision inputs
    grad_input, grad_weight = vjp(grad)
    grad_bias = jnp.sum(grad, axis=(0,) + tuple(range(2, grad.ndim))) if output_mask[2] else None
    return (grad_input if output_mask[0] else None,
            grad_weight if output_mask[1] else None,
            grad_bias)
