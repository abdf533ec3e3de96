"""SPMD: one program over a mesh of devices, partitioned by XLA.

A pjrt tensor's storage holds one `jax.Array`; here that array may be sharded over a
`jax.sharding.Mesh` (a `NamedSharding`). Nothing else changes: eager ops and compiled graphs
are `jax.jit` calls, and jit follows its inputs' shardings (computation follows data), so XLA's
SPMD partitioner inserts the all-gathers, reduce-scatters and all-reduces a plan needs.

    mesh = spmd.mesh((8,), ("data",))
    model = spmd.parallelize(model.to("pjrt"), mesh, "fsdp")
    step = torch.compile(train_step, backend="pjrt")
    x, y = spmd.shard_input((x, y), mesh, "data")

Tensors are placed in place (their storage gets the sharded array), so parameters keep their
identity and an optimizer built before `parallelize` still holds them. PyTorch still reports
the device as `pjrt:0`; `sharding_of(t)` says where the data really is. With several processes
(JAX's multi-process runtime) the mesh spans every process's devices, each process runs the
same program, and `shard_input` takes the process's own part of the batch.
"""

import fnmatch
import math

import jax
import numpy as np
import torch
from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding

from .. import device as pjrt_device
from .. import dtypes, fusion, storage

# whole-storage writes check for a mesh placement to keep from now on (storage.write)
storage.mesh_placements = True

__all__ = ["mesh", "shard", "replicate", "shard_input", "parallelize", "sharding_of", "partition_spec",
           "Replicate", "FullyShard", "ColwiseParallel", "RowwiseParallel"]


# ---- meshes -------------------------------------------------------------------------------


def mesh(shape=None, axis_names=("data",), devices=None) -> jax.sharding.Mesh:
    """A `jax.sharding.Mesh` over the pjrt platform's devices (every process's, under JAX's
    multi-process runtime). `shape` defaults to all devices on one axis; one entry may be -1
    (inferred). Axes are `Auto`: XLA's partitioner decides the shardings of intermediates."""
    devices = list(devices) if devices is not None else jax.devices(pjrt_device.platform())
    axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    n = len(devices)
    shape = (n,) if shape is None else ((shape,) if isinstance(shape, int) else tuple(int(s) for s in shape))
    if len(shape) != len(axis_names):
        raise ValueError(f"torchpjrt.spmd.mesh: shape {shape} and axis names {axis_names} differ in length")
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"torchpjrt.spmd.mesh: axis names {axis_names} repeat")
    if shape.count(-1) > 1:
        raise ValueError(f"torchpjrt.spmd.mesh: at most one dimension may be -1, got {shape}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known <= 0 or n % known:
            raise ValueError(f"torchpjrt.spmd.mesh: {n} devices do not fill a mesh of shape {shape}")
        shape = tuple(n // known if s == -1 else s for s in shape)
    if any(s <= 0 for s in shape) or math.prod(shape) != n:
        raise ValueError(f"torchpjrt.spmd.mesh: a mesh of shape {shape} needs {math.prod(shape)} devices; "
                         f"there are {n} ({pjrt_device.platform()})")
    return jax.make_mesh(shape, axis_names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


def _check_mesh(m):
    if not isinstance(m, jax.sharding.Mesh):
        raise TypeError(f"torchpjrt.spmd: expected a mesh (torchpjrt.distributed.spmd.mesh(...) or a "
                        f"jax.sharding.Mesh), got {type(m).__name__}")


def _axis(m, axis, default, who):
    """The mesh axis (or tuple of axes) a style shards over; None picks `default`, or the only
    axis of a one-axis mesh."""
    if axis is None:
        if default in m.axis_names:
            return default
        if len(m.axis_names) == 1:
            return m.axis_names[0]
        raise ValueError(f"torchpjrt.spmd: {who} needs a mesh axis: the mesh has axes {m.axis_names} and none "
                         f"is named {default!r}; pass axis=... to {who}")
    return axis


# ---- placing one tensor -------------------------------------------------------------------


def _spec(spec):
    if spec is None:
        return PartitionSpec()
    if isinstance(spec, PartitionSpec):
        return spec
    if isinstance(spec, str):
        return PartitionSpec(spec)
    if isinstance(spec, (tuple, list)):
        return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in spec))
    raise TypeError(f"torchpjrt.spmd: a sharding spec is a PartitionSpec, a tuple of mesh axis names "
                    f"(or None) per dimension, or None; got {spec!r}")


def _check_spec(what, shape, m, spec):
    """Raise a clear error unless `spec` names mesh axes and divides `shape` evenly."""
    if len(spec) > len(shape):
        raise ValueError(f"torchpjrt.spmd: {what} has {len(shape)} dimension(s) {tuple(shape)} but the spec "
                         f"{spec} names {len(spec)}")
    used = []
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        for a in axes:
            if a not in m.shape:
                raise ValueError(f"torchpjrt.spmd: {what}: the mesh has no axis {a!r} (axes: {m.axis_names})")
            if a in used:
                raise ValueError(f"torchpjrt.spmd: {what}: mesh axis {a!r} shards two dimensions in {spec}")
            used.append(a)
        ways = math.prod(m.shape[a] for a in axes)
        if shape[dim] % ways:
            raise ValueError(f"torchpjrt.spmd: {what}: dimension {dim} of size {shape[dim]} (shape "
                             f"{tuple(shape)}) does not divide evenly over mesh axis {entry!r} of size {ways}")


def _owned_storage(t, what):
    if not isinstance(t, torch.Tensor) or t.device.type != "pjrt":
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"torchpjrt.spmd: {what} must be a pjrt tensor, got {where}; move it with .to('pjrt') first")
    st = storage.storage_of(t)
    if not storage.is_identity(t, st):
        raise ValueError(f"torchpjrt.spmd: {what} is a view of a larger storage; shard the tensor that owns "
                         "the storage (or a .clone())")
    return st


