"""Fused eager execution: ops are recorded into a pending graph and run as one XLA program.

Every device computation of the eager path goes through `call(fn, *args)`, where `fn` is a
jitted JAX function (an op's lowering, a strided read or write, a cast). In strict and debug
mode `call` runs it at once. In fused mode it appends a node to the pending graph and returns
`Pending` placeholders that know only their shape and dtype; storages hold them like arrays.

At an observation point (a host read, `.item()`, `torch.pjrt.synchronize()`, the end of an
optimizer step, a data-dependent op, a mode change, or the size cap) `flush` turns the pending
graph into one function, jits it, and runs it. Only the values still referenced (by a storage
or by Python) become outputs: temporaries that died stay inside the program, where XLA fuses
them away. Compiled graphs are cached by structure (the node functions, their wiring and
which values survive) and input shapes, so a training loop compiles in its first steps and
then hits the cache.

A graph is compiled only when it comes back: the first time a structure meets its input
shapes (`compile_after` sightings in all), its ops run one by one through their own kernels,
as strict mode runs them. Compiling a whole graph costs far more than its ops' kernels, which
other graphs and steps share, so a graph that never repeats (a region between data-dependent
reads whose shapes follow the data, as an expert loop's routing) would make fused mode pay a
large compile per flush for nothing; a graph that does repeat (a training step) is compiled
one sighting later and fused from then on. A graph whose kernels are all kept by the kernel
cache is kept there too: a later process loads it at its first sighting, and learns its kernels'
result shapes from their entries, so a warm process traces nothing.

A graph that comes back only after many other graphs (`generate()`: one small graph per token,
each length once per call) is compiled at its second sighting only when it returns within
`reuse_distance` flushes. Otherwise it keeps running op by op until the dispatches it has paid
for (an estimated cost per op) add up to what compiling it is estimated to cost (the compile
seconds per op of the graphs this process compiled): fused mode then spends at most about what
strict mode spends plus one compile, instead of a compile per graph that rarely pays back.

Flush-heavy regions run as strict mode runs them. Recording an op and running it later by its own
kernel costs more than running it at once, so when most ops of the last `passthrough_window`
flushes (`passthrough_share`) ran op by op rather than in a compiled graph (code that reads values
on the host every few ops, with shapes that follow the data: an expert loop's routing, a sampling
loop that grows the sequence), the next `passthrough_ops` ops are not recorded: each runs at
once, as in strict mode. Then recording resumes for another look; a graph seen again meanwhile
compiles as usual (its sightings are kept), and recording stays on as long as compiled graphs
keep coming back (a graph last seen before the region counts as far away: it compiles when it
has paid for its compile). A look that finds the region still flush-heavy doubles the next
stretch run at once (up to 32 times `passthrough_ops`), so a steady data-dependent loop spends
little of its time being recorded. A look after a region compiles nothing until it has decided:
a graph that would compile there (seen again within the look) runs op by op and counts as
compiled for the decision; if recording stays on, it compiles at its next sighting, and if the
region goes on, nothing was compiled for a loop that runs op by op anyway (a bucketed expert loop
sees some of its small graphs twice in any look).
"""

import contextlib
import itertools
import os
import threading
import time
import weakref
from collections import Counter, OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.array import ArrayImpl  # the concrete class of every array a kernel returns
from jax._src.lax import lax as lax_internal  # _convert_element_type: the one way to make a value weakly typed

from . import live_programs, placement

stats = Counter()  # shown by torchpjrt.eager_stats()
flush_reasons = Counter()

