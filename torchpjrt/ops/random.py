"""Random ops, drawn from the pjrt generator (see random_state.py).

Every lowering here takes the trailing `key` the dispatcher derives from torch.manual_seed's
seed and a per-op counter: the same seed gives the same numbers, which differ from CPU's
(as CUDA's do) but follow the same distributions. 16-bit floats are drawn in float32 and
rounded. Only the default generator exists: an explicit `generator=` is refused.
"""

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .. import dtypes
from . import DeviceCheck, aten, check_vector, lower
from .factory import schema_dtype


def _check_generator(generator):
    if generator is not None:
        raise NotImplementedError(
            "torchpjrt: random ops on pjrt tensors draw from the default pjrt generator only "
            "(seeded by torch.manual_seed); a user-provided torch.Generator is not supported"
        )


def _draw_dtype(dtype):
    """Float64 for double precision, float32 for everything narrower."""
    return jnp.float64 if dtype in (jnp.float64, jnp.complex128) else jnp.float32


def _draw(sample, key, shape, dtype):
    """sample(key, shape, float dtype) for a tensor of `shape` and `dtype`; complex ones get
    independent real and imaginary parts (PyTorch samples them through view_as_real)."""
    dt = _draw_dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        parts = sample(key, tuple(shape) + (2,), dt)
        return lax.complex(parts[..., 0], parts[..., 1])
    return sample(key, shape, dt)


def _like(sample, key, x):
    return _draw(sample, key, x.shape, x.dtype)


def _check_float(x, name):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise NotImplementedError(f'"{name}" not implemented for \'{dtypes.to_torch(x.dtype)}\'')


# ---- continuous distributions filling a tensor ------------------------------------------


def _uniform_range(self, from_=0.0, to=1.0, *rest):
    return check_vector(jnp.asarray(from_) > jnp.asarray(to), from_, to, dtype=jnp.float64)


def _uniform_error(from_, to):
    return RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={from_:g} > to={to:g}")


@lower(aten.uniform_.default, random=True, mutates=("self",), check=DeviceCheck(_uniform_range, _uniform_error))
def uniform_(self, from_=0.0, to=1.0, generator=None, key=None):
    _check_generator(generator)
    _check_float(self, "check_uniform_bounds")
    real = jnp.finfo(self.dtype).dtype

    def sample(k, shape, dt):
        u = jax.random.uniform(k, shape, dt, from_, to).astype(real)
        # rounding can reach `to`; PyTorch maps it to `from` so values stay in [from, to)
        return jnp.where(u >= to, jnp.asarray(from_, real), u)

    return _like(sample, key, self)


def _normal(key, shape, dtype, mean, std):
    if jnp.issubdtype(dtype, jnp.complexfloating):  # PyTorch splits the variance between the parts
        std = std / math.sqrt(2)
    return mean + std * _draw(jax.random.normal, key, shape, dtype)


@lower(aten.normal_.default, random=True, mutates=("self",))
def normal_(self, mean=0.0, std=1.0, generator=None, key=None):
    _check_generator(generator)
    return _normal(key, self.shape, self.dtype, mean, std)


@lower(aten.normal_functional.default, random=True)
def normal_functional(self, mean=0.0, std=1.0, generator=None, key=None):
    _check_generator(generator)
    return _normal(key, self.shape, self.dtype, mean, std)


@lower(aten.normal.Tensor_float, random=True)
def normal_tensor_float(mean, std=1.0, generator=None, key=None):
    _check_generator(generator)
    return mean + std * jax.random.normal(key, mean.shape, _draw_dtype(mean.dtype))


@lower(aten.normal.float_Tensor, random=True)
def normal_float_tensor(mean, std, generator=None, key=None):
    _check_generator(generator)
    return mean + std * jax.random.normal(key, std.shape, _draw_dtype(std.dtype))


@lower(aten.normal.Tensor_Tensor, random=True)
def normal_tensor_tensor(mean, std, generator=None, key=None):
    _check_generator(generator)
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    dt = _draw_dtype(jnp.result_type(mean, std))
    return mean + std * jax.random.normal(key, shape, dt)


