"""Reductions and scans: sum, mean, max/min, var/std, norms, cumulative ops, any/all.

PyTorch's meta kernels run first: they raise PyTorch's errors (empty max, mean of ints)
and give the result dtype every output is cast to. These functions therefore only need
the right values; they accumulate low-precision floats in float32 as PyTorch's CPU does.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..dtypes import LOW_PRECISION, to_jax
from . import aten, lower



# ---- helpers --------------------------------------------------------------------------------


def _axes(x, dim, empty_is_all=True):
    """Normalized reduction axes. None (and [] where empty_is_all) mean every dim; a 0-d
    tensor accepts dim 0/-1 and reduces nothing."""
    if isinstance(dim, int):
        dim = (dim,)
    if dim is None or (len(dim) == 0 and empty_is_all):
        return tuple(range(x.ndim))
    if x.ndim == 0:
        return ()
    return tuple(sorted({d % x.ndim for d in dim}))


def _count(x, axes):
    return math.prod(x.shape[a] for a in axes)


def _is_float(x):
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _acc(x, dtype=None):
    """The input in the dtype to accumulate in: `dtype=` if given, int64 for integers and
    bools (sum/prod/cumsum promote), float32 for bfloat16/float16."""
    x = jnp.asarray(x)
    if dtype is not None:
        x = x.astype(to_jax(dtype))
    elif not _is_float(x):
        x = x.astype(jnp.int64)
    if x.dtype in LOW_PRECISION:
        x = x.astype(jnp.float32)
    return x


def _upcast(x):
    """Low-precision floats to float32, integers to the default float; for float-only math."""
    x = jnp.asarray(x)
    if x.dtype in LOW_PRECISION or not _is_float(x):
        return x.astype(jnp.float32)
    return x


# ---- sum / mean / prod ----------------------------------------------------------------------


@lower(aten.sum.default)
def sum_(self, dtype=None):
    return jnp.sum(_acc(self, dtype))


@lower(aten.sum.dim_IntList)
def sum_dim(self, dim, keepdim=False, dtype=None):
    x = _acc(self, dtype)
    return jnp.sum(x, axis=_axes(x, dim), keepdims=keepdim)


@lower(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, dtype=None):
    x = _acc(self, dtype)
    return jnp.nansum(x, axis=_axes(x, dim), keepdims=keepdim)


@lower(aten.mean.default)
def mean(self, dtype=None):
    return jnp.mean(_acc(self, dtype))


@lower(aten.mean.dim)
def mean_dim(self, dim, keepdim=False, dtype=None):
    x = _acc(self, dtype)
    return jnp.mean(x, axis=_axes(x, dim), keepdims=keepdim)


@lower(aten.prod.default)
def prod(self, dtype=None):
    return jnp.prod(_acc(self, dtype))


@lower(aten.prod.dim_int)
def prod_dim(self, dim, keepdim=False, dtype=None):
    x = _acc(self, dtype)
    return jnp.prod(x, axis=_axes(x, dim), keepdims=keepdim)


# ---- max / min / arg ------------------------------------------------------------------------
# XLA's max/min propagate NaN and argmax/argmin pick the first NaN, then the first extreme
# value: both as PyTorch.


def _check_not_empty(x, name):
    if x.size == 0:
        raise RuntimeError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
                           "Specify the reduction dim with the 'dim' argument.")


@lower(aten.max.default)
def max_(self):
    _check_not_empty(self, "max")
    return jnp.max(self)


@lower(aten.min.default)
def min_(self):
    _check_not_empty(self, "min")
    return jnp.min(self)


@lower(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=_axes(self, dim), keepdims=keepdim)


@lower(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    return jnp.min(self, axis=_axes(self, dim), keepdims=keepdim)


def _arg_extreme(x, dim, keepdim, argfn):
    if dim is None:
        i = argfn(x.reshape(-1))
        return i.reshape((1,) * x.ndim) if keepdim else i
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    return argfn(x, axis=dim % x.ndim, keepdims=keepdim)


@lower(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    if self.dtype == jnp.bool_:
        raise RuntimeError("argmax(): does not support bool input")
    return _arg_extreme(self, dim, keepdim, jnp.argmax)


@lower(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    if self.dtype == jnp.bool_:
        raise RuntimeError("argmin(): does not support bool input")
    return _arg_extreme(self, dim, keepdim, jnp.argmin)


def _extreme_with_index(x, dim, keepdim, argfn):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = dim % x.ndim
    if x.shape[axis] == 0:
        name = "max" if argfn is jnp.argmax else "min"
        raise IndexError(f"{name}(): Expected reduction dim {axis} to have non-zero size.")
    idx = argfn(x, axis=axis, keepdims=True)
    values = jnp.take_along_axis(x, idx, axis=axis)
    if not keepdim:
        values, idx = jnp.squeeze(values, axis), jnp.squeeze(idx, axis)
    return values, idx


@lower(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    return _extreme_with_index(self, dim, keepdim, jnp.argmax)


@lower(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    return _extreme_with_index(self, dim, keepdim, jnp.argmin)


@lower(aten.aminmax.default)
def aminmax(self, dim=None, keepdim=False):
    axes = _axes(self, dim)
    return jnp.min(self, axis=axes, keepdims=keepdim), jnp.max(self, axis=axes, keepdims=keepdim)


# ---- var / std ------------------------------------------------------------------------------


def _var_mean(self, dim, correction, keepdim, name="std and var"):
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        raise RuntimeError(f"{name} only support floating point and complex dtypes")
    x = _upcast(self)
    axes = _axes(x, dim)
    m = jnp.mean(x, axis=axes, keepdims=True)
    d = x - m
    ss = jnp.sum(jnp.real(d * jnp.conj(d)), axis=axes, keepdims=keepdim)
    correction = 1 if correction is None else correction
    # PyTorch divides by max(N - correction, 0): 0/0 -> nan, x/0 -> inf
    var = ss / jnp.maximum(_count(x, axes) - correction, 0)
    return var, (m if keepdim else jnp.squeeze(m, axes))


@lower(aten.var.correction)
def var(self, dim=None, correction=None, keepdim=False):
    return _var_mean(self, dim, correction, keepdim)[0]


@lower(aten.std.correction)
def std(self, dim=None, correction=None, keepdim=False):
    return jnp.sqrt(_var_mean(self, dim, correction, keepdim)[0])


@lower(aten.var_mean.correction)
def var_mean(self, dim=None, correction=None, keepdim=False):
    return _var_mean(self, dim, correction, keepdim, "var_mean")


@lower(aten.std_mean.correction)
def std_mean(self, dim=None, correction=None, keepdim=False):
    v, m = _var_mean(self, dim, correction, keepdim, "std_mean")
    return jnp.sqrt(v), m


# ---- norms / logsumexp ----------------------------------------------------------------------


def _vector_norm(x, ord, dim, keepdim, dtype):
    x = _acc(x, dtype) if dtype is not None else _upcast(x)
    axes = _axes(x, dim)
    a = jnp.abs(x)
    if ord == math.inf:
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == -math.inf:
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=axes, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    return jnp.sum(a**ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)


@lower(aten.linalg_vector_norm.default, static=("ord",))
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, dtype=None):
    return _vector_norm(self, ord, dim, keepdim, dtype)


@lower(aten.norm.Scalar, static=("p",))
def norm(self, p=2):
    return _vector_norm(self, p, None, False, None)


@lower(aten.norm.ScalarOpt_dtype, static=("p",))
def norm_dtype(self, p, dtype):
    return _vector_norm(self, 2 if p is None else p, None, False, dtype)


@lower(aten.norm.ScalarOpt_dim, static=("p",))
def norm_dim(self, p, dim, keepdim=False):
    return _vector_norm(self, 2 if p is None else p, dim, keepdim, None)


@lower(aten.norm.ScalarOpt_dim_dtype, static=("p",))
def norm_dim_dtype(self, p, dim, keepdim, dtype):
    return _vector_norm(self, 2 if p is None else p, dim, keepdim, dtype)


@lower(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    x = _upcast(self)
    # jax's logsumexp shifts by the max, zeroed where infinite: PyTorch's formula
    return jax.nn.logsumexp(x, axis=_axes(x, dim), keepdims=keepdim)


# ---- cumulative ops -------------------------------------------------------------------------


@lower(aten.cumsum.default)
def cumsum(self, dim, dtype=None):
    x = _acc(self, dtype)
    return x if x.ndim == 0 else jnp.cumsum(x, axis=dim % x.ndim)


@lower(aten.cumprod.default)
def cumprod(self, dim, dtype=None):
    x = _acc(self, dtype)
    return x if x.ndim == 0 else jnp.cumprod(x, axis=dim % x.ndim)


@lower(aten.logcumsumexp.default, aten._logcumsumexp.default)
def logcumsumexp(self, dim):
    x = _upcast(self)
    return x if x.ndim == 0 else lax.cumlogsumexp(x, axis=dim % x.ndim)


def _cum_extreme(x, dim, better):
    """Running extreme and its index. Ties take the later index and NaN beats everything
    (the latest NaN wins), as PyTorch's CPU kernel: a max over a total order, so the
    combine is associative."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = dim % x.ndim
    idx = lax.broadcasted_iota(jnp.int64, x.shape, axis)
    if x.shape[axis] == 0:
        return x, idx
    is_float = _is_float(x)

    def combine(a, b):
        (av, ai), (bv, bi) = a, b
        take_b = better(bv, av) | (bv == av)
        if is_float:
            take_b = jnp.isnan(bv) | (~jnp.isnan(av) & take_b)
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    return lax.associative_scan(combine, (x, idx), axis=axis)


