"""torch.optim's fused kernels (`Adam(fused=True)`, `AdamW(fused=True)`, `SGD(fused=True)`):
the whole step for every parameter as one compiled call.

Arithmetic follows PyTorch's CPU kernels (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
FusedSGDKernel.cpp): per element in the opmath type (float32 for 16-bit floats), coefficients
computed in double and rounded once to the opmath type; exp_avg moves by lerp. `grad_scale` divides the
gradients (and the unscaled gradients are stored back); a `found_inf` of 1.0 skips the step,
leaving every tensor as it was.

Every hyperparameter a schedule may change between steps (lr, betas, weight decay, eps,
momentum, dampening) is traced (`traced=`), as are the step counts: a new learning rate every
step reuses one program. Bools (amsgrad, maximize, nesterov, is_first_step) and the lists'
structure (momentum buffers or none: torch.optim passes none for a zero momentum) are fixed
per program. A weight decay of zero is a value, not a program: the CPU kernels skip its term,
and a select keeps that exact result. Coefficients combine in float64 on the device (XLA
computes `1 - lr * weight_decay` as one fused multiply-add, as the CPU's AVX2 kernel does;
rounded to float32 for 16-bit and float32 parameters, it differs from the separately rounded
form only where a float32 rounding boundary falls between the two). The CPU refuses momentum
buffers given with a zero momentum, or none with a nonzero one; the momentum's value is not
seen here, so SGD then leaves the buffers as they are, or takes plain steps.

The in-place overloads update several lists, so they are lowered with `mutates=`; the
functional overloads serve compiled graphs (where the values may also be Python floats).
"""

import jax.numpy as jnp

from ..dtypes import LOW_PRECISION
from . import aten, lower
from .elementwise import lerp

_ADAM_MUTATES = ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")


def _opmath(dtype):
    return jnp.float32 if dtype in LOW_PRECISION else dtype


def _check_same_lengths(what, *lists):
    lengths = {len(x) for x in lists if len(x)}
    if len(lengths) > 1:
        raise RuntimeError(f"{what}: tensor lists must have the same number of tensors, got {sorted(lengths)}")


def _gradient(what, p, g, grad_scale, maximize):
    """The start of every fused step for one parameter: (opmath type, parameter and gradient in
    it, the gradient to store back: unscaled by grad_scale, else unchanged)."""
    if not jnp.issubdtype(p.dtype, jnp.floating):
        raise RuntimeError(f"{what}: parameters must be floating point, got {p.dtype}")
    op = _opmath(p.dtype)
    param, grad, stored = p.astype(op), g.astype(op), g
    if grad_scale is not None:
        grad = grad / grad_scale.reshape(()).astype(op)
        stored = grad.astype(g.dtype)
    return op, param, -grad if maximize else grad, stored


def _coefficient(x, op):
    """A double coefficient rounded once to the opmath type, as the CPU kernels do."""
    return jnp.asarray(x, jnp.float64).astype(op)


def _double(x):
    """A hyperparameter (a traced scalar, a Python float, or lr's 0-dim tensor) as a float64 scalar."""
    return jnp.asarray(x, jnp.float64).reshape(())


def _unless_zero(x, with_term, without):
    """`with_term` where the hyperparameter `x` is nonzero, else `without`: the CPU kernels skip
    a zero weight decay's term (adding param * 0 would turn a gradient of -0.0 into +0.0 and
    an infinite parameter's gradient into NaN)."""
    return jnp.where(x != 0, with_term, without)


def _skipped(found_inf, new, old):
    """`new`, or `old` where found_inf says the step is skipped."""
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) == 1.0
    return [jnp.where(skip, o, n) for n, o in zip(new, old)]