_lock = threading.RLock()
_NO_CONTEXT = contextlib.nullcontext()
_recording = False
max_ops = 4096  # pending graph size that forces a flush
cache_size = 512  # compiled graphs kept (least recently used are dropped)
# sightings of a graph (structure and input shapes) before it is compiled; earlier ones run op by op
compile_after = int(os.environ.get("TORCHPJRT_FUSED_COMPILE_AFTER", "2"))
sightings_kept = 4096  # graphs seen but not compiled that are remembered (least recent dropped)
reuse_distance = 32  # flushes within which a graph's return compiles it at compile_after
passthrough_window = 16  # flushes looked at to find a flush-heavy region
passthrough_share = 0.75  # the share of their ops run op by op that starts running ops at once
passthrough_ops = 2048  # ops run at once before recording is tried again
_passthrough_left = 0  # ops still to run at once
# read by strict mode's hot path (hot_path.py): while true (fused mode, outside a flush-heavy
# region) it records the programs of the calls it serves instead of running them
records_ops = False
_hot_calls_at = 0  # the hot path's call count when a flush-heavy region's count was last settled
hot_calls = int  # the hot path's call count (hot_path.calls once it is loaded; 0 until then)
# tells the hot path how many more ops it may serve before the Python kernels must run one (-1:
# no limit): a flush-heavy region ends at a Python kernel's op (hot_path.set_budget once loaded)
hot_budget = id
_passthrough_next = 0  # the length of the next stretch run at once (0: passthrough_ops)
_outcomes = []  # per recent flush (at most passthrough_window): (ran or would compile a graph, ops)
_looking_after_region = False  # recording resumed after a region: compiles wait for the look's verdict
_deferred = False  # the flush just run: a graph that compiles if the look keeps recording on
DISPATCH_SECONDS_PER_OP = 15e-6  # what running a recorded op by its own kernel costs the host
_compile_seconds_per_op = [2e-3, 0]  # estimate, and graphs measured (a prior until the first)
_flushes_seen = 0


class Pending:
    """The not-yet-computed output of a recorded op: shape, dtype, and its graph slot. (The hot
    path makes these from C++ too, setting every slot but __weakref__.)"""

    __slots__ = ("shape", "dtype", "weak_type", "graph", "slot", "value", "__weakref__")

    def __init__(self, shape, dtype, weak_type, graph, slot):
        self.shape = shape
        self.dtype = dtype
        self.weak_type = weak_type
        self.graph = graph
        self.slot = slot
        self.value = None

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    def concrete(self, reason="host_read"):
        if self.value is None:
            flush(reason)
            if self.value is None:
                self.graph.lost()
        return self.value

    # Anything else (numpy conversion, a jax.Array method) needs the value: compute it.
    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.concrete())
        return a if dtype is None else a.astype(dtype)

    def __jax_array__(self):
        return self.concrete()

    def __bool__(self):
        return bool(self.concrete())

    def __getattr__(self, name):
        return getattr(self.concrete(), name)

    def __repr__(self):
        state = "computed" if self.value is not None else "pending"
        return f"Pending({state}, shape={self.shape}, dtype={self.dtype})"


def concrete(x, reason="host_read"):
    """`x` as a jax.Array, running the pending graph if `x` is one of its values."""
    if type(x) is Pending:
        return x.concrete(reason)
    return x


def concrete_tree(tree):
    if not _has_pending(tree):
        return tree
    flush("data_dependent_op")
    return jax.tree_util.tree_map(lambda x: x.value if type(x) is Pending else x, tree)


def _has_pending(tree):
    return any(type(x) is Pending for x in jax.tree_util.tree_leaves(tree))


_graph_serials = itertools.count(1)


