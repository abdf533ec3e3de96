"""`torchpjrt.export`: a module as a StableHLO program plus safetensors weights.

    exported = torchpjrt.export(model.eval(), (x,))
    print(exported.stablehlo())           # StableHLO text
    exported.save("model_dir")            # program + weights + signature
    loaded = torchpjrt.load_exported("model_dir")
    y = loaded(x)                         # runs on pjrt

`torch.export` captures the module as a core-aten graph (parameters and buffers lifted to
inputs); it becomes one JAX function through the same lowering table as every other path, and
`jax.export` serializes it. The saved directory needs no PyTorch to run:

    model_dir/program.jax        jax.export serialization (StableHLO bytecode + calling convention)
    model_dir/program.mlirbc     the StableHLO module alone, as MLIR bytecode
    model_dir/weights.safetensors  parameters and buffers, by their state_dict names
    model_dir/signature.json     weight order, input and output shapes/dtypes

Plain JAX runs it with `jax.export.deserialize(open("program.jax", "rb").read()).call(*weights, *inputs)`,
the weights in `signature.json`'s order.
"""

import json
import os
import tempfile
import warnings

import jax
import numpy as np
import torch

from . import dtypes, fusion, storage
from .compile import graph as graph_mod

FORMAT = "torchpjrt.exported/1"


class ExportError(RuntimeError):
    """The module cannot be exported (an op without a lowering, data-dependent shapes...)."""


def _array(t: torch.Tensor):
    return fusion.concrete(storage.value_of(t))


def _describe(a):
    return {"shape": list(a.shape), "dtype": str(dtypes.to_torch(a.dtype)).removeprefix("torch.")}


class Exported:
    """A module exported to StableHLO, with its weights."""

    def __init__(self, jax_exported, weight_names, weights, input_avals, output_avals, single_output):
        self.jax_exported = jax_exported
        self.weight_names = list(weight_names)
        self.weights = list(weights)  # jax arrays, in weight_names order
        self.input_avals = input_avals
        self.output_avals = output_avals
        self.single_output = single_output

    def stablehlo(self) -> str:
        """The program as StableHLO text (weights are its leading arguments)."""
        return self.jax_exported.mlir_module()

    def signature(self) -> dict:
        return {
            "format": FORMAT,
            "weights": [{"name": n, **_describe(w)} for n, w in zip(self.weight_names, self.weights)],
            "inputs": [_describe(a) for a in self.input_avals],
            "outputs": [_describe(a) for a in self.output_avals],
            "single_output": self.single_output,
            "platforms": list(self.jax_exported.platforms),
        }

    def save(self, directory) -> None:
        """Write program, weights and signature; each file appears complete or not at all."""
        from safetensors.numpy import save

        os.makedirs(directory, exist_ok=True)
        files = {
            "program.jax": bytes(self.jax_exported.serialize()),
            "program.mlirbc": bytes(self.jax_exported.mlir_module_serialized),
            "signature.json": json.dumps(self.signature(), indent=2).encode(),
        }
        for name, data in files.items():
            _atomic_write(os.path.join(directory, name), lambda f, data=data: f.write(data))
        weights = {n: np.asarray(w) for n, w in zip(self.weight_names, self.weights)}
        _atomic_write(os.path.join(directory, "weights.safetensors"), lambda f: f.write(save(weights)))

    def __call__(self, *args):
        inputs = [_array(a) for a in args]
        self._check_inputs(inputs)
        outs = fusion.call(self._runner(), self.weights, inputs)
        wrapped = [storage.wrap(o) for o in outs]
        return wrapped[0] if self.single_output else tuple(wrapped)

    def _runner(self):
        runner = getattr(self, "_jitted", None)
        if runner is None:
            call = self.jax_exported.call
            runner = self._jitted = jax.jit(lambda weights, inputs: tuple(call(*weights, *inputs)))
        return runner

    def _check_inputs(self, inputs):
        if len(inputs) != len(self.input_avals):
            raise TypeError(f"torchpjrt exported program takes {len(self.input_avals)} inputs, got {len(inputs)}")
        for i, (a, want) in enumerate(zip(inputs, self.input_avals)):
            if tuple(a.shape) != tuple(want.shape) or a.dtype != want.dtype:
                raise ValueError(
                    f"torchpjrt exported program: input {i} is {dtypes.to_torch(a.dtype)}{list(a.shape)}, "
                    f"exported for {dtypes.to_torch(want.dtype)}{list(want.shape)}"
                )


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _atomic_write(path, write):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def export(module: torch.nn.Module, example_args: tuple) -> Exported:
    """Capture `module(*example_args)` (tensors on pjrt or CPU) as an exported StableHLO program."""
    from .compile.backend import _decompositions

    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    try:
        with warnings.catch_warnings():
            # raised inside torch.export's own pytree handling, not by the caller's code
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            ep = torch.export.export(module, example_args)
            ep = ep.run_decompositions(_decompositions())
    except Exception as e:
        raise ExportError(f"torchpjrt.export: torch.export could not capture the module: {e}") from e
    gm = ep.graph_module
    missing = graph_mod.unsupported_ops(gm)
    if missing:
        raise ExportError(f"torchpjrt.export: the module uses ops without a lowering: {', '.join(missing)}")
    if graph_mod.uses_random(gm):
        raise ExportError("torchpjrt.export: the module draws random numbers (dropout in train mode?); "
                          "export it in eval() mode")
    run = graph_mod.to_jax_function(gm)
    sig = ep.graph_signature
    state = {**ep.state_dict, **ep.constants}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weight_names, weights, order = [], [], []
    n_user = 0
    for i, (spec, node) in enumerate(zip(sig.input_specs, placeholders)):
        if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT:
            n_user += 1
            continue
        if not node.users:
            continue  # a buffer the program never reads (BatchNorm's num_batches_tracked in eval)
        if spec.target not in state:
            raise ExportError(f"torchpjrt.export: no value for lifted input {spec.target!r}")
        weight_names.append(spec.target)
        weights.append(_array(state[spec.target]))
        order.append(i)
    user_outputs = [i for i, spec in enumerate(sig.output_specs)
                    if spec.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT]
    user_positions = [i for i, spec in enumerate(sig.input_specs)
                      if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    n_inputs = len(sig.input_specs)

    def program(*flat):
        weights_in, inputs_in = flat[: len(order)], flat[len(order):]
        full = [None] * n_inputs
        for pos, w in zip(order, weights_in):
            full[pos] = w
        for pos, x in zip(user_positions, inputs_in):
            full[pos] = x
        outs = run(None, *full)
        return tuple(outs[i] for i in user_outputs)

    inputs = [_array(a) for a in example_args if isinstance(a, torch.Tensor)]
    if len(inputs) != n_user:
        raise ExportError("torchpjrt.export: example_args must be tensors (non-tensor arguments are baked in)")
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in weights + inputs]
    exported = jax.export.export(jax.jit(program))(*avals)
    out_avals = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in exported.out_avals]
    single = ep.call_spec.out_spec.is_leaf()
    return Exported(exported, weight_names, weights, avals[len(weights):], out_avals, single)


