"""An aten-level FX graph as one JAX function, built from the lowering table.

The graph comes from AOTAutograd (functionalized core aten IR). Each `call_function` node
is looked up in the same table eager execution uses; outputs are cast to the dtype PyTorch
recorded for the node (node.meta["val"]), so results match eager exactly.
"""

import hashlib
import operator

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes, fusion, random_state, storage
from ..dispatch import SCALAR, TENSOR, TENSOR_LIST, signature
from ..kernels import OUTPUT_CHECKS
from ..ops import TABLE, DeviceCheck, check_vector, lowering_for


class UnsupportedGraph(Exception):
    """The graph holds an op the table cannot lower."""


# Size arithmetic of dynamic-shape graphs (`s0 * s1` for a view's size): plain Python on ints,
# since sizes are compiled in.
SIZE_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
                  operator.truediv, torch.sym_max, torch.sym_min, torch.sym_not}


def is_size_node(node) -> bool:
    return node.op == "call_function" and isinstance(node.meta.get("val"), (int, torch.SymInt)) and (
        node.target in SIZE_FUNCTIONS or node.target is torch.ops.aten.sym_size.int)


def is_linalg_check(node) -> bool:
    """`with_effects(token, aten._linalg_check_errors, info, api_name, is_matrix=...)`: how a
    graph keeps linalg's "the matrix is singular" check (an effect, so it is not dead code)."""
    return (node.op == "call_function" and node.target is torch.ops.higher_order.with_effects
            and node.args[1] is torch.ops.aten._linalg_check_errors.default)


def _linalg_check(node) -> DeviceCheck:
    """A device check of a LAPACK-style `info` result: its first nonzero entry, turned into the
    CPU's exception (torch.linalg.LinAlgError with PyTorch's message) on the host."""
    dtype = node.args[2].meta["val"].dtype
    api_name = node.args[3]
    is_matrix = node.kwargs.get("is_matrix", node.args[4] if len(node.args) > 4 else True)

    def find(info):
        # the shape travels with the vector: in a dynamic-shape graph it is known only here
        flat = info.reshape(-1)
        if flat.size == 0:
            return check_vector(False, 0, 0, *info.shape)
        bad = flat != 0
        position = jnp.argmax(bad)
        return check_vector(bad.any(), position, flat[position], *info.shape)

    def error(position, value, *shape):
        cpu_info = torch.zeros(shape, dtype=dtype)
        cpu_info.view(-1)[position] = value
        try:
            torch.ops.aten._linalg_check_errors(cpu_info, api_name, is_matrix=is_matrix)
        except Exception as e:  # noqa: BLE001 - PyTorch's own exception is the one to raise
            return e
        return RuntimeError(f"{api_name}: the computation failed (info = {value})")

    return DeviceCheck(find, error)


def unsupported_ops(gm: torch.fx.GraphModule):
    missing = set()
    for node in gm.graph.nodes:
        if is_size_node(node) or is_linalg_check(node):
            continue
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            lowering = lowering_for(node.target)
            if lowering is None or lowering.has_dynamic_shape(_meta_values(node.args)) or _leaves_pjrt(node):
                missing.add(str(node.target))
        elif node.op == "call_function" and node.target is not operator.getitem:
            missing.add(str(node.target))
        elif node.op in ("call_module", "call_method", "get_attr"):
            if node.op == "get_attr":
                continue
            missing.add(f"{node.op}:{node.target}")
    return sorted(missing)


def _leaves_pjrt(node):
    """A copy to another device (`.cpu()` in a compiled function) cannot be a value of the
    JAX program."""
    device = node.kwargs.get("device") if node.target is torch.ops.aten._to_copy.default else None
    return device is not None and torch.device(device).type != "pjrt"


def _meta_values(args):
    """A node's arguments with other nodes replaced by their example (fake) values."""
    return torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))


def _expected_dtypes(node):
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    out = []
    for v in vals:
        out.append(dtypes.to_jax(v.dtype) if isinstance(v, torch.Tensor) else None)
    return out


def _cast(outs, expected):
    if len(expected) != len(outs):
        return outs
    return tuple(o.astype(d) if d is not None and hasattr(o, "dtype") and o.dtype != d else o
                 for o, d in zip(outs, expected))


def uses_random(gm) -> bool:
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        and TABLE.get(n.target) is not None and TABLE[n.target].random
        for n in gm.graph.nodes
    )


def uses_user_code(gm) -> bool:
    """Whether the graph calls a custom kernel (torchpjrt.kernel), whose program is user code."""
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        and lowering_for(n.target) is not None and lowering_for(n.target).user_code
        for n in gm.graph.nodes
    )


def fingerprint(gm: torch.fx.GraphModule) -> str:
    """What fixes the program to_jax_function(gm) builds, as a hash: the graph's code, each
    node's example value (geometry and dtype: outputs are cast to it) and the contents of the
    lifted constants, which the program holds as literals."""
    digest = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        digest.update(f"{node.name}:{_describe(node.meta.get('val'))};".encode())
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor):
                array = np.asarray(fusion.concrete(storage.value_of(value)))
                digest.update(f"{array.dtype}{array.shape}".encode() + array.tobytes())
            else:
                digest.update(repr(value).encode())
    return digest.hexdigest()