class _Graph:
    __slots__ = ("nodes", "runners", "inputs", "input_slots", "input_sigs", "input_ids", "outputs", "storages",
                 "n_slots", "task", "error", "device", "serial")

    def __init__(self):
        self.serial = next(_graph_serials)  # which graph a storage is tracked in (track)
        self.nodes = []  # (fn, treedef, input slots, first output slot); also the cache key
        self.runners = []  # per node, the callable that runs it alone (a strict-mode kernel)
        self.inputs = []  # concrete values (jax arrays, numpy arrays, Python scalars)
        self.input_slots = []
        self.input_sigs = []  # signature_of each input: part of the graph's key
        self.input_ids = {}  # id(array) -> slot, so an array used twice is one input
        self.outputs = []  # weakrefs to this graph's Pendings
        self.storages = []  # weakrefs to storages that were given a Pending
        self.n_slots = 0
        self.task = -1  # autograd graph task recording into this graph (-1: none)
        self.error = None  # why running this graph failed, if it did
        self.device = 0  # the pjrt index every node runs on (placement: one graph per device)

    def input_slot(self, x):
        """The slot of a concrete input (an array passed twice is one input)."""
        is_array = type(x) is ArrayImpl or isinstance(x, jax.Array)
        if is_array:
            slot = self.input_ids.get(id(x))
            if slot is not None:
                return slot
        slot = self.n_slots
        self.n_slots += 1
        self.inputs.append(x)
        self.input_slots.append(slot)
        self.input_sigs.append(signature_of(x))
        if is_array:
            self.input_ids[id(x)] = slot
        return slot

    def lost(self):
        raise RuntimeError(
            "torchpjrt (fused mode): this tensor's value was never computed: running the graph "
            f"that computes it failed ({self.error!r})"
        ) from self.error


class _GraphKey:
    """A graph's cache key (its structure and input signature): a tuple over every node, hashed
    once, where a plain tuple would be hashed again at each dictionary operation of a flush."""

    __slots__ = ("parts", "hash")

    def __init__(self, parts):
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return self.hash == other.hash and self.parts == other.parts


_graph = _Graph()
_out_avals = {}  # (fn, treedef, input signature) -> (out treedef, [(shape, dtype, weak_type)])
_compiled = OrderedDict()  # _GraphKey -> [jitted replay, whether its results' shapes were checked]
_sightings = OrderedDict()  # _GraphKey -> (times run op by op, last flush, dispatch s paid)
_current_task = torch._C._current_graph_task_id


def recording() -> bool:
    return _recording


def set_recording(on: bool) -> None:
    global _recording, _passthrough_left, _passthrough_next, _looking_after_region
    with _lock:
        if not on:
            flush("mode_change")
        _recording = on
        _passthrough_left = _passthrough_next = 0
        _sync_records_ops()
        _outcomes.clear()
        _looking_after_region = False


def device_error(e):
    """The exception to raise for a runtime error of XLA: torch.OutOfMemoryError (like CUDA's)
    when the device refused an allocation, else `e` itself."""
    msg = str(e)
    if "RESOURCE_EXHAUSTED" in msg or "Out of memory" in msg:
        return torch.OutOfMemoryError(
            f"pjrt device out of memory ({msg.splitlines()[0].rstrip('.')}). Tensors that are still "
            "referenced keep their memory; free some (del, or smaller batches) and retry."
        )
    return e


def call(fn, *args):
    """Run jitted `fn` now (strict, debug, a flush-heavy region of fused) or record it into the
    pending graph (fused)."""
    if not _recording or (_passthrough_left and _pass_through()):
        try:
            return fn(*(_computed(args) if _recording else args))
        except jax.errors.JaxRuntimeError as e:
            raise device_error(e) from e
    traced = getattr(fn, "traceable", fn)  # a kernel_cache.CachedKernel is traced as its jitted form
    leaves, treedef = jax.tree_util.tree_flatten(args)
    out_treedef, avals = _output_avals(fn, traced, treedef, leaves)
    return jax.tree_util.tree_unflatten(out_treedef, _add_node(traced, fn, treedef, leaves, avals))


def record_keyed(avals_cache, key, fn, args):
    """`call` for a caller whose `key` already fixes the argument shapes and dtypes, and so the
    structure of `args` and of the outputs: both are worked out once per key."""
    if _passthrough_left and _pass_through():
        return fn(*_computed(args))
    entry = avals_cache.get(key)
    if entry is None:
        traced = getattr(fn, "traceable", fn)
        leaves, treedef = jax.tree_util.tree_flatten(tuple(args))  # the call's arguments, as `call` sees them
        out_treedef, avals = _output_avals(fn, traced, treedef, leaves)
        flat_in = treedef == jax.tree_util.tree_structure(tuple(range(len(leaves))))
        flat_out = out_treedef == jax.tree_util.tree_structure(tuple(range(len(avals))))
        entry = avals_cache[key] = (traced, treedef, flat_in, out_treedef, avals, flat_out)
    traced, treedef, flat_in, out_treedef, avals, flat_out = entry
    leaves = args if flat_in else jax.tree_util.tree_leaves(args)
    pendings = _add_node(traced, fn, treedef, leaves, avals)
    return tuple(pendings) if flat_out else jax.tree_util.tree_unflatten(out_treedef, pendings)


