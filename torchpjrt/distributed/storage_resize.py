"""`UntypedStorage.resize_` for pjrt storages, which FSDP2 uses to free and re-allocate the
unsharded parameters around each all-gather (`storage.resize_(0)` / `resize_(nbytes)`).

torchpjrt.untyped_storage refuses storage resizes; FSDP2 needs them, so this module wraps
that method (installed by torchpjrt.distributed): a pjrt storage becomes a flat array of the
new number of elements of its dtype, keeping the leading elements like PyTorch's resize_.
Tensors on it keep their geometry; they read through it as views.
"""

import functools

import jax
import jax.numpy as jnp
import torch

from .. import dtypes, fusion, storage
from ..storage import _zeros

_previous = None


@functools.lru_cache(maxsize=None)
def _refit_fn(old_numel, new_numel, dtype):
    def refit(x):
        flat = x.reshape(-1)
        if new_numel <= old_numel:
            return flat[:new_numel]
        return jnp.concatenate([flat, jnp.zeros((new_numel - old_numel,), dtype)])

    return jax.jit(refit)


def _resize_(self, nbytes):
    if self.device.type != "pjrt":
        return _previous(self, nbytes)
    st = self._pjrt
    itemsize = st.dtype.itemsize
    if nbytes % itemsize:
        raise RuntimeError(f"torchpjrt: cannot resize a {st.dtype} storage to {nbytes} bytes (not a whole number of elements)")
    numel = nbytes // itemsize
    if nbytes > storage._capacity:
        storage.check_allocation(nbytes)  # a size the device cannot hold: OutOfMemoryError now
    if numel == st.numel and len(st.shape) == 1:
        return self
    jdtype = dtypes.to_jax(st.dtype)
    if numel == 0:
        new = _zeros((0,), jdtype)  # freed: FSDP2 re-allocates before the next read
    elif st.array is None or st.numel == 0:
        new = _zeros((numel,), jdtype)
    else:
        new = fusion.call(_refit_fn(st.numel, numel, jdtype), st.array)
    st.replace(new)
    storage.give_address(self, nbytes)  # re-allocated memory has a new address, as on CUDA
    return self


def install():
    global _previous
    if _previous is None:
        _previous = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = _resize_
