"""Discrete Fourier transforms (torch.fft lowers to these three aten ops)."""

import math

import jax.numpy as jnp

from . import aten, lower


def _normalize(x, n, normalization):
    # aten's fft_norm_mode: 0 = none, 1 = 1/sqrt(n), 2 = 1/n
    if normalization == 1:
        return x / math.sqrt(n)
    if normalization == 2:
        return x / n
    return x


def _signal_size(shape, dims):
    return math.prod(shape[d] for d in dims)


@lower(aten._fft_r2c.default)
def fft_r2c(self, dim, normalization, onesided):
    dims = tuple(dim)
    n = _signal_size(self.shape, dims)
    out = jnp.fft.rfftn(self, axes=dims) if onesided else jnp.fft.fftn(self, axes=dims)
    return _normalize(out, n, normalization)


@lower(aten._fft_c2c.default)
def fft_c2c(self, dim, normalization, forward):
    dims = tuple(dim)
    if not dims:
        return self
    n = _signal_size(self.shape, dims)
    out = jnp.fft.fftn(self, axes=dims) if forward else jnp.fft.ifftn(self, axes=dims) * n
    return _normalize(out, n, normalization)


@lower(aten._fft_c2r.default)
def fft_c2r(self, dim, normalization, last_dim_size):
    dims = tuple(dim)
    sizes = [self.shape[d] for d in dims[:-1]] + [last_dim_size]
    n = math.prod(sizes)
    out = jnp.fft.irfftn(self, s=sizes, axes=dims) * n
    return _normalize(out, n, normalization)