def _output_avals(fn, traced, treedef, leaves):
    """(out treedef, [(shape, dtype, weak_type)]) of `fn` (traced as `traced`) on these arguments,
    once per argument signature: from the kernel cache's entry for it when one is kept (a warm
    process traces nothing), else from jax.eval_shape."""
    sig = tuple(signature_of(x) for x in leaves)
    entry = _out_avals.get((traced, treedef, sig))
    if entry is None:
        stored_shapes = getattr(fn, "stored_shapes", None)  # a kernel_cache.CachedKernel's
        stored = stored_shapes() if stored_shapes is not None else None
        if stored is not None and stored[0] == treedef and stored[1] == sig:
            entry = (stored[2], stored[3])
        else:
            entry = _eval_shape(traced, treedef, leaves, sig)
        _out_avals[(traced, treedef, sig)] = entry
    return entry


def signature_of(x):
    """What of an argument fixes a program: (shape, dtype, weak_type) for an array, the type of a
    Python scalar (its value is traced)."""
    t = type(x)
    if t is Pending:
        if x.value is not None:
            x = x.value
            t = type(x)
        else:
            return (x.shape, x.dtype, x.weak_type)
    if t is ArrayImpl or isinstance(x, jax.Array):
        aval = x.aval  # one attribute read (an array's shape, dtype and weak_type each read it)
        return (aval.shape, aval.dtype, aval.weak_type)
    if t is np.ndarray:
        return (x.shape, x.dtype, False)
    if t is jax.ShapeDtypeStruct:  # an abstract argument (kernel_cache.prepare_all's) stands for its array
        return (x.shape, x.dtype, x.weak_type)
    return t


def _eval_shape(fn, treedef, leaves, sig):
    abstract = [
        jax.ShapeDtypeStruct(s[0], s[1], weak_type=s[2]) if isinstance(s, tuple) else x
        for x, s in zip(leaves, sig)
    ]
    out = jax.eval_shape(fn, *jax.tree_util.tree_unflatten(treedef, abstract))
    avals, out_treedef = jax.tree_util.tree_flatten(out)
    return out_treedef, [(a.shape, a.dtype, a.weak_type) for a in avals]


def _add_node(fn, runner, treedef, leaves, avals):
    """Record fn on `leaves` into the pending graph: its outputs' Pendings, in order. (The hot
    path, csrc/hot_ops.cpp record_node, does this same work in C++ for a key it recorded, through
    _Graph's and Pending's slots: a change here is a change there. It calls this function by name
    for what it leaves to Python: an autograd pass's first op, a value of a graph that never ran.)"""
    with _lock:
        g = _graph
        task = _current_task()
        if task != g.task:
            if task >= 0 and g.nodes:
                # a backward pass starts: run the forward now, so that it computes while
                # the backward is recorded (and `loss.item()` waits for the forward only)
                flush("backward")
                g = _graph
            g.task = task
        if placement.multi:
            device = _device_of(leaves, g)
            if device != g.device:
                if g.nodes:
                    flush("device_change")  # a graph runs on one device
                    g = _graph
                    g.task = task
                g.device = device
        refs = []
        for x in leaves:
            if x.__class__ is Pending:
                if x.graph is g and x.value is None:
                    refs.append(x.slot)
                    continue
                if x.value is None:
                    x.graph.lost()
                x = x.value  # computed by an earlier flush
            refs.append(g.input_slot(x))
        first = g.n_slots
        g.n_slots += len(avals)
        g.nodes.append((fn, treedef, tuple(refs), first))
        g.runners.append(runner)
        if len(avals) == 1:
            shape, dtype, weak_type = avals[0]
            pendings = [Pending(shape, dtype, weak_type, g, first)]
            g.outputs.append(weakref.ref(pendings[0]))
        else:
            pendings = [Pending(a[0], a[1], a[2], g, first + i) for i, a in enumerate(avals)]
            g.outputs.extend(map(weakref.ref, pendings))
        full = len(g.nodes) >= max_ops
    if full:
        flush("max_ops")
    return pendings