@lower(aten.cummax.default)
def cummax(self, dim):
    return _cum_extreme(self, dim, jnp.greater)


@lower(aten.cummin.default)
def cummin(self, dim):
    return _cum_extreme(self, dim, jnp.less)


# ---- any / all / count_nonzero --------------------------------------------------------------


def _nonzero(x):
    return jnp.asarray(x) != 0


@lower(aten.any.default)
def any_(self):
    return jnp.any(_nonzero(self))


@lower(aten.any.dim)
def any_dim(self, dim, keepdim=False):
    return jnp.any(_nonzero(self), axis=_axes(self, dim), keepdims=keepdim)


@lower(aten.any.dims)
def any_dims(self, dim=None, keepdim=False):
    return jnp.any(_nonzero(self), axis=_axes(self, dim, empty_is_all=False), keepdims=keepdim)


@lower(aten.all.default)
def all_(self):
    return jnp.all(_nonzero(self))


@lower(aten.all.dim)
def all_dim(self, dim, keepdim=False):
    return jnp.all(_nonzero(self), axis=_axes(self, dim), keepdims=keepdim)


@lower(aten.all.dims)
def all_dims(self, dim=None, keepdim=False):
    return jnp.all(_nonzero(self), axis=_axes(self, dim, empty_is_all=False), keepdims=keepdim)


