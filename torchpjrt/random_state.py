"""The pjrt device's random generator: a seed and an offset, as in PyTorch's CUDA generator.

Every random op takes the pair (seed, offset) as a traced input and derives its JAX key
from it inside the compiled function, so changing the offset never recompiles. The same
seed gives the same numbers on pjrt (they differ from CPU's, as CUDA's do).
"""

import random
import threading

import numpy as np
import torch

_lock = threading.Lock()
_seed = 67280421310721  # PyTorch's default seed
_offset = 0


def manual_seed(seed: int) -> None:
    """Seed the generator as torch.Generator.manual_seed does: seeds in [-2**63, 2**64 - 1],
    a negative one taken modulo 2**64."""
    global _seed, _offset
    seed = int(seed)
    if not -0x8000_0000_0000_0000 <= seed <= 0xFFFF_FFFF_FFFF_FFFF:
        raise ValueError("Overflow when unpacking long long")  # torch.Generator's words
    with _lock:
        _seed = seed & 0xFFFF_FFFF_FFFF_FFFF
        _offset = 0


def seed() -> None:
    manual_seed(random.getrandbits(63))


def initial_seed() -> int:
    return _seed


def next_seed_offset() -> np.ndarray:
    """The (seed, offset) pair for one random op, advancing the offset."""
    global _offset
    with _lock:
        pair = np.array([_seed, _offset], dtype=np.uint64)
        _offset += 1
    return pair


def get_state() -> torch.Tensor:
    """16 bytes (a uint8 CPU tensor): seed and offset as little-endian uint64, CUDA's layout.

    Random ops take their (seed, offset) when they are issued, also in fused mode where they
    run later, so setting a saved state replays the same numbers in every eager mode."""
    with _lock:
        pair = np.array([_seed, _offset], dtype="<u8")
    return torch.from_numpy(pair.view(np.uint8).copy())


def set_state(state: torch.Tensor) -> None:
    global _seed, _offset
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        got = state.dtype if isinstance(state, torch.Tensor) else type(state).__name__
        raise TypeError(f"RNG state must be a torch.ByteTensor (from torch.pjrt.get_rng_state), got {got}")
    raw = state.detach().cpu().contiguous().numpy().reshape(-1)
    if raw.size != 16:
        raise RuntimeError(f"pjrt RNG state must be 16 bytes, got {raw.size}")
    s, o = raw.view("<u8")
    with _lock:
        _seed, _offset = int(s), int(o)


def key_from_seed_offset(pair):
    """Inside a traced function: a JAX PRNG key from the (seed, offset) pair."""
    import jax

    key = jax.random.key(pair[0].astype("uint32") ^ (pair[0] >> 32).astype("uint32"))
    return jax.random.fold_in(key, pair[1].astype("uint32"))