def _device_of(leaves, g) -> int:
    """The pjrt index a node with these arguments runs on: its device inputs', else the device
    of the factory being recorded."""
    for x in leaves:
        if x.__class__ is Pending:
            return g.device if x.graph is g and x.value is None else placement.index_of(x.value)
        if isinstance(x, jax.Array):
            return placement.index_of(x)
    return placement.ambient()


def track(storage, pending) -> None:
    """`storage` now holds `pending`: give it the computed array when its graph runs. A storage is
    listed once per graph however often it is written (an optimizer's in-place foreach ops write
    each state several times a step): a weak reference per write was most of the objects a
    recorded step leaves for Python's garbage collector. (No lock: a list's append is atomic, and
    the graph sets its values before it reads the list.) The hot path, csrc/hot_ops.cpp track,
    does the same for the storages it makes and writes."""
    g = pending.graph
    if storage.tracked_in != g.serial:
        storage.tracked_in = g.serial
        g.storages.append(weakref.ref(storage))
    if pending.value is not None:  # its graph has run already (a flush within the kernel's ops)
        storage.array = pending.value


def flush(reason: str) -> None:
    """Compile (or fetch from the cache) and run the pending graph; resolve its values."""
    global _graph, _flushes_seen, _deferred
    with _lock:
        g = _graph
        if not g.nodes:
            return
        _deferred = False
        _graph = _Graph()
        stats["ops_recorded"] += len(g.nodes)
        alive = [p for p in (ref() for ref in g.outputs) if p is not None]
        out_slots = tuple(p.slot for p in alive)
        input_signature = tuple(g.input_sigs)
        key = _GraphKey((tuple(g.nodes), tuple(g.input_slots), out_slots, input_signature, g.device))
        entry = _compiled.get(key)
        _flushes_seen += 1
        if entry is not None:
            stats["cache_hits"] += 1
            _compiled.move_to_end(key)
        elif (identity := _kept_identity(g, out_slots, input_signature)) is not None and key not in _sightings and \
                _stored(identity) or _worth_compiling(key, len(g.nodes)):
            live_programs.release_if_due()
            stats["cache_misses"] += 1
            replay = _make_replay(g.nodes, g.input_slots, out_slots, g.n_slots, g.inputs, identity)
            entry = _compiled[key] = [replay, False]
            if len(_compiled) > cache_size:
                _compiled.popitem(last=False)
        traced = stats["graphs_compiled"]
        t0 = time.perf_counter()
        try:
            with placement.on(g.device) if g.device else _NO_CONTEXT:
                if entry is None:
                    stats["graphs_run_op_by_op"] += 1
                    results = _run_op_by_op(g, out_slots)
                else:
                    results = entry[0](*g.inputs)
            if g.device:
                results = placement.commit(results, g.device)
        except Exception as e:
            g.error = e
            if isinstance(e, jax.errors.JaxRuntimeError):
                raise device_error(e) from e
            raise
        finally:
            if stats["graphs_compiled"] != traced:
                seconds = time.perf_counter() - t0
                stats["compile_seconds"] += seconds
                _note_compile(seconds, len(g.nodes))
        if entry is None or not entry[1]:
            # a compiled graph computes the same shapes at every run of its key: checked at its first
            for p, r in zip(alive, results):
                if r.dtype != p.dtype or r.shape != p.shape:
                    raise RuntimeError(
                        f"torchpjrt (fused mode): a recorded value was computed as {r.dtype}{list(r.shape)} "
                        f"but announced as {p.dtype}{list(p.shape)} (internal error)"
                    )
            if entry is not None:
                entry[1] = True
        for p, r in zip(alive, results):
            p.value = r
        for ref in g.storages:
            st = ref()
            if st is not None and type(st.array) is Pending and st.array.value is not None:
                st.array = st.array.value
        stats["flushes"] += 1
        stats["ops_flushed"] += len(g.nodes)
        flush_reasons[reason] += 1
        _note_outcome(entry is not None or _deferred, len(g.nodes))