def _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
          weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled):
    what = "_fused_adamw_" if decoupled else "_fused_adam_"
    _check_same_lengths(what, params, grads, exp_avgs, exp_avg_sqs, state_steps)
    if amsgrad and len(max_exp_avg_sqs) != len(params):
        raise RuntimeError(f"{what}: amsgrad needs one max_exp_avg_sq per parameter")
    lr, beta1, beta2, weight_decay, eps = (_double(x) for x in (lr, beta1, beta2, weight_decay, eps))
    out_p, out_g, out_m, out_v, out_vmax = [], [], [], [], []
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        op, param, grad, stored = _gradient(what, p, g, grad_scale, maximize)
        out_g.append(stored)

        def c(x):
            return _coefficient(x, op)

        step = step.reshape(()).astype(jnp.float64)
        bias_correction1 = 1 - jnp.power(beta1, step)
        bias_correction2_sqrt = jnp.sqrt(1 - jnp.power(beta2, step))
        step_size = lr / bias_correction1
        if decoupled:
            param = param * c(1 - lr * weight_decay)  # a zero weight decay multiplies by exactly 1
        else:
            grad = _unless_zero(weight_decay, grad + param * c(weight_decay), grad)
        exp_avg = lerp(m.astype(op), grad, c(1 - beta1))
        exp_avg_sq = v.astype(op) * c(beta2) + c(1 - beta2) * grad * grad
        if amsgrad:
            peak = jnp.maximum(max_exp_avg_sqs[i].astype(op), exp_avg_sq)
            out_vmax.append(peak.astype(max_exp_avg_sqs[i].dtype))
            denom = jnp.sqrt(peak) / c(bias_correction2_sqrt) + c(eps)
        else:
            denom = jnp.sqrt(exp_avg_sq) / c(bias_correction2_sqrt) + c(eps)
        param = param - c(step_size) * exp_avg / denom
        out_p.append(param.astype(p.dtype))
        out_m.append(exp_avg.astype(m.dtype))
        out_v.append(exp_avg_sq.astype(v.dtype))
    if not amsgrad:
        out_vmax = list(max_exp_avg_sqs)
    return tuple(_skipped(found_inf, new, old) for new, old in (
        (out_p, params), (out_g, grads), (out_m, exp_avgs), (out_v, exp_avg_sqs), (out_vmax, max_exp_avg_sqs)))


def _adam_lowering(decoupled):
    def fused(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2, weight_decay,
              eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        return _adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                     weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled)

    return fused


# lr changes every step under a schedule, betas under OneCycleLR's momentum cycling, weight
# decay when a program edits param_groups: all traced (the `float` arguments are otherwise baked in)
_TRACED = ("lr", "beta1", "beta2", "weight_decay", "eps")
lower(aten._fused_adam_.default, aten._fused_adam_.tensor_lr, mutates=_ADAM_MUTATES, traced=_TRACED)(
    _adam_lowering(False))
lower(aten._fused_adamw_.default, aten._fused_adamw_.tensor_lr, mutates=_ADAM_MUTATES, traced=_TRACED)(
    _adam_lowering(True))
lower(aten._fused_adam.default, aten._fused_adam.tensor_lr, graph_only=True, traced=_TRACED)(_adam_lowering(False))
lower(aten._fused_adamw.default, aten._fused_adamw.tensor_lr, graph_only=True, traced=_TRACED)(_adam_lowering(True))


def _sgd(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov, maximize,
         is_first_step, grad_scale, found_inf):
    _check_same_lengths("_fused_sgd_", params, grads, momentum_buffers)
    lr, weight_decay, momentum, dampening = (_double(x) for x in (lr, weight_decay, momentum, dampening))
    # torch.optim passes momentum buffers exactly when momentum is nonzero: their presence fixes
    # the program, and a zero momentum with buffers (a direct call) leaves them as they were
    with_momentum = len(momentum_buffers) > 0
    out_p, out_g, out_b = [], [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        op, param, grad, stored = _gradient("_fused_sgd_", p, g, grad_scale, maximize)
        out_g.append(stored)

        def c(x):
            return _coefficient(x, op)

        grad = _unless_zero(weight_decay, grad + param * c(weight_decay), grad)
        if with_momentum:
            b = momentum_buffers[i]
            buf = grad if is_first_step else b.astype(op) * c(momentum) + grad * c(1 - dampening)
            out_b.append(_unless_zero(momentum, buf.astype(b.dtype), b))
            grad = _unless_zero(momentum, grad + buf * c(momentum) if nesterov else buf, grad)
        out_p.append((param - grad * c(lr)).astype(p.dtype))
    if not with_momentum:
        out_b = list(momentum_buffers)
    return tuple(_skipped(found_inf, new, old) for new, old in (
        (out_p, params), (out_g, grads), (out_b, momentum_buffers)))


def fused_sgd(self, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening, nesterov, maximize,
              is_first_step, grad_scale=None, found_inf=None):
    return _sgd(self, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening, nesterov, maximize,
                is_first_step, grad_scale, found_inf)


_SGD_TRACED = ("lr", "weight_decay", "momentum", "dampening")
lower(aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr, mutates=("self", "grads", "momentum_buffer_list"),
      traced=_SGD_TRACED)(fused_sgd)
lower(aten._fused_sgd.default, aten._fused_sgd.tensor_lr, graph_only=True, traced=_SGD_TRACED)(fused_sgd)
