"""`@torchpjrt.kernel`: a JAX (or Pallas) function as a PyTorch custom op on pjrt.

    @torchpjrt.kernel(name="mylib::rms_norm")
    def rms_norm(x, weight, eps: float = 1e-6):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    y = rms_norm(x_pjrt, w_pjrt)          # a torch op: autograd, torch.compile, fused mode

The op is a `torch.library.custom_op`. Its pjrt implementation is an entry of the lowering
table, so strict, fused and compiled execution all run the JAX function the way they run
aten ops (in compiled graphs it is inlined into the same XLA program). Its fake (meta)
implementation comes from `jax.eval_shape`; its gradient from `jax.vjp`, unless `backward=`
is given. Parameters with no annotation and no default are tensors; the others need an
annotation or a default of type int, float, bool, str, list[int] or list[float]; they reach
the JAX function as Python values (compiled in: a new value compiles again).
"""

import functools
import inspect
import itertools
import typing

import jax
import jax.numpy as jnp
import torch

from . import dispatch, dtypes
from .ops import TABLE, Lowering

_SCALAR_TYPES = {int: "int", float: "float", bool: "bool", str: "str"}
_LIST_TYPES = {int: "int[]", float: "float[]"}
_libraries = {}
_anonymous = itertools.count()

# op -> check(args, outputs) of a kernel with a user `fake=`, for graph lowerings (torch.compile)
# to call while tracing: there the real outputs' shapes and dtypes are known, and eager
# execution's call-time check does not run
OUTPUT_CHECKS = {}


class _Param:
    def __init__(self, name, schema_type, default):
        self.name = name
        self.type = schema_type
        self.default = default

    @property
    def is_tensor(self):
        return self.type.startswith("Tensor")


def _schema_type(kernel_name, p: inspect.Parameter, mutated: bool) -> str:
    ann = p.annotation
    if ann is inspect.Parameter.empty:
        if p.default is inspect.Parameter.empty:
            return "Tensor(a!)" if mutated else "Tensor"
        ann = type(p.default)
        if ann in (list, tuple) and p.default:
            ann = list[type(p.default[0])]
    if mutated:
        raise TypeError(f"torchpjrt kernel '{kernel_name}': mutated argument '{p.name}' must be a tensor")
    if ann in _SCALAR_TYPES:
        return _SCALAR_TYPES[ann]
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (list, tuple) and args and args[0] in _LIST_TYPES:
        return _LIST_TYPES[args[0]]
    if ann in (torch.Tensor, jax.Array):
        return "Tensor"
    raise TypeError(
        f"torchpjrt kernel '{kernel_name}': cannot tell the type of argument '{p.name}' "
        f"(annotation {ann!r}); annotate it as a tensor, int, float, bool, str, list[int] or list[float]"
    )


def _schema_default(value) -> str:
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_schema_default(v) for v in value) + "]"
    return repr(value)


def _n_outputs(fn, n_outputs):
    if n_outputs is not None:
        return int(n_outputs)
    ret = inspect.signature(fn).return_annotation
    if typing.get_origin(ret) is tuple:
        args = typing.get_args(ret)
        if args and args[-1] is not Ellipsis:
            return len(args)
    return 1


def kernel(fn=None, *, name=None, mutates_args=(), backward=None, fake=None, n_outputs=None):
    """Turn a JAX function into a PyTorch custom op that runs on pjrt tensors.

    name:         "namespace::op" (default "torchpjrt_kernels::<function name>").
    mutates_args: names of tensor arguments the kernel updates; the JAX function returns
                  their new values after its regular outputs.
    backward:     a JAX function (inputs, outputs, grad_outputs, **non-tensor args) returning
                  one gradient (or None) per tensor input; default: jax.vjp of the kernel.
    fake:         a torch function giving the outputs' shapes/dtypes (default: jax.eval_shape);
                  the kernel's real outputs are checked against it.
    n_outputs:    number of tensor outputs (default: from a tuple[...] return annotation, else 1).
    """
    if fn is None:
        return functools.partial(kernel, name=name, mutates_args=mutates_args, backward=backward, fake=fake,
                                 n_outputs=n_outputs)
    return _Kernel(fn, name, tuple(mutates_args), backward, fake, _n_outputs(fn, n_outputs)).op_callable()


