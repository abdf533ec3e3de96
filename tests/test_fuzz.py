"""Differential fuzzing: random PyTorch programs must give the same results on pjrt as on CPU.

Each program (see fuzz_programs.py) runs on CPU, then on pjrt in strict and in fused eager
mode. Every value the program keeps, the inputs it mutated, the host reads it made, the
gradients of its leaf inputs and the exceptions it expects must match CPU's.

CI runs the derandomized "ci" profile; a long local run:

    python -m pytest tests/test_fuzz.py --hypothesis-profile=long -k matches_cpu

Profiles are registered in conftest.py. A falsifying program is printed as PyTorch code
(the hypothesis note) and as a `Program(...)` literal to add to REGRESSIONS below.
"""

import warnings

import pytest
import torch
from hypothesis import given, note, reject, settings

import torchpjrt
from fuzz_programs import (CpuScalar, Empty, Lit, Program, Ref, Step, StepFailed, loosest, make_input, programs,
                           run_program)

# assert_close's defaults, looser where chains of ops amplify last-bit differences between
# two libms: an ulp of x in exp(x) is a relative error of |x| ulps in the result (float32: about
# 80 ulps allowed). bfloat16 (about 5 ulps): CPU computes each op in float32 and rounds once,
# while a lowering expanded into several bfloat16 ops (or a fused chain) rounds elsewhere; near
# zero, an ulp of the O(1) values that cancelled.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.bfloat16: (4e-2, 5e-2),
}
MODES = ("strict", "fused")


def _fuzz_settings():
    """The "ci" profile unless "long" was chosen (`--hypothesis-profile=long`). PyTorch's test
    utilities load profiles of their own when imported (a 200 ms deadline): not ours."""
    current = settings.get_current_profile_name()
    return settings.get_profile("long" if current == "long" else "ci")


def _tolerance(dtype, computed_from=None):
    """Exact for integers and bools; for floats, that of the least precise dtype involved."""
    if not dtype.is_floating_point:
        return 0, 0
    return TOLERANCES[loosest(dtype, computed_from)]


def assert_tensor_matches(cpu, dev, what, computed_from=None):
    assert isinstance(dev, torch.Tensor), f"{what}: expected a tensor, got {type(dev).__name__}"
    assert dev.device.type == "pjrt", f"{what}: on {dev.device}"
    assert dev.shape == cpu.shape, f"{what}: shape {tuple(dev.shape)} != CPU {tuple(cpu.shape)}"
    assert dev.dtype == cpu.dtype, f"{what}: dtype {dev.dtype} != CPU {cpu.dtype}"
    assert dev.requires_grad == cpu.requires_grad, f"{what}: requires_grad {dev.requires_grad} != CPU"
    rtol, atol = _tolerance(cpu.dtype, computed_from)
    torch.testing.assert_close(dev.detach().cpu(), cpu.detach(), rtol=rtol, atol=atol, equal_nan=True,
                               check_stride=False, msg=lambda m: f"{what}: {m}")


def assert_runs_match(cpu, dev, mode):
    assert dev.errors == cpu.errors, f"[{mode}] exceptions (step: type) {dev.errors} != CPU {cpu.errors}"
    assert sorted(dev.values) == sorted(cpu.values), f"[{mode}] kept values differ"
    for i, c in cpu.values.items():
        assert_tensor_matches(c, dev.values[i], f"[{mode}] v{i}", cpu.precision[i])
    assert len(dev.reads) == len(cpu.reads), f"[{mode}] reads"
    for k, ((cdt, c), (ddt, d)) in enumerate(zip(cpu.reads, dev.reads)):
        assert ddt == cdt, f"[{mode}] read {k}: dtype"
        rtol, atol = _tolerance(cdt, cpu.precision["grads"])
        torch.testing.assert_close(torch.tensor(d, dtype=torch.float64), torch.tensor(c, dtype=torch.float64),
                                   rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"[{mode}] read {k}: {m}")
    assert sorted(dev.grads) == sorted(cpu.grads), f"[{mode}] inputs with gradients"
    for i, c in cpu.grads.items():
        d = dev.grads[i]
        assert (c is None) == (d is None), f"[{mode}] v{i}.grad: {d!r} vs CPU {c!r}"
        if c is not None:
            assert_tensor_matches(c, d, f"[{mode}] v{i}.grad", cpu.precision["grads"])


