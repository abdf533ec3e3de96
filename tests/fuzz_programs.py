"""Random PyTorch programs as data, and an interpreter that runs them on any device.

A `Program` is a tuple of `Step`s. Each step names an operation (`torch.add`, `.mul_`,
`F.gelu`, `op:+`, `[]=`...) and its arguments; `Ref(i)` stands for the i-th value produced
so far, `Lit` for a small literal tensor (indices, masks), `CpuScalar` for a 0-dim CPU tensor
and `Empty` for a fresh `out=` tensor. Programs are built by `programs()`, a hypothesis
strategy that runs every candidate step on the CPU while it builds, so it knows shapes, dtypes
and values and rarely emits an invalid program. `Program.to_python()` renders a program as
the PyTorch code it runs; `repr(program)` is a literal that rebuilds it (for regression lists).
"""

import dataclasses
import math
import operator
import re
import warnings

import torch
import torch.nn.functional as F
from hypothesis import strategies as st


# ---------------------------------------------------------------------------------------------
# Program data


@dataclasses.dataclass(frozen=True)
class Ref:
    """The value numbered `index` (values are numbered in the order steps produce them)."""

    index: int

    def __repr__(self):
        return f"Ref({self.index})"


@dataclasses.dataclass(frozen=True)
class Lit:
    """A literal tensor made on the program's device: `torch.tensor(values, dtype=dtype)`."""

    values: object
    dtype: torch.dtype = torch.int64

    def __repr__(self):
        return f"Lit({self.values!r}, {self.dtype!r})"


@dataclasses.dataclass(frozen=True)
class CpuScalar:
    """A 0-dim CPU tensor operand (allowed next to device tensors, as on CUDA)."""

    value: object
    dtype: torch.dtype

    def __repr__(self):
        return f"CpuScalar({self.value!r}, {self.dtype!r})"


@dataclasses.dataclass(frozen=True)
class Empty:
    """A fresh `torch.empty(0)` on the program's device, as an `out=` target to be resized."""

    dtype: torch.dtype

    def __repr__(self):
        return f"Empty({self.dtype!r})"


@dataclasses.dataclass(frozen=True)
class Step:
    op: str
    args: tuple = ()
    kwargs: tuple = ()  # ((name, value), ...)
    n_out: int = 1  # values appended to the program's values (0: a statement)
    keep: bool = True  # False: the values are dropped after their last use
    raises: str = None  # exception type name the step raises on CPU

    def __repr__(self):
        parts = [repr(self.op), _literal(self.args)]
        if self.kwargs:
            parts.append(f"kwargs={_literal(self.kwargs)}")
        if self.n_out != 1:
            parts.append(f"n_out={self.n_out}")
        if not self.keep:
            parts.append("keep=False")
        if self.raises:
            parts.append(f"raises={self.raises!r}")
        return f"Step({', '.join(parts)})"


def _literal(x):
    """repr() that reads back as Python (float('inf') rather than inf)."""
    if isinstance(x, float) and not math.isfinite(x):
        return f"float('{x}')"
    if isinstance(x, tuple):
        inner = ", ".join(_literal(v) for v in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if isinstance(x, list):
        return "[" + ", ".join(_literal(v) for v in x) + "]"
    if isinstance(x, slice):
        return f"slice({_literal(x.start)}, {_literal(x.stop)}, {_literal(x.step)})"
    return repr(x)


@dataclasses.dataclass(frozen=True)
class Program:
    steps: tuple

    def __repr__(self):
        inner = "".join(f"\n    {s!r}," for s in self.steps)
        return f"Program(({inner}\n))"

    def _repr_pretty_(self, printer, cycle):  # hypothesis prints falsifying examples this way
        printer.text(repr(self))

    def last_uses(self):
        """Step number of the last use of each value."""
        last = {}
        for k, step in enumerate(self.steps):
            for r in _refs((step.args, step.kwargs)):
                last[r.index] = k
        return last

    def drops(self):
        """{step number: values to drop after it}: values of keep=False steps, after last use."""
        last = self.last_uses()
        out = {}
        index = 0
        for k, step in enumerate(self.steps):
            for i in range(index, index + step.n_out):
                if not step.keep:
                    out.setdefault(max(last.get(i, k), k), []).append(i)
            index += step.n_out
        return out

    def to_python(self):
        lines = [
            "import torch",
            "import torch.nn.functional as F",
            "",
            'dev = "pjrt"  # run again with dev = "cpu" and compare',
            "reads = []",
        ]
        drops = self.drops()
        index = 0
        for k, step in enumerate(self.steps):
            names = [f"v{i}" for i in range(index, index + step.n_out)]
            code = render_step(step, names)
            if step.raises:
                lines.append(f"try:  # raises {step.raises} on CPU")
                lines.extend("    " + c for c in code.splitlines())
                lines.append(f"except {step.raises}:\n    pass")
            else:
                lines.append(code)
            if k in drops:
                lines.append("del " + ", ".join(f"v{i}" for i in drops[k]))
            index += step.n_out
        return "\n".join(lines)


def _refs(x):
    if isinstance(x, Ref):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _refs(v)
    elif isinstance(x, slice):
        yield from _refs((x.start, x.stop, x.step))


# ---------------------------------------------------------------------------------------------
# Rendering


def render_value(x, in_key=False):
    if isinstance(x, Ref):
        return f"v{x.index}"
    if isinstance(x, Lit):
        inferred = torch.tensor(x.values).dtype  # an empty list would be float32
        dtype = "" if inferred == x.dtype else f", dtype={x.dtype}"
        return f"torch.tensor({x.values!r}{dtype}, device=dev)"
    if isinstance(x, CpuScalar):
        return f"torch.tensor({x.value!r}, dtype={x.dtype})"
    if isinstance(x, Empty):
        return f"torch.empty(0, dtype={x.dtype}, device=dev)"
    if isinstance(x, torch.dtype):
        return str(x)
    if x is Ellipsis:
        return "..."
    if isinstance(x, slice):
        if not in_key:
            return repr(x)
        parts = ["" if v is None else render_value(v) for v in (x.start, x.stop, x.step)]
        text = f"{parts[0]}:{parts[1]}"
        return text + (f":{parts[2]}" if parts[2] else "")
    if isinstance(x, tuple):
        inner = ", ".join(render_value(v, in_key) for v in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if isinstance(x, list):
        return "[" + ", ".join(render_value(v) for v in x) + "]"
    return _literal(x)


def _render_key(key):
    if isinstance(key, tuple):
        return ", ".join(render_value(k, in_key=True) for k in key) if key else "()"
    return render_value(key, in_key=True)


_OPERATORS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod, "**": operator.pow, "@": operator.matmul,
    "&": operator.and_, "|": operator.or_, "^": operator.xor, "<": operator.lt,
    "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
}
_UNARY_OPERATORS = {"neg": (operator.neg, "-"), "invert": (operator.invert, "~")}


def render_call(step):
    op, args = step.op, step.args
    a = [render_value(v) for v in args] + [f"{k}={render_value(v)}" for k, v in step.kwargs]
    if op == "input":
        shape, dtype, seed = args
        return f"make_input({shape!r}, {dtype}, seed={seed}" + "".join(
            f", {k}={v!r}" for k, v in step.kwargs) + ")"
    if op.startswith("op:"):
        sym = op[3:]
        if sym in _UNARY_OPERATORS:
            return f"{_UNARY_OPERATORS[sym][1]}{a[0]}"
        return f"{a[0]} {sym} {a[1]}"
    if op == "[]":
        return f"{a[0]}[{_render_key(args[1])}]"
    if op == "[]=":
        return f"{a[0]}[{_render_key(args[1])}] = {a[2]}"
    if op == "[]+=":
        return f"{a[0]}[{_render_key(args[1])}] += {a[2]}"
    if op == "read":
        return f"reads.append({a[0]}.tolist())"
    if op == "backward":
        return "(" + " + ".join(f"{v}.sum()" for v in a) + ").backward()"
    if op.startswith("."):
        return f"{a[0]}{op}({', '.join(a[1:])})"
    if op.endswith("[0]"):
        return f"{op[:-3]}({', '.join(a)})[0]"
    return f"{op}({', '.join(a)})"


SEQUENCE_OPS = {".split", ".chunk", ".unbind"}


def render_step(step, names):
    call = render_call(step)
    if not names or step.raises:
        return call
    sequence = step.op in SEQUENCE_OPS or (step.op == "torch.where" and len(step.args) == 1)
    return f"{', '.join(names)}{',' if sequence and len(names) == 1 else ''} = {call}"


# ---------------------------------------------------------------------------------------------
# Running


def make_input(shape, dtype, seed, requires_grad=False, special=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 2
        if special and t.numel():
            flat = t.view(-1)
            picks = torch.randint(0, flat.numel(), (2,), generator=g)
            specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0], dtype=torch.float64)
            flat[picks] = specials[torch.randint(0, 5, (2,), generator=g)]
        t = t.to(dtype)
    else:
        t = torch.randint(-6, 7, shape, generator=g).to(dtype)
    t = t.to(device)
    return t.requires_grad_() if requires_grad else t


