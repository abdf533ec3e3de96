"""`torch.compile(model, backend="pjrt")`.

Dynamo captures the graph, AOTAutograd produces forward and backward graphs in aten IR,
and each becomes one JAX function built from the lowering table and compiled by `jax.jit`
into a single XLA program. Ops the table cannot lower make that graph run eagerly on pjrt
(op by op, same kernels as eager mode), never on the CPU.
"""

import functools
import operator
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import jax
import torch
from functorch.compile import make_boxed_func

from .. import device_checks, fusion, kernel_cache, placement, random_state, storage
from ..ops import TABLE
from . import buckets as buckets_mod
from . import graph as graph_mod

stats = Counter()
eager_fallback_reasons = []
recompile_reasons = []
bucket_fallback_reasons = []
_seen_graphs = {}  # graph code -> input shapes it was last compiled for


def compile_stats() -> dict:
    """Graphs compiled, eager fallbacks (with the ops that caused them), compile seconds, the
    persistent compilation cache's hits and misses (every XLA compile of the process), and the
    programs (eager kernels, compiled graphs) loaded from disk as executables or compiled and
    stored (kernel_cache)."""
    from .. import compile_cache

    return {
        **{key: 0 for key in ("graphs", "graph_cache_hits", "eager_graphs", "recompiles", "xla_compiles", "calls",
                              "compile_seconds",
                              "donatable_inputs", "donated_buffers", "donation_declined",
                              "bucketed_graphs", "unbucketed_graphs")},
        **stats,
        "eager_fallback_reasons": list(eager_fallback_reasons),
        "recompile_reasons": list(recompile_reasons),
        "bucket_fallback_reasons": list(bucket_fallback_reasons),
        "persistent_cache_dir": compile_cache.directory(),
        "persistent_cache_hits": compile_cache.stats["persistent_cache_hits"],
        "persistent_cache_misses": compile_cache.stats["persistent_cache_misses"],
        "kernel_cache_hits": kernel_cache.stats["kernel_cache_hits"],
        "kernel_cache_misses": kernel_cache.stats["kernel_cache_misses"],
    }


@functools.lru_cache(maxsize=1)
def _decompositions():
    """torch._decomp entries for the ops the table does not lower directly."""
    from torch._decomp import core_aten_decompositions

    from ..transformer_fast_path import DECOMPOSITIONS

    table = {**core_aten_decompositions(), **DECOMPOSITIONS}
    return {op: fn for op, fn in table.items() if op not in TABLE}


def _shapes(example_inputs):
    return [tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in example_inputs]


