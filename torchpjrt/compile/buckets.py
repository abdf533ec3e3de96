"""Shape buckets: dynamic sizes padded up to a few bucket sizes, one XLA program per bucket.

`torch.compile(..., backend="pjrt", dynamic=True, options={"buckets": [64, 128, 256]})` (or
`"pow2"`). Dynamo and AOTAutograd trace the graph once with symbolic sizes (s0, s1, ...). At
each call every symbolic size n is rounded up to its bucket b; the tensor inputs are padded with
zeros to b, the program compiled for the bucket runs with the true sizes as runtime scalars, and
the outputs are sliced back to n. Each graph's interface stays at the true sizes, so a forward
and its backward may bucket (or not) independently.

Padded positions hold garbage (zeros at first, anything after an op). Ops that keep positions
apart (elementwise ops, views, the rows of a matmul) need nothing. Ops that combine values
along a padded dimension are masked with the true sizes: sums, means and matmul contractions
see zeros, max and softmax see -inf, means divide by the true count, softmax and layer-norm
backward zero their padded gradients. A size used as a number (`x / s0`) gets the true size.
Anything else over a padded dimension (a sort, a variance, a norm over it, an index into it, a
reshape that would move padded positions) makes the graph unbucketable: it then compiles once
per size as without buckets, and `compile_stats()["bucket_fallback_reasons"]` says why.

A dimension's layout is the ordered list of its factors ("atoms"): (s0,) for a padded
dimension, (4, s0) after a view merged a static 4 with it. From the layout, the mask of valid
positions follows without tracing anything.
"""

import functools
import math
import operator
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import sympy
import torch
from jax import lax

from .. import fusion, storage
from ..dispatch import signature
from . import graph as graph_mod

aten = torch.ops.aten


class Unbucketable(Exception):
    """The graph holds an op over a padded dimension that masking cannot make exact."""