def check_program(program, cpu_must_run=True):
    try:
        cpu = run_program(program, "cpu")
    except StepFailed:
        # a generated program that fails on CPU (the generator judged a step on other values)
        # tests nothing; a listed one must run
        if cpu_must_run:
            raise
        reject()
    for mode in MODES:
        # fused: every graph compiled at its first sighting (the default runs a graph seen
        # once op by op, which strict mode already checks)
        with torchpjrt.eager_mode(mode, **({"compile_after": 1} if mode == "fused" else {})):
            try:
                dev = run_program(program, "pjrt")
            except StepFailed as e:
                raise AssertionError(f"[{mode}] {e}") from e
            assert_runs_match(cpu, dev, mode)


@pytest.mark.slow  # the sweep: 300 programs in CI
@_fuzz_settings()
@given(programs())
def test_pjrt_matches_cpu(program):
    note(program.to_python())
    check_program(program, cpu_must_run=False)


def _known(reason):
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)


# Programs that once disagreed with CPU, replayed forever. Fixed ones must pass; the others are
# strict xfails that flip when their bug is fixed.
REGRESSIONS = [
    # accumulating bool scatters (CPU's bool += bool is an or): put_, index_put_, index_add_ and
    # scatter_add_ raised TypeError from jnp's add
    pytest.param(Program((
        Step('input', ((4,), torch.bool, 1)),
        Step('input', ((3,), torch.bool, 9)),
        Step('.put_', (Ref(1), Lit([-1, 0, 0, -1]), Ref(0)), kwargs=(('accumulate', True),)),
        Step('.index_put_', (Ref(1), (Lit([1, 1, 2, 0]),), Ref(0)), kwargs=(('accumulate', True),)),
        Step('.index_add_', (Ref(1), 0, Lit([2, 0, 2, 0]), Ref(0))),
        Step('.scatter_add_', (Ref(1), 0, Lit([2, 1, 0]), Ref(0))),
    )), id="bool_accumulate"),
    # addcmul on integers with a float `value`: CPU truncates the value first (0.5 -> 0)
    pytest.param(Program((
        Step('input', ((), torch.int64, 986)),
        Step('input', ((1,), torch.int64, 438)),
        Step('input', ((), torch.int64, 782)),
        Step('torch.addcmul', (Ref(0), Ref(1), Ref(2)), kwargs=(('value', 0.5),)),
        Step('torch.addcmul', (Ref(0), Ref(1), Ref(2)), kwargs=(('value', -1.7),)),
    )), id="addcmul_int_float_value"),
    # clamp with a NaN bound: CPU's result is NaN, pjrt ignored the bound
    pytest.param(Program((
        Step('input', ((4, 3), torch.float32, 423)),
        Step('input', ((1,), torch.bool, 241)),
        Step('input', ((), torch.float32, 528), kwargs=(('special', True),)),
        Step('torch.clamp', (Ref(0),), kwargs=(('min', Ref(1)), ('max', Ref(2)))),
        Step('torch.clamp_min', (Ref(0), Ref(2))),
        Step('torch.clamp_max', (Ref(0), Ref(2))),
    )), id="clamp_nan_bound"),
    # sign/sgn of bool (the identity on CPU) raised TypeError from jnp.sign
    pytest.param(Program((
        Step('input', ((3, 4), torch.bool, 41)),
        Step('torch.sign', (Ref(0),)),
        Step('torch.sgn', (Ref(0),)),
    )), id="sign_bool"),
    # sign of NaN is 0 on CPU ((0 < x) - (x < 0)); jnp.sign kept NaN
    pytest.param(Program((
        Step('input', ((4, 4), torch.float32, 174)),
        Step('.transpose', (Ref(0), -2, -1)),
        Step('.pow_', (Ref(1), -2.5)),
        Step('torch.sign', (Ref(1),)),
        Step('torch.sgn', (Ref(1),)),
    )), id="sign_nan"),
    # std/var of an integer or bool tensor: CPU raises, pjrt returned a number
    pytest.param(Program((
        Step('input', ((4,), torch.bool, 285)),
        Step('input', ((2, 3), torch.int64, 0)),
        Step('torch.std', (Ref(0),), n_out=0, raises='RuntimeError'),
        Step('torch.var', (Ref(1),), kwargs=(('dim', 1),), n_out=0, raises='RuntimeError'),
        Step('torch.var_mean', (Ref(1),), n_out=0, raises='RuntimeError'),
    )), id="std_var_of_integers_raise"),
    # lerp with infinities: CPU computes from `end` when |weight| >= 0.5
    pytest.param(Program((
        Step('input', ((3,), torch.float64, 310), kwargs=(('special', True),)),
        Step('input', ((1, 1), torch.float64, 237)),
        Step('torch.lerp', (Ref(0), Ref(1), Ref(1))),
        Step('torch.lerp', (Ref(1), Ref(0), 0.75)),
    )), id="lerp_infinities"),
    # bool / bool: XLA rewrites convert(bool a) / b as select(a, 1 / b, 0): False / False gave 0
    pytest.param(Program((
        Step('input', ((1, 2), torch.bool, 468)),
        Step('input', ((1, 1), torch.bool, 6)),
        Step('torch.div', (Ref(0), Ref(1))),
        Step('op:/', (Ref(0), Ref(1))),
    )), id="bool_true_divide"),
    # float * bool and bool / float: jnp and XLA turn them into selects (inf * False gave 0, not
    # nan), seen through amax's gradient at a NaN maximum (grad / 0 * mask)
    pytest.param(Program((
        Step('input', ((4, 2), torch.float32, 287), kwargs=(('requires_grad', True), ('special', True))),
        Step('torch.amax', (Ref(0),), kwargs=(('dim', (1,)),)),
        Step('input', ((4, 4), torch.float32, 115), kwargs=(('special', True),)),
        Step('op:@', (Ref(1), Ref(2))),
        Step('input', ((4, 2), torch.bool, 1)),
        Step('op:*', (Ref(0), Ref(4))),
        Step('op:/', (Ref(4), Ref(0))),
        Step('backward', (Ref(3),), n_out=0),
    )), id="float_times_bool_nan"),
    # ... and inside addcmul (int64 + 0.5 * float32 * bool)
    pytest.param(Program((
        Step('input', ((1,), torch.float32, 128), kwargs=(('special', True),)),
        Step('input', ((2, 4, 3), torch.int64, 639)),
        Step('input', ((3,), torch.bool, 510)),
        Step('torch.addcmul', (Ref(1), Ref(0), Ref(2)), kwargs=(('value', 0.5),)),
    )), id="addcmul_bool_nan"),
    # CPU's BLAS products do not promote: mixed dtypes raise
    pytest.param(Program((
        Step('input', ((1,), torch.float64, 244)),
        Step('input', ((1, 1), torch.bool, 54)),
        Step('input', ((2, 3), torch.float32, 74)),
        Step('input', ((3, 3), torch.int64, 289)),
        Step('input', ((3,), torch.bfloat16, 0)),
        Step('torch.matmul', (Ref(0), Ref(1)), n_out=0, raises='RuntimeError'),
        Step('F.linear', (Ref(2), Ref(3), Ref(4)), n_out=0, raises='RuntimeError'),
    )), id="matmul_mixed_dtypes_raise"),
    # add/sub check alpha against the result type: a float alpha for bool results and a bool
    # alpha for non-bool results raise
    pytest.param(Program((
        Step('input', ((3, 2), torch.bool, 863)),
        Step('input', ((2,), torch.bool, 478)),
        Step('input', ((2,), torch.int64, 1)),
        Step('torch.add', (Ref(0), Ref(1)), kwargs=(('alpha', 0.5),), n_out=0, raises='RuntimeError'),
        Step('torch.add', (Ref(2), Ref(2)), kwargs=(('alpha', True),), n_out=0, raises='RuntimeError'),
        Step('torch.add', (Ref(0), Ref(1)), kwargs=(('alpha', 2),)),
    )), id="add_alpha_check"),
    # subtraction with any bool tensor raises; heaviside does not promote
    pytest.param(Program((
        Step('input', ((2, 4), torch.bool, 898)),
        Step('input', ((3, 1, 1), torch.float32, 399)),
        Step('input', ((), torch.int64, 783)),
        Step('torch.sub', (Ref(0), Ref(1)), n_out=0, raises='RuntimeError'),
        Step('torch.sub', (Ref(1), Ref(0)), kwargs=(('alpha', 2),), n_out=0, raises='RuntimeError'),
        Step('torch.heaviside', (Ref(1), Ref(2)), n_out=0, raises='RuntimeError'),
    )), id="bool_sub_and_heaviside_dtypes_raise"),
    # heaviside of NaN is 0 on CPU (x == 0 ? values : x > 0)
    pytest.param(Program((
        Step('input', ((3,), torch.bfloat16, 203), kwargs=(('special', True),)),
        Step('.pow_', (Ref(0), Ref(0))),
        Step('torch.heaviside', (Ref(0), Ref(1))),
    )), id="heaviside_nan"),
    # x[index tensor] = value of another dtype raises on CPU (index_put_ does not cast)
    pytest.param(Program((
        Step('input', ((2, 2), torch.float32, 46)),
        Step('input', ((), torch.int64, 1)),
        Step('input', ((4,), torch.int64, 625)),
        Step('input', ((), torch.float64, 421)),
        Step('[]=', (Ref(0), (Ellipsis, Lit([-2])), Ref(1)), n_out=0, raises='RuntimeError'),
        Step('[]=', (Ref(2), [-2, 1, 3, 0], Ref(3)), n_out=0, raises='RuntimeError'),
        Step('[]=', (Ref(2), Lit([True, False, True, True], torch.bool), Ref(3)), n_out=0),
    )), id="index_put_dtype_mismatch_raises"),
    # masked_select/masked_scatter_ with shapes that do not broadcast: RuntimeError (was JAX's
    # ValueError)
    pytest.param(Program((
        Step('input', ((3, 0, 2), torch.float32, 100)),
        Step('torch.masked_select', (Ref(0), Lit([[[]], [[]]], torch.bool)), n_out=0, raises='RuntimeError'),
        Step('input', ((0, 3), torch.float64, 345)),
        Step('.masked_scatter_', (Ref(0), Lit([], torch.bool), Ref(1)), n_out=0, raises='RuntimeError'),
    )), id="masked_select_scatter_shape_error_type"),
    # relu of bool raises on CPU
    pytest.param(Program((
        Step('input', ((), torch.bool, 322)),
        Step('.relu_', (Ref(0),), n_out=0, raises='RuntimeError'),
        Step('torch.relu', (Ref(0),), n_out=0, raises='RuntimeError'),
    )), id="relu_bool_raises"),
    # argmax/argmin of bool raise on CPU
    pytest.param(Program((
        Step('input', ((2,), torch.bool, 131)),
        Step('torch.argmax', (Ref(0),), n_out=0, raises='RuntimeError'),
        Step('torch.argmin', (Ref(0),), kwargs=(('dim', 0),), n_out=0, raises='RuntimeError'),
    )), id="argmax_bool_raises"),
    # pow of a bool base by an int scalar; lerp of bools with a float weight tensor
    pytest.param(Program((
        Step('input', ((1, 2, 3), torch.bool, 153)),
        Step('input', ((), torch.float64, 773)),
        Step('torch.pow', (Ref(0), 10)),
        Step('torch.lerp', (Ref(0), Ref(0), Ref(1))),
    )), id="bool_pow_and_lerp"),
    # div(bool, int64, rounding_mode="trunc") converted the divisor to the dividend's dtype
    pytest.param(Program((
        Step('input', ((3, 3), torch.bool, 571)),
        Step('input', ((), torch.int64, 207)),
        Step('torch.div', (Ref(0), Ref(1)), kwargs=(('rounding_mode', 'trunc'),)),
    )), id="trunc_div_promotes"),
    # max()/min() of an empty tensor: RuntimeError (was JAX's ValueError); max(dim) over an
    # empty dim: IndexError; addcdiv of integers or bools raises
    pytest.param(Program((
        Step('input', ((1, 0, 4), torch.float32, 354)),
        Step('input', ((), torch.bool, 1)),
        Step('torch.min', (Ref(0),), n_out=0, raises='RuntimeError'),
        Step('torch.max', (Ref(0), 1), n_out=0, raises='IndexError'),
        Step('torch.addcdiv', (Ref(1), Ref(1), Ref(1)), kwargs=(('value', -2),), n_out=0, raises='RuntimeError'),
        Step('torch.addcdiv', (Ref(0), Ref(1), Ref(1)), n_out=0, raises='RuntimeError'),
    )), id="empty_max_and_integer_addcdiv_raise"),
    # in-place cumsum_ of a 0-dim bool: pjrt checked the functional op's result type (Long)
    # against the target's, where CPU runs it in the target's dtype
    pytest.param(Program((
        Step('input', ((), torch.bool, 69)),
        Step('.cumsum_', (Ref(0), 0)),
    )), id="bool_cumsum_"),

    # CPU kernels without the dtype raise NotImplementedError (pjrt raised JAX's TypeError)
    pytest.param(Program((
        Step('input', ((), torch.float32, 0)),
        Step('torch.bitwise_not', (Ref(0),), n_out=0, raises='NotImplementedError'),
    )), id="unsupported_dtype_error_type"),
    # a 0-dim CPU tensor (allowed next to device tensors, as on CUDA) as masked_fill_'s value,
    # copysign's other or the dividend of //
    pytest.param(Program((
        Step('input', ((3, 1, 4), torch.int64, 786)),
        Step('input', ((3, 1, 4), torch.bool, 1)),
        Step('.masked_fill_', (Ref(0), Ref(1), CpuScalar(-4.0, torch.float64))),
    )), id="masked_fill_cpu_scalar_value"),
    pytest.param(Program((
        Step('input', ((3, 3), torch.int64, 115)),
        Step('torch.copysign', (Ref(0), CpuScalar(-0.5, torch.float32))),
    )), id="copysign_cpu_scalar"),
    pytest.param(Program((
        Step('input', ((2,), torch.float32, 20)),
        Step('op://', (CpuScalar(2.0, torch.float64), Ref(0))),
    )), id="cpu_scalar_floor_divide"),
    # -- known, not fixed ----------------------------------------------------------------------
    # bool cast then divide inside one fused graph: XLA's select rewrite again (the cast is not
    # a lowering)
    pytest.param(Program((
        Step('input', ((1, 2), torch.bool, 468)),
        Step('input', ((1, 1), torch.bool, 6)),
        Step('.float', (Ref(0),), keep=False),
        Step('op:/', (Ref(2), Ref(1))),
    )), id="fused_bool_cast_then_divide",
        marks=_known("fused: XLA's convert(bool) / b -> select(a, 1 / b, 0) rewrite")),
    # fused graphs keep bfloat16 intermediates in float32 (XLA's excess precision): a bfloat16
    # product read back as float32 differs from CPU's rounded one
    pytest.param(Program((
        Step('input', ((4,), torch.bfloat16, 3)),
        Step('op:*', (Ref(0), Ref(0)), keep=False),
        Step('.float', (Ref(1),), keep=False),
        Step('op:*', (Ref(2), 65536), keep=False),
        Step('.long', (Ref(3),)),
    )), id="fused_bfloat16_excess_precision", marks=_known("fused: xla_allow_excess_precision")),
    # t_() of a 3-D tensor: PyTorch's meta kernel raises AssertionError, CPU RuntimeError
    pytest.param(Program((
        Step('input', ((2, 3, 2), torch.int64, 140)),
        Step('.t_', (Ref(0),), n_out=0, raises='RuntimeError'),
    )), id="t__3d_error_type"),
    # inf-norm over a non-empty negative dim of an empty tensor: PyTorch's reference check
    # (run as the meta kernel) does not wrap negative dims and raises; CPU returns an empty result
    pytest.param(Program((
        Step('input', ((0, 4), torch.float32, 135)),
        Step('torch.norm', (Ref(0),), kwargs=(('p', float('inf')), ('dim', -1), ('keepdim', True))),
    )), id="norm_inf_negative_dim_empty"),
    # amin/amax/argmax over an empty dim: CPU raises IndexError, PyTorch's reference (pjrt's
    # meta kernel) RuntimeError
    pytest.param(Program((
        Step('input', ((0,), torch.int64, 237)),
        Step('torch.amin', (Ref(0),), kwargs=(('dim', 0), ('keepdim', True)), n_out=0, raises='IndexError'),
        Step('torch.argmax', (Ref(0),), n_out=0, raises='IndexError'),
    )), id="empty_reduction_error_type"),
    # integer sub with a float alpha: CPU raises RuntimeError, PyTorch's reference ValueError
    pytest.param(Program((
        Step('input', ((1, 4), torch.int64, 184)),
        Step('torch.sub', (Ref(0), Ref(0)), kwargs=(('alpha', 0.5),), n_out=0, raises='RuntimeError'),
    )), id="int_float_alpha_error_type"),
    # clamp() with neither bound: CPU raises RuntimeError, PyTorch's reference ValueError
    pytest.param(Program((
        Step('input', ((1,), torch.float32, 0)),
        Step('torch.clamp', (Ref(0),), kwargs=(('min', None), ('max', None)), n_out=0, raises='RuntimeError'),
    )), id="clamp_no_bounds_error_type"),
    # pow(bool tensor, False) is bool on CPU; PyTorch's meta kernel (pjrt's result dtype) says int64
    pytest.param(Program((
        Step('input', ((1, 2, 3), torch.bool, 153)),
        Step('torch.pow', (Ref(0), False)),
    )), id="bool_pow_bool_scalar_dtype"),
    # all() into an int64 out=, index_select() into a float32 out= and neg() into a float64 out=
    # raise on CPU
    pytest.param(Program((
        Step('input', ((3, 1), torch.int64, 599)),
        Step('torch.all', (Ref(0),), kwargs=(('out', Empty(torch.int64)),), n_out=0, raises='RuntimeError'),
        Step('input', ((3, 2), torch.int64, 599)),
        Step('torch.index_select', (Ref(1), 0, Lit([0, 0, 2])), kwargs=(('out', Empty(torch.float32)),), n_out=0,
             raises='RuntimeError'),
        Step('input', ((), torch.float32, 0)),
        Step('torch.neg', (Ref(2),), kwargs=(('out', Empty(torch.float64)),), n_out=0, raises='RuntimeError'),
    )), id="out_dtype_must_match"),
    # writing one value into a view with internal overlap (fill_, x[index] = 2) is allowed on CPU
    pytest.param(Program((
        Step('input', ((), torch.bool, 5)),
        Step('.as_strided', (Ref(0), (1, 3), (1, 0), 0)),
        Step('[]=', (Ref(1), Lit([0]), 2), n_out=0),
        Step('input', ((), torch.float32, 1)),
        Step('.as_strided', (Ref(2), (3,), (0,), 0)),
        Step('.fill_', (Ref(3), 2)),
    )), id="fill_overlapping_view"),
    # a split/chunk output whose base was then written in place: pjrt's meta conversion reads
    # `is_leaf`, which makes autograd raise for such a view (CPU raises only if it needs grad)
    pytest.param(Program((
        Step('input', ((2, 3), torch.float64, 40), kwargs=(('requires_grad', True),)),
        Step('torch.index_select', (Ref(0), -1, Lit([1, 0]))),
        Step('.chunk', (Ref(1), 1, 0)),
        Step('.unflatten', (Ref(1), -1, (1, -1))),
        Step('input', ((1, 1, 2), torch.float64, 236)),
        Step('.index_put_', (Ref(3), (Lit([-2]),), Ref(4)), kwargs=(('accumulate', True),)),
        Step('torch.isnan', (Ref(2),)),
    )), id="split_view_after_inplace"),
    # int_tensor.mul_(float_tensor): CPU raises (the result type cannot be cast to the target's);
    # pjrt truncates, and bumps the version counter a later backward checks
    pytest.param(Program((
        Step('input', ((1,), torch.float32, 0), kwargs=(('requires_grad', True),)),
        Step('torch.sort', (Ref(0),), kwargs=(('dim', 0), ('descending', False), ('stable', True)), n_out=2),
        Step('.mul_', (Ref(2), Ref(0)), n_out=0, raises='RuntimeError'),
        Step('input', ((2,), torch.int64, 1)),
        Step('.add_', (Ref(3), Lit([1.5, 2.0], torch.float32)), n_out=0, raises='RuntimeError'),
        Step('backward', (Ref(1),), n_out=0),
    )), id="inplace_result_type_unchecked"),
    # x[index] = value whose shape does not fit: CPU raises RuntimeError, pjrt ValueError
    pytest.param(Program((
        Step('input', ((3,), torch.float32, 0)),
        Step('input', ((0,), torch.float32, 1)),
        Step('[]=', (Ref(0), Lit([0, 2]), Ref(1)), n_out=0, raises='RuntimeError'),
    )), id="index_put_value_shape_error_type"),
]