def load_exported(directory, device="pjrt") -> Exported:
    """Load a directory written by `Exported.save`; calling the result runs it on pjrt."""
    from safetensors.numpy import load_file

    try:
        with open(os.path.join(directory, "signature.json")) as f:
            signature = json.load(f)
        with open(os.path.join(directory, "program.jax"), "rb") as f:
            exported = jax.export.deserialize(bytearray(f.read()))
        weights_np = load_file(os.path.join(directory, "weights.safetensors"))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"torchpjrt.load_exported: {directory!r} is not an exported program: {e}") from None
    except Exception as e:
        raise RuntimeError(f"torchpjrt.load_exported: {directory!r} is damaged or not an exported program ({e})") from e
    if signature.get("format") != FORMAT:
        raise RuntimeError(f"torchpjrt.load_exported: {directory!r} has format {signature.get('format')!r}, expected {FORMAT!r}")
    if torch.device(device).type != "pjrt":
        raise ValueError(f"torchpjrt.load_exported: device must be pjrt, got {device!r}")
    target = storage.default_device()
    names = [w["name"] for w in signature["weights"]]
    missing = [n for n in names if n not in weights_np]
    if missing:
        raise RuntimeError(f"torchpjrt.load_exported: weights.safetensors in {directory!r} lacks {missing}")
    weights = [jax.device_put(weights_np[n], target) for n in names]
    input_avals = [jax.ShapeDtypeStruct(tuple(i["shape"]), dtypes.to_jax(getattr(torch, i["dtype"])))
                   for i in signature["inputs"]]
    output_avals = [jax.ShapeDtypeStruct(tuple(o["shape"]), dtypes.to_jax(getattr(torch, o["dtype"])))
                    for o in signature["outputs"]]
    return Exported(exported, names, weights, input_avals, output_avals, signature["single_output"])