def _resolve(x, env, device):
    if isinstance(x, Ref):
        return env[x.index]
    if isinstance(x, Lit):
        return torch.tensor(x.values, dtype=x.dtype, device=device)
    if isinstance(x, CpuScalar):
        return torch.tensor(x.value, dtype=x.dtype)
    if isinstance(x, Empty):
        return torch.empty(0, dtype=x.dtype, device=device)
    if isinstance(x, tuple):
        return tuple(_resolve(v, env, device) for v in x)
    if isinstance(x, list):
        return [_resolve(v, env, device) for v in x]
    if isinstance(x, slice):
        return slice(*(_resolve(v, env, device) for v in (x.start, x.stop, x.step)))
    return x


def _attr(root, dotted):
    for name in dotted.split("."):
        root = getattr(root, name)
    return root


def execute(step, env, device, reads):
    """Run one step; return the list of the values it produces."""
    op = step.op
    if op == "input":
        shape, dtype, seed = step.args
        return [make_input(shape, dtype, seed, device=device, **dict(step.kwargs))]
    args = _resolve(step.args, env, device)
    kwargs = {k: _resolve(v, env, device) for k, v in step.kwargs}
    if op.startswith("op:"):
        sym = op[3:]
        result = _UNARY_OPERATORS[sym][0](*args) if sym in _UNARY_OPERATORS else _OPERATORS[sym](*args)
    elif op == "[]":
        result = args[0][args[1]]
    elif op == "[]=":
        args[0][args[1]] = args[2]
        result = None
    elif op == "[]+=":
        args[0][args[1]] += args[2]
        result = None
    elif op == "read":
        reads.append((args[0].dtype, args[0].tolist()))
        result = None
    elif op == "backward":
        loss = args[0].sum()
        for t in args[1:]:
            loss = loss + t.sum()
        loss.backward()
        result = None
    elif op.startswith("."):
        result = getattr(args[0], op[1:])(*args[1:], **kwargs)
    elif op.startswith("F."):
        result = _attr(F, op[2:])(*args, **kwargs)
    elif op.startswith("torch."):
        first_only = op.endswith("[0]")
        result = _attr(torch, op[6:-3] if first_only else op[6:])(*args, **kwargs)
        if first_only:
            result = result[0]
    else:
        raise ValueError(f"unknown step op {op!r}")
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    return list(result)


class StepFailed(Exception):
    """A step raised where CPU did not (or the program's expectation was not met)."""


@dataclasses.dataclass
class RunResult:
    values: dict  # value index -> tensor, for the values the program keeps
    grads: dict  # input value index -> .grad
    reads: list  # (dtype, tolist()) of each read step
    errors: dict  # step number -> exception type name (None: it did not raise)
    # value index -> the least precise float dtype its storage's contents were computed from
    # (a float64 result of float32 operands carries float32 rounding); "grads": the program's
    precision: dict


_LOOSENESS = {torch.float64: 0, torch.float32: 1, torch.bfloat16: 2}


def loosest(*dtypes):
    floats = [d for d in dtypes if d in _LOOSENESS]
    return max(floats, key=_LOOSENESS.get) if floats else None


def _storage_key(t):
    return t.untyped_storage().data_ptr(), t.device.type


def run_program(program, device):
    env, reads, errors = {}, [], {}
    drops = program.drops()
    inputs = []
    index = 0
    precision = {}  # storage key -> loosest float dtype that flowed into it
    everything = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, step in enumerate(program.steps):
            if step.raises:
                try:
                    execute(step, env, device, reads)
                    errors[k] = None
                except Exception as e:  # noqa: BLE001 - any type; compared with CPU's
                    errors[k] = type(e).__name__
            else:
                try:
                    produced = execute(step, env, device, reads)
                except Exception as e:
                    raise StepFailed(f"step {k} ({render_call(step)}) raised on {device}: "
                                     f"{type(e).__name__}: {e}") from e
                if len(produced) != step.n_out:
                    raise StepFailed(f"step {k} produced {len(produced)} values, expected {step.n_out}")
                operands = [env[r.index] for r in _refs((step.args, step.kwargs))]
                feeding = loosest(*(precision.get(_storage_key(t)) for t in operands))
                written = produced + (operands[:1] if step.op in ("[]=", "[]+=") else [])
                for t in written:
                    key = _storage_key(t)
                    precision[key] = loosest(precision.get(key), feeding, t.dtype)
                everything = loosest(everything, *(precision[_storage_key(t)] for t in written))
                for v in produced:
                    env[index] = v
                    if step.op == "input":
                        inputs.append(index)
                    index += 1
            for i in drops.get(k, ()):
                env.pop(i, None)
        grads = {i: env[i].grad for i in inputs if i in env and env[i].requires_grad}
        kept = {i: precision.get(_storage_key(t)) for i, t in env.items()}
    return RunResult(env, grads, reads, errors, {**kept, "grads": everything})


# ---------------------------------------------------------------------------------------------
# Building programs


INPUT_DTYPES = (torch.float32, torch.int64, torch.float64, torch.bool, torch.bfloat16)
SCALARS = (2, 0.5, -1, True, 3, -2.5, 0, 1.5, -3, 0.25, False, 10)

# CPU errors a candidate step is dropped for, rather than kept as an expected error: those
# that depend on tensor values (a device cannot raise them without a host sync), and CPU
# kernels' missing dtypes ("not implemented for 'Float'") and index assignments whose value
# does not fit, where pjrt raises another type (known divergences, in test_fuzz.REGRESSIONS).
_NOT_KEPT_ERRORS = re.compile(
    r"ZeroDivisionError|out of bounds|out of range|must be in range|index \S+ is out|"
    r"Integers to negative|invalid argument \d+: index|masked_scatter|Number of elements|"
    r"shape mismatch: value tensor|not implemented for '",
    re.IGNORECASE,
)