class _Kernel:
    def __init__(self, fn, name, mutates, backward, fake, n_out):
        self.fn = fn
        self.name = name or f"torchpjrt_kernels::{fn.__name__}"
        if "::" not in self.name:
            raise ValueError(f"torchpjrt kernel name {self.name!r} must look like 'namespace::op'")
        self.mutates = mutates
        self.user_backward = backward
        self.user_fake = fake
        self.n_out = n_out
        sig = inspect.signature(fn)
        unknown = set(mutates) - set(sig.parameters)
        if unknown:
            raise ValueError(f"torchpjrt kernel '{self.name}': mutates_args names unknown arguments {sorted(unknown)}")
        self.params = []
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"torchpjrt kernel '{self.name}': *args/**kwargs are not supported")
            default = None if p.default is inspect.Parameter.empty else p.default
            self.params.append(_Param(p.name, _schema_type(self.name, p, p.name in mutates), default))
        if not any(p.is_tensor for p in self.params):
            raise TypeError(f"torchpjrt kernel '{self.name}' takes no tensor argument")
        self.tensor_positions = [i for i, p in enumerate(self.params) if p.is_tensor]
        self._checked = set()
        self._define()

    # ---- the custom op ---------------------------------------------------------------------

    def _schema(self, params, returns):
        parts = []
        for p in params:
            s = f"{p.type} {p.name}"
            if p.default is not None:
                s += "=" + _schema_default(p.default)
            parts.append(s)
        return f"({', '.join(parts)}) -> {returns}"

    def _define(self):
        namespace, opname = self.name.split("::", 1)
        returns = "Tensor" if self.n_out == 1 else "(" + ", ".join(["Tensor"] * self.n_out) + ")"
        if self.n_out == 0:
            returns = "()"
        schema = self._schema(self.params, returns)
        self.custom_op = torch.library.custom_op(self.name, self._off_device, mutates_args=self.mutates,
                                                 schema=schema)
        self.custom_op.register_fake(self._fake)
        self.op = getattr(getattr(torch.ops, namespace), opname).default
        self._register_pjrt(self.op, Lowering(self._lowered, mutates=self.mutates, user_code=True))
        if self.user_fake is not None:
            OUTPUT_CHECKS[self.op] = self.check_traced_outputs
        if not self.mutates:
            self._define_backward(namespace, opname)

    def _register_pjrt(self, op, lowering):
        TABLE[op] = lowering
        namespace = op._schema.name.split("::")[0]
        lib = _libraries.get(namespace)
        if lib is None:
            lib = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
        eager = dispatch.make_functional_kernel(op, lowering)
        lib.impl(op._schema.name.split("::")[1], dispatch._instrumented(op, self._guarded(op, eager)), "PrivateUse1")

    def _guarded(self, op, eager):
        def pjrt_kernel(*args, **kwargs):
            vals = dispatch.signature(op).values(args, kwargs)
            for v in vals:
                for t in v if isinstance(v, (list, tuple)) else (v,):
                    if isinstance(t, torch.Tensor) and t.device.type != "pjrt":
                        raise RuntimeError(
                            f"torchpjrt kernel '{op._schema.name}': all tensors must be on pjrt, got one on {t.device}"
                        )
            if op is self.op and self.user_fake is not None:
                self._check_against_fake(vals)
            return eager(*args, **kwargs)

        return pjrt_kernel

    def _off_device(self, *args, **kwargs):
        # the op's implementation for every device but pjrt
        devices = {str(a.device) for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)}
        raise RuntimeError(
            f"torchpjrt kernel '{self.name}' runs on pjrt tensors only; it was called with tensors on "
            f"{', '.join(sorted(devices))}. Move them with .to('pjrt')."
        )

    def op_callable(self):
        op = self.custom_op
        functools.update_wrapper(op, self.fn, updated=())
        return op

    # ---- shapes --------------------------------------------------------------------------

    def _call_jax(self, fn, args):
        """fn(*args) with tensors abstract (ShapeDtypeStruct) and the other arguments bound."""
        tensors = [args[i] for i in self.tensor_positions]

        def with_tensors(*ts):
            full = list(args)
            for i, t in zip(self.tensor_positions, ts):
                full[i] = t
            return fn(*full)

        structs = [jax.ShapeDtypeStruct(tuple(t.shape), dtypes.to_jax(t.dtype)) for t in tensors]
        # A JAX function may run torch code of its own while it is traced (Helion's jax_fn wraps
        # its inputs in a meta-tensor subclass and compiles with fake tensors): it runs outside
        # the caller's dispatch modes (torch.compile asks for shapes under FakeTensorMode) and
        # with tensor subclasses dispatching (the eager kernels' shape inference disables them)
        with torch.utils._python_dispatch._disable_current_modes(), \
                torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.Python, False), \
                torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.PythonTLSSnapshot, False):
            return jax.eval_shape(with_tensors, *structs)

    def _outputs(self, result):
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        expected = self.n_out + len(self.mutates)
        if len(outs) != expected:
            raise RuntimeError(
                f"torchpjrt kernel '{self.name}' returned {len(outs)} arrays; expected {self.n_out} output(s)"
                + (f" and the new values of {list(self.mutates)}" if self.mutates else "")
            )
        return outs

    def _fake(self, *args):
        if self.user_fake is not None:
            return self.user_fake(*args)
        outs = self._outputs(self._call_jax(self.fn, list(args)))[: self.n_out]
        like = args[self.tensor_positions[0]]
        made = [like.new_empty(o.shape, dtype=dtypes.to_torch(o.dtype)) for o in outs]
        if self.n_out == 0:
            return None
        return made[0] if self.n_out == 1 else tuple(made)

    def _check_against_fake(self, vals):
        key = tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else dispatch._freeze(v) for v in vals)
        if key in self._checked:
            return
        real = self._outputs(self._call_jax(self.fn, vals))[: self.n_out]
        self._compare_with_fake(vals, real, lambda v: dispatch.meta_like(v) if isinstance(v, torch.Tensor) else v)
        self._checked.add(key)

    def check_traced_outputs(self, args, outs):
        """The fake check inside a traced graph (torch.compile): `args` are the lowering's
        arguments (JAX arrays or tracers for tensors), `outs` the outputs it just traced."""
        tensors = set(self.tensor_positions)

        def meta(i, v):
            if i in tensors and v is not None:
                return torch.empty(tuple(v.shape), dtype=dtypes.to_torch(v.dtype), device="meta")
            return v

        self._compare_with_fake([meta(i, v) for i, v in enumerate(args)], list(outs)[: self.n_out], lambda v: v)

    def _compare_with_fake(self, vals, real, to_meta):
        """Raise if the real outputs (anything with .shape and a JAX .dtype) are not the
        shapes and dtypes the user's fake implementation promises for `vals`."""
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            promised = self.user_fake(*[to_meta(v) for v in vals])
        promised = list(promised) if isinstance(promised, (tuple, list)) else [promised]
        for i, (r, p) in enumerate(zip(real, promised)):
            if tuple(r.shape) != tuple(p.shape) or dtypes.to_torch(r.dtype) != p.dtype:
                raise RuntimeError(
                    f"torchpjrt kernel '{self.name}': output {i} is {dtypes.to_torch(r.dtype)}{list(r.shape)} "
                    f"but its fake implementation says {p.dtype}{list(p.shape)}"
                )

    def _lowered(self, *args):
        result = self.fn(*args)
        outs = self._outputs(result)
        return tuple(outs)

    # ---- autograd ----------------------------------------------------------------------------

    def _define_backward(self, namespace, opname):
        statics = [p for p in self.params if not p.is_tensor]
        params = [_Param("inputs", "Tensor[]", None), _Param("outputs", "Tensor[]", None),
                  _Param("grad_outputs", "Tensor[]", None)] + statics
        bwd_name = f"{namespace}::{opname}_backward"
        schema = self._schema(params, "Tensor[]")
        self.backward_op_def = torch.library.custom_op(bwd_name, self._off_device, mutates_args=(), schema=schema)
        self.backward_op_def.register_fake(lambda inputs, outputs, grads, *rest: [t.new_empty(t.shape) for t in inputs])
        self.backward_op = getattr(getattr(torch.ops, namespace), f"{opname}_backward").default
        self._register_pjrt(self.backward_op, Lowering(self._lowered_backward, user_code=True))
        self.custom_op.register_autograd(self._autograd_backward, setup_context=self._setup_context)

    def _split(self, args):
        tensors = [args[i] for i in self.tensor_positions]
        statics = [a for i, a in enumerate(args) if i not in self.tensor_positions]
        return tensors, statics

    def _setup_context(self, ctx, inputs, output):
        tensors, statics = self._split(list(inputs))
        outs = list(output) if isinstance(output, (tuple, list)) else [output]
        ctx.save_for_backward(*tensors, *outs)
        ctx.statics = statics
        ctx.n_inputs = len(tensors)

    def _autograd_backward(self, ctx, *grads):
        saved = ctx.saved_tensors
        inputs, outputs = list(saved[: ctx.n_inputs]), list(saved[ctx.n_inputs:])
        grads = [g if g is not None else torch.zeros_like(o) for g, o in zip(grads, outputs)]
        input_grads = self.backward_op(inputs, outputs, grads, *ctx.statics)
        result = [None] * len(self.params)
        for pos, t, g in zip(self.tensor_positions, inputs, input_grads):
            if t.dtype.is_floating_point or t.dtype.is_complex:
                result[pos] = g
        return tuple(result)

    def _full_args(self, tensors, statics):
        full, t_it, s_it = [], iter(tensors), iter(statics)
        for p in self.params:
            full.append(next(t_it) if p.is_tensor else next(s_it))
        return full

    def _lowered_backward(self, inputs, outputs, grads, *statics):
        inputs, outputs, grads = list(inputs), list(outputs), list(grads)
        if self.user_backward is not None:
            names = [p.name for p in self.params if not p.is_tensor]
            given = self.user_backward(tuple(inputs), tuple(outputs), tuple(grads), **dict(zip(names, statics)))
            given = list(given) if isinstance(given, (tuple, list)) else [given]
            if len(given) != len(inputs):
                raise RuntimeError(
                    f"torchpjrt kernel '{self.name}': backward returned {len(given)} gradients for {len(inputs)} tensor inputs"
                )
        else:
            given = self._vjp(inputs, grads, list(statics))
        return [jnp.zeros_like(x) if g is None else jnp.asarray(g).astype(x.dtype).reshape(x.shape)
                for x, g in zip(inputs, given)]

    def _vjp(self, inputs, grads, statics):
        diff = [i for i, x in enumerate(inputs) if jnp.issubdtype(x.dtype, jnp.inexact)]

        def differentiable(*xs):
            full = list(inputs)
            for i, x in zip(diff, xs):
                full[i] = x
            outs = self._outputs(self.fn(*self._full_args(full, statics)))
            return tuple(outs)

        _, pullback = jax.vjp(differentiable, *[inputs[i] for i in diff])
        cotangents = pullback(tuple(grads))
        given = [None] * len(inputs)
        for i, c in zip(diff, cotangents):
            given[i] = c
        return given