def parse(spec):
    """The `buckets` option: None, "pow2", or strictly increasing positive ints (a tuple)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec in ("pow2", "powers_of_two"):
            return "pow2"
        raise ValueError(f"torchpjrt: torch.compile option 'buckets' must be 'pow2' or a list of sizes, got {spec!r}")
    try:
        sizes = list(spec)
    except TypeError:
        sizes = None
    if (not sizes or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in sizes)
            or any(a >= b for a, b in zip(sizes, sizes[1:]))):
        raise ValueError("torchpjrt: torch.compile option 'buckets' must be 'pow2' or a non-empty list of "
                         f"strictly increasing positive sizes, got {spec!r}")
    return tuple(int(b) for b in sizes)


def bucket_for(spec, n: int) -> int:
    """The padded size for true size n: the smallest bucket holding it; beyond the largest
    bucket, n itself (compiled for that size, still exact)."""
    if spec == "pow2":
        return 1 << max(n - 1, 0).bit_length()
    for b in spec:
        if b >= n:
            return b
    return n


# ---- layouts -------------------------------------------------------------------------------


# Layouts of merged padded dims that bucketed graphs returned, per ShapeEnv (a forward and its
# backward share one): the backward receives saved tensors whose size (s0*s1) alone does not
# say how its factors are ordered.
_returned_layouts = weakref.WeakKeyDictionary()  # ShapeEnv -> {size expr: atoms, or None if ambiguous}


def _shape_env(val):
    for s in val.shape:
        if isinstance(s, torch.SymInt):
            return s.node.shape_env
    return None


def _expr(size):
    if isinstance(size, torch.SymInt):
        e = size.node.expr
        return int(e) if e.is_number else e
    return int(size)


def _shape_exprs(val):
    return [_expr(s) for s in val.shape]


def _is_padded(layout) -> bool:
    return layout is not None and any(isinstance(a, sympy.Symbol) for atoms in layout for a in atoms)


def _padded_dims(layout):
    return {d for d, atoms in enumerate(layout) if any(isinstance(a, sympy.Symbol) for a in atoms)}


def _regroup(in_layout, out_exprs):
    """The layout of a reshape's output, or None when the reshape would mix padded positions
    with others (a padded factor split or moved)."""
    atoms = [a for dim in in_layout for a in dim]
    out = []
    for e in out_exprs:
        got, remaining = [], sympy.sympify(e)
        while remaining != 1:
            if not atoms:
                return None
            a = atoms.pop(0)
            if isinstance(a, sympy.Symbol):
                q = sympy.cancel(remaining / a)
                if sympy.fraction(q)[1] != 1:
                    return None
                got.append(a)
                remaining = q
                continue
            if a == 1:
                continue
            coeff = int(remaining.as_coeff_Mul()[0])
            if coeff % a == 0:
                got.append(a)
                remaining = remaining / a
            elif remaining.is_Integer and a % coeff == 0:
                got.append(coeff)  # a static factor split between two output dims
                atoms.insert(0, a // coeff)
                remaining = sympy.Integer(1)
            else:
                return None
        out.append(tuple(got) or (1,))
    if any(a != 1 for a in atoms):
        return None
    return tuple(out)


def _sizes(atoms, sizes):
    return [sizes.get(a, a) if isinstance(a, sympy.Symbol) else int(a) for a in atoms]


def _valid_mask(layout, padded, true):
    """Boolean array (broadcastable to the value) that is True at the positions that exist at
    the true sizes: along each dim, every padded factor's index is below its true size."""
    mask = None
    rank = len(layout)
    for d, atoms in enumerate(layout):
        if not any(isinstance(a, sympy.Symbol) for a in atoms):
            continue
        dim_sizes = _sizes(atoms, padded)
        index = lax.iota(jnp.int32, math.prod(dim_sizes))
        ok, inner = None, 1
        for a, size in zip(reversed(atoms), reversed(dim_sizes)):
            if isinstance(a, sympy.Symbol):
                here = (index // inner) % size < true[a]
                ok = here if ok is None else ok & here
            inner *= size
        shape = [1] * rank
        shape[d] = ok.shape[0]
        ok = ok.reshape(shape)
        mask = ok if mask is None else mask & ok
    return mask


def _evaluate(expr, values):
    """A size expression evaluated at `values` (ints or traced scalars)."""
    if isinstance(expr, int) or expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return values[expr]
    if isinstance(expr, sympy.Add):
        return functools.reduce(operator.add, (_evaluate(a, values) for a in expr.args))
    if isinstance(expr, sympy.Mul):
        return functools.reduce(operator.mul, (_evaluate(a, values) for a in expr.args))
    raise Unbucketable(f"size expression {expr} is not a sum of products")


# ---- ops over padded dimensions ------------------------------------------------------------

# ops that move or combine values without mixing positions along any dimension beyond what their
# output layout records (checked per op below where a dim argument matters)
_MOVEMENT = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.expand.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
    aten.detach.default, aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default, aten.stack.default,
    aten.slice.Tensor, aten.select.int, aten.embedding.default, aten.index_select.default,
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.lift_fresh_copy.default, aten.native_dropout.default,
}
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SUM_LIKE = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}
_EXTREMA = {aten.amax.default: -jnp.inf, aten.amin.default: jnp.inf}
_SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default}
_SOFTMAX_BACKWARD = {aten._softmax_backward_data.default, aten._log_softmax_backward_data.default}
_CONTRACTIONS = {  # op: ((argument, contracted dim), ...)
    aten.mm.default: (("self", 1), ("mat2", 0)),
    aten.bmm.default: (("self", 2), ("mat2", 1)),
    aten.addmm.default: (("mat1", 1), ("mat2", 0)),
    aten.baddbmm.default: (("batch1", 2), ("batch2", 1)),
}


def _dims(value, rank):
    if value is None or value == []:
        return set(range(rank))
    value = [value] if isinstance(value, int) else value
    return {d % rank if rank else 0 for d in value}