def _note_recompile(code, shapes):
    """Dynamo hands us the same graph again when its guards failed: say what changed."""
    before = _seen_graphs.get(code)
    _seen_graphs[code] = shapes
    if before is None:
        return
    stats["recompiles"] += 1
    changed = [f"input {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(before, shapes)) if a != b]
    recompile_reasons.append("; ".join(changed) if changed else "guards failed with the same input shapes")


@dataclass(frozen=True)
class Options:
    """torch.compile(..., backend="pjrt", options={...})."""

    donate: bool = False  # let XLA reuse the buffers of inputs the graph overwrites
    buckets: object = None  # None, "pow2", or sorted bucket sizes (tuple of ints)


OPTION_HELP = ("'donate' (bool: donate the buffers of inputs the graph updates in place) and 'buckets' "
               "(a list of increasing sizes, or 'pow2': pad dynamic sizes up to a bucket)")


def parse_options(options) -> Options:
    """Validate torch.compile's `options=` for this backend; errors name the bad key or value."""
    options = dict(options or {})
    unknown = sorted(set(options) - {"donate", "buckets"})
    if unknown:
        raise ValueError(f"torchpjrt: unknown torch.compile option(s) {unknown} for backend 'pjrt'; "
                         f"supported: {OPTION_HELP}")
    donate = options.get("donate", False)
    if not isinstance(donate, bool):
        raise TypeError(f"torchpjrt: torch.compile option 'donate' must be True or False, got {donate!r}")
    return Options(donate=donate, buckets=buckets_mod.parse(options.get("buckets")))


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, options=Options(), donatable=None):
    """The boxed runner of one AOTAutograd graph, and whether the graph may be stored in the
    on-disk graph cache (bucketed graphs keep per-size state built from symbolic shapes: not).
    `example_inputs` needs the right types only where inputs are sizes (ints); `donatable`
    comes from _donatable_inputs, computed while AOTAutograd's tracing context is live."""
    t0 = time.perf_counter()
    try:
        fn = graph_mod.to_jax_function(gm, checks=device_checks.enabled)
    except graph_mod.UnsupportedGraph as e:
        stats["eager_graphs"] += 1
        eager_fallback_reasons.append(f"ops without lowering: {e}")
        warnings.warn(f"torchpjrt: running a compiled graph eagerly on pjrt (ops without lowering: {e})")
        return _eager(gm), False  # not stored: a restored graph would be called with other inputs

    # dynamic=True graphs take sizes as SymInt inputs and may return sizes (saved for the
    # backward): sizes are compiled in (one XLA program per size, or per bucket) and returned as ints
    int_inputs = [i for i, e in enumerate(example_inputs) if isinstance(e, (int, torch.SymInt))]
    if options.buckets is not None and int_inputs:
        try:
            bucketed = buckets_mod.BucketedGraph(gm, example_inputs, options.buckets, stats)
        except buckets_mod.Unbucketable as e:
            stats["unbucketed_graphs"] += 1
            bucket_fallback_reasons.append(str(e))
        else:
            stats["bucketed_graphs"] += 1
            stats["graphs"] += 1
            stats["compile_seconds"] += time.perf_counter() - t0
            return make_boxed_func(_bucketed_runner(bucketed, graph_mod.uses_random(gm))), False

    random = graph_mod.uses_random(gm)
    # a custom kernel's body is not part of the graph's fingerprint: such graphs are not kept
    user_code = graph_mod.uses_user_code(gm)
    # out-of-range indices and other data checks: their vectors follow the outputs
    checks = graph_mod.checked_ops(gm) if device_checks.enabled else []
    stats["graphs"] += 1
    stats["compile_seconds"] += time.perf_counter() - t0
    int_outputs = {i for i, v in enumerate(graph_mod.output_values(gm)) if isinstance(v, (int, torch.SymInt))}
    array_position = {i: 1 + i - sum(1 for j in int_inputs if j < i) for i in range(len(example_inputs))}
    donatable = donatable or {}
    stats["donatable_inputs"] += len(donatable)
    programs = {}

    @functools.cache
    def fingerprint():
        return graph_mod.fingerprint(gm)

    def program_for(sizes, donated):
        on = placement.ambient()  # each device has its own executable
        jitted = programs.get((sizes, donated, on))
        if jitted is None:
            if not int_inputs:
                body = fn
            else:
                def body(seed_offset, *arrays):
                    full = list(arrays)
                    for i, v in zip(int_inputs, sizes):
                        full.insert(i, v)
                    return fn(seed_offset, *full)

            jitted = jax.jit(body, donate_argnums=tuple(array_position[i] for i in donated))
            if kernel_cache.directory() is not None and not user_code:  # hashed only when the layer is on
                # a new process loads the graph's executable without tracing and lowering it
                identity = ("graph", fingerprint(), sizes, donated, bool(checks)) + ((on,) if on else ())
                jitted = kernel_cache.kept(jitted, identity)
            programs[(sizes, donated, on)] = jitted
            # one XLA program per input signature: compiled, or found in a cache, on its first call
            stats["xla_compiles"] += 1
        return jitted

    named_devices = _named_pjrt_devices(gm)
    eager_runner = []

    def run(*args):
        on = 0
        if placement.multi or named_devices:
            devices = named_devices | {a.get_device() for a in args
                                       if isinstance(a, torch.Tensor) and a.device.type == "pjrt"}
            if len(devices) > 1:
                # a graph spanning pjrt devices (a pipeline's stages and the copies between them)
                # is one program per device in eager mode: it runs op by op there
                if not eager_runner:
                    stats["eager_graphs"] += 1
                    eager_fallback_reasons.append(f"a graph spanning devices {sorted(devices)}")
                    eager_runner.append(_eager(gm))
                return eager_runner[0](list(args))
            on = next(iter(devices), 0)
        if on:
            with placement.on(on):  # also where a graph without device inputs computes
                return run_on_device(*args)
        return run_on_device(*args)

    def run_on_device(*args):
        seed_offset = random_state.next_seed_offset(placement.ambient()) if random else _NO_SEED
        sizes = tuple(int(args[i]) for i in int_inputs)
        # decide before the arrays are gathered below: each gathered reference counts as a holder
        donated = _donations(args, donatable)
        arrays = [_input(a) for i, a in enumerate(args) if i not in int_inputs]
        before, start = stats["xla_compiles"], time.perf_counter()
        outs = fusion.call(program_for(sizes, donated), seed_offset, *arrays)
        del arrays
        if stats["xla_compiles"] != before:
            stats["compile_seconds"] += time.perf_counter() - start
        stats["calls"] += 1
        if checks:
            for (op, check), vector in zip(checks, outs[len(outs) - len(checks):]):
                device_checks.record(vector, check, op)
            outs = outs[:len(outs) - len(checks)]
        for i in donated:
            # the donated buffer is gone: the storage takes its new value now, before anyone reads
            # it (AOTAutograd's epilogue then copies the same value in again)
            storage.storage_of(args[i]).replace(outs[donatable[i]])
        return [int(fusion.concrete(o)) if i in int_outputs
                else storage.wrap(o) if hasattr(o, "shape") and hasattr(o, "dtype") else o
                for i, o in enumerate(outs)]

    # AOTAutograd restores a graph with effect tokens (linalg's error checks) with other inputs
    # than it compiled it for: such graphs are compiled again in each process
    return make_boxed_func(run), not any(graph_mod.is_linalg_check(n) for n in gm.graph.nodes)


def _named_pjrt_devices(gm) -> set:
    """The pjrt indices the graph's nodes name explicitly (a copy to pjrt:1, a factory on it)."""
    named = set()
    for node in gm.graph.nodes:
        for v in list(node.args) + list(node.kwargs.values()):
            if isinstance(v, torch.device) and v.type == "pjrt" and v.index is not None:
                named.add(v.index)
    return named