def _kept_identity(g, out_slots, input_signature):
    """What fixes the graph's program in any process, when every node is a kernel the kernel cache
    keeps (their identities, the wiring, which values survive, the inputs' signatures, the
    device), so that the compiled graph is kept on disk with them; None otherwise."""
    from . import kernel_cache

    if kernel_cache.directory() is None:
        return None
    nodes = []
    for runner, (_, treedef, refs, first) in zip(g.runners, g.nodes):
        digest = getattr(runner, "digest", None)  # a kernel_cache.CachedKernel's
        if digest is None:
            return None
        nodes.append((digest(), treedef, refs, first))
    return ("fused_graph", tuple(nodes), tuple(g.input_slots), out_slots, g.n_slots, input_signature, g.device)


def _stored(identity) -> bool:
    """Whether a graph's program is kept on disk: loading it costs less than running the graph op
    by op, so a warm process runs its graphs fused from their first sighting. (Asked at a first
    sighting only: a graph this process saw before was kept by an earlier process, and loaded
    then, or was not. Its nodes are their kernels' digests: with their whole identities, hashing
    a graph of 236 nodes took 2.4 ms.)"""
    from . import kernel_cache

    return kernel_cache.stored(identity)


def _pass_through() -> bool:
    """Whether this op runs at once (a flush-heavy region; see the module's docstring). Never
    while ops are pending: a region starts right after a flush."""
    global _passthrough_left, _unsettled
    if _graph.nodes:
        return False
    # the hot path's calls are counted against the region every SETTLE_EVERY ops, and at each op
    # near its end (two calls into the helper an op cost strict mode's speed); meanwhile its own
    # budget, set at the last count, is the larger: the region ends on this side
    _unsettled += 1
    if _unsettled >= SETTLE_EVERY or _passthrough_left <= SETTLE_EVERY:
        _unsettled = 0
        settle_hot_calls()
    if _passthrough_left:
        _passthrough_left -= 1
        if not _passthrough_left:
            stats["passthrough_ends"] += 1
            _sync_records_ops()
    stats["ops_passed_through"] += 1
    return True


SETTLE_EVERY = 64
_unsettled = 0


def settle_hot_calls():
    """Count the ops the hot path served in a flush-heavy region (it runs a region's ops too)
    against the region, at its Python kernels' ops and when the stats are read."""
    global _passthrough_left, _hot_calls_at
    served = hot_calls() - _hot_calls_at
    _hot_calls_at += served
    if served and _passthrough_left:
        _passthrough_left = max(_passthrough_left - served, 0)
        stats["ops_passed_through"] += served
        if not _passthrough_left:
            stats["passthrough_ends"] += 1
        _sync_records_ops()


def _sync_records_ops():
    global records_ops
    records_ops = _recording and not _passthrough_left
    hot_budget(_passthrough_left if _recording and _passthrough_left else -1)


def _computed(args):
    """`args` with each Pending (from a graph run earlier) replaced by its array, for an op run at
    once in fused mode."""
    if _nested_pending(args):
        return jax.tree_util.tree_map(lambda x: x.concrete() if type(x) is Pending else x, args)
    return args


def _nested_pending(args) -> bool:
    """_has_pending for a kernel's arguments (arrays, (array, offset) pairs, lists of them),
    without a tree walk."""
    for a in args:
        t = type(a)
        if t is Pending or ((t is tuple or t is list) and _nested_pending(a)) or (t is dict and _has_pending(a)):
            return True
    return False