@lower(aten.count_nonzero.dim_IntList)
def count_nonzero_dims(self, dim):
    return jnp.sum(_nonzero(self), axis=_axes(self, dim), dtype=jnp.int64)


@lower(aten.count_nonzero.default)
def count_nonzero(self, dim=None):
    return jnp.sum(_nonzero(self), axis=_axes(self, dim), dtype=jnp.int64)


# ---- segment_reduce ---------------------------------------------------------------------------
# Segments run along the last dim of lengths/offsets (the data axis); leading dims of lengths
# match the data's leading dims. Data past the last segment is ignored (and gets no gradient).


def _segment_layout(data, lengths, offsets):
    """data as (outer, N, inner), per-outer offsets (outer, S+1), and the segment id of each
    position along the axis (outer, N; S where the position is in no segment)."""
    if offsets is None:
        zero = jnp.zeros(lengths.shape[:-1] + (1,), lengths.dtype)
        offsets = jnp.concatenate([zero, jnp.cumsum(lengths, axis=-1)], axis=-1)
    axis = offsets.ndim - 1
    outer = math.prod(data.shape[:axis])
    n = data.shape[axis]
    x = data.reshape(outer, n, -1)
    offs = offsets.reshape(outer, -1).astype(jnp.int64)
    s = offs.shape[1] - 1
    pos = jnp.arange(n)
    ids = jax.vmap(lambda o: jnp.searchsorted(o, pos, side="right") - 1)(offs)
    ids = jnp.where((ids < 0) | (ids >= s) | (pos[None] >= offs[:, -1:]), s, ids)
    return x, offs, ids, axis, s


def _seg(fn, x, ids, s):
    # per outer row: fn(values (N, inner), ids (N,), S) -> (S, inner); id S is dropped
    return jax.vmap(lambda v, i: fn(v, i, num_segments=s))(x, ids)


