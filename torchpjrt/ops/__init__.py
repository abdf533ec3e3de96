"""The lowering table: the only mapping from aten overloads to JAX.

A lowering is a pure function of `jax.Array`s and Python values whose parameters follow
the aten schema's arguments in order (keyword-only ones included, passed positionally).
Every execution path (eager, fused, compiled) calls these functions.

    @lower(aten.add.Tensor)
    def add(self, other, alpha=1):
        return self + alpha * other

Options:
  static=("name", ...)  Scalar arguments baked into the compiled function (others are
                        traced, so a changing learning rate does not recompile).
  traced=("name", ...)  `float` arguments passed traced (a JAX scalar, or a Python float
                        in compiled graphs) instead of baked in, as Scalar ones are: the
                        hyperparameters a schedule changes every step (a fused
                        optimizer's lr, betas, weight decay). Other `float` arguments
                        are baked in, one program per value.
  random=True           the function takes a trailing `key` (a JAX PRNG key) argument.
  mutates=("self",)     for mutating overloads: the function returns the new values of
                        these arguments (after any regular outputs).
  dynamic_shape=True    the output shape depends on values (nonzero, unique): run
                        without jit on concrete arrays. A predicate of the aten
                        arguments instead of True says per call (x[mask] is dynamic,
                        x[indices] is not).
  view=True             a view op's value semantics, for graph paths (compile, fused).
                        Eager execution never uses these: eager views alias storage
                        through the generic view kernel in dispatch.py.
  graph_only=True       used by compiled graphs only: eager execution keeps its own
                        kernel (an eager result would need strides a value cannot carry).
  check=DeviceCheck(find, error)
                        a validity check that needs the data (indices in range): `find`
                        takes the lowering's arguments and returns a small vector
                        [failed, details...] computed on the device next to the result;
                        `error(*details)` builds the CPU's exception on the host when it
                        failed (device_checks.py reads it asynchronously).

In-place (`add_`) and `out=` (`add.out`) overloads of a lowered op need no entry: the
generic kernels in dispatch.py derive them.
"""

import dataclasses
import importlib
from typing import Callable

import torch

class _MissingOp:
    """An aten op the installed PyTorch does not have (added by a later release): each of its
    overloads is None, which lower() skips, so the table loads on older PyTorch versions."""

    def __getattr__(self, overload):
        return None


class _InstalledAten:
    """torch.ops.aten, with _MissingOp for the ops this PyTorch lacks."""

    def __getattr__(self, name):
        try:
            packet = getattr(torch.ops.aten, name)
        except AttributeError:
            packet = _MissingOp()
        setattr(self, name, packet)  # later lookups skip __getattr__
        return packet


aten = _InstalledAten()


@dataclasses.dataclass(frozen=True)
class DeviceCheck:
    find: Callable
    error: Callable


def check_vector(failed, *details, dtype=None):
    """What a DeviceCheck's `find` returns: [failed, details...] in one small array (int64, or
    float64 for float details), so the host reads one value per checked op."""
    import jax.numpy as jnp

    dtype = dtype or jnp.int64
    return jnp.stack([jnp.asarray(failed).astype(dtype)] + [jnp.asarray(d).astype(dtype) for d in details])


def first_bad(bad):
    """(whether any of the 1-D bool array `bad` is set, the position of the first that is): one
    reduction, where `any` and `argmax` make two (each a loop of its own on the CPU platform)."""
    import jax.numpy as jnp
    from jax import lax

    n = bad.shape[0]
    first = jnp.min(jnp.where(bad, lax.iota(jnp.int64, n), n))  # n when none is
    return first < n, jnp.minimum(first, n - 1)


def first_failure(vectors):
    """The first failed vector of several (or the first one if none failed)."""
    import jax.numpy as jnp

    if len(vectors) == 1:
        return vectors[0]
    stacked = jnp.stack(vectors)
    return stacked[jnp.argmax(stacked[:, 0] != 0)]


@dataclasses.dataclass(frozen=True)
class Lowering:
    fn: Callable
    static: frozenset = frozenset()
    random: bool = False
    mutates: tuple = ()
    dynamic_shape: bool | Callable = False
    view: bool = False
    graph_only: bool = False
    check: DeviceCheck | None = None
    traced: frozenset = frozenset()
    # the program comes from user code (torchpjrt.kernel), which the kernel cache's environment
    # tag does not hash: its executables are not kept on disk under the op's name
    user_code: bool = False

    def has_dynamic_shape(self, args) -> bool:
        """Whether this call's output shape depends on values; `args` are the aten arguments
        (real or fake tensors, in schema order)."""
        d = self.dynamic_shape
        return bool(d(*args)) if callable(d) else d

    @property
    def eager(self) -> bool:
        """Whether eager execution runs this lowering (else it serves graph paths only)."""
        return not (self.view or self.graph_only)


TABLE: dict = {}

# Lowerings of ops that other libraries define (`transformers::grouped_mm_fallback`), by
# qualified overload name: such an op exists only once its library is imported, so it enters
# TABLE when a graph first meets it (lowering_for).
BY_NAME: dict = {}


def lowering_for(op):
    """TABLE's entry for `op`, registering a by-name lowering on first sight."""
    found = TABLE.get(op)
    if found is None and isinstance(op, torch._ops.OpOverload):
        found = BY_NAME.get(f"{op._schema.name}.{op._overloadname}")
        if found is not None:
            TABLE[op] = found
    return found


def lower_by_name(*names, static=(), mutates=()):
    """@lower for ops of other libraries, named like "transformers::grouped_mm_fallback.default".
    They serve compiled graphs: eager execution runs the library's own implementation."""
    def register(fn):
        for name in names:
            BY_NAME[name] = Lowering(fn, frozenset(static), mutates=tuple(mutates), graph_only=True)
        return fn

    return register


def lower(*overloads, static=(), random=False, mutates=(), dynamic_shape=False, view=False, graph_only=False,
          check=None, traced=()):
    def register(fn):
        for op in overloads:
            if op is None:
                continue  # not in this PyTorch
            if isinstance(op, torch._ops.OpOverloadPacket):
                raise TypeError(f"lower() needs overloads, got the packet {op}")
            if op in TABLE:
                raise ValueError(f"{op} is lowered twice")
            TABLE[op] = Lowering(fn, frozenset(static), random, tuple(mutates), dynamic_shape, view, graph_only,
                                 check, traced=frozenset(traced))
        return fn

    return register


_FAMILIES = (
    "elementwise",
    "reduction",
    "linalg",
    "shape",
    "indexing",
    "nn",
    "conv",
    "random",
    "factory",
    "foreach",
    "views",
    "fft",
    "special",
    "distance",
    "amp",
    "optimizers",
    "grouped_mm",
    "asserts",
    "attention",
)


def load_all():
    for name in _FAMILIES:
        importlib.import_module(f"{__name__}.{name}")