def _note_outcome(compiled: bool, n_ops: int) -> None:
    global _passthrough_left, _passthrough_next, _flushes_seen, _hot_calls_at, _looking_after_region
    _outcomes.append((compiled, n_ops))
    if len(_outcomes) > passthrough_window:
        del _outcomes[0]
    if len(_outcomes) < passthrough_window or not passthrough_ops:
        return
    op_by_op = sum(n for c, n in _outcomes if not c)
    if op_by_op >= passthrough_share * sum(n for _, n in _outcomes):
        _passthrough_left = _passthrough_next or passthrough_ops
        _passthrough_next = min(2 * _passthrough_left, 32 * passthrough_ops)
        _hot_calls_at = hot_calls()
        _sync_records_ops()
        _outcomes.clear()
        # what came before the region is far away by the time recording resumes: a graph seen
        # then compiles at its next sighting only if it has paid for its compile (not by distance)
        _flushes_seen += reuse_distance + 1
        stats["passthrough_regions"] += 1
        _looking_after_region = True
    else:
        _passthrough_next = 0
        _looking_after_region = False


def _worth_compiling(key, n_ops) -> bool:
    """Whether this sighting of a graph compiles it (the policy in the module's docstring);
    otherwise the sighting is counted and the graph runs op by op."""
    if compile_after <= 1:
        _sightings.pop(key, None)
        return True
    global _deferred
    seen, last, paid = _sightings.pop(key, None) or (0, None, 0.0)
    seen += 1
    paid += n_ops * DISPATCH_SECONDS_PER_OP
    if seen >= compile_after:
        if _flushes_seen - last <= reuse_distance or paid >= n_ops * _compile_seconds_per_op[0]:
            if not _looking_after_region:
                return True
            _deferred = True  # counted as compiled by the look; compiled at its next sighting if recording stays on
            stats["compiles_deferred_in_looks"] += 1
        else:
            stats["compiles_deferred"] += 1
    _sightings[key] = (seen, _flushes_seen, paid)
    if len(_sightings) > sightings_kept:
        _sightings.popitem(last=False)
    return False


def _note_compile(seconds, n_ops):
    """The compile-cost estimate per op: the mean over the graphs this process compiled."""
    estimate, measured = _compile_seconds_per_op
    per_op = seconds / max(n_ops, 1)
    _compile_seconds_per_op[:] = [(estimate * measured + per_op) / (measured + 1), measured + 1]


def _run_op_by_op(g, out_slots):
    """The graph's values at `out_slots`, each node run by its own kernel (no graph compile).
    A value is dropped after its last use, so memory peaks as in strict mode."""
    _prepare_kernels(g)
    unflatten = jax.tree_util.tree_unflatten
    leaves_of = jax.tree_util.tree_leaves
    env = [None] * g.n_slots
    for slot, v in zip(g.input_slots, g.inputs):
        env[slot] = v
    last_use = {}
    for i, node in enumerate(g.nodes):
        for r in node[2]:
            last_use[r] = i
    wanted = set(out_slots)
    for s in out_slots:
        last_use.pop(s, None)
    wanted.update(last_use)
    drop_after = [[] for _ in g.nodes]
    for slot, i in last_use.items():
        drop_after[i].append(slot)
    for (_, treedef, refs, first), runner, dead in zip(g.nodes, g.runners, drop_after):
        result = runner(*unflatten(treedef, [env[r] for r in refs]))
        for i, v in enumerate(leaves_of(result)):
            if first + i in wanted:
                env[first + i] = v
        for slot in dead:
            env[slot] = None
    return [env[s] for s in out_slots]