def _overlap(t):
    # 0: no internal overlap, 1: overlap, 2: too hard to tell (writes then depend on order)
    return torch._debug_has_internal_overlap(t)


def _castable_to_int(t):
    """Whether converting t to an integer dtype is defined (finite, in int32 range)."""
    if not t.dtype.is_floating_point:
        return True
    d = t.detach().double()
    return bool(torch.isfinite(d).all()) and bool((d.abs() < 2**31).all())


class Builder:
    def __init__(self, draw):
        self.draw = draw
        self.steps = []
        self.values = []  # CPU value of each value index
        self.reads = []
        # values from split/chunk/unbind that require grad: writing into their storages makes
        # pjrt raise at the next use of such a view (known, in test_fuzz.REGRESSIONS)
        self.split_values = []

    @property
    def split_storages(self):
        """The storages of split_values, keyed from the live values: a key kept from an earlier
        run (before a replay) could name a freed address that a new storage reuses, and the
        candidates, hence the draws, would then depend on the allocator."""
        return {_storage_key(self.values[i]) for i in self.split_values}

    # -- drawing helpers ----------------------------------------------------------------------

    def choice(self, options):
        return self.draw(st.sampled_from(options))

    def int(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    def flag(self, one_in=2):
        """True with probability 1/one_in; shrinks to False."""
        return self.draw(st.integers(0, one_in - 1)) == one_in - 1

    def size(self):
        v = self.int(0, 12)  # mostly 1..4, sometimes 0; shrinks to 1
        return 0 if v == 12 else 1 + v % 4

    def shape(self, max_ndim=3):
        return tuple(self.size() for _ in range(self.int(0, max_ndim)))

    def candidates(self, pred=lambda t: True):
        return [i for i, v in enumerate(self.values) if isinstance(v, torch.Tensor) and pred(v)]

    def pick(self, pred=lambda t: True, prefer=None):
        """A Ref to a value satisfying pred (preferring `prefer` half the time), or None."""
        cands = self.candidates(pred)
        if not cands:
            return None
        if prefer is not None:
            preferred = [i for i in cands if prefer(self.values[i])]
            if preferred and self.flag():
                cands = preferred
        return Ref(cands[self.int(0, len(cands) - 1)] if len(cands) > 1 else cands[0])

    def val(self, ref):
        return self.values[ref.index]

    # -- adding steps -------------------------------------------------------------------------

    def add(self, step):
        """Run `step` on CPU; append it if it works (or, sometimes, as a step expected to raise
        when CPU raises for its shapes or dtypes). Returns its values' Refs, or None."""
        # on values fresh from a replay: the generator's own looks at values (`t.is_leaf` of a
        # view whose base changed in place refreshes its autograd metadata) must not change
        # what the step does
        self._replay()
        env = dict(enumerate(self.values))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                produced = execute(step, env, "cpu", self.reads)
        except Exception as e:  # noqa: BLE001
            message = f"{type(e).__name__}: {e}"
            # an in-place op whose tensor operand promotes past the target's dtype does not
            # raise on pjrt (known, in test_fuzz.REGRESSIONS)
            uncastable = "can't be cast to the desired output type" in message and any(
                True for _ in _refs((step.args[1:], step.kwargs)))
            if not _NOT_KEPT_ERRORS.search(message) and not uncastable and self.flag(3):
                self.steps.append(dataclasses.replace(step, n_out=0, keep=True, raises=type(e).__name__))
            self._replay()  # an op can fail halfway (after a write, or autograd's bookkeeping)
            return None
        if step.op in ("[]=", "[]+=", "read", "backward"):
            self.steps.append(dataclasses.replace(step, n_out=0))
            return []
        if not all(isinstance(v, torch.Tensor) for v in produced):
            return None
        keep = step.op == "input" or not self.flag(4)
        first = len(self.values)
        if step.op in SEQUENCE_OPS and any(t.requires_grad for t in produced):
            self.split_values.extend(range(first, first + len(produced)))
        self.steps.append(dataclasses.replace(step, n_out=len(produced), keep=keep))
        self.values.extend(produced)
        return [Ref(first + i) for i in range(len(produced))]

    def _replay(self):
        values, env = [], {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in self.steps:
                try:
                    produced = execute(step, env, "cpu", [])
                except Exception:  # noqa: BLE001 - a step kept as expected to raise
                    continue
                for v in produced:
                    env[len(values)] = v
                    values.append(v)
        self.values = values

    def new_input(self, shape=None, dtype=None, requires_grad=None):
        shape = self.shape() if shape is None else tuple(shape)
        dtype = self.choice(INPUT_DTYPES) if dtype is None else dtype
        kwargs = []
        if dtype.is_floating_point:
            if requires_grad is None:
                requires_grad = self.flag()
            if requires_grad:
                kwargs.append(("requires_grad", True))
            if self.flag(8):
                kwargs.append(("special", True))
        return self.add(Step("input", (shape, dtype, self.int(0, 999)), tuple(kwargs)))[0]

    def program(self):
        return Program(tuple(self.steps))

    # -- operands -----------------------------------------------------------------------------

    def broadcastable_shape(self, shape, into=False):
        """A shape that broadcasts with `shape` (into=True: broadcasts *to* `shape`)."""
        n = len(shape)
        keep = self.int(0, n)
        out = []
        for d in shape[n - keep:]:
            r = self.int(0, 3)
            if r == 1:
                out.append(1)
            elif r == 2 and d == 1 and not into:
                out.append(self.int(2, 3))
            else:
                out.append(d)
        if not into and self.flag(5):
            out.insert(0, self.int(1, 2))
        return tuple(out)

    def operand(self, like, into=False, tensor_only=False, dtype=None, cpu_scalar=True):
        """Second operand for `like`: a value, a new input, a Python scalar or a CPU scalar."""
        shape = tuple(like.shape)
        kind = self.int(0, 1 if tensor_only else 3 if cpu_scalar else 2)
        if kind == 0:
            def fits(t):
                try:
                    b = torch.broadcast_shapes(shape, t.shape)
                except RuntimeError:
                    return False
                return b == shape if into else True
            ref = self.pick(lambda t: fits(t) and (dtype is None or t.dtype == dtype))
            if ref is not None:
                return ref
        if kind <= 1:
            same_dtype = dtype or (like.dtype if self.flag() else None)
            return self.new_input(self.broadcastable_shape(shape, into), same_dtype)
        if kind == 2:
            return self.choice(SCALARS)
        return CpuScalar(self.choice((2.0, -0.5, 3, 1.25)), self.choice((torch.float64, torch.int64, torch.float32)))

    def index_list(self, n, unique):
        """Indices into a dim of size n (some negative), duplicates allowed unless unique."""
        if n == 0:
            return []
        if unique:
            count = self.int(1, n)
            perm = self.draw(st.permutations(range(n)))[:count]
        else:
            perm = [self.int(0, n - 1) for _ in range(self.int(1, 4))]
        return [i - n if self.flag(4) else i for i in perm]

    def mask_like(self, shape):
        """A bool mask of `shape`: an existing bool value of that shape or a literal."""
        ref = self.pick(lambda t: t.dtype == torch.bool and tuple(t.shape) == tuple(shape))
        if ref is not None and self.flag():
            return ref
        # one draw (a seed) rather than one per element keeps the choice sequence short
        g = torch.Generator().manual_seed(self.int(0, 999))
        return Lit(torch.randint(0, 2, shape, generator=g).bool().tolist(), torch.bool)


# ---------------------------------------------------------------------------------------------
# Step families


UNARY = (
    "torch.abs", "torch.neg", "torch.exp", "torch.log", "torch.sqrt", "torch.sin", "torch.cos",
    "torch.tanh", "torch.sigmoid", "torch.floor", "torch.ceil", "torch.round", "torch.trunc",
    "torch.frac", "torch.sign", "torch.sgn", "torch.reciprocal", "torch.rsqrt", "torch.square",
    "torch.relu", "torch.logical_not", "torch.bitwise_not", "torch.isnan", "torch.isinf",
    "torch.isfinite", "torch.signbit", "torch.log1p", "torch.expm1", "torch.exp2", "torch.log2",
    "torch.atan", "torch.asin", "torch.sinh", "torch.asinh", "torch.erf", "torch.erfc",
    "torch.lgamma", "torch.nan_to_num", "torch.positive", "torch.clone", "torch.sinc",
    "torch.deg2rad", "op:neg", "op:invert", ".contiguous", ".float", ".double", ".long", ".bool",
    ".bfloat16", "F.gelu", "F.silu", "F.softplus", "F.elu", "F.leaky_relu", "F.hardtanh",
    "F.relu6", "F.mish", "F.hardswish", "F.logsigmoid", "F.softsign",
)
# unary ops with a dim or other parameters
UNARY_WITH_ARGS = (
    "torch.clamp", "torch.round", "F.softmax", "F.log_softmax", "torch.cumsum", "torch.cumprod",
    "torch.logcumsumexp", "torch.cummax", "torch.flip", "torch.roll", "torch.tril", "torch.triu",
    "torch.nan_to_num", ".to", "torch.sort", "torch.topk", "F.normalize", "F.layer_norm",
)
TO_INT = {".long", ".bool"}


def _dim(b, t):
    return b.int(-t.dim(), t.dim() - 1) if t.dim() else None


def gen_unary(b):
    ref = b.pick()
    t = b.val(ref)
    if b.flag(3):
        op = b.choice(UNARY_WITH_ARGS)
        args, kwargs = (), ()
        d = _dim(b, t)
        if op == "torch.clamp":
            lo, hi = b.choice((-0.5, 0, None, -2)), b.choice((1.0, None, 2, 0.5))
            if lo is None and hi is None:
                return None  # pjrt raises ValueError, CPU RuntimeError (known, in test_fuzz.REGRESSIONS)
            kwargs = (("min", lo), ("max", hi))
        elif op == "torch.round":
            kwargs = (("decimals", b.choice((1, 2, -1))),)
        elif op in ("F.softmax", "F.log_softmax", "torch.cumsum", "torch.cumprod", "torch.logcumsumexp",
                    "torch.cummax"):
            # softmax of an empty non-float tensor works on CPU only because its kernel (which
            # checks the dtype) never runs
            if d is None or (op in ("F.softmax", "F.log_softmax") and not t.dtype.is_floating_point):
                return None
            args = (d,)
            if op in ("torch.cumsum", "torch.cumprod") and b.flag(4):
                kwargs = (("dtype", b.choice((torch.float64, torch.int64, torch.float32))),)
        elif op == "torch.flip":
            args = (tuple(sorted({b.int(0, max(t.dim() - 1, 0)) for _ in range(b.int(1, 2))})),)
        elif op == "torch.roll":
            args = (b.int(-3, 3),) if d is None or b.flag(3) else (b.int(-3, 3), d)
        elif op in ("torch.tril", "torch.triu"):
            args = (b.int(-2, 2),)
        elif op == "torch.nan_to_num":
            kwargs = (("nan", 0.5), ("posinf", b.choice((100.0, None))), ("neginf", -7.0))
        elif op == ".to":
            dtype = b.choice(INPUT_DTYPES)
            if dtype == torch.int64 and not _castable_to_int(t):
                return None
            args = (dtype,)
        elif op == "torch.sort":
            kwargs = (("dim", d if d is not None else -1), ("descending", b.flag()), ("stable", True))
        elif op == "torch.topk":
            if d is None or t.shape[d] == 0 or t.dtype == torch.bool:  # bool: CPU only lacks it
                return None
            # indices of equal values are unspecified: keep the values only
            return Step("torch.topk[0]", (ref, b.int(1, t.shape[d]), d), (("largest", b.flag()),))
        elif op == "F.normalize":
            kwargs = (("dim", d if d is not None else 0),)
        elif op == "F.layer_norm":
            if not t.dim():
                return None
            args = (tuple(t.shape[-b.int(1, t.dim()):]),)
        return Step(op, (ref, *args), kwargs)
    op = b.choice(UNARY)
    if op in TO_INT and op != ".bool" and not _castable_to_int(t):
        return None
    if op == "F.gelu" and t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
        return None  # CPU's vectorized gelu gives NaN at +-inf (a CPU quirk)
    return Step(op, (ref,))


BINARY = (
    "torch.add", "torch.sub", "torch.mul", "torch.div", "torch.floor_divide", "torch.remainder",
    "torch.fmod", "torch.pow", "torch.maximum", "torch.minimum", "torch.fmax", "torch.fmin",
    "torch.atan2", "torch.hypot", "torch.copysign", "torch.eq", "torch.ne", "torch.lt", "torch.le",
    "torch.gt", "torch.ge", "torch.logical_and", "torch.logical_or", "torch.logical_xor",
    "torch.bitwise_and", "torch.bitwise_or", "torch.bitwise_xor", "torch.xlogy", "torch.logaddexp",
    "torch.heaviside", "torch.true_divide", "op:+", "op:-", "op:*", "op:/", "op://", "op:%",
    "op:**", "op:&", "op:|", "op:^", "op:<", "op:<=", "op:>", "op:>=", "op:==", "op:!=",
)
# a 0-dim CPU tensor operand fails there on pjrt (known, in test_fuzz.REGRESSIONS)
NO_CPU_SCALAR = {"torch.copysign", ".copysign_"}
TENSOR_ONLY = {"torch.maximum", "torch.minimum", "torch.fmax", "torch.fmin", "torch.atan2",
               "torch.hypot", "torch.logaddexp", "torch.heaviside"}


def gen_binary(b):
    ref = b.pick()
    op = b.choice(BINARY)
    other = b.operand(b.val(ref), tensor_only=op in TENSOR_ONLY, cpu_scalar=op not in NO_CPU_SCALAR)
    if op in ("torch.pow", "op:**") and isinstance(other, bool):
        return None  # bool ** False: pjrt's result dtype is int64 (known, in test_fuzz.REGRESSIONS)
    # a CPU scalar first fails for some ops (known, in test_fuzz.REGRESSIONS): not swapped
    swappable = isinstance(other, Ref) or (op.startswith("op:") and not isinstance(other, CpuScalar))
    args = (other, ref) if swappable and b.flag(4) else (ref, other)
    kwargs = ()
    if op in ("torch.add", "torch.sub") and b.flag(4):
        # a float alpha with integer tensors: CPU raises RuntimeError, pjrt's meta check
        # ValueError (known, in test_fuzz.REGRESSIONS)
        floats = any(isinstance(a, Ref) and b.val(a).dtype.is_floating_point for a in args)
        kwargs = (("alpha", b.choice((2, -1, 0.5) if floats else (2, -1))),)
    elif op == "torch.div" and b.flag(3):
        kwargs = (("rounding_mode", b.choice(("floor", "trunc"))),)
    return Step(op, args, kwargs)


def _broadcasts(a, b):
    try:
        torch.broadcast_shapes(a, b)
        return True
    except RuntimeError:
        return False


def gen_ternary(b):
    ref = b.pick()
    t = b.val(ref)
    op = b.choice(("torch.where", "torch.lerp", "torch.addcmul", "torch.addcdiv", "torch.clamp"))
    if op == "torch.where":
        cond = b.pick(lambda c: c.dtype == torch.bool and _broadcasts(c.shape, t.shape))
        if cond is None:
            cond = b.new_input(b.broadcastable_shape(tuple(t.shape)), torch.bool)
        other = b.operand(t)
        return Step(op, (cond, ref, other) if b.flag() else (cond, other, ref))
    if op == "torch.clamp":  # tensor bounds
        return Step(op, (ref,), (("min", b.operand(t, tensor_only=True)), ("max", b.operand(t, tensor_only=True))))
    x, y = b.operand(t, tensor_only=True), b.operand(t, tensor_only=True)
    if op == "torch.lerp":
        return Step(op, (ref, x, b.choice((0.25, 0.75)) if b.flag() else y))
    return Step(op, (ref, x, y), (("value", b.choice((1, 0.5, -2))),))


REDUCTIONS = (
    "torch.sum", "torch.mean", "torch.prod", "torch.amax", "torch.amin", "torch.max", "torch.min",
    "torch.argmax", "torch.argmin", "torch.any", "torch.all", "torch.std", "torch.var",
    "torch.logsumexp", "torch.norm", "torch.count_nonzero", "torch.nansum", "torch.nanmean",
    "torch.aminmax", "torch.var_mean",
)
TUPLE_DIM = {"torch.sum", "torch.mean", "torch.amax", "torch.amin", "torch.std", "torch.var",
             "torch.logsumexp", "torch.nansum", "torch.nanmean", "torch.count_nonzero", "torch.norm",
             "torch.any", "torch.all", "torch.var_mean"}
NEEDS_DIM = {"torch.logsumexp"}
NO_KEEPDIM = {"torch.count_nonzero"}


def gen_reduction(b):
    ref = b.pick()
    t = b.val(ref)
    op = b.choice(REDUCTIONS)
    if t.numel() == 0 and op in ("torch.amax", "torch.amin", "torch.argmax", "torch.argmin", "torch.aminmax"):
        return None  # pjrt raises RuntimeError where CPU raises IndexError (test_fuzz.REGRESSIONS)
    kwargs = []
    r = b.int(0, 2)
    if t.dim() == 0 or (r == 0 and op not in NEEDS_DIM):
        dim = None
    elif r == 1 or op not in TUPLE_DIM:
        dim = _dim(b, t)
    else:
        dim = tuple(sorted({b.int(0, t.dim() - 1) for _ in range(b.int(1, t.dim()))}))
    if dim is None and op in NEEDS_DIM:
        dim = 0 if t.dim() else ()
    args = [ref]
    if dim is not None:
        if op in ("torch.max", "torch.min"):
            args.append(dim)
        else:
            kwargs.append(("dim", dim))
        if op not in NO_KEEPDIM and b.flag():
            kwargs.append(("keepdim", True))
    if op in ("torch.std", "torch.var", "torch.var_mean") and b.flag():
        kwargs.append(("correction", b.choice((0, 2))))
    if op == "torch.norm" and b.flag():
        # no inf-norm of empty tensors: a known PyTorch meta-check bug (test_fuzz.REGRESSIONS)
        p_choices = (1, 3, float("inf")) if dim is not None and t.numel() else (1, 3)
        kwargs.insert(0, ("p", b.choice(p_choices)))
    if op in ("torch.sum", "torch.prod", "torch.mean") and b.flag(5):
        dtype = b.choice((torch.float64, torch.float32, torch.int64))
        if dtype.is_floating_point or _castable_to_int(t):  # NaN -> int64 is undefined
            kwargs.append(("dtype", dtype))
    if op == "torch.var_mean" and t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
        return None  # CPU's Welford mean of infinities is NaN or inf depending on their position
    return Step(op, tuple(args), tuple(kwargs))


def gen_matmul(b):
    ref = b.pick(lambda t: 1 <= t.dim() <= 3, prefer=lambda t: t.dtype.is_floating_point)
    if ref is None:
        return None
    t = b.val(ref)
    # mixed dtypes raise, except on CPU when a tensor is empty (its kernel never runs)
    dtype = t.dtype if b.int(0, 5) or t.numel() == 0 else None
    n = b.int(1, 4)
    if t.dim() == 1:
        op = b.choice(("torch.matmul", "op:@", "torch.dot", "torch.outer"))
        k = t.shape[0]
        shape = {"torch.dot": (k,), "torch.outer": (n,)}.get(op, b.choice(((k,), (k, n), (2, k, n))))
    elif t.dim() == 2:
        op = b.choice(("torch.matmul", "op:@", "torch.mm", "torch.mv", "torch.addmm", "F.linear"))
        m, k = t.shape
        shape = {"torch.mv": (k,), "F.linear": (n, k)}.get(op, (k, n) if op != "torch.matmul" or b.flag(4)
                                                             else b.choice(((k,), (3, k, n))))
    else:
        op = b.choice(("torch.matmul", "op:@", "torch.bmm", "torch.baddbmm"))
        bt, m, k = t.shape
        shape = (bt, k, n) if op != "torch.matmul" or b.flag() else (k, n)
    other = b.pick(lambda v: tuple(v.shape) == shape and (dtype is None or v.dtype == dtype))
    if other is None:
        other = b.new_input(shape, dtype)
    if op in ("torch.addmm", "torch.baddbmm"):
        out_shape = (t.shape[0], n) if op == "torch.addmm" else (t.shape[0], t.shape[1], n)
        bias = b.new_input(b.broadcastable_shape(out_shape, into=True), dtype)
        kwargs = (("beta", b.choice((1, 0.5))), ("alpha", b.choice((1, 2))))
        return Step(op, (bias, ref, other), kwargs)
    if op == "F.linear" and b.flag():
        return Step(op, (ref, other, b.new_input((n,), dtype)))
    return Step(op, (ref, other))


def _factorizations(shape):
    numel = math.prod(shape)
    out = [(-1,), (numel,)]
    for d in range(1, max(numel, 1) + 1):
        if numel % d == 0:
            out.append((d, -1))
            out.append((numel // d, d, 1) if numel else (0, d))
    if shape:
        out.append(tuple(shape[::-1]))
        out.append((1, *shape))
    return out


VIEWS = ("slice", "transpose", "permute", "view", "reshape", "unsqueeze", "squeeze", "narrow",
         "select", "expand", "diagonal", "unfold", "as_strided", "split", "flatten", "unflatten",
         "t", "mT", "movedim", "detach", "unbind", "chunk", "view_as")


def gen_view(b):
    ref = b.pick()
    t = b.val(ref)
    kind = b.choice(VIEWS)
    nd = t.dim()
    if kind == "slice":
        key = []
        for d in range(min(nd, b.int(1, 3))):
            n = t.shape[d]
            r = b.int(0, 4)
            if r == 1 or n == 0:
                key.append(slice(None))
            elif r == 2:
                key.append(b.int(-n, n - 1))
            elif r == 3:
                key.append(None)
            else:
                start, stop = b.int(-n, n - 1), b.choice((None, n, n - 1, -1, 1))
                key.append(slice(start if b.flag() else None, stop, b.choice((None, 2, 3))))
        if b.flag(4):
            key.insert(0 if b.flag() else len(key), Ellipsis)
        return Step("[]", (ref, tuple(key) if len(key) != 1 or b.flag() else key[0]))
    if kind == "view_as":
        other = b.pick(lambda v: v.numel() == t.numel())
        return Step(".view_as", (ref, other)) if other is not None else None
    if kind == "detach":
        return Step(".detach", (ref,))
    if nd == 0 and kind not in ("view", "reshape", "unsqueeze", "expand", "as_strided", "squeeze", "flatten"):
        return None
    d = _dim(b, t)
    if kind == "transpose":
        return Step(".transpose", (ref, d, _dim(b, t)))
    if kind == "permute":
        return Step(".permute", (ref, tuple(b.draw(st.permutations(range(nd))))))
    if kind in ("view", "reshape"):
        return Step("." + kind, (ref, b.choice(_factorizations(tuple(t.shape)))))
    if kind == "unsqueeze":
        return Step(".unsqueeze", (ref, b.int(-nd - 1, nd)))
    if kind == "squeeze":
        return Step(".squeeze", (ref,) if nd == 0 or b.flag() else (ref, d))
    if kind == "narrow":
        n = t.shape[d]
        start = b.int(0, n)
        return Step(".narrow", (ref, d, start, b.int(0, n - start)))
    if kind == "select":
        n = t.shape[d]
        return Step(".select", (ref, d, b.int(-n, n - 1))) if n else None
    if kind == "expand":
        grown = [s if s != 1 or not b.flag() else b.int(2, 3) for s in t.shape]
        sizes = [-1 if s == old and b.flag(3) else s for s, old in zip(grown, t.shape)]
        leading = [b.int(1, 3)] if b.flag(3) else []
        return Step(".expand", (ref, tuple(leading + sizes)))
    if kind == "diagonal":
        if nd < 2:
            return None
        d1 = b.int(0, nd - 1)
        d2 = b.choice([x for x in range(nd) if x != d1])
        return Step(".diagonal", (ref,), (("offset", b.int(-2, 2)), ("dim1", d1), ("dim2", d2)))
    if kind == "unfold":
        n = t.shape[d]
        return Step(".unfold", (ref, d, b.int(0, n) if n else 0, b.int(1, 3)))
    if kind == "as_strided":  # within the storage
        storage = t.untyped_storage().nbytes() // t.element_size()
        size = tuple(b.int(1, 3) for _ in range(b.int(1, 2)))
        stride = tuple(b.int(0, 3) for _ in size)
        extent = sum((s - 1) * st_ for s, st_ in zip(size, stride))
        if extent >= storage:
            return None
        offset = b.int(0, storage - 1 - extent)
        return Step(".as_strided", (ref, size, stride, offset))
    if kind == "split":
        return Step(".split", (ref, b.int(1, 3), d))
    if kind == "chunk":
        return Step(".chunk", (ref, b.int(1, 3), d))
    if kind == "unbind":
        return Step(".unbind", (ref, d))
    if kind == "flatten":
        if nd == 0:
            return Step(".flatten", (ref,))
        s = b.int(0, nd - 1)
        return Step(".flatten", (ref, s, b.int(s, nd - 1)))
    if kind == "unflatten":
        n = t.shape[d]
        sizes = b.choice([(f, -1) for f in range(1, n + 1) if n % f == 0] or [(0, -1)])
        return Step(".unflatten", (ref, d, sizes))
    if kind == "t":
        return Step(".t", (ref,)) if nd <= 2 else None
    if kind == "mT":
        return Step(".transpose", (ref, -2, -1)) if nd >= 2 else None
    if kind == "movedim":
        return Step(".movedim", (ref, d, _dim(b, t)))
    return None


INPLACE_UNARY = (".zero_", ".neg_", ".abs_", ".exp_", ".sqrt_", ".floor_", ".sigmoid_", ".relu_",
                 ".tanh_", ".round_", ".reciprocal_", ".sin_", ".square_", ".trunc_", ".sign_",
                 ".logical_not_", ".bitwise_not_", ".nan_to_num_", ".t_", ".unsqueeze_", ".squeeze_",
                 ".tril_", ".triu_", ".fill_diagonal_", ".clamp_", ".fill_", ".cumsum_")
INPLACE_BINARY = (".add_", ".sub_", ".mul_", ".div_", ".pow_", ".remainder_", ".fmod_", ".copy_",
                  ".clamp_min_", ".clamp_max_", ".lerp_", ".addcmul_", ".bitwise_and_", ".logical_or_",
                  ".maximum", ".masked_fill_", ".masked_scatter_", ".index_fill_", ".index_add_",
                  ".index_copy_", ".scatter_", ".scatter_add_", ".index_put_", ".put_", ".floor_divide_",
                  ".copysign_", ".atan2_", ".hypot_", ".eq_", ".lt_")
# In-place ops that CPU runs through TensorIterator, which refuses a target with internal
# overlap (an expanded view): both devices must raise. Other writes (fill_, index_put_...) into
# such a target are allowed on CPU and refused on pjrt (known, in test_fuzz.REGRESSIONS).
OVERLAP_CHECKED = {
    ".neg_", ".abs_", ".exp_", ".sqrt_", ".floor_", ".sigmoid_", ".tanh_", ".round_", ".reciprocal_",
    ".sin_", ".square_", ".trunc_", ".sign_", ".logical_not_", ".bitwise_not_", ".add_", ".sub_",
    ".mul_", ".div_", ".pow_", ".remainder_", ".fmod_", ".clamp_min_", ".clamp_max_", ".bitwise_and_",
    ".logical_or_", ".floor_divide_", ".copysign_", ".atan2_", ".hypot_", ".eq_", ".lt_",
}


def _is_view(t):
    return t._base is not None


def _writable(t):
    return _overlap(t) != 2


def _same_view(a, b):
    return (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())


def _grad_leaf_view(t):
    """A leaf that requires grad, or a view of one: in-place writes raise (both devices)."""
    base = t if t._base is None else t._base
    return base.requires_grad and base.is_leaf


def _target(b, pred=lambda t: True):
    """A Ref to write into, preferably a view; rarely a (view of a) leaf that requires grad."""
    allow_leaf = b.flag(10)
    return b.pick(lambda t: _writable(t) and pred(t) and (allow_leaf or not _grad_leaf_view(t))
                  and _storage_key(t) not in b.split_storages, prefer=_is_view)


def gen_inplace(b):
    step = _gen_inplace(b)
    if step is None:
        return None
    target = b.val(step.args[0])
    if step.op not in OVERLAP_CHECKED and _overlap(target):
        return None
    # a source that partly overlaps the target makes CPU's result depend on its loop order
    for r in _refs((step.args[1:], step.kwargs)):
        source = b.val(r)
        if _storage_key(source) == _storage_key(target) and not _same_view(source, target):
            return None
    return step


def _gen_inplace(b):
    ref = _target(b)
    if ref is None:
        return None
    t = b.val(ref)
    nd = t.dim()
    if b.flag(3):
        op = b.choice(INPLACE_UNARY)
        if op == ".fill_":
            v = b.choice(SCALARS) if b.flag() else CpuScalar(2.5, torch.float64)
            return Step(op, (ref, v))
        if op == ".clamp_":
            return Step(op, (ref,), (("min", b.choice((-1, 0, 0.5))), ("max", b.choice((None, 1, 2.5)))))
        if op == ".t_" and nd > 2:
            return None  # raises AssertionError on pjrt, RuntimeError on CPU (test_fuzz.REGRESSIONS)
        if op == ".unsqueeze_":
            return Step(op, (ref, b.int(-nd - 1, nd)))
        if op == ".squeeze_":
            return Step(op, (ref,) if nd == 0 or b.flag() else (ref, _dim(b, t)))
        if op in (".tril_", ".triu_"):
            return Step(op, (ref, b.int(-1, 1)))
        if op == ".fill_diagonal_":
            return Step(op, (ref, b.choice((5, -1.5))), (("wrap", b.flag()),))
        if op == ".cumsum_":
            if t.dtype == torch.bool:  # CPU has no bool kernel, except for 0-dim tensors
                return None
            return Step(op, (ref, _dim(b, t) if nd else 0))
        return Step(op, (ref,))
    op = b.choice(INPLACE_BINARY)
    if op == ".maximum":  # out= into the target itself
        return Step("torch.maximum", (ref, b.operand(t, into=True, tensor_only=True)), (("out", ref),))
    if op in (".add_", ".sub_", ".mul_", ".div_", ".pow_", ".remainder_", ".fmod_", ".clamp_min_",
              ".clamp_max_", ".bitwise_and_", ".logical_or_", ".floor_divide_", ".copysign_", ".atan2_",
              ".hypot_", ".eq_", ".lt_"):
        other = b.operand(t, into=True, cpu_scalar=op not in NO_CPU_SCALAR)
        kwargs = (("alpha", b.choice((2, -1))),) if op in (".add_", ".sub_") and b.flag(4) else ()
        return Step(op, (ref, other), kwargs)
    if op == ".copy_":
        src = b.operand(t, into=True, tensor_only=True)
        if t.dtype == torch.int64 and isinstance(src, Ref) and not _castable_to_int(b.val(src)):
            return None
        return Step(op, (ref, src))
    if op == ".lerp_":
        return Step(op, (ref, b.operand(t, into=True, tensor_only=True, dtype=t.dtype), b.choice((0.5, 0.25))))
    if op == ".addcmul_":
        return Step(op, (ref, b.operand(t, into=True, tensor_only=True), b.operand(t, into=True, tensor_only=True)),
                    (("value", b.choice((1, -0.5))),))
    if op == ".masked_fill_":
        mask = b.mask_like(b.broadcastable_shape(tuple(t.shape), into=True))
        # a CPU 0-dim `value` fails on pjrt (known, in test_fuzz.REGRESSIONS): scalars only
        return Step(op, (ref, mask, b.choice(SCALARS)))
    if op == ".masked_scatter_":
        mask = b.mask_like(tuple(t.shape))
        return Step(op, (ref, mask, b.new_input(tuple(t.shape), t.dtype)))
    if nd == 0:
        return None
    d = _dim(b, t)
    n = t.shape[d]
    if op in (".index_fill_", ".index_add_", ".index_copy_"):
        idx = b.index_list(n, unique=op == ".index_copy_")
        if not idx:
            return None
        if op == ".index_fill_":
            return Step(op, (ref, d, Lit(idx), b.choice(SCALARS)))
        src_shape = list(t.shape)
        src_shape[d] = len(idx)
        src = b.new_input(tuple(src_shape), t.dtype)
        kwargs = (("alpha", 2),) if op == ".index_add_" and b.flag(3) else ()
        return Step(op, (ref, d, Lit(idx), src), kwargs)
    if op in (".scatter_", ".scatter_add_"):
        # each fiber of the index along d holds distinct positions (scatter_ with duplicates
        # is undefined)
        idx_shape = [b.int(1, s) if s else 0 for s in t.shape]
        idx_shape[d] = b.int(1, n) if n else 0
        if 0 in idx_shape:
            return None
        g = torch.Generator().manual_seed(b.int(0, 999))
        other = [s for i, s in enumerate(idx_shape) if i != d % nd]
        fibers = [torch.randperm(n, generator=g)[:idx_shape[d]].tolist() for _ in range(math.prod(other))]
        idx = torch.tensor(fibers, dtype=torch.int64).reshape(*other, idx_shape[d]).movedim(-1, d)
        if op == ".scatter_" and b.flag():
            return Step(op, (ref, d, Lit(idx.tolist()), b.choice(SCALARS)))
        src = b.new_input(tuple(idx_shape), t.dtype)
        return Step(op, (ref, d, Lit(idx.tolist()), src))
    if op == ".index_put_":
        accumulate = b.flag()
        idx = b.index_list(t.shape[0], unique=not accumulate)
        if not idx:
            return None
        values_shape = b.broadcastable_shape((len(idx), *t.shape[1:]), into=True)
        values = b.new_input(values_shape, t.dtype)
        return Step(op, (ref, (Lit(idx),), values), (("accumulate", accumulate),) if accumulate else ())
    if op == ".put_":
        accumulate = b.flag()
        idx = b.index_list(t.numel(), unique=not accumulate)
        if not idx:
            return None
        return Step(op, (ref, Lit(idx), b.new_input((len(idx),), t.dtype)),
                    (("accumulate", accumulate),) if accumulate else ())
    return None


NO_OUT = {"torch.topk[0]", "torch.var_mean", "torch.positive"}


def gen_out(b):
    """A `torch.*` function step with `out=`: fresh empty tensors, or existing values (views)."""
    family = b.choice(("binary", "unary", "reduction", "matmul", "cat", "ternary", "index"))
    step = FAMILIES[family](b)
    if (not isinstance(step, Step) or not step.op.startswith("torch.") or step.op in NO_OUT
            or (step.op == "torch.where" and len(step.args) == 1)):
        return step
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = execute(step, dict(enumerate(b.values)), "cpu", [])
    except Exception:  # noqa: BLE001 - an invalid draw: keep it as it is
        return step
    targets = []
    # an out= sharing memory with an operand is undefined for most ops (a reduction reads what
    # it has already written on CPU)
    operand_storages = {_storage_key(b.val(r)) for r in _refs((step.args, step.kwargs))}
    for r in result:
        def fits(v, r=r):
            return (tuple(v.shape) == tuple(r.shape) and not v.requires_grad and _overlap(v) == 0
                    and _storage_key(v) not in operand_storages and _storage_key(v) not in b.split_storages
                    and (v.dtype == r.dtype or (v.dtype.is_floating_point and r.dtype != torch.bool)))
        existing = b.pick(fits, prefer=_is_view) if b.flag() else None
        if existing is not None:
            targets.append(existing)
        else:
            # a wider out= dtype: binary ops with type promotion cast into it; other ops (neg,
            # index_select, any...) raise on CPU and not on pjrt (known, in test_fuzz.REGRESSIONS)
            widen = {torch.float32: torch.float64, torch.int64: torch.float32, torch.bool: torch.int64}
            promoting = (step.op in BINARY and step.op != "torch.heaviside") or step.op == "torch.where"
            dtype = widen.get(r.dtype, r.dtype) if promoting and b.flag(4) else r.dtype
            targets.append(Empty(dtype))
    out = targets[0] if len(targets) == 1 else tuple(targets)
    return dataclasses.replace(step, kwargs=step.kwargs + (("out", out),))


def gen_setitem(b):
    ref = _target(b, lambda t: t.dim() > 0 and not _overlap(t))
    if ref is None:
        return None
    t = b.val(ref)
    r = b.int(0, 4)
    if r == 0:
        key = b.int(-t.shape[0], t.shape[0] - 1) if t.shape[0] else slice(None)
    elif r == 1:
        key = tuple(slice(b.choice((None, 1, -2)), None, b.choice((None, 2))) for _ in range(b.int(1, t.dim())))
    elif r == 2:
        key = Lit(b.index_list(t.shape[0], unique=True)) if b.flag() else b.index_list(t.shape[0], unique=True)
        if key == [] or key == Lit([]):
            return None
    elif r == 3:
        key = b.mask_like(tuple(t.shape[:b.int(1, t.dim())]))
    else:
        n = t.shape[-1]
        if n == 0:
            return None
        key = (Ellipsis, Lit(b.index_list(n, unique=True)))
    try:
        target = t[_resolve(key, dict(enumerate(b.values)), "cpu")]
    except Exception:  # noqa: BLE001
        return None
    if b.flag():
        value = b.choice(SCALARS)
    else:
        shape = b.broadcastable_shape(tuple(target.shape), into=True)
        # a 0-dim CPU value is fill_()ed on CPU but copied on other devices: for a value that
        # requires grad and a non-float target, only CPU's result then requires grad
        value = b.new_input(shape, t.dtype if b.flag() else None,
                            requires_grad=None if t.dtype.is_floating_point else False)
        if t.dtype == torch.int64 and not _castable_to_int(b.val(value)):
            return None
    # x[key] += v reads x[key] (a view, or a copy for advanced keys), adds, and assigns back
    return Step("[]+=" if b.flag(3) else "[]=", (ref, key, value))


def gen_index(b):
    ref = b.pick(lambda t: t.dim() > 0)
    if ref is None:
        return None
    t = b.val(ref)
    d = _dim(b, t)
    n = t.shape[d]
    kind = b.choice(("[]", "index_select", "gather", "take", "mask", "masked_select", "nonzero",
                     "two_lists", "where1"))
    if kind == "[]":
        idx = b.index_list(n, unique=False)
        if not idx:
            return None
        key = (*([slice(None)] * (d % t.dim())), Lit(idx))
        return Step("[]", (ref, key if len(key) > 1 else key[0]))
    if kind == "index_select":
        idx = b.index_list(n, unique=False)
        return Step("torch.index_select", (ref, d, Lit([i % n for i in idx]))) if idx else None
    if kind == "gather":
        if n == 0 or 0 in t.shape:
            return None
        shape = [b.int(1, s) for s in t.shape]
        shape[d] = b.int(1, 3)
        idx = torch.randint(0, n, shape, generator=torch.Generator().manual_seed(b.int(0, 99)))
        return Step("torch.gather", (ref, d, Lit(idx.tolist())))
    if kind == "take":
        idx = b.index_list(t.numel(), unique=False)
        return Step("torch.take", (ref, Lit(idx))) if idx else None
    if kind == "mask":
        return Step("[]", (ref, b.mask_like(tuple(t.shape[:b.int(1, t.dim())]))))
    if kind == "masked_select":
        return Step("torch.masked_select", (ref, b.mask_like(b.broadcastable_shape(tuple(t.shape)))))
    if kind == "nonzero":
        return Step("torch.nonzero", (ref,))
    if kind == "where1":
        return Step("torch.where", (ref,))
    if t.dim() < 2 or 0 in t.shape:
        return None
    count = b.int(1, 3)
    rows = [b.int(-t.shape[0], t.shape[0] - 1) for _ in range(count)]
    cols = [b.int(0, t.shape[1] - 1) for _ in range(count)]
    return Step("[]", (ref, (Lit(rows), Lit(cols))))


def gen_cat(b):
    ref = b.pick()
    t = b.val(ref)
    op = b.choice(("torch.cat", "torch.stack", "torch.cat"))
    pieces = [ref]
    if op == "torch.cat" and t.dim() == 0:
        return None
    d = _dim(b, t) if op == "torch.cat" else b.int(-t.dim() - 1, t.dim())
    for _ in range(b.int(1, 2)):
        shape = list(t.shape)
        if op == "torch.cat":
            shape[d] = b.int(0, 3)
        existing = b.pick(lambda v: tuple(v.shape) == tuple(shape))
        if existing is not None and b.flag():
            pieces.append(existing)
        elif op == "torch.cat" and b.flag(8):
            pieces.append(b.new_input((0,), t.dtype))  # legacy: 1-D empty tensors are skipped
        else:
            pieces.append(b.new_input(tuple(shape), t.dtype if b.flag() else None))
    if b.flag(3):
        pieces.reverse()
    return Step(op, (pieces, d))


def gen_read(b):
    ref = b.pick(lambda t: t.numel() <= 64)
    return Step("read", (ref,)) if ref is not None else None


def gen_nn(b):
    ref = b.pick(lambda t: t.dtype.is_floating_point and t.dim() >= 1)
    if ref is None:
        return None
    t = b.val(ref)
    op = b.choice(("F.mse_loss", "F.l1_loss", "F.smooth_l1_loss", "F.cross_entropy", "F.dropout"))
    if op == "F.dropout":  # p=0: the identity, whatever the generator
        return Step(op, (ref,), (("p", 0.0),))
    if op == "F.cross_entropy":
        if t.dim() != 2 or 0 in t.shape:
            return None
        target = Lit([b.int(0, t.shape[1] - 1) for _ in range(t.shape[0])])
        return Step(op, (ref, target), (("reduction", b.choice(("mean", "sum", "none"))),))
    other = b.new_input(tuple(t.shape), t.dtype)
    return Step(op, (ref, other), (("reduction", b.choice(("mean", "sum", "none"))),))


FAMILIES = {
    "unary": gen_unary, "binary": gen_binary, "ternary": gen_ternary, "reduction": gen_reduction,
    "matmul": gen_matmul, "view": gen_view, "inplace": gen_inplace, "out": gen_out,
    "setitem": gen_setitem, "index": gen_index, "cat": gen_cat, "read": gen_read, "nn": gen_nn,
}
# drawn from this list (repeats weight the families); shrinking moves toward the front
FAMILY_DRAW = ("unary", "binary", "view", "inplace", "view", "binary", "reduction", "setitem",
               "inplace", "out", "matmul", "index", "cat", "ternary", "read", "nn", "view", "unary",
               "inplace", "out", "setitem", "reduction")


def gen_backward(b):
    cands = b.candidates(lambda t: t.requires_grad and t.dtype.is_floating_point)
    if not cands:
        return None
    chosen = sorted({cands[b.int(0, len(cands) - 1)] for _ in range(b.int(1, 2))})
    return Step("backward", tuple(Ref(i) for i in chosen))


@st.composite
def programs(draw, max_steps=10):
    b = Builder(draw)
    for _ in range(b.int(1, 3)):
        b.new_input()
    for _ in range(b.int(1, max_steps)):
        step = FAMILIES[b.choice(FAMILY_DRAW)](b)
        if step is not None:
            b.add(step)
    if b.int(0, 2):
        step = gen_backward(b)
        if step is not None:
            b.add(step)
    return b.program()
