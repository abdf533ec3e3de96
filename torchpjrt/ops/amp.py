"""GradScaler's two kernels: unscale gradients while looking for inf/NaN, and update the scale.

Same arithmetic as PyTorch's CPU and CUDA kernels (aten/src/ATen/native/cpu/AmpGradScalerKernels
.cpp): gradients are multiplied by `inv_scale` in their opmath type (float32 for 16-bit
floats); `found_inf` becomes 1.0 when any value is not finite and is otherwise left as it
was; the scale backs off on a found inf and grows after `growth_interval` clean steps unless
growing would overflow float32.

The in-place overloads update two arguments each, so they are lowered with `mutates=`; the
functional overloads serve compiled graphs (eager runs PyTorch's composite: clone, then the
in-place kernel).
"""

import jax.numpy as jnp

from ..dtypes import LOW_PRECISION
from . import aten, lower


def _check(condition, message):
    if not condition:
        raise RuntimeError(message)


def _check_one_float(t, name):
    _check(t.size == 1, f"{name} must be a 1-element tensor.")
    _check(t.dtype == jnp.float32, f"{name} must be a float tensor.")


def _unscale(grads, found_inf, inv_scale):
    _check_one_float(inv_scale, "inv_scale")
    _check_one_float(found_inf, "found_inf")
    inv = inv_scale.reshape(())
    any_non_finite = jnp.zeros((), jnp.bool_)
    unscaled = []
    for g in grads:
        _check(jnp.issubdtype(g.dtype, jnp.floating),
               f'"_amp_foreach_non_finite_check_and_unscale" not implemented for gradients of dtype {g.dtype}')
        opmath = jnp.float32 if g.dtype in LOW_PRECISION else g.dtype
        value = g.astype(opmath)
        any_non_finite = any_non_finite | ~jnp.all(jnp.isfinite(value))
        unscaled.append(jnp.where(inv == 1, value, value * inv.astype(opmath)).astype(g.dtype))
    found = jnp.where(any_non_finite, jnp.ones_like(found_inf), found_inf) if grads else found_inf
    return unscaled, found


@lower(aten._amp_foreach_non_finite_check_and_unscale_.default, mutates=("self", "found_inf"))
def amp_foreach_non_finite_check_and_unscale_(self, found_inf, inv_scale):
    return _unscale(self, found_inf, inv_scale)


@lower(aten._amp_foreach_non_finite_check_and_unscale.default, graph_only=True)
def amp_foreach_non_finite_check_and_unscale(self, found_inf, inv_scale):
    return _unscale(self, found_inf, inv_scale)


def _update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    _check(growth_tracker.size == 1, "growth_tracker must be a 1-element tensor.")
    _check(scale.size == 1, "current_scale must be a 1-element tensor.")
    _check(found_inf.size == 1, "found_inf must be a 1-element tensor.")
    _check(growth_tracker.dtype == jnp.int32, "growth_tracker must be an int tensor.")
    _check(scale.dtype == jnp.float32, "current_scale must be a float tensor.")
    _check(found_inf.dtype == jnp.float32, "found_inf must be a float tensor.")
    current = scale.reshape(())
    tracker = growth_tracker.reshape(())
    found = found_inf.reshape(()) != 0  # a NaN found_inf counts as found, as `if (*found_inf)`
    # float * double, rounded once to float, as the C++ kernel computes it
    backed_off = (current.astype(jnp.float64) * backoff_factor).astype(jnp.float32)
    grown = (current.astype(jnp.float64) * growth_factor).astype(jnp.float32)
    successful = tracker + 1
    grow = successful == growth_interval
    new_scale = jnp.where(found, backed_off, jnp.where(grow & jnp.isfinite(grown), grown, current))
    new_tracker = jnp.where(found | grow, jnp.zeros_like(tracker), successful)
    return new_scale.reshape(scale.shape), new_tracker.reshape(growth_tracker.shape)


@lower(aten._amp_update_scale_.default, mutates=("self", "growth_tracker"))
def amp_update_scale_(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    return _update_scale(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval)


@lower(aten._amp_update_scale.default)
def amp_update_scale(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    return _update_scale(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval)