# Eager execution gets these as empty + uniform_/normal_; compiled graphs keep them whole.
@lower(aten.rand.default, random=True, graph_only=True)
def rand(size, dtype=None, layout=None, device=None, pin_memory=None, key=None):
    dtype = dtypes.to_jax(schema_dtype(dtype) if dtype is not None else torch.get_default_dtype())
    return _draw(lambda k, shape, dt: jax.random.uniform(k, shape, dt), key, tuple(size), dtype).astype(dtype)


@lower(aten.randn.default, random=True, graph_only=True)
def randn(size, dtype=None, layout=None, device=None, pin_memory=None, key=None):
    dtype = dtypes.to_jax(schema_dtype(dtype) if dtype is not None else torch.get_default_dtype())
    return _normal(key, tuple(size), dtype, 0.0, 1.0).astype(dtype)


@lower(aten.normal.float_float, random=True)
def normal_float_float(mean, std, size, generator=None, dtype=None, layout=None, device=None,
                       pin_memory=None, key=None):
    _check_generator(generator)
    dtype = dtypes.to_jax(dtype or torch.get_default_dtype())
    return _normal(key, tuple(size), dtype, mean, std)


@lower(aten.log_normal_.default, random=True, mutates=("self",))
def log_normal_(self, mean=1.0, std=2.0, generator=None, key=None):
    _check_generator(generator)
    return jnp.exp(mean + std * _like(jax.random.normal, key, self))


@lower(aten.exponential_.default, random=True, mutates=("self",))
def exponential_(self, lambd=1.0, generator=None, key=None):
    _check_generator(generator)
    return _like(jax.random.exponential, key, self) / lambd


@lower(aten.cauchy_.default, random=True, mutates=("self",))
def cauchy_(self, median=0.0, sigma=1.0, generator=None, key=None):
    _check_generator(generator)
    return median + sigma * _like(jax.random.cauchy, key, self)


@lower(aten.geometric_.default, random=True, mutates=("self",))
def geometric_(self, p, generator=None, key=None):
    _check_generator(generator)
    dt = _draw_dtype(self.dtype)
    # the number of Bernoulli(p) trials up to the first success: ceil(log(u) / log(1 - p))
    u = jax.random.uniform(key, self.shape, dt, jnp.finfo(dt).tiny, 1.0)
    return jnp.maximum(jnp.ceil(jnp.log(u) / jnp.log1p(-p)), 1)


# ---- Bernoulli --------------------------------------------------------------------------


def _bernoulli(key, x, p):
    dt = _draw_dtype(jnp.result_type(x, p) if hasattr(p, "dtype") else x.dtype)
    return jax.random.uniform(key, x.shape, dt) < p


def _check_p(p, name):
    if not 0 <= p <= 1:
        raise RuntimeError(f"{name} expects p to be in [0, 1], but got p={p}")


@lower(aten.bernoulli_.float, random=True, mutates=("self",))
def bernoulli_float_(self, p=0.5, generator=None, key=None):
    _check_generator(generator)
    _check_p(p, "bernoulli_")
    return _bernoulli(key, self, p)


@lower(aten.bernoulli_.Tensor, random=True, mutates=("self",))
def bernoulli_tensor_(self, p, generator=None, key=None):
    _check_generator(generator)
    return _bernoulli(key, self, p)


@lower(aten.bernoulli.default, random=True)
def bernoulli(self, generator=None, key=None):
    _check_generator(generator)
    return _bernoulli(key, self, self)


@lower(aten.bernoulli.p, random=True)
def bernoulli_p(self, p, generator=None, key=None):
    _check_generator(generator)
    _check_p(p, "bernoulli")
    return _bernoulli(key, self, p)


# ---- random integers ----------------------------------------------------------------------


def _random_ints(key, shape, low, high):
    """Integers in [low, high) (a span of up to 2**64) as int64: 64 random bits modulo the
    span, as PyTorch does."""
    bits = jax.random.bits(key, shape, jnp.uint64)
    span = high - low
    if span < 2**64:
        bits = bits % jnp.uint64(span)
    # adding low modulo 2**64 then reinterpreting is two's-complement addition
    return lax.bitcast_convert_type(bits + jnp.uint64(low % 2**64), jnp.int64)


def _max_inclusive(dtype):
    """random_()'s upper bound: 2**mantissa for floats (every integer exact), else the max."""
    if dtype == jnp.bool_:
        return 1
    if jnp.issubdtype(dtype, jnp.floating):
        return 2 ** (jnp.finfo(dtype).nmant + 1)
    return int(jnp.iinfo(dtype).max)


