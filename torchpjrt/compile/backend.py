"""`torch.compile(model, backend="pjrt")`.

Dynamo captures the graph, AOTAutograd produces forward and backward graphs in aten IR,
and each becomes one JAX function built from the lowering table and compiled by `jax.jit`
into a single XLA program. Ops the table cannot lower make that graph run eagerly on pjrt
(op by op, same kernels as eager mode), never on the CPU.
"""

import functools
import time
import warnings
from collections import Counter

import jax
import torch
from functorch.compile import make_boxed_func

from .. import fusion, random_state, storage
from ..ops import TABLE
from . import graph as graph_mod

stats = Counter()
eager_fallback_reasons = []
recompile_reasons = []
_seen_graphs = {}  # graph code -> input shapes it was last compiled for


def compile_stats() -> dict:
    """Graphs compiled, eager fallbacks (with the ops that caused them), compile seconds, and
    the persistent compilation cache's hits and misses (every XLA compile of the process)."""
    from .. import compile_cache

    return {
        **{key: 0 for key in ("graphs", "eager_graphs", "recompiles", "xla_compiles", "calls", "compile_seconds")},
        **stats,
        "eager_fallback_reasons": list(eager_fallback_reasons),
        "recompile_reasons": list(recompile_reasons),
        "persistent_cache_dir": compile_cache.directory(),
        "persistent_cache_hits": compile_cache.stats["persistent_cache_hits"],
        "persistent_cache_misses": compile_cache.stats["persistent_cache_misses"],
    }


@functools.lru_cache(maxsize=1)
def _decompositions():
    """torch._decomp entries for the ops the table does not lower directly."""
    from torch._decomp import core_aten_decompositions

    table = core_aten_decompositions()
    return {op: fn for op, fn in table.items() if op not in TABLE}


def _shapes(example_inputs):
    return [tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in example_inputs]


def _note_recompile(gm, example_inputs):
    """Dynamo hands us the same graph again when its guards failed: say what changed."""
    code, shapes = gm.code, _shapes(example_inputs)
    before = _seen_graphs.get(code)
    _seen_graphs[code] = shapes
    if before is None:
        return
    stats["recompiles"] += 1
    changed = [f"input {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(before, shapes)) if a != b]
    recompile_reasons.append("; ".join(changed) if changed else "guards failed with the same input shapes")


def _compile_graph(gm: torch.fx.GraphModule, example_inputs):
    t0 = time.perf_counter()
    _note_recompile(gm, example_inputs)
    try:
        fn = graph_mod.to_jax_function(gm)
    except graph_mod.UnsupportedGraph as e:
        stats["eager_graphs"] += 1
        eager_fallback_reasons.append(f"ops without lowering: {e}")
        warnings.warn(f"torchpjrt: running a compiled graph eagerly on pjrt (ops without lowering: {e})")
        return _eager(gm)

    def traced(*args):
        stats["xla_compiles"] += 1  # runs when jax traces: once per input signature
        return fn(*args)

    random = graph_mod.uses_random(gm)
    stats["graphs"] += 1
    stats["compile_seconds"] += time.perf_counter() - t0
    # dynamic=True graphs take sizes as SymInt inputs and may return sizes (saved for the
    # backward): sizes are compiled in (one XLA program per size) and returned as ints
    int_inputs = [i for i, e in enumerate(example_inputs) if isinstance(e, (int, torch.SymInt))]
    int_outputs = {i for i, v in enumerate(graph_mod.output_values(gm)) if isinstance(v, (int, torch.SymInt))}
    by_sizes = {}

    def program_for(sizes):
        jitted = by_sizes.get(sizes)
        if jitted is None:
            if not int_inputs:
                jitted = jax.jit(traced)
            else:
                def with_sizes(seed_offset, *arrays):
                    full = list(arrays)
                    for i, v in zip(int_inputs, sizes):
                        full.insert(i, v)
                    return traced(seed_offset, *full)

                jitted = jax.jit(with_sizes)
            by_sizes[sizes] = jitted
        return jitted

    def run(*args):
        seed_offset = random_state.next_seed_offset() if random else _NO_SEED
        sizes = tuple(int(args[i]) for i in int_inputs)
        arrays = [_input(a) for i, a in enumerate(args) if i not in int_inputs]
        before, start = stats["xla_compiles"], time.perf_counter()
        outs = fusion.call(program_for(sizes), seed_offset, *arrays)
        if stats["xla_compiles"] != before:
            stats["compile_seconds"] += time.perf_counter() - start
        stats["calls"] += 1
        return [int(fusion.concrete(o)) if i in int_outputs
                else storage.wrap(o) if hasattr(o, "shape") and hasattr(o, "dtype") else o
                for i, o in enumerate(outs)]

    return make_boxed_func(run)


_NO_SEED = None


def _input(a):
    return storage.value_of(a) if isinstance(a, torch.Tensor) else a


def _eager(gm):
    def run(*args):
        return gm(*args)

    return make_boxed_func(run)


# torch.compile modes are inductor's tuning levels; XLA compiles every graph one way, so they
# are accepted (code written for inductor runs unchanged) and change nothing.
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def pjrt_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """The Dynamo backend registered as "pjrt"."""
    from torch._dynamo.backends.common import aot_autograd

    import torchpjrt  # noqa: F401  (the device must exist; entry points may load us first)

    if mode not in MODES:
        raise ValueError(f"torchpjrt: unknown torch.compile mode {mode!r}; expected one of {MODES[1:]}")
    if options:
        raise NotImplementedError(
            f"torchpjrt: torch.compile options {sorted(options)} are not supported by the pjrt backend yet "
            "(buffer donation and shape buckets are planned); call torch.compile without options"
        )
    compiler = aot_autograd(fw_compiler=_compile_graph, bw_compiler=_compile_graph, decompositions=_decompositions())
    return compiler(gm, example_inputs)


def register():
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "pjrt" not in _BACKENDS:
        register_backend(name="pjrt")(pjrt_backend)
