"""Padded storages: sizes that follow the data, rounded up to buckets, so that eager code whose
shapes change with its values compiles its kernels once per bucket instead of once per size.

A mixture-of-experts layer routes a different number of tokens to each expert at every step
(`torch.where(expert_mask[e])`, `hidden[token_idx]`, `index_add_`); a boolean mask selects a
different number of elements each time. Each new size would compile every kernel that follows
it once more. Here `nonzero` (and so `torch.where(cond)` and `x[mask]`) computes its result at
a bucket size B >= n (a power of two, at most the largest possible size) and returns the first
n rows of that storage: a tensor whose storage is larger than its elements, as PyTorch allows
(CPU shows one after `resize_` to a smaller size). Its sizes, strides and values are what CPU
gives; the rows n..B-1 of the storage hold values nobody sees.

The ops that follow run on the whole storage when they can treat the padded positions apart
(the rules below): the kernel is the one for size B, the result is again the first n positions
of a padded storage, and the padding travels on. Ops that combine values along the padded
dimension get the padded positions masked first: matmul contractions and sums see -0.0 (which
adds nothing, signed zeros included), scatters that accumulate (index_add_, index_put_ with
accumulate, which autograd uses for indexing's backward) add -0.0 to index 0. Padded index
positions are set to 0 before a gather, so bounds checks see valid indices only. Every other op
reads the exact elements (a strided read of the first n positions), as for any view.

Rules (each result is padded along one dimension; anything else is an exact read):
- pointwise ops (the `pointwise` tag, random ones excepted): the padded dimension of every
  padded input lines up in the broadcast result, and no other input has that dimension;
- mm, bmm, addmm: a padded row or column dimension stays padded in the result; a padded
  contracted dimension (both operands) is masked, and the result is exact;
- sum and mean over dimensions: the padded dimension kept stays padded; reduced, it is
  masked (a mean divides the masked sum by the true count);
- index (advanced indexing with padded 1-D indices, next to each other), index_select: the
  result is padded where the indices went; bool masks become nonzero's padded coordinates;
- index_add, index_put with accumulate=True (in place or not) with padded indices and values;
- cat along another dimension of tensors padded alike;
- softmax and log_softmax along another dimension, and nll_loss (so cross_entropy) over padded
  rows: their targets become ignore_index, which the loss, its mean and its gradient leave out.

TORCHPJRT_PADDING=off turns it off (every data-dependent size is then exact, compiled per size).
"""

import functools
import os
import weakref

import jax
import jax.numpy as jnp
import torch
from jax import lax

from . import fusion, kernel_cache, placement, storage

aten = torch.ops.aten

# read when kernels are registered; switching it off later stops new padded results
enabled = os.environ.get("TORCHPJRT_PADDING", "on").strip().lower() not in ("0", "off", "false", "no")
MIN_BUCKET = 8
# Where sizes can reach 256 and more, the smallest bucket is 64: small sizes are the rare ones
# there (an expert that got few of a batch's tokens), and each first sighting of a bucket
# compiles every kernel that follows it again, in the middle of training; 64 positions more
# cost nothing next to that.
LARGE_MIN_BUCKET = 64
live = 0  # padded storages alive: while 0, every rule's wrapper returns at once


