"""torch.optim's fused kernels (`Adam(fused=True)`, `AdamW(fused=True)`, `SGD(fused=True)`):
the whole step for every parameter as one compiled call.

Arithmetic follows PyTorch's CPU kernels (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
FusedSGDKernel.cpp): per element in the opmath type (float32 for 16-bit floats), coefficients
computed in double and rounded once to the opmath type; exp_avg moves by lerp. `grad_scale` divides the
gradients (and the unscaled gradients are stored back); a `found_inf` of 1.0 skips the step,
leaving every tensor as it was.

The in-place overloads update several lists, so they are lowered with `mutates=`; the
functional overloads serve compiled graphs.
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
    lr = jnp.asarray(lr, jnp.float64).reshape(())
    out_p, out_g, out_m, out_v, out_vmax = [], [], [], [], []
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        op, param, grad, stored = _gradient(what, p, g, grad_scale, maximize)
        out_g.append(stored)

        def c(x):
            return _coefficient(x, op)

        step = step.reshape(()).astype(jnp.float64)
        bias_correction1 = 1 - jnp.power(jnp.float64(beta1), step)
        bias_correction2_sqrt = jnp.sqrt(1 - jnp.power(jnp.float64(beta2), step))
        step_size = lr / bias_correction1
        if decoupled:
            param = param * c(1 - lr * weight_decay)
        elif weight_decay != 0:
            grad = grad + param * c(weight_decay)
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


# betas, weight decay and eps are fixed per optimizer: static, so the coefficients fold in;
# lr (a schedule changes it every step) stays traced
_STATIC = ("beta1", "beta2", "weight_decay", "eps")
lower(aten._fused_adam_.default, aten._fused_adam_.tensor_lr, mutates=_ADAM_MUTATES, static=_STATIC)(
    _adam_lowering(False))
lower(aten._fused_adamw_.default, aten._fused_adamw_.tensor_lr, mutates=_ADAM_MUTATES, static=_STATIC)(
    _adam_lowering(True))
lower(aten._fused_adam.default, aten._fused_adam.tensor_lr, graph_only=True, static=_STATIC)(_adam_lowering(False))
lower(aten._fused_adamw.default, aten._fused_adamw.tensor_lr, graph_only=True, static=_STATIC)(_adam_lowering(True))


def _sgd(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov, maximize,
         is_first_step, grad_scale, found_inf):
    _check_same_lengths("_fused_sgd_", params, grads, momentum_buffers)
    lr = jnp.asarray(lr, jnp.float64).reshape(())
    out_p, out_g, out_b = [], [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        op, param, grad, stored = _gradient("_fused_sgd_", p, g, grad_scale, maximize)
        out_g.append(stored)

        def c(x):
            return _coefficient(x, op)

        if weight_decay != 0:
            grad = grad + param * c(weight_decay)
        if momentum != 0:
            b = momentum_buffers[i]
            buf = grad if is_first_step else b.astype(op) * c(momentum) + grad * c(1 - dampening)
            out_b.append(buf.astype(b.dtype))
            grad = grad + buf * c(momentum) if nesterov else buf
        out_p.append((param - grad * c(lr)).astype(p.dtype))
    if momentum == 0:
        out_b = list(momentum_buffers)
    return tuple(_skipped(found_inf, new, old) for new, old in (
        (out_p, params), (out_g, grads), (out_b, momentum_buffers)))


def fused_sgd(self, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening, nesterov, maximize,
              is_first_step, grad_scale=None, found_inf=None):
    return _sgd(self, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening, nesterov, maximize,
                is_first_step, grad_scale, found_inf)


_SGD_STATIC = ("weight_decay", "momentum", "dampening")
lower(aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr, mutates=("self", "grads", "momentum_buffer_list"),
      static=_SGD_STATIC)(fused_sgd)
lower(aten._fused_sgd.default, aten._fused_sgd.tensor_lr, graph_only=True, static=_SGD_STATIC)(fused_sgd)