def _describe(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{val.dtype}{tuple(val.shape)}{tuple(val.stride())}"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(_describe(v) for v in val) + ")"
    return repr(val)


def output_values(gm: torch.fx.GraphModule):
    """The example values (node.meta["val"]) of the graph's outputs, None where unknown."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    results = out.args[0]
    flat = results if isinstance(results, (list, tuple)) else (results,)
    return [r.meta.get("val") if isinstance(r, torch.fx.Node) else r for r in flat]


def checked_ops(gm: torch.fx.GraphModule):
    """(op, DeviceCheck) of the graph's checked nodes, in the order their vectors are returned
    by to_jax_function(gm, checks=True)."""
    found = []
    for node in gm.graph.nodes:
        if is_linalg_check(node):
            found.append((node.args[1], _linalg_check(node)))
        elif (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
              and not is_size_node(node) and lowering_for(node.target) is not None
              and lowering_for(node.target).check is not None):
            found.append((node.target, lowering_for(node.target).check))
    return found


def to_jax_function(gm: torch.fx.GraphModule, hooks=None, checks=False):
    """f(seed_offset, *inputs) -> tuple of outputs, a pure function of JAX arrays.

    `hooks` (shape buckets) may replace an op's argument values (`hooks.arguments(node, vals)`)
    and how an op is computed (`hooks.call(node, fn, vals)`, None to compute it as usual).
    With `checks`, the device check vectors of checked_ops(gm) follow the outputs."""
    missing = unsupported_ops(gm)
    if missing:
        raise UnsupportedGraph(", ".join(missing))
    nodes = list(gm.graph.nodes)
    linalg_checks = {node.name: _linalg_check(node) for node in nodes if is_linalg_check(node)}
    constants = {}
    for node in nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            # a lifted constant, on the CPU or on pjrt
            constants[node.name] = fusion.concrete(storage.value_of(value)) if isinstance(value, torch.Tensor) else value

    def run(seed_offset, *inputs):
        env = {}
        it = iter(inputs)
        counter = 0
        vectors = []

        def value(a):
            if isinstance(a, torch.fx.Node):
                return env[a.name]
            if isinstance(a, (list, tuple)):
                return type(a)(value(x) for x in a)
            return a

        for node in nodes:
            if node.op == "placeholder":
                env[node.name] = next(it)
            elif node.op == "get_attr":
                env[node.name] = constants[node.name]
            elif node.op == "call_function":
                if node.target is operator.getitem:
                    container, index = node.args
                    env[node.name] = env[container.name][index]
                    continue
                if is_size_node(node):
                    env[node.name] = _size_value(node, value)
                    continue
                if node.name in linalg_checks:
                    env[node.name] = (value(node.args[0]),)  # the effect token passes through
                    if checks:
                        vectors.append(linalg_checks[node.name].find(value(node.args[2])))
                    continue
                op = node.target
                lowering = TABLE[op]
                sig = signature(op)
                vals = sig.values([value(a) for a in node.args], {k: value(v) for k, v in node.kwargs.items()})
                vals = [_plain(v, k) for v, k in zip(vals, sig.kinds)]
                if hooks is not None:
                    vals = hooks.arguments(node, vals)
                if lowering.random:
                    key = random_state.key_from_seed_offset(seed_offset)
                    vals.append(jax.random.fold_in(key, counter))
                    counter += 1
                out = hooks.call(node, lowering.fn, vals) if hooks is not None else None
                if out is None:
                    out = lowering.fn(*vals)
                if checks and lowering.check is not None:
                    vectors.append(lowering.check.find(*vals))
                outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                n_regular = len(op._schema.returns)
                if op in OUTPUT_CHECKS:
                    # a custom kernel's outputs against its fake: before the cast below hides a dtype
                    OUTPUT_CHECKS[op](vals, outs)
                outs = _cast(outs, _expected_dtypes(node))
                val = node.meta.get("val")
                if n_regular == 0:
                    env[node.name] = None  # an op run for its check alone (_assert_async)
                elif isinstance(val, (list, tuple)) or n_regular > 1:
                    env[node.name] = outs
                else:
                    env[node.name] = outs[0]
            elif node.op == "output":
                results = node.args[0]
                flat = results if isinstance(results, (list, tuple)) else (results,)
                return tuple(value(r) if r is not None else None for r in flat) + tuple(vectors)
        raise RuntimeError("graph has no output node")

    return run


def _size_value(node, value):
    if node.target is torch.ops.aten.sym_size.int:
        tensor, dim = node.args
        return int(value(tensor).shape[dim])
    return node.target(*(int(a) if isinstance(a, torch.SymInt) else a for a in value(tuple(node.args))))


def _plain(v, kind):
    # SymInts and scalar tensors captured as constants become Python values
    if kind == SCALAR and isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, torch.SymInt):
        return int(v)
    if kind not in (TENSOR, TENSOR_LIST, SCALAR) and isinstance(v, np.generic):
        return v.item()
    return v
