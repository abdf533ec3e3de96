"""Compiled graphs that AOTAutograd's on-disk cache and torch's precompile can store.

The pjrt backend's forward and backward compilers return a CompiledGraph: an OutputCode, the
type AOTAutograd's cache (and `torch.compile(...).aot_compile` / `save_compiled_function`)
knows how to keep. It carries the aten graph, not generated code: a process that finds the
entry skips AOTAutograd's tracing and partitioning, lowers the graph again through the table
(milliseconds) and gets the XLA program from the persistent XLA cache.

Entries live under $TORCHPJRT_CACHE_DIR/graphs/<tag>, where the tag covers what shapes the
stored aten graphs besides what AOTAutograd hashes itself: torchpjrt's version, the
decompositions it asks for and the backend options. TORCHPJRT_CACHE_DIR=off turns it off.
"""

import contextlib
import gc
import hashlib
import os

import jax
import numpy as np
import torch
import torch.utils._pytree as pytree
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
from torch._inductor.output_code import OutputCode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx._graph_pickler import GraphPickler
from torch.fx._graph_pickler import Options as PicklerOptions
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._mode_utils import no_dispatch

from .. import fusion, storage
from . import backend


class CompiledGraph(OutputCode):
    """One forward or backward graph compiled by the pjrt backend (called boxed, like every
    AOTAutograd graph)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, options, forward: bool):
        super().__init__()
        self._boxed_call = True
        self.options = options
        self.code, self.shapes = gm.code, backend._shapes(example_inputs)
        self.size_inputs = [i for i, e in enumerate(example_inputs) if isinstance(e, (int, torch.SymInt))]
        self.num_inputs = len(example_inputs)
        self.donatable = backend._donatable_inputs(gm, example_inputs) if options.donate and forward else {}
        backend._note_recompile(self.code, self.shapes)
        self.graph_module, self.payload = gm, None
        self.runner, self.storable = backend._compile_graph(gm, example_inputs, options, self.donatable)

    def __call__(self, inputs):
        return self.runner(inputs)

    # ---- stored form ----------------------------------------------------------------------

    def prepare_for_serialization(self) -> None:
        # called on a shallow copy: the live graph keeps its runner
        if not self.storable:
            raise BypassAOTAutogradCache("torchpjrt: a bucketed graph or one run eagerly is compiled again in "
                                         "each process")
        with unset_fake_temporarily():
            self.payload = _dump_graph(self.graph_module)
        self.graph_module = self.runner = None

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self.runner is not None:
            return  # compiled in this process
        with unset_fake_temporarily():
            self.graph_module = _load_graph(self.payload)
        self.payload = None
        backend.stats["graph_cache_hits"] += 1
        backend._note_recompile(self.code, self.shapes)
        # only the positions of size inputs matter to the runner
        stand_ins = [0 if i in self.size_inputs else None for i in range(self.num_inputs)]
        self.runner, self.storable = backend._compile_graph(self.graph_module, stand_ins, self.options,
                                                            self.donatable)

    def set_triton_bundle(self, triton_bundle) -> None:
        pass  # no triton kernels


def _tensor_constants(gm):
    """{attribute: tensor} for the lifted constants the graph reads with get_attr."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = torch.fx.graph_module._get_attr(gm, node.target)
            if isinstance(value, torch.Tensor):
                found[node.target] = value
    return found


def _dump_graph(gm) -> bytes:
    # constants travel as numpy arrays (pjrt tensors have no pickled form of their own); the
    # graph itself holds meta stand-ins for them
    constants = {}
    for name, value in _tensor_constants(gm).items():
        array = np.asarray(fusion.concrete(storage.value_of(value)))
        constants[name] = (value.device.type, value.dtype, array)
    root = torch.nn.Module()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = torch.fx.graph_module._get_attr(gm, node.target)
            if node.target in constants:
                value = torch.empty(value.shape, dtype=value.dtype, device="meta")
            torch.fx.graph_module._assign_attr(value, root, node.target)
    bare = torch.fx.GraphModule(root, gm.graph)
    # example values travel as specs, rebuilt as fake tensors far faster than GraphPickler
    # rebuilds them (it recreates storages and views, which the lowering never reads)
    originals = {}
    for node in gm.graph.nodes:
        if "val" in node.meta:
            spec = pytree.tree_map(_spec_of, node.meta["val"])
            if not pytree.tree_any(lambda v: isinstance(v, torch.SymInt), spec):
                originals[node] = node.meta["val"]
                node.meta["val"] = spec
    try:
        return GraphPickler.dumps((bare, constants),
                                  PicklerOptions(ops_filter=None, node_metadata_key_filter=_kept_metadata))
    finally:
        for node, val in originals.items():
            node.meta["val"] = val


class _TensorSpec:
    """Shape, strides, dtype and device of a graph's example tensor."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.dtype, self.device = tuple(t.shape), t.stride(), t.dtype, str(t.device)


def _spec_of(value):
    if isinstance(value, torch.Tensor) and not any(isinstance(n, torch.SymInt) for n in (*value.shape, *value.stride())):
        return _TensorSpec(value)
    return value


def _fake_of(fake_mode):
    def rebuild(value):
        if isinstance(value, _TensorSpec):
            # a meta tensor wrapped directly: no trip through the fake mode's dispatch or memo
            meta = torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
            with no_dispatch():
                return FakeTensor(fake_mode, meta, torch.device(value.device))
        return value

    return rebuild


def _kept_metadata(key: str) -> bool:
    # the lowering reads only the example values; the rest (module stacks, source functions)
    # can point at objects that do not pickle
    return key == "val"


def _load_graph(payload: bytes) -> torch.fx.GraphModule:
    # unpickling a graph allocates thousands of objects: without this, Python's cyclic
    # collector runs full passes over torch's and JAX's heaps in the middle (a few 100 ms)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _unpickle_graph(payload)
    finally:
        if enabled:
            gc.enable()


def _unpickle_graph(payload: bytes) -> torch.fx.GraphModule:
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    gm, constants = GraphPickler.loads(payload, fake_mode)
    rebuild = _fake_of(fake_mode)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = pytree.tree_map(rebuild, node.meta["val"])
    for name, (device, dtype, array) in constants.items():
        value = storage.wrap(jax.device_put(array), dtype)  # jnp.asarray would compile a program
        torch.fx.graph_module._assign_attr(value if device == "pjrt" else value.cpu(), gm, name)
    gm.recompile()
    return gm


# ---- where entries live ---------------------------------------------------------------------


def _tag(options) -> str:
    from importlib.metadata import version

    from .. import kernel_cache

    decompositions = sorted(str(op) for op in backend._decompositions())
    # the source hash: graphs stored by another torchpjrt source (a partitioning or lowering
    # change under the same version string) are not loaded
    text = repr((version("torchpjrt"), kernel_cache.source_digest(), torch.__version__, decompositions, options))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def caching(options):
    """Around one backend call: AOTAutograd's cache on, in torchpjrt's directory, storing
    CompiledGraphs whole (bundled) with the backward compiled right away so that forward and
    backward are stored as one entry."""
    from .. import compile_cache

    root = compile_cache.directory()
    if root is None:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield
        return
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # AOTAutograd finds its directory through inductor's cache_dir(), which reads this variable
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "graphs", _tag(options))
    try:
        with torch._functorch.config.patch(enable_autograd_cache=True, bundled_autograd_cache=True,
                                           force_non_lazy_backward_lowering=True):
            yield
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