class BucketedGraph:
    """One graph compiled per bucket; called with the graph's true-size arguments."""

    def __init__(self, gm, example_inputs, spec, stats):
        self.spec, self.stats = spec, stats
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.layouts = {}  # node name -> layout (tuple of atom tuples), or a list of them
        self.masked = {}  # node name -> how to compute the op with masks
        self.true_args = {}  # node name -> {schema position: size node} (sizes used as numbers)
        self._find_symbols(example_inputs)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                self._analyze(node)
        if not any(_is_padded(lay) for lay in self._flat_layouts()):
            raise Unbucketable("no tensor of the graph has a dynamic size")
        self.outputs = graph_mod.output_values(gm)
        # every size the program derives from the true sizes must be computable from them
        probe = {sym: 2 for sym in self.symbols}
        for expr in [e for subs in self.true_args.values() for e in subs.values()] + \
                [_expr(v) for v in self.outputs + [n.meta.get("val") for n in self.placeholders]
                 if isinstance(v, (int, torch.SymInt))]:
            _evaluate(expr, probe)
        self.output_layouts = [self._layout_of_output(v, i) for i, v in enumerate(self._output_nodes(gm))]
        self._register_returned_layouts()
        self.fn = graph_mod.to_jax_function(gm, hooks=self)
        self.programs = {}
        self._true = self._padded = None  # set while the program for a bucket is traced

    # -- analysis --

    def _find_symbols(self, example_inputs):
        self.sources = {}  # symbol -> ("int", input index) or ("dim", input index, dim)
        for i, node in enumerate(self.placeholders):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
                self.sources.setdefault(val.node.expr, ("int", i))
        for i, node in enumerate(self.placeholders):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                exprs = _shape_exprs(val)
                for d, e in enumerate(exprs):
                    if isinstance(e, sympy.Symbol):
                        self.sources.setdefault(e, ("dim", i, d))
                known = _returned_layouts.get(_shape_env(val), {}) if _shape_env(val) is not None else {}
                layout = []
                for e in exprs:
                    atoms = (e,) if isinstance(e, (int, sympy.Symbol)) else known.get(e)
                    if atoms is None:
                        raise Unbucketable(f"input {node.name} has a size {e} whose layout is unknown")
                    layout.append(atoms)
                self.layouts[node.name] = tuple(layout)
        self.symbols = sorted(self.sources, key=str)
        if not self.symbols:
            raise Unbucketable("the graph has no dynamic sizes")

    def _flat_layouts(self):
        for lay in self.layouts.values():
            if isinstance(lay, list):
                yield from lay
            else:
                yield lay

    def _layout(self, arg):
        if isinstance(arg, torch.fx.Node):
            return self.layouts.get(arg.name)
        return None

    def _analyze(self, node):
        if node.target is operator.getitem:
            container, index = node.args
            lay = self.layouts.get(container.name)
            self.layouts[node.name] = lay[index] if isinstance(lay, list) else None
            return
        if graph_mod.is_size_node(node):
            return
        op = node.target
        if not isinstance(op, torch._ops.OpOverload):
            raise Unbucketable(f"{op} is not an aten op")
        sig = signature(op)
        fx_vals = sig.values(list(node.args), dict(node.kwargs))
        named = dict(zip(sig.names, fx_vals))
        tensor_args = [a for v in fx_vals for a in (v if isinstance(v, (list, tuple)) else [v])
                       if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        in_layouts = [self.layouts.get(a.name) for a in tensor_args]
        # sizes passed where the schema wants a number are values: they get the true size
        for pos, (arg, v) in enumerate(zip(sig.schema.arguments, fx_vals)):
            if isinstance(arg.type, torch.NumberType) and isinstance(v, torch.fx.Node) and \
                    isinstance(v.meta.get("val"), torch.SymInt):
                self.true_args.setdefault(node.name, {})[pos] = v.meta["val"].node.expr
        self.layouts[node.name] = self._output_layout(node, op, fx_vals, tensor_args, in_layouts)
        if not any(_is_padded(lay) for lay in in_layouts):
            return
        self._check_op(node, op, named, sig)

    def _output_layout(self, node, op, fx_vals, tensor_args, in_layouts):
        val = node.meta.get("val")
        candidates = [(e, atoms) for a, lay in zip(tensor_args, in_layouts) if lay is not None
                      for e, atoms in zip(_shape_exprs(a.meta["val"]), lay)]

        def one(v):
            if not isinstance(v, torch.Tensor):
                return None
            exprs = _shape_exprs(v)
            if op in _RESHAPES and in_layouts and in_layouts[0] is not None:
                layout = _regroup(in_layouts[0], exprs)
                if layout is None:
                    raise Unbucketable(f"{op} reshapes {_shape_exprs(tensor_args[0].meta['val'])} to {exprs}, "
                                       "which would move padded positions")
                return layout
            layout = []
            for e in exprs:
                if isinstance(e, (int, sympy.Symbol)):
                    layout.append((e,))
                    continue
                found = {atoms for ce, atoms in candidates if ce == e}
                if len(found) != 1:
                    raise Unbucketable(f"{op}: cannot tell how the padded size {e} of its output is laid out")
                layout.append(found.pop())
            return tuple(layout)

        if isinstance(val, (list, tuple)):
            return [one(v) for v in val]
        return one(val)

    def _check_op(self, node, op, named, sig):
        def layout(name):
            return self._layout(named.get(name))

        def dims_of(name, value):
            lay = layout(name)
            return _dims(value, len(lay)) & _padded_dims(lay)

        if torch.Tag.pointwise in op.tags:
            return
        if op in _MOVEMENT:
            self._check_movement(node, op, named, layout)
            return
        if op in _SUM_LIKE or op in _EXTREMA:
            if dims_of("self", named.get("dim")):
                self.masked[node.name] = ("reduce", sig.names.index("self"), self.layouts[named["self"].name])
            return
        if op in _SOFTMAX:
            if dims_of("self", named["dim"]):
                self.masked[node.name] = ("fill", {sig.names.index("self"): (-jnp.inf, layout("self"))})
            return
        if op in _SOFTMAX_BACKWARD:
            if dims_of("grad_output", named["dim"]):
                self.masked[node.name] = ("fill", {sig.names.index("grad_output"): (0, layout("grad_output")),
                                                   sig.names.index("output"): (0, layout("output"))})
            return
        if op in _CONTRACTIONS:
            fills = {}
            for name, dim in _CONTRACTIONS[op]:
                if dim in _padded_dims(layout(name) or ()):
                    fills = {sig.names.index(n): (0, layout(n)) for n, _ in _CONTRACTIONS[op]
                             if layout(n) is not None}
            if fills:
                self.masked[node.name] = ("fill", fills)
            return
        if op is aten.native_layer_norm.default or op is aten.native_layer_norm_backward.default:
            x = "input"
            lay = layout(x)
            normalized = set(range(len(lay) - len(named["normalized_shape"]), len(lay)))
            if normalized & _padded_dims(lay):
                raise Unbucketable(f"{op} normalizes over a padded dimension")
            if op is aten.native_layer_norm_backward.default and _padded_dims(lay):
                # weight and bias gradients sum over the padded rows: zero them (x too: 0 * inf)
                self.masked[node.name] = ("fill", {sig.names.index(n): (0, layout(n))
                                                   for n in ("grad_out", "input", "mean", "rstd")
                                                   if layout(n) is not None})
            return
        if op is aten.embedding_dense_backward.default:
            self.masked[node.name] = ("fill", {sig.names.index("grad_output"): (0, layout("grad_output"))})
            return
        raise Unbucketable(f"{op} over a padded dimension cannot be masked")

    def _check_movement(self, node, op, named, layout):
        lay = layout("self") if "self" in named else None
        padded = _padded_dims(lay) if lay is not None else set()
        if op is aten.slice.Tensor and named["dim"] % len(lay) in padded:
            size = lay[named["dim"] % len(lay)]
            end = named.get("end")
            end_expr = end.meta["val"].node.expr if isinstance(end, torch.fx.Node) else end
            if named.get("start") not in (None, 0) or not (end_expr is None or (isinstance(end_expr, int)
                                                                               and end_expr >= 2 ** 62)
                                                            or (len(size) == 1 and end_expr == size[0])):
                raise Unbucketable(f"{op} slices a padded dimension")
        elif op in (aten.select.int, aten.index_select.default, aten.split.Tensor,
                    aten.split_with_sizes.default) and named["dim"] % len(lay) in padded:
            raise Unbucketable(f"{op} indexes or splits a padded dimension")
        elif op is aten.cat.default:
            lays = [self._layout(t) for t in named["tensors"]]
            dim = named["dim"]
            if any(lay is not None and dim % len(lay) in _padded_dims(lay) for lay in lays):
                raise Unbucketable(f"{op} concatenates along a padded dimension")
        elif op is aten.embedding.default and 0 in _padded_dims(layout("weight")):
            raise Unbucketable(f"{op} looks up rows of a padded table")
        elif op is aten.native_dropout.default:
            pass  # elementwise given its random mask

    def _register_returned_layouts(self):
        for value, layout in zip(self.outputs, self.output_layouts):
            if not isinstance(value, torch.Tensor) or layout is None or _shape_env(value) is None:
                continue
            known = _returned_layouts.setdefault(_shape_env(value), {})
            for e, atoms in zip(_shape_exprs(value), layout):
                if len(atoms) > 1:
                    known[e] = atoms if known.get(e, atoms) == atoms else None

    def _output_nodes(self, gm):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        results = out.args[0]
        return results if isinstance(results, (list, tuple)) else (results,)

    def _layout_of_output(self, node, i):
        return self.layouts.get(node.name) if isinstance(node, torch.fx.Node) else None

    # -- hooks called by graph.to_jax_function while a bucket's program is traced --

    def arguments(self, node, vals):
        subs = self.true_args.get(node.name)
        if subs:
            vals = list(vals)
            for pos, expr in subs.items():
                vals[pos] = _evaluate(expr, self._true)
        return vals

    def call(self, node, fn, vals):
        how = self.masked.get(node.name)
        if how is None:
            return None
        if how[0] == "fill":
            vals = list(vals)
            for pos, (fill, layout) in how[1].items():
                mask = _valid_mask(layout, self._padded, self._true)
                if mask is not None:
                    vals[pos] = jnp.where(mask, vals[pos], jnp.asarray(fill, vals[pos].dtype))
            return fn(*vals)
        _, pos, layout = how
        x = vals[pos]
        mask = _valid_mask(layout, self._padded, self._true)
        op = node.target
        if op in _EXTREMA:
            vals = list(vals)
            vals[pos] = jnp.where(mask, x, jnp.asarray(_EXTREMA[op], x.dtype))
            return fn(*vals)
        vals = list(vals)
        vals[pos] = jnp.where(mask, x, jnp.zeros((), x.dtype))
        if op in (aten.sum.dim_IntList, aten.sum.default):
            return fn(*vals)
        # mean: the masked sum over the number of valid positions it covered
        dims = sorted(_dims(vals[1] if op is aten.mean.dim else None, x.ndim))
        keepdim = bool(vals[2]) if op is aten.mean.dim else False
        dtype = node.meta["val"].dtype
        from .. import dtypes

        jdtype = dtypes.to_jax(dtype)
        total = jnp.sum(vals[pos].astype(jdtype), axis=tuple(dims), keepdims=keepdim)
        count = jnp.sum(jnp.broadcast_to(mask, x.shape), axis=tuple(dims), keepdims=keepdim)
        return total / count.astype(jdtype)

    # -- running --

    def __call__(self, seed_offset, args):
        true = {}
        for sym, src in self.sources.items():
            true[sym] = int(args[src[1]]) if src[0] == "int" else int(args[src[1]].shape[src[2]])
        padded = {sym: bucket_for(self.spec, n) for sym, n in true.items()}
        key = tuple(padded[s] for s in self.symbols)
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = self._program(padded)
        arrays = []
        for node, a in zip(self.placeholders, args):
            if isinstance(a, torch.Tensor):
                arrays.append(_resize(storage.value_of(a), self.layouts[node.name], true, padded))
        true_sizes = np.asarray([true[s] for s in self.symbols], np.int32)
        outs = fusion.call(program, seed_offset, true_sizes, *arrays)
        results = []
        for value, layout, o in zip(self.outputs, self.output_layouts, outs):
            if isinstance(value, (int, torch.SymInt)):
                results.append(int(_evaluate(_expr(value), true)))
            elif hasattr(o, "shape") and hasattr(o, "dtype"):
                results.append(storage.wrap(_resize(o, layout, padded, true) if layout is not None else o))
            else:
                results.append(o)
        return results

    def _program(self, padded):
        int_positions = {i: _expr(n.meta["val"]) for i, n in enumerate(self.placeholders)
                         if isinstance(n.meta.get("val"), (int, torch.SymInt))}

        def body(seed_offset, true_sizes, *arrays):
            self.stats["xla_compiles"] += 1  # runs when jax traces: once per bucket
            self._true = {s: true_sizes[j] for j, s in enumerate(self.symbols)}
            self._padded = padded
            it = iter(arrays)
            full = [int(_evaluate(int_positions[i], padded)) if i in int_positions else next(it)
                    for i in range(len(self.placeholders))]
            try:
                outs = self.fn(seed_offset, *full)
            finally:
                self._true = self._padded = None
            # sizes are computed outside from the true sizes; the program returns arrays only
            return tuple(None if isinstance(v, (int, torch.SymInt)) else o for v, o in zip(self.outputs, outs))

        return jax.jit(body)


def _resize(array, layout, have, want):
    """Pad (zeros) or slice every padded factor of `array` from its size in `have` to `want`."""
    if not _is_padded(layout):
        return array
    atoms = tuple(a for dim in layout for a in dim)
    groups = tuple(len(dim) for dim in layout)
    src = tuple(_sizes(atoms, have))
    dst = tuple(_sizes(atoms, want))
    if src == dst:
        return array
    return fusion.call(_resize_fn(src, dst, groups, tuple(_sizes(atoms, want)), str(array.dtype)), array)


@functools.lru_cache(maxsize=1024)
def _resize_fn(src, dst, groups, want_atoms, dtype):
    merged, at = [], 0
    for g in groups:
        merged.append(math.prod(want_atoms[at:at + g]))
        at += g

    def resize(x):
        x = x.reshape(src)
        grow = [(0, max(d - s, 0)) for s, d in zip(src, dst)]
        if any(hi for _, hi in grow):
            x = jnp.pad(x, grow)
        x = x[tuple(slice(0, d) for d in dst)]
        return x.reshape(merged)

    return jax.jit(resize)