@pytest.mark.parametrize("program", REGRESSIONS)
def test_regression(program):
    try:
        check_program(program)
    except AssertionError as e:
        e.add_note(program.to_python())
        raise


@pytest.mark.slow
@_fuzz_settings()
@given(programs())
def test_printed_code_reproduces_the_program(program):
    """The code a failure prints computes what the interpreter computes (on CPU)."""
    run = run_program(program, "cpu")
    namespace = {"make_input": make_input}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's own (std() with too few elements...)
        exec(program.to_python().replace('dev = "pjrt"', 'dev = "cpu"'), namespace)  # noqa: S102
    for i, value in run.values.items():
        printed = namespace[f"v{i}"]
        assert printed.dtype == value.dtype and printed.shape == value.shape, i
        torch.testing.assert_close(printed, value, equal_nan=True, rtol=0, atol=0, check_stride=False)
    assert len(namespace["reads"]) == len(run.reads)
    for (_, read), printed in zip(run.reads, namespace["reads"]):
        torch.testing.assert_close(torch.tensor(printed, dtype=torch.float64), torch.tensor(read, dtype=torch.float64),
                                   equal_nan=True, rtol=0, atol=0)


def test_comparison_catches_a_wrong_value():
    program = Program((
        Step("input", ((3,), torch.float32, 0)),
        Step("torch.exp", (Ref(0),)),
    ))
    cpu = run_program(program, "cpu")
    dev = run_program(program, "pjrt")
    assert_runs_match(cpu, dev, "strict")
    dev.values[1] = dev.values[1] + 1e-3
    with pytest.raises(AssertionError, match="v1"):
        assert_runs_match(cpu, dev, "strict")