def _random(key, self, low, high):
    return _random_ints(key, self.shape, low, high).astype(self.dtype)


@lower(aten.random_.default, random=True, mutates=("self",))
def random_(self, generator=None, key=None):
    _check_generator(generator)
    return _random(key, self, 0, _max_inclusive(self.dtype) + 1)


@lower(aten.random_.to, random=True, mutates=("self",))
def random_to(self, to, generator=None, key=None):
    _check_generator(generator)
    return _random(key, self, 0, to)


@lower(getattr(aten.random_, "from"), random=True, mutates=("self",))
def random_from(self, from_, to=None, generator=None, key=None):
    _check_generator(generator)
    high = _max_inclusive(self.dtype) + 1 if to is None else to
    return _random(key, self, from_, high)


@lower(aten.randperm.default, random=True)
def randperm(n, dtype=None, layout=None, device=None, pin_memory=None, key=None):
    return jax.random.permutation(key, n).astype(dtypes.to_jax(schema_dtype(dtype) or torch.int64))


@lower(aten.randperm.generator, random=True)
def randperm_generator(n, generator, dtype=None, layout=None, device=None, pin_memory=None,
                       key=None):
    _check_generator(generator)
    return randperm(n, dtype, layout, device, pin_memory, key)


def _multinomial_distribution(self, *rest):
    p = self.astype(_draw_dtype(self.dtype))
    invalid = ~jnp.isfinite(p) | (p < 0)
    empty = p.sum(-1) <= 0
    problem = jnp.where(invalid.any(), 1, jnp.where(empty.any(), 2, 0))
    return check_vector(problem != 0, problem)


_MULTINOMIAL_ERRORS = {
    1: "probability tensor contains either `inf`, `nan` or element < 0",
    2: "invalid multinomial distribution (sum of probabilities <= 0)",
}


@lower(aten.multinomial.default, random=True,
       check=DeviceCheck(_multinomial_distribution, lambda problem: RuntimeError(_MULTINOMIAL_ERRORS[problem])))
def multinomial(self, num_samples, replacement=False, generator=None, key=None):
    _check_generator(generator)
    logits = jnp.log(self.astype(_draw_dtype(self.dtype)))
    if replacement:
        batch = logits.shape[:-1]
        draws = jax.random.categorical(key, logits, shape=(num_samples,) + batch)
        return jnp.moveaxis(draws, 0, -1).astype(jnp.int64)
    # without replacement: the top num_samples of Gumbel-perturbed logits (Gumbel-top-k)
    perturbed = logits + jax.random.gumbel(key, logits.shape, logits.dtype)
    return lax.top_k(perturbed, num_samples)[1].astype(jnp.int64)


# ---- dropout-style ops ----------------------------------------------------------------------


@lower(aten.native_dropout.default, random=True)
def native_dropout(input, p, train, key=None):
    if train is False or p == 0:
        return input, jnp.ones(input.shape, jnp.bool_)
    keep = 1.0 - p
    mask = jax.random.uniform(key, input.shape, _draw_dtype(input.dtype)) < keep
    scale = 1.0 / keep if keep > 0 else 0.0
    return input * mask.astype(input.dtype) * scale, mask


def _rrelu(self, noise, lower_, upper, training, key):
    if not training:  # eval: leaky ReLU with the mean slope; noise is left as it is
        return jnp.where(self >= 0, self, self * ((lower_ + upper) / 2)), noise
    slope = jax.random.uniform(key, self.shape, _draw_dtype(self.dtype), lower_, upper)
    negative = self <= 0
    new_noise = jnp.where(negative, slope, 1).astype(noise.dtype)
    return jnp.where(negative, self * slope, self), new_noise


@lower(aten.rrelu_with_noise.default, random=True, mutates=("noise",))
def rrelu_with_noise(self, noise, lower=0.125, upper=1 / 3, training=False, generator=None,
                     key=None):
    _check_generator(generator)
    return _rrelu(self, noise, lower, upper, training, key)


@lower(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise_functional(self, noise, lower=0.125, upper=1 / 3, training=False,
                                generator=None, key=None):
    _check_generator(generator)
    return _rrelu(self, noise, lower, upper, training, key)