def _prepare_kernels(g) -> None:
    """Before `g` runs op by op: its kernels that have no executable yet (a first step on a cold
    cache) load or compile side by side (kernel_cache.prepare_all), each traced on its arguments
    as the graph will pass them: the graph's inputs, and for the values its nodes compute,
    abstract arrays of the shapes, dtypes and weak types they were recorded with."""
    from . import kernel_cache
    from .device import jax_device

    if placement.multi:
        return  # (a kernel without array arguments runs on the device placement.on names, in this thread only)
    if sum(1 for r in g.runners if type(r) is kernel_cache.CachedKernel and r._call is None) < 2:
        return
    sharding = jax.sharding.SingleDeviceSharding(jax_device(g.device))
    unflatten = jax.tree_util.tree_unflatten
    env = [None] * g.n_slots
    for slot, v in zip(g.input_slots, g.inputs):
        env[slot] = v
    calls = []
    for (fn, treedef, refs, first), runner in zip(g.nodes, g.runners):
        leaves = [env[r] for r in refs]
        sig = tuple(signature_of(x) for x in leaves)
        entry = _out_avals.get((fn, treedef, sig))
        if entry is None:
            entry = _eval_shape(fn, treedef, leaves, sig)
        calls.append((runner, tuple(unflatten(treedef, leaves))))
        for i, (shape, dtype, weak_type) in enumerate(entry[1]):
            env[first + i] = jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type, sharding=sharding)
    kernel_cache.prepare_all(calls)


pack_host_scalars_from = 2  # a graph with fewer host scalars passes them as they are


def unpacked_numbers(pack, n, weak=True):
    """Inside a program, the n host numbers packed into array `pack` (one transfer where each
    number would cost its own): with `weak`, each weakly typed as jit makes a Python number
    (`float32 * lr` stays float32), so results are those of the unpacked call. Fused graphs and
    the kernels' packed lists of numbers (dispatch.pack_numbers) both unpack here."""
    if not weak:
        return [pack[j] for j in range(n)]
    return [lax_internal._convert_element_type(pack[j], weak_type=True) for j in range(n)]


def _make_replay(nodes, input_slots, out_slots, n_slots, inputs, identity=None):
    """The graph as one jitted function (kept by the kernel cache under `identity`, when given),
    called with the graph's inputs. Host scalars among them
    (a learning rate, an optimizer's per-parameter bias corrections: dozens in a fused optimizer
    step) reach it packed into one array per dtype: each separate Python number costs the call
    its own host-to-device transfer. Unpacked, each keeps the dtype and weak type jit gives it
    (a Python float stays weak: f32 * lr stays f32)."""
    unflatten = jax.tree_util.tree_unflatten
    leaves_of = jax.tree_util.tree_leaves
    groups = {}  # (dtype, weak) -> input positions
    for i, x in enumerate(inputs):
        if not isinstance(x, jax.Array) and np.ndim(x) == 0:
            # JAX's rule, without a device computation: Python numbers other than bool are weak
            groups.setdefault((jnp.result_type(x), type(x) in (int, float, complex)), []).append(i)
    packed = {i for positions in groups.values() for i in positions}
    if len(packed) < pack_host_scalars_from:
        groups = {}
        packed = set()
    direct = [i for i in range(len(inputs)) if i not in packed]
    layout = [(dtype, weak, positions) for (dtype, weak), positions in groups.items()]
    n_inputs = len(inputs)

    def replay(*args):
        stats["graphs_compiled"] += 1  # runs when jax traces, i.e. once per new input signature
        values = [None] * n_inputs
        for i, v in zip(direct, args):
            values[i] = v
        for (dtype, weak, positions), pack in zip(layout, args[len(direct):]):
            for i, v in zip(positions, unpacked_numbers(pack, len(positions), weak)):
                values[i] = v
        env = [None] * n_slots
        for slot, v in zip(input_slots, values):
            env[slot] = v
        for fn, treedef, refs, first in nodes:
            result = fn(*unflatten(treedef, [env[r] for r in refs]))
            for i, v in enumerate(leaves_of(result)):
                env[first + i] = v
        return [env[s] for s in out_slots]

    from . import kernel_cache

    replay.__name__ = replay.__qualname__ = "fused_graph"  # its name in XLA's compile logs and profiles
    jitted = kernel_cache.kept(jax.jit(replay), identity)
    if not layout:
        return jitted

    def call(*inputs):
        return jitted(*[inputs[i] for i in direct],
                      *[np.array([inputs[i] for i in positions], dtype) for dtype, _, positions in layout])

    return call


def pending_ops() -> int:
    return len(_graph.nodes)


def reset_stats() -> None:
    stats.clear()
    flush_reasons.clear()