def _place(st, sharding):
    # in place: every tensor (and autograd's view of it) sharing the storage sees the new layout
    st.replace(jax.device_put(fusion.concrete(st.value(), "sharding"), sharding))


def shard(tensor: torch.Tensor, mesh, spec) -> torch.Tensor:
    """Re-place `tensor`'s data over `mesh` by `spec` (one entry per leading dimension: a mesh
    axis name, a tuple of names, or None for not sharded), in place; returns `tensor`."""
    _check_mesh(mesh)
    spec = _spec(spec)
    st = _owned_storage(tensor, "shard()'s tensor")
    _check_spec(f"tensor of shape {tuple(tensor.shape)}", tensor.shape, mesh, spec)
    _place(st, NamedSharding(mesh, spec))
    return tensor


def replicate(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """A full copy of `tensor` on every device of `mesh`, in place; returns `tensor`."""
    return shard(tensor, mesh, None)


def shard_input(batch, mesh, axis="data", dim=0):
    """New pjrt tensors holding `batch` (a tensor, or a list/tuple/dict of them; CPU or pjrt)
    split along `dim` over mesh `axis` (a name or tuple of names). Under several processes each
    passes its own part and the result is the global batch (their concatenation along `dim`)."""
    _check_mesh(mesh)
    axis = _axis(mesh, axis, "data", "shard_input")

    def one(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.requires_grad and not t.is_leaf:
            raise ValueError("torchpjrt.spmd.shard_input takes data; this tensor is the result of an autograd "
                             "computation (detach it, or shard it in place with spmd.shard)")
        if t.dim() <= dim:
            raise ValueError(f"torchpjrt.spmd.shard_input: a tensor of shape {tuple(t.shape)} has no dimension {dim}")
        spec = PartitionSpec(*([None] * dim), axis)
        sharding = NamedSharding(mesh, spec)
        if t.device.type == "pjrt":
            value = fusion.concrete(storage.read(t), "sharding")
        else:
            value = np.array(dtypes.numpy_from_cpu_tensor(t), copy=True)
        if jax.process_count() == 1:
            _check_spec(f"input of shape {tuple(t.shape)}", t.shape, mesh, spec)
            array = jax.device_put(value, sharding)
        else:
            array = jax.make_array_from_process_local_data(sharding, np.asarray(value))
        out = storage.wrap(array, t.dtype)
        return out.requires_grad_() if t.requires_grad else out

    if isinstance(batch, dict):
        return type(batch)((k, shard_input(v, mesh, axis, dim)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        items = [shard_input(v, mesh, axis, dim) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return one(batch)


# ---- plans --------------------------------------------------------------------------------


class Style:
    """How one module's parameters are placed: `specs(module, mesh)` gives a spec per
    parameter name (relative to the module)."""

    def specs(self, module, mesh):
        raise NotImplementedError


class Replicate(Style):
    """Every parameter of the module (and its submodules) whole on every device."""

    def specs(self, module, mesh):
        return {name: PartitionSpec() for name, _ in module.named_parameters()}

    def __repr__(self):
        return "Replicate()"


class FullyShard(Style):
    """FSDP: every parameter of the module (and its submodules) split along `dim` over mesh
    `axis` (default "fsdp", or the mesh's only axis); XLA all-gathers them where they are used
    and reduce-scatters their gradients. 0-d parameters stay replicated."""

    def __init__(self, axis=None, dim=0):
        self.axis, self.dim = axis, dim

    def specs(self, module, mesh):
        axis = _axis(mesh, self.axis, "fsdp", "FullyShard")
        out = {}
        for name, p in module.named_parameters():
            out[name] = PartitionSpec(*([None] * self.dim), axis) if p.dim() > self.dim else PartitionSpec()
        return out

    def __repr__(self):
        return f"FullyShard(axis={self.axis!r}, dim={self.dim})"


class _TensorParallel(Style):
    name = ""

    def __init__(self, axis=None):
        self.axis = axis

    def specs(self, module, mesh):
        axis = _axis(mesh, self.axis, "model", self.name)
        if isinstance(module, torch.nn.Linear):
            return self._linear(module, axis)
        if isinstance(module, torch.nn.Embedding):
            return self._embedding(module, axis)
        raise ValueError(f"torchpjrt.spmd: {self.name} applies to nn.Linear and nn.Embedding, not "
                         f"{type(module).__name__}; use FullyShard or Replicate for other modules")

    def __repr__(self):
        return f"{self.name}(axis={self.axis!r})"


class ColwiseParallel(_TensorParallel):
    """Tensor parallel, output features split over mesh `axis` (default "model"): a Linear's
    weight (out, in) by rows and its bias; an Embedding's embedding dimension. Its output is
    sharded along the last dimension; follow it by a RowwiseParallel Linear."""

    name = "ColwiseParallel"

    def _linear(self, module, axis):
        specs = {"weight": PartitionSpec(axis, None)}
        if module.bias is not None:
            specs["bias"] = PartitionSpec(axis)
        return specs

    def _embedding(self, module, axis):
        return {"weight": PartitionSpec(None, axis)}


class RowwiseParallel(_TensorParallel):
    """Tensor parallel, input features split over mesh `axis` (default "model"): a Linear's
    weight (out, in) by columns, its bias replicated (XLA all-reduces the partial products);
    an Embedding's rows (the vocabulary)."""

    name = "RowwiseParallel"

    def _linear(self, module, axis):
        specs = {"weight": PartitionSpec(None, axis)}
        if module.bias is not None:
            specs["bias"] = PartitionSpec()
        return specs

    def _embedding(self, module, axis):
        return {"weight": PartitionSpec(axis, None)}


_NAMED_PLANS = {"data": Replicate, "dp": Replicate, "replicate": Replicate, "fsdp": FullyShard}


def _plan_dict(plan):
    if isinstance(plan, str):
        if plan not in _NAMED_PLANS:
            raise ValueError(f"torchpjrt.spmd.parallelize: unknown plan {plan!r}; use one of "
                             f"{sorted(_NAMED_PLANS)}, a style, or a dict {{module pattern: style}}")
        return {"": _NAMED_PLANS[plan]()}
    if isinstance(plan, Style):
        return {"": plan}
    if isinstance(plan, dict):
        for pattern, style in plan.items():
            if not isinstance(pattern, str) or not isinstance(style, Style):
                raise TypeError(f"torchpjrt.spmd.parallelize: a plan dict maps module name patterns to styles "
                                f"(ColwiseParallel(), RowwiseParallel(), FullyShard(), Replicate()); got "
                                f"{pattern!r}: {style!r}")
        return plan
    raise TypeError(f"torchpjrt.spmd.parallelize: a plan is 'data', 'fsdp', a style or a dict, "
                    f"not {type(plan).__name__}")


def parallelize(module: torch.nn.Module, mesh, plan) -> torch.nn.Module:
    """Place `module`'s parameters and buffers over `mesh` by `plan`, in place; returns `module`.

    `plan` is "data" (replicate everything: data parallel once the inputs are sharded with
    `shard_input`), "fsdp" (FullyShard() on the whole module), a style, or a dict mapping
    module names (fnmatch patterns such as "layers.*.mlp.up"; "" is the root) to styles,
    applied in order, later entries overriding earlier ones. Parameters no entry covers, and
    all buffers, are replicated. Every spec is checked before any tensor moves."""
    _check_mesh(mesh)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"torchpjrt.spmd.parallelize: expected an nn.Module, got {type(module).__name__}")
    modules = dict(module.named_modules())
    tensors = {}  # id -> (qualified name, tensor); tied parameters appear once
    specs = {}  # id -> (spec, which plan entry set it)
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if t is not None:
            tensors.setdefault(id(t), (name, t))
            specs.setdefault(id(t), (PartitionSpec(), None))

    for pattern, style in _plan_dict(plan).items():
        matched = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            names = [n for n in modules if n]
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise ValueError(f"torchpjrt.spmd.parallelize: plan entry {pattern!r} matches no module of "
                             f"{type(module).__name__} (its modules: {shown or 'none'})")
        for mod_name in matched:
            sub = modules[mod_name]
            for pname, spec in style.specs(sub, mesh).items():
                t = sub.get_parameter(pname)
                entry = f"{pattern!r}: {style!r}"
                prev = specs[id(t)]
                if prev[1] is not None and prev[1][0] == pattern and prev[0] != spec:
                    raise ValueError(f"torchpjrt.spmd.parallelize: plan entry {entry} gives the tied parameter "
                                     f"{tensors[id(t)][0]} two shardings ({prev[0]} and {spec})")
                specs[id(t)] = (spec, (pattern, entry))

    for key, (spec, source) in specs.items():
        name, t = tensors[key]
        what = f"{name} (set by plan entry {source[1]})" if source else name
        _owned_storage(t, what)
        _check_spec(what, t.shape, mesh, spec)
    for key, (spec, _) in specs.items():
        _, t = tensors[key]
        sharding = NamedSharding(mesh, spec)
        _place(storage.storage_of(t), sharding)
        if isinstance(t, torch.nn.Parameter):
            _keep_grad_with_param(t, sharding)
    return module


def _keep_grad_with_param(param, sharding):
    """Give the parameter's gradient the parameter's sharding after every backward. XLA is
    free to return a compiled backward's gradients replicated; resharding them makes the
    optimizer's update, and the state it creates (Adam's moments), follow the parameter, so
    FSDP keeps optimizer memory split across devices."""
    old = getattr(param, "_pjrt_spmd_grad_hook", None)
    if old is not None:
        old.remove()

    def reshard(p):
        g = p.grad
        if g is None or g.device.type != "pjrt":
            return
        st = storage.storage_of(g)
        array = st.array
        # a fused-mode gradient is not computed yet: leave it rather than force a flush per parameter
        if isinstance(array, jax.Array) and storage.is_identity(g, st) and array.sharding != sharding:
            _place(st, sharding)

    param._pjrt_spmd_grad_hook = param.register_post_accumulate_grad_hook(reshard)
    reshard(param)


# ---- inspecting ---------------------------------------------------------------------------


def _array_of(t):
    if not isinstance(t, torch.Tensor) or t.device.type != "pjrt":
        return None
    return fusion.concrete(storage.storage_of(t).value(), "sharding")


def partition_spec(tensor: torch.Tensor):
    """The PartitionSpec of the tensor's storage over a mesh, trailing unsharded dimensions
    left out (XLA may report P('x') or P('x', None) for the same layout), or None when it is
    not placed on a mesh (one device, or not a pjrt tensor)."""
    array = _array_of(tensor)
    sharding = getattr(array, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    entries = list(sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def sharding_of(tensor: torch.Tensor) -> str:
    """Where a tensor's data is, in words: one device, replicated over a mesh, or which
    dimensions are split over which mesh axes and the shape each device holds."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"torchpjrt.spmd.sharding_of: expected a tensor, got {type(tensor).__name__}")
    if tensor.device.type != "pjrt":
        return f"not a pjrt tensor (on {tensor.device})"
    st = storage.storage_of(tensor)
    array = _array_of(tensor)
    prefix = "" if storage.is_identity(tensor, st) else f"a view of a storage of shape {st.shape} that is "
    sharding = array.sharding
    if isinstance(sharding, SingleDeviceSharding):
        return f"{prefix}on one device ({next(iter(sharding.device_set))})"
    if not isinstance(sharding, NamedSharding):
        return f"{prefix}{sharding}"
    axes = ", ".join(f"{a}={n}" for a, n in sharding.mesh.shape.items())
    split = []
    for dim, entry in enumerate(sharding.spec):
        if entry is not None:
            ways = math.prod(sharding.mesh.shape[a] for a in (entry if isinstance(entry, tuple) else (entry,)))
            split.append(f"dim {dim} over {entry!r} ({ways} ways)")
    if not split:
        return f"{prefix}replicated over mesh ({axes})"
    local = sharding.shard_shape(tuple(array.shape))
    return (f"{prefix}sharded over mesh ({axes}): {', '.join(split)}; each device holds {tuple(local)} "
            f"of {tuple(array.shape)}")
