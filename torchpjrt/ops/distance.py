"""Pairwise distances: cdist and pdist, forward and backward.

The distance formulas follow PyTorch's CPU kernels (aten/src/ATen/native/Distance.cpp and
cpu/DistanceOpsKernel.cpp): the same per-p special cases, and in the backward the same
subgradient conventions (0 where the distance is 0, 0 where a difference is 0 for p < 1,
every tied coordinate gets the gradient for p = inf). Low-precision floats are computed in
float32; the dispatcher casts results back to PyTorch's result dtype.
"""

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..dtypes import LOW_PRECISION
from . import aten, lower



def _up(x):
    x = jnp.asarray(x)
    if x.dtype in LOW_PRECISION:
        return x.astype(jnp.float32)
    return x


# ---- the p-norm of a difference, and its gradient -------------------------------------------


def _norm(adiff, p, nan_max=True):
    """The p-"norm" of |x_i - x_j| over the last axis (`adiff` holds the absolute values).
    An empty last axis gives 0, as CPU fills zeros for zero columns."""
    if p == 0:
        # the count of nonzero differences (CPU: min(ceil(|d|), 1), which keeps NaN)
        return jnp.sum(jnp.minimum(jnp.ceil(adiff), 1), axis=-1)
    if p == 1:
        return jnp.sum(adiff, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(adiff * adiff, axis=-1))
    if math.isinf(p):
        if not nan_max:
            # cdist's scalar loop reduces with std::max(agg, up), which drops a NaN `up`
            adiff = jnp.where(jnp.isnan(adiff), 0, adiff)
        return jnp.max(adiff, axis=-1, initial=0)
    return jnp.power(jnp.sum(jnp.power(adiff, p), axis=-1), 1.0 / p)


def _norm_grad(diff, grad, dist, p):
    """d dist / d x_i times grad, for diff = x_i - x_j; grad and dist broadcast against
    diff. This is the CPU kernel's per-p `backward` (odist/lttdist/tdist/idist/pdist)."""
    if p == 0:
        return jnp.zeros_like(diff)  # a count: piecewise constant
    if p == 1:
        return grad * jnp.sign(diff)
    if p < 2:
        out = jnp.sign(diff) * jnp.power(jnp.abs(diff), p - 1) * grad / jnp.power(dist, p - 1)
        out = jnp.where(dist == 0, 0, out)
        if p < 1:
            # |0|^(p-1) is inf there: CPU takes the 0 subgradient instead of a NaN
            out = jnp.where(diff == 0, 0, out)
        return out
    if p == 2:
        return jnp.where(dist == 0, 0, grad * diff / dist)
    if math.isinf(p):
        # CPU's 1 - min(1, ceil(||d| - dist|)): 1 exactly where |d| attains the max (ties
        # all count); written out so NaNs propagate as they do there
        hit = 1 - jnp.minimum(1, jnp.ceil(jnp.abs(jnp.abs(diff) - dist)))
        return grad * jnp.sign(diff) * hit
    out = diff * jnp.power(jnp.abs(diff), p - 2) * grad / jnp.power(dist, p - 1)
    return jnp.where(dist == 0, 0, out)


# ---- cdist ----------------------------------------------------------------------------------


def _batch_shape(x1, x2):
    return tuple(np.broadcast_shapes(x1.shape[:-2], x2.shape[:-2]))


def _uses_mm(p, compute_mode, r1, r2):
    """cdist_impl's choice of the matmul formula for p = 2 (mode 0: only past 25 rows)."""
    mode = 0 if compute_mode is None else compute_mode
    return p == 2 and (mode == 1 or (mode == 0 and (r1 > 25 or r2 > 25)))


@lower(aten._euclidean_dist.default)
def euclidean_dist(x1, x2):
    # ||a||^2 - 2 a.b + ||b||^2 as one matmul of padded operands, exactly as CPU builds it, so
    # the cancellation error (and the clamp at 0) is the same
    x1, x2 = _up(x1), _up(x2)
    x1_norm = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    x2_norm = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    x1_ = jnp.concatenate([-2 * x1, x1_norm, jnp.ones_like(x1_norm)], axis=-1)
    x2_ = jnp.concatenate([x2, jnp.ones_like(x2_norm), x2_norm], axis=-1)
    # HIGHEST: float32 must not run as TF32/bf16 passes on accelerators
    result = jnp.matmul(x1_, jnp.swapaxes(x2_, -1, -2), precision=lax.Precision.HIGHEST)
    return jnp.sqrt(jnp.maximum(result, 0))


@lower(aten._cdist_forward.default, static=("p", "compute_mode"))
def cdist_forward(x1, x2, p, compute_mode=None):
    x1, x2 = _up(x1), _up(x2)
    batch = _batch_shape(x1, x2)
    (r1, c), r2 = x1.shape[-2:], x2.shape[-2]
    x1 = jnp.broadcast_to(x1, batch + (r1, c))
    x2 = jnp.broadcast_to(x2, batch + (r2, c))
    if c > 0 and _uses_mm(p, compute_mode, r1, r2):
        return euclidean_dist(x1, x2)
    adiff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    return _norm(adiff, p, nan_max=False)


@lower(aten._cdist_backward.default, static=("p",))
def cdist_backward(grad, x1, x2, p, cdist):
    """The gradient for x1 at x1's batch-broadcast shape (autograd sums it back down);
    x2's gradient is this op with the operands swapped and grad/cdist transposed."""
    x1, x2 = _up(x1), _up(x2)
    batch = _batch_shape(x1, x2)
    (r1, c), r2 = x1.shape[-2:], x2.shape[-2]
    if r1 == 0 or r2 == 0 or c == 0 or math.prod(batch) == 0:
        return jnp.zeros_like(x1)  # CPU: zeros of the unexpanded x1
    x1 = jnp.broadcast_to(x1, batch + (r1, c))
    x2 = jnp.broadcast_to(x2, batch + (r2, c))
    grad = jnp.reshape(_up(grad), batch + (r1, r2, 1))
    dist = jnp.reshape(_up(cdist), batch + (r1, r2, 1))
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    return jnp.sum(_norm_grad(diff, grad, dist, p), axis=-2)


# ---- pdist ----------------------------------------------------------------------------------


def _pairs(n):
    """Row pairs i < j in row-major order: pdist's output order."""
    i, j = np.triu_indices(n, 1)
    return i.astype(np.int64), j.astype(np.int64)


@lower(aten._pdist_forward.default, static=("p",))
def pdist_forward(self, p=2.0):
    x = _up(self)
    i, j = _pairs(x.shape[0])
    return _norm(jnp.abs(x[i] - x[j]), p)


@lower(aten._pdist_backward.default, static=("p",))
def pdist_backward(grad, self, p, pdist):
    x = _up(self)
    n = x.shape[0]
    i, j = _pairs(n)
    if len(i) == 0 or x.shape[1] == 0:
        return jnp.zeros_like(x)
    g = _norm_grad(x[i] - x[j], _up(grad).reshape(-1, 1), _up(pdist).reshape(-1, 1), p)
    # each pair pushes row i along the gradient and row j against it
    return jnp.zeros_like(x).at[i].add(g).at[j].add(-g)
