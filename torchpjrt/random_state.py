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
_DEFAULT_SEED = 67280421310721  # PyTorch's default seed
# one generator per pjrt device, as CUDA has: index -> [seed, offset]; a device whose
# generator was never touched starts from `_seed_all` (manual_seed_all's seed)
_generators = {}
_seed_all = _DEFAULT_SEED


def _generator(index):
    g = _generators.get(index)
    if g is None:
        g = _generators[index] = [_seed_all, 0]
    return g


def _checked_seed(seed) -> int:
    """A seed as torch.Generator.manual_seed takes it: in [-2**63, 2**64 - 1], a negative one
    taken modulo 2**64."""
    seed = int(seed)
    if not -0x8000_0000_0000_0000 <= seed <= 0xFFFF_FFFF_FFFF_FFFF:
        raise ValueError("Overflow when unpacking long long")  # torch.Generator's words
    return seed & 0xFFFF_FFFF_FFFF_FFFF


def manual_seed(seed: int, index: int = 0) -> None:
    """Seed pjrt:`index`'s generator."""
    seed = _checked_seed(seed)
    with _lock:
        _generators[index] = [seed, 0]


def manual_seed_all(seed: int) -> None:
    """Seed every pjrt device's generator (torch.manual_seed does this)."""
    global _seed_all
    seed = _checked_seed(seed)
    with _lock:
        _seed_all = seed
        _generators.clear()


def seed(index: int = 0) -> None:
    manual_seed(random.getrandbits(63), index)


def seed_all() -> None:
    manual_seed_all(random.getrandbits(63))


def initial_seed(index: int = 0) -> int:
    with _lock:
        return _generator(index)[0]


def next_seed_offset(index: int = 0) -> np.ndarray:
    """The (seed, offset) pair for one random op on pjrt:`index`, advancing the offset."""
    with _lock:
        g = _generators.get(index) or _generator(index)
        pair = np.array(g, dtype=np.uint64)
        g[1] += 1
    return pair


def get_state(index: int = 0) -> torch.Tensor:
    """16 bytes (a uint8 CPU tensor): seed and offset as little-endian uint64, CUDA's layout.

    Random ops take their (seed, offset) when they are issued, also in fused mode where they
    run later, so setting a saved state replays the same numbers in every eager mode."""
    with _lock:
        pair = np.array(_generator(index), dtype="<u8")
    return torch.from_numpy(pair.view(np.uint8).copy())


def set_state(state: torch.Tensor, index: int = 0) -> None:
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        got = state.dtype if isinstance(state, torch.Tensor) else type(state).__name__
        raise TypeError(f"RNG state must be a torch.ByteTensor (from torch.pjrt.get_rng_state), got {got}")
    raw = state.detach().cpu().contiguous().numpy().reshape(-1)
    if raw.size != 16:
        raise RuntimeError(f"pjrt RNG state must be 16 bytes, got {raw.size}")
    s, o = raw.view("<u8")
    with _lock:
        _generators[index] = [int(s), int(o)]


def key_from_seed_offset(pair):
    """Inside a traced function: a JAX PRNG key from the (seed, offset) pair."""
    import jax

    key = jax.random.key(pair[0].astype("uint32") ^ (pair[0] >> 32).astype("uint32"))
    return jax.random.fold_in(key, pair[1].astype("uint32"))