@lower(aten.segment_reduce.default, static=("axis", "unsafe"))
def segment_reduce(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    x, offs, ids, ax, s = _segment_layout(data, lengths, offsets)
    lens = (offs[:, 1:] - offs[:, :-1])[:, :, None]
    empty = lens == 0
    nan = jnp.asarray(jnp.nan, x.dtype)
    if reduce in ("max", "min"):
        fn = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
        out = _seg(fn, x, ids, s)
        if initial is not None:
            init = jnp.asarray(initial, x.dtype)
            out = jnp.maximum(out, init) if reduce == "max" else jnp.minimum(out, init)
        # a NaN anywhere in the segment wins, as CPU's _isnan check
        has_nan = _seg(jax.ops.segment_max, jnp.isnan(x).astype(jnp.int32), ids, s) > 0
        out = jnp.where(has_nan, nan, out)
        if initial is None:
            out = jnp.where(empty, -jnp.inf if reduce == "max" else jnp.inf, out)
    elif reduce in ("sum", "mean"):
        out = _seg(jax.ops.segment_sum, x, ids, s)
        if initial is not None:
            out = out + jnp.asarray(initial, x.dtype)
        if reduce == "mean":
            div = jnp.where(empty, 1, lens).astype(x.dtype)
            out = jnp.where(empty, nan if initial is None else out, out / div)
    elif reduce == "prod":
        out = _seg(jax.ops.segment_prod, x, ids, s)
        if initial is not None:
            out = out * jnp.asarray(initial, x.dtype)
    else:
        raise ValueError(f"unsupported reduction given! {reduce}")
    return out.astype(data.dtype).reshape(data.shape[:ax] + (s,) + data.shape[ax + 1 :])


@lower(aten._segment_reduce_backward.default, static=("axis",))
def _segment_reduce_backward(grad, output, data, reduce, lengths=None, offsets=None, axis=0, initial=None):
    x, offs, ids, ax, s = _segment_layout(data, lengths, offsets)
    g_seg = grad.reshape(x.shape[0], s, -1)
    out_seg = output.reshape(x.shape[0], s, -1)
    inside = (ids < s)[:, :, None]

    def at_pos(t):
        # a per-segment value (outer, S, inner) at each data position (outer, N, inner)
        return jnp.take_along_axis(t, jnp.minimum(ids, max(s - 1, 0))[:, :, None], axis=1)

    g = jnp.where(inside, at_pos(g_seg), 0) if s else jnp.zeros_like(x)
    lens = offs[:, 1:] - offs[:, :-1]
    if reduce in ("max", "min"):
        hit = inside & (jnp.isnan(x) | (x == at_pos(out_seg)))
        counter = _seg(jax.ops.segment_sum, hit.astype(jnp.int64), ids, s)
        gi = jnp.where(hit, g, 0)
        # CPU splits among ties only the positive gradients
        c = at_pos(counter)
        gi = jnp.where((c >= 2) & (gi > 0), gi / jnp.maximum(c, 1).astype(gi.dtype), gi)
    elif reduce == "sum":
        gi = g
    elif reduce == "mean":
        gi = g / jnp.maximum(at_pos(lens[:, :, None]), 1).astype(g.dtype)
    elif reduce == "prod":
        special = jnp.isnan(x) | (x == 0)
        init = jnp.asarray(1 if initial is None else initial, x.dtype)
        # product of the segment's ordinary elements (times initial), and its zero/NaN counts
        nz_prod = _seg(jax.ops.segment_prod, jnp.where(special, 1, x), ids, s) * init
        n_special = _seg(jax.ops.segment_sum, special.astype(jnp.int64), ids, s)
        n_nan = _seg(jax.ops.segment_sum, jnp.isnan(x).astype(jnp.int64), ids, s)
        other_nan = (at_pos(n_nan) - jnp.isnan(x)) > 0
        # exclusive product for a zero/NaN element: the others' product
        excl = jnp.where(
            at_pos(n_special) == 1, at_pos(nz_prod), jnp.where(other_nan, jnp.nan, at_pos(nz_prod) * 0)
        )
        ordinary = g * at_pos(out_seg) / jnp.where(special, 1, x)
        gi = jnp.where(inside, jnp.where(special, g * excl, ordinary), 0)
    else:
        raise ValueError(f"unsupported reduction given! {reduce}")
    return gi.astype(data.dtype).reshape(data.shape)