def bucket(n: int, limit: int) -> int:
    """The padded size for n: the next power of two, at least the smallest bucket (MIN_BUCKET,
    growing with `limit` up to LARGE_MIN_BUCKET), at most `limit`."""
    smallest = min(max(1 << max((limit // 4).bit_length() - 1, 0), MIN_BUCKET), LARGE_MIN_BUCKET)
    return min(max(1 << max(n - 1, 0).bit_length(), smallest), limit)


_marks = set()  # a weak reference per padded storage alive, whose callback counts it out of `live`


def _forget(ref):
    global live
    _marks.discard(ref)
    live -= 1


def mark_storage(st, n: int, B: int, stride: int) -> None:
    """Mark storage object `st` padded: a tensor's first n of its B positions along the dimension
    of `stride`. Counted in `live` while it is alive (the hot path's padded results call it too)."""
    global live
    st.padding = (n, B, stride)
    live += 1
    _marks.add(weakref.ref(st, _forget))  # (a plain reference with a callback costs a fraction of a finalize)


def _mark(full: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """`full` (a new tensor) as its first n positions along `dim`, its storage marked padded."""
    B = full.shape[dim]
    mark_storage(storage.storage_of(full), n, B, full.stride(dim))
    if B == n:
        return full  # marked all the same: it shares the bucket's kernels
    size = list(full.shape)
    size[dim] = n
    return full.as_strided(size, full.stride(), full.storage_offset())


def padded_dim(t):
    """(dim, n, B) when `t` is the first n positions of a padded storage along one dimension,
    else None."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        p = t.untyped_storage()._pjrt.padding  # only a pjrt storage has `_pjrt`
    except (AttributeError, RuntimeError, NotImplementedError):  # another device's, or no storage (sparse)
        return None
    if p is None:
        return None
    n, B, S = p
    found = None
    for d, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if size == n and stride == S:
            if found is not None:
                return None  # two candidates: which one is padded is not clear
            found = d
    if found is None or (t.storage_offset() // S) % B:
        return None  # not the padded dimension from position 0
    return found, n, B


def _widened(t, d, B):
    """The padded view of `t`: all B positions along d."""
    size = list(t.shape)
    size[d] = B
    return t.as_strided(size, t.stride(), t.storage_offset())


def fill_beyond(x, n, dim, fill):
    """`x` with its positions from n on along `dim` set to `fill` (traced: n is an argument)."""
    keep = lax.broadcasted_iota(jnp.int64, x.shape, dim) < n
    return jnp.where(keep, x, jnp.asarray(fill, x.dtype) if x.dtype != jnp.bool_ else False)


@functools.lru_cache(maxsize=None)
def _fill_beyond_fn(shape, dtype, dim, fill, device):
    # kept on disk like every kernel: a warm process loads it instead of tracing it
    return kernel_cache.kept_jit(lambda x, n: fill_beyond(x, n, dim, fill), "padding.fill_beyond", shape,
                                 str(dtype), dim, fill, device)


BEYOND = "_pjrt_beyond"  # the attribute marking a padded view whose op reads it masked


def _masked(t, d, n, B, fill=None, kernel=None):
    """The padded view of `t` with the positions from n on along d read as `fill` (-0.0 for
    floating point: adds nothing; 0 for integers). Handed to `kernel`, an op kernel of
    dispatch.py (`reads_beyond`), it is the view itself, marked: the op's own program reads it
    so (dispatch.masked_reader), with no program of its own; otherwise a new tensor."""
    if fill is None:
        fill = -0.0 if (t.dtype.is_floating_point or t.dtype.is_complex) else 0
    wide = _widened(t, d, B)
    if getattr(kernel, "reads_beyond", False):
        setattr(wide, BEYOND, (d, n, fill))
        return wide
    array = storage.read(wide)
    masked = _fill_beyond_fn(tuple(array.shape), array.dtype, d, fill, placement.index_of(array))
    return storage.wrap(fusion.call(masked, array, n), t.dtype)


def _same_padding(found):
    """The common (n, B) of padded arguments, or None when they differ."""
    sizes = {(n, B) for _, n, B in found}
    return sizes.pop() if len(sizes) == 1 else None


def _mark_results(out, dim, n):
    if isinstance(out, torch.Tensor):
        return _mark(out, dim, n) if out.dim() > dim else out
    if isinstance(out, (tuple, list)):
        return type(out)(_mark_results(o, dim, n) for o in out)
    return out


# ---- the rules -------------------------------------------------------------------------------
# Each takes (kernel, sig, vals) and returns the result, or NotImplemented for an exact run.
#
# A rule marked `keyed` calls the op's kernel once, with every padded argument widened to its
# whole storage or marked to be read masked (its n then an argument of the program: dispatch keys
# those apart), all with the same n; each result is padded along one dimension with that n, or
# exact (a contraction, a sum or a scatter over the masked positions); an in-place one writes its
# target whole. What it decides follows from the arguments' sizes with B for n, their padded
# dimensions, the other arguments and n being the same for all, and its fills are constants, so
# the hot path (hot_path.py) keys such a call without n and replays the program of the whole
# storages for any n, passing n to the masked reads.


def keyed(rule):
    rule.keyed = True
    return rule


@keyed
def _pointwise(kernel, sig, vals):
    found = {}
    tensors = []
    for i, v in enumerate(vals):
        if isinstance(v, torch.Tensor):
            tensors.append((i, v))
            p = padded_dim(v)
            if p is not None:
                found[i] = p
    if not found:
        return NotImplemented
    nb = _same_padding(found.values())
    if nb is None:
        return NotImplemented
    n, B = nb
    rank = max(t.dim() for _, t in tensors)
    dims = {rank - (t.dim() - found[i][0]) for i, t in tensors if i in found}
    if len(dims) != 1:
        return NotImplemented
    D = dims.pop()
    for i, t in tensors:
        if i not in found:
            j = D - (rank - t.dim())
            if j >= 0 and t.shape[j] != 1:
                return NotImplemented  # an exact tensor along the padded dimension
    wide = list(vals)
    for i, (d, _, _) in found.items():
        wide[i] = _widened(vals[i], d, B)
    return _mark_results(_call(kernel, sig, wide), D, n)


@keyed
def _pointwise_inplace(kernel, sig, vals):
    """self.sub_(other), self.fill_(v) on a padded self: the whole storage is written (its
    padded positions too, which nobody sees)."""
    self = vals[0]
    p = padded_dim(self)
    if p is None:
        return NotImplemented
    D, n, B = p
    rank = self.dim()
    wide = list(vals)
    wide[0] = _widened(self, D, B)
    for i in range(1, len(vals)):
        v = vals[i]
        if not isinstance(v, torch.Tensor):
            continue
        if v.dim() > rank:
            return NotImplemented  # a broadcast the target cannot hold: the kernel raises
        j = D - (rank - v.dim())
        q = padded_dim(v)
        if q is not None:
            if q != (j, n, B):
                return NotImplemented
            wide[i] = _widened(v, j, B)
        elif j >= 0 and v.shape[j] != 1:
            return NotImplemented
    _call(kernel, sig, wide)
    return self


def empty_like(self, *args, **kwargs):
    """empty_like (so zeros_like, ones_like, full_like, `1 - x`) of a padded tensor is padded
    alike; of any other tensor, PyTorch's own kernel."""
    if live:
        p = padded_dim(self)
        if p is not None and kwargs.get("device") in (None, self.device):
            d, n, B = p
            full = _empty_like_composite(_COMPOSITE, _widened(self, d, B), *args, **kwargs)
            if full.shape[d] == B and padded_dim(full) is None:
                return _mark(full, d, n)
    return _empty_like_composite(_COMPOSITE, self, *args, **kwargs)


_COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
_empty_like_composite = aten.empty_like.default._handle.redispatch_boxed


def _call(kernel, sig, vals):
    args, kwargs = sig.split(vals)
    return kernel(*args, **kwargs)


def _matmul(first, batched):
    """mm / bmm (first=0) and addmm (first=1: its bias must not be padded)."""
    row, col = (1, 2) if batched else (0, 1)

    def rule(kernel, sig, vals):
        a, b = vals[first], vals[first + 1]
        pa, pb = padded_dim(a), padded_dim(b)
        if first and padded_dim(vals[0]) is not None:
            return NotImplemented
        wide = list(vals)
        if pa is not None and pb is not None:
            if pa[1:] != pb[1:]:
                return NotImplemented
            n, B = pa[1:]
            if pa[0] == col and pb[0] == row:  # the contracted dimension: masked
                wide[first] = _masked(a, col, n, B, kernel=kernel)
                wide[first + 1] = _masked(b, row, n, B, kernel=kernel)
                return _call(kernel, sig, wide)
            if batched and pa[0] == 0 and pb[0] == 0:
                wide[first], wide[first + 1] = _widened(a, 0, B), _widened(b, 0, B)
                return _mark_results(_call(kernel, sig, wide), 0, n)
            return NotImplemented
        if pa is not None and pa[0] == row:
            d, n, B = pa
            wide[first] = _widened(a, d, B)
            out_dim = row
        elif pb is not None and pb[0] == col:
            d, n, B = pb
            wide[first + 1] = _widened(b, d, B)
            out_dim = col
        else:
            return NotImplemented
        if first:
            bias = vals[0]
            if bias.dim() == 2 and bias.shape[out_dim] != 1 or bias.dim() == 1 and out_dim == col \
                    and bias.shape[0] != 1:
                return NotImplemented
        return _mark_results(_call(kernel, sig, wide), out_dim, n)

    return keyed(rule)


def _reduced_apart(kernel, sig, vals, p, reduced, keepdim):
    """A reduction over dimensions other than the padded one: per padded position."""
    d, n, B = p
    wide = list(vals)
    wide[0] = _widened(vals[0], d, B)
    out_dim = d if keepdim else d - sum(1 for r in reduced if r < d)
    return _mark_results(_call(kernel, sig, wide), out_dim, n)


@keyed
def _sum(kernel, sig, vals):
    x, dims, keepdim = vals[0], vals[1], vals[2]
    p = padded_dim(x)
    if p is None:
        return NotImplemented
    reduced = set(range(x.dim())) if not dims else {r % max(x.dim(), 1) for r in dims}
    if p[0] not in reduced:
        return _reduced_apart(kernel, sig, vals, p, reduced, keepdim)
    wide = list(vals)
    wide[0] = _masked(x, *p, kernel=kernel)
    return _call(kernel, sig, wide)


@keyed
def _sum_all(kernel, sig, vals):
    """x.sum() of a padded x: over the masked storage."""
    p = padded_dim(vals[0])
    if p is None:
        return NotImplemented
    wide = list(vals)
    wide[0] = _masked(vals[0], *p, kernel=kernel)
    return _call(kernel, sig, wide)


def _mean(kernel, sig, vals):
    """mean over dimensions (all for mean.default): with the padded dimension kept, a mean per
    position; reduced, the masked sum over the true count (what the kernel computes: the sum
    in float32 for 16-bit floats, divided, then cast back)."""
    x = vals[0]
    p = padded_dim(x)
    if p is None or not (x.dtype.is_floating_point or x.dtype.is_complex):
        return NotImplemented
    d, n, B = p
    every = len(vals) == 2  # mean.default(self, dtype)
    dims, keepdim, dtype = (None, False, vals[1]) if every else (vals[1], vals[2], vals[3])
    if dims and (any(not -x.dim() <= r < x.dim() for r in dims) or len({r % x.dim() for r in dims}) != len(dims)):
        return NotImplemented  # the kernel raises CPU's error
    reduced = set(range(x.dim())) if not dims else {r % x.dim() for r in dims}
    if d not in reduced:
        return _reduced_apart(kernel, sig, vals, p, reduced, keepdim)
    out_dtype = dtype or x.dtype
    acc = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    total = aten.sum.dim_IntList(_masked(x, d, n, B), sorted(reduced), keepdim, dtype=acc)
    count = 1
    for r in reduced:
        count *= x.shape[r]
    return aten.div.Tensor(total, count).to(out_dtype)


def _along_dim(dim_pos):
    """softmax and log_softmax (and their backward) along another dimension than the padded
    one: every tensor argument padded alike."""

    def rule(kernel, sig, vals):
        found = {}
        for i, v in enumerate(vals):
            if isinstance(v, torch.Tensor):
                p = padded_dim(v)
                if p is None:
                    return NotImplemented
                found[i] = p
        if not found or len(set(found.values())) != 1 or len({vals[i].dim() for i in found}) != 1:
            return NotImplemented
        d, n, B = next(iter(found.values()))
        if vals[dim_pos] % max(vals[next(iter(found))].dim(), 1) == d:
            return NotImplemented
        wide = list(vals)
        for i in found:
            wide[i] = _widened(vals[i], d, B)
        return _mark_results(_call(kernel, sig, wide), d, n)

    return keyed(rule)


def _nll_padded(x, target, weight):
    """(n, B) when nll_loss's input rows and targets are padded alike, else None."""
    px, pt = padded_dim(x), padded_dim(target)
    if px is None or pt is None or x.dim() != 2 or px[0] != 0 or pt[0] != 0 or px[1:] != pt[1:] \
            or padded_dim(weight) is not None:
        return None
    return px[1:]


def _nll_forward(kernel, sig, vals):
    """nll_loss (so cross_entropy) on padded rows: their targets become ignore_index, which
    the loss, its total weight and its gradient leave out."""
    x, target, weight, reduction, ignore_index = vals[:5]
    nb = _nll_padded(x, target, weight)
    if nb is None:
        return NotImplemented
    n, B = nb
    wide = list(vals)
    wide[0], wide[1] = _widened(x, 0, B), _masked(target, 0, n, B, ignore_index, kernel)
    output, total_weight = _call(kernel, sig, wide)
    return (_mark(output, 0, n) if reduction == 0 else output), total_weight


def _nll_backward(kernel, sig, vals):
    grad_output, x, target, weight, reduction, ignore_index = vals[:6]
    nb = _nll_padded(x, target, weight)
    if nb is None or (reduction == 0 and padded_dim(grad_output) != (0,) + nb):
        return NotImplemented
    n, B = nb
    wide = list(vals)
    wide[1], wide[2] = _widened(x, 0, B), _masked(target, 0, n, B, ignore_index, kernel)
    if reduction == 0:
        wide[0] = _widened(grad_output, 0, B)
    return _mark(_call(kernel, sig, wide), 0, n)


def _padded_indices(indices):
    """(first position, n, B) when every index given is a padded 1-D tensor and they sit next
    to each other; else None."""
    given = [i for i, t in enumerate(indices) if t is not None]
    if not given or given != list(range(given[0], given[-1] + 1)):
        return None
    found = {}
    for i in given:
        p = padded_dim(indices[i])
        if p is None or indices[i].dim() != 1 or indices[i].dtype in (torch.bool, torch.uint8):
            return None
        found[i] = p
    nb = _same_padding(found.values())
    return None if nb is None else (given[0], *nb)


def _mask_dtypes(indices):
    """The dtypes of the bool and uint8 masks among advanced indices (uint8 masks are deprecated:
    they keep the exact kernel, which warns as CPU does)."""
    return {t.dtype for t in indices if t is not None and t.dtype in (torch.bool, torch.uint8)}


@keyed
def _index(kernel, sig, vals):
    x, indices = vals[0], list(vals[1])
    masks = _mask_dtypes(indices)
    if masks:
        return NotImplemented if torch.uint8 in masks else _index_with_masks(kernel, sig, vals)
    if not live:
        return NotImplemented
    found = _padded_indices(indices)
    if found is None or padded_dim(x) is not None:
        return NotImplemented
    first, n, B = found
    wide = list(vals)
    wide[1] = [None if t is None else _masked(t, 0, n, B, 0, kernel) for t in indices]
    return _mark_results(_call(kernel, sig, wide), first, n)


def _expand_masks(x, indices):
    """Indices with each bool mask replaced by its nonzero coordinates (padded), as CPU's
    kernel does; None when a mask does not fit or nothing came out padded."""
    expanded, dim = [], 0
    for t in indices:
        if t is not None and t.dtype == torch.bool:
            if t.device.type != "pjrt" or t.dim() == 0 or tuple(t.shape) != tuple(x.shape[dim:dim + t.dim()]):
                return None  # the kernel gives CPU's errors for these
            # unpadded too (a mask that selects nothing, a mask of one element): the index kernel
            # on coordinates is kept and traced once per shape, where the exact kernel on a mask
            # runs JAX's element-by-element ops and compiles each of them in every process
            coords = aten.nonzero.default(t)
            expanded.extend(coords.unbind(1))
            dim += t.dim()
        else:
            expanded.append(t)
            dim += 1
    return expanded


def _index_with_masks(kernel, sig, vals):
    """x[mask]: the mask's coordinates (padded when the count is) as indices."""
    expanded = _expand_masks(vals[0], list(vals[1]))
    if expanded is None:
        return NotImplemented
    wide = list(vals)
    wide[1] = expanded
    out = _index(kernel, sig, wide)
    return _call(kernel, sig, wide) if out is NotImplemented else out


@keyed
def _index_select(kernel, sig, vals):
    x, dim, index = vals[0], vals[1], vals[2]
    p = padded_dim(index)
    if p is None or x.dim() == 0 or padded_dim(x) is not None or index.dim() != 1:
        return NotImplemented
    _, n, B = p
    wide = list(vals)
    wide[2] = _masked(index, 0, n, B, 0, kernel)
    return _mark_results(_call(kernel, sig, wide), dim % x.dim(), n)


@keyed
def _index_add(kernel, sig, vals):
    x, dim, index, source = vals[0], vals[1], vals[2], vals[3]
    pi, ps = padded_dim(index), padded_dim(source)
    if pi is None or ps is None or pi[1:] != ps[1:] or padded_dim(x) is not None or index.dim() != 1 \
            or source.dim() == 0 or ps[0] != dim % source.dim():
        return NotImplemented
    _, n, B = pi
    wide = list(vals)
    wide[2] = _masked(index, 0, n, B, 0, kernel)
    wide[3] = _masked(source, ps[0], n, B, kernel=kernel)
    return _call(kernel, sig, wide)


@keyed
def _index_put(kernel, sig, vals):
    x, indices, values, accumulate = vals[0], list(vals[1]), vals[2], vals[3]
    pv = padded_dim(values)
    if not accumulate or padded_dim(x) is not None or pv is None:
        return NotImplemented
    masks = _mask_dtypes(indices)
    if masks:
        # the backward of x[mask]: the mask's coordinates, padded like the values
        indices = None if torch.uint8 in masks else _expand_masks(x, indices)
        if indices is None:
            return NotImplemented
    found = _padded_indices(indices)
    if found is None:
        return NotImplemented
    first, n, B = found
    result_rank = x.dim() - sum(t is not None for t in indices) + 1
    if pv[1:] != (n, B) or pv[0] != values.dim() - result_rank + first:
        return NotImplemented
    wide = list(vals)
    wide[1] = [None if t is None else _masked(t, 0, n, B, 0, kernel) for t in indices]
    wide[2] = _masked(values, pv[0], n, B, kernel=kernel)
    return _call(kernel, sig, wide)


@functools.lru_cache(maxsize=4096)
def _append_fn(shape, dtype, dim, bucket_size, tail_shape, device):
    def append(full, tail, n):
        if full.shape[dim] < bucket_size:
            widths = [(0, 0)] * full.ndim
            widths[dim] = (0, bucket_size - full.shape[dim])
            full = jnp.pad(full, widths)
        return lax.dynamic_update_slice_in_dim(full, tail, n, axis=dim)

    return kernel_cache.kept_jit(append, "padding.append", shape, str(dtype), dim, bucket_size, tail_shape,
                                 device)


def _appended(kernel, sig, vals):
    """cat([x, y], d) that appends y to a sequence x growing along d (generate's input_ids, a
    token a step): the second append to an exact cat's result, and every append to a padded x
    after it, writes y at position n of a bucket-sized storage; the program is the bucket's, n an
    argument. Only where the result is laid out as the CPU's (every dimension before d of size 1:
    a batch of one): contiguous, with the CPU's strides but in those size-1 dimensions (which
    address nothing; kept per bucket, so views of the sequence are the bucket's too)."""
    tensors, dim = vals[0], vals[1]
    if len(tensors) != 2:
        return NotImplemented
    x, y = tensors
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.device.type != "pjrt" \
            or y.device != x.device or y.dtype != x.dtype or y.dim() != x.dim() or not -x.dim() <= dim < x.dim():
        return NotImplemented
    d = dim % x.dim()
    k = y.shape[d]
    if k == 0 or any(x.shape[i] != y.shape[i] for i in range(x.dim()) if i != d) \
            or any(x.shape[i] != 1 for i in range(d)) or y.untyped_storage()._pjrt.padding is not None:
        return NotImplemented
    st = x.untyped_storage()._pjrt
    p = padded_dim(x)
    if p is not None and p[0] == d:
        _, n, B = p
        full = _widened(x, d, B)
    elif st.padding is None and st.appended_along == d and storage.is_identity(x, st):
        n = B = x.shape[d]
        full = x
    else:
        if st.padding is not None:
            return NotImplemented
        out = _call(kernel, sig, vals)  # a first append: exact, and remembered
        storage.storage_of(out).appended_along = d
        return out
    size = B if n + k <= B else bucket(n + k, 1 << 62)
    array = storage.read(full)
    append = _append_fn(tuple(array.shape), array.dtype, d, size, tuple(y.shape), placement.index_of(array))
    return _mark(storage.wrap(fusion.call(append, array, storage.read(y), n), x.dtype), d, n + k)


@keyed
def _cat(kernel, sig, vals):
    tensors, dim = list(vals[0]), vals[1]
    if not tensors:
        return NotImplemented
    if enabled:
        out = _appended(kernel, sig, vals)
        if out is not NotImplemented:
            return out
    if not live:
        return NotImplemented
    found = [padded_dim(t) for t in tensors]
    if any(p is None for p in found) or len({p for p in found}) != 1 or len({t.dim() for t in tensors}) != 1:
        return NotImplemented
    d, n, B = found[0]
    if dim % tensors[0].dim() == d:
        return NotImplemented
    wide = list(vals)
    wide[0] = [_widened(t, d, B) for t in tensors]
    return _mark_results(_call(kernel, sig, wide), d, n)


@keyed
def _to_copy(kernel, sig, vals):
    """x.to(dtype) on the same device: a conversion per position."""
    x, device, memory_format = vals[0], vals[3], vals[6]
    p = padded_dim(x)
    if p is None or (device is not None and torch.device(device) != x.device) or vals[4] \
            or memory_format not in (None, torch.preserve_format):
        return NotImplemented
    d, n, B = p
    wide = list(vals)
    wide[0] = _widened(x, d, B)
    return _mark_results(_call(kernel, sig, wide), d, n)


def _masked_select(kernel, sig, vals):
    """masked_select(x, mask): x[mask] of the two broadcast together (padded like x[mask])."""
    x, mask = vals[0], vals[1]
    if mask.dtype != torch.bool or mask.device != x.device:
        return NotImplemented
    try:
        shape = torch.broadcast_shapes(x.shape, mask.shape)
    except RuntimeError:
        return NotImplemented  # the kernel raises CPU's error
    if not shape:
        return NotImplemented
    return aten.index.Tensor(x.expand(shape), [mask.expand(shape)])


@functools.lru_cache(maxsize=None)
def _count_fn(shape, dtype, device):
    return kernel_cache.kept_jit(jnp.count_nonzero, "padding.count_nonzero", shape, str(dtype), device)


@functools.lru_cache(maxsize=None)
def _nonzero_fn(shape, dtype, size, device):
    def coordinates(x):
        return jnp.stack(jnp.nonzero(x, size=size, fill_value=0), axis=-1).astype(jnp.int64)

    return kernel_cache.kept_jit(coordinates, "padding.nonzero", shape, str(dtype), size, device)


def _nonzero(kernel, sig, vals):
    """nonzero at a bucket size: the count is read back (as the exact kernel must), the
    coordinates computed for B rows, of which the first n are the result (marked padded even when
    n fills its bucket: it shares the bucket's kernels). A tensor of one element gets its n rows
    exactly, from the same kept program (the exact kernel would run JAX's element-by-element ops,
    compiled again in every process)."""
    x = vals[0]
    if not enabled or x.dim() == 0:
        return NotImplemented
    array = fusion.concrete_tree(storage.read(x))
    shape, dtype, device = tuple(array.shape), array.dtype, placement.index_of(array)
    n = int(_count_fn(shape, dtype, device)(array))
    if n == 0 or x.numel() < 2:  # nothing to pad
        return storage.wrap(_nonzero_fn(shape, dtype, n, device)(array))
    return _mark(storage.wrap(_nonzero_fn(shape, dtype, bucket(n, x.numel()), device)(array)), 0, n)


_RULES = {
    aten.mm.default: _matmul(0, False), aten.bmm.default: _matmul(0, True), aten.addmm.default: _matmul(1, False),
    aten.sum.dim_IntList: _sum, aten.sum.default: _sum_all, aten.mean.dim: _mean, aten.mean.default: _mean,
    aten.index.Tensor: _index, aten._unsafe_index.Tensor: _index, aten.index_select.default: _index_select,
    aten.index_add.default: _index_add, aten.index_add_.default: _index_add,
    aten.index_put.default: _index_put, aten.index_put_.default: _index_put,
    aten._index_put_impl_.default: _index_put,
    aten.cat.default: _cat,
    aten._softmax.default: _along_dim(1), aten._log_softmax.default: _along_dim(1),
    aten._softmax_backward_data.default: _along_dim(2), aten._log_softmax_backward_data.default: _along_dim(2),
    aten.nll_loss_forward.default: _nll_forward, aten.nll_loss_backward.default: _nll_backward,
    aten._to_copy.default: _to_copy,
    aten.fill_.Scalar: _pointwise_inplace, aten.fill_.Tensor: _pointwise_inplace, aten.zero_.default: _pointwise_inplace,
}
# data-dependent sizes start here: their rules run whether or not a padded storage is alive
PRODUCERS = {aten.nonzero.default: _nonzero, aten.index.Tensor: _index, aten.masked_select.default: _masked_select,
             aten.cat.default: _cat}  # cat: a sequence appended to (generate's input_ids) starts one


def rule_for(op, lowering):
    """The padding rule of `op` (with its lowering), or None."""
    if not enabled:
        return None
    if op in PRODUCERS:
        return PRODUCERS[op]
    if op in _RULES:
        return _RULES[op]
    if lowering is None:
        return None
    schema = op._schema
    if torch.Tag.pointwise not in op.tags or lowering.random or not schema.returns:
        return None
    written = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
    if not any(written):
        return _pointwise
    if written[0] and not any(written[1:]) and not schema.arguments[0].kwarg_only:
        return _pointwise_inplace
    return None


def aware(op, kernel, rule, sig):
    """`kernel` with its padding rule: while no padded storage is alive, one comparison."""
    producer = op in PRODUCERS

    def padded_kernel(*args, **kwargs):
        if not live and not producer:
            return kernel(*args, **kwargs)
        out = rule(kernel, sig, sig.values(args, kwargs))
        if out is NotImplemented:
            return kernel(*args, **kwargs)
        return out

    return padded_kernel


def storage_padding_of(t):
    """(n, B) of a padded tensor, for tests and reports; None for an exact one."""
    p = padded_dim(t)
    return None if p is None else p[1:]