def _bucketed_runner(bucketed, random):
    def run(*args):
        seed_offset = random_state.next_seed_offset() if random else _NO_SEED
        stats["calls"] += 1
        return bucketed(seed_offset, args)

    return run


# ---- buffer donation ---------------------------------------------------------------------


def _donatable_inputs(gm, example_inputs) -> dict:
    """{graph input index: index of the graph output holding its new value} for the inputs whose
    data the graph overwrites (AOTAutograd returns those new values first, in input order).
    Empty when the graph's inputs do not line up with AOTAutograd's view of them (synthetic
    bases for aliased inputs, extra RNG inputs): donating there could hit the wrong buffer."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None or len(meta.input_info) != len(example_inputs):
        return {}
    outputs = graph_mod.output_values(gm)
    mutated = list(meta.mutated_inp_runtime_indices)
    if len(outputs) < len(mutated):
        return {}
    donatable = {}
    for k, i in enumerate(mutated):
        info, example, new = meta.input_info[i], example_inputs[i], outputs[k]
        if not (info.mutates_data and not info.mutates_metadata and not info.mutates_storage_metadata):
            continue
        if not (isinstance(example, torch.Tensor) and isinstance(new, torch.Tensor)):
            continue
        if example.device.type != "pjrt" or new.shape != example.shape or new.dtype != example.dtype:
            continue
        donatable[i] = k
    return donatable


def _donations(args, donatable) -> tuple:
    """The donatable inputs whose buffer this call may hand to XLA: those whose storage is the
    only holder of its array. Anything else still referencing the array (another storage that
    shares it after a copy, a cached view, a fused graph waiting to run, a user's variable, the
    same storage passed twice) would see a deleted buffer, so those inputs are not donated."""
    if not donatable or fusion.recording():
        stats["donation_declined"] += len(donatable)
        return ()
    seen = Counter(id(storage.storage_of(a)) for a in args
                   if isinstance(a, torch.Tensor) and a.device.type == "pjrt")
    chosen = []
    for i in donatable:
        t = args[i]
        st = storage.storage_of(t)
        if seen[id(st)] == 1 and storage.is_identity(t, st) and _sole_holder(st):
            chosen.append(i)
    stats["donated_buffers"] += len(chosen)
    stats["donation_declined"] += len(donatable) - len(chosen)
    return tuple(chosen)


class _Holder:
    __slots__ = ("array",)


def _array_refs(holder):
    array = holder.array
    return sys.getrefcount(array)


def _refs_of_a_sole_holder():
    holder = _Holder()
    holder.array = object()
    return _array_refs(holder)


# what `_array_refs` counts for an array that one storage slot alone holds (interpreter-specific)
_SOLE_REFS = _refs_of_a_sole_holder()


def _sole_holder(st) -> bool:
    array = st.array
    if array is None or not isinstance(array, jax.Array):  # unwritten, or a fused-mode Pending
        return False
    del array
    return _array_refs(st) <= _SOLE_REFS


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


def _partition(joint_module, joint_inputs, **kwargs):
    """AOTAutograd's default partitioner, except that random ops inside activation-checkpointed
    regions are saved for the backward instead of recomputed. PyTorch replays a recomputed random
    op through run_and_save_rng_state / run_with_rng_state, which it implements for CUDA, CPU,
    HPU and XPU only ("Backend not supported for pjrt"). Saving the values gives the backward
    the forward's random numbers, as eager checkpointing's replay does, and costs the memory of
    those values (a dropout mask per checkpointed dropout)."""
    from torch._functorch.partitioners import default_partition
    from torch.utils.checkpoint import CheckpointPolicy

    recomputed = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
    for node in joint_module.graph.nodes:
        if (node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
                and node.meta.get("recompute") in recomputed):
            # the op and the picks of its outputs (native_dropout's result and mask)
            for saved in [node] + [u for u in node.users if u.target is operator.getitem]:
                saved.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return default_partition(joint_module, joint_inputs, **kwargs)


def pjrt_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """The Dynamo backend registered as "pjrt"."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.output_code import OutputCode

    import torchpjrt  # noqa: F401  (the device must exist; entry points may load us first)

    from . import graph_cache

    if mode not in MODES:
        raise ValueError(f"torchpjrt: unknown torch.compile mode {mode!r}; expected one of {MODES[1:]}")
    parsed = parse_options(options)

    def compiler_for(forward):
        # an OutputCode-returning compiler is what AOTAutograd's cache stores and loads
        return SerializableAOTDispatchCompiler(
            OutputCode, lambda g, inputs: graph_cache.CompiledGraph(g, inputs, parsed, forward))

    compiler = aot_autograd(fw_compiler=compiler_for(True), bw_compiler=compiler_for(False),
                            decompositions=_decompositions(), partition_fn=_partition)
    with graph_cache.caching(parsed):
        return compiler(gm, example_inputs)


def register():
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "pjrt" not in _BACKENDS:
        register_backend(name="pjrt")(pjrt_backend)
