"""A flash-attention-style Pallas kernel as a PyTorch op on pjrt, inside a small transformer.

    python examples/kernels/flash_attention.py

The forward pass is a Pallas kernel: one program per (batch*head, query block) walks over
the key/value blocks with an online softmax, never materializing the attention matrix. On
TPU and GPU Pallas compiles it natively; on the CPU platform it runs in Pallas' interpret
mode (same results, slow). Pallas kernels have no automatic derivative, so the gradient is
given with `backward=`: the vjp of plain causal attention written in JAX.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import torch
import torchpjrt


def _flash_forward_kernel(q_ref, k_ref, v_ref, o_ref, *, block_k, scale):
    q = q_ref[...].astype(jnp.float32) * scale  # (block_q, d)
    block_q = q.shape[0]
    q_start = pl.program_id(1) * block_q
    rows = q_start + jnp.arange(block_q)[:, None]

    def visit(j, carry):
        m, l, acc = carry
        k = k_ref[pl.ds(j * block_k, block_k), :].astype(jnp.float32)
        v = v_ref[pl.ds(j * block_k, block_k), :].astype(jnp.float32)
        s = q @ k.T
        cols = j * block_k + jnp.arange(block_k)[None, :]
        s = jnp.where(cols <= rows, s, -jnp.inf)  # causal
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[:, None])
        correction = jnp.exp(m - m_new)
        return m_new, correction * l + p.sum(axis=-1), correction[:, None] * acc + p @ v

    init = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    # key blocks past the last query row of this block are fully masked: skip them
    n_blocks = (q_start + block_q + block_k - 1) // block_k
    _, l, acc = jax.lax.fori_loop(0, n_blocks, visit, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def _interpret() -> bool:
    return torch.pjrt.platform() not in ("tpu", "gpu", "cuda", "rocm")


def _reference_attention(q, k, v):
    s = (q.astype(jnp.float32) @ jnp.swapaxes(k, -1, -2).astype(jnp.float32)) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return (jax.nn.softmax(s, axis=-1) @ v.astype(jnp.float32)).astype(q.dtype)


def _attention_backward(inputs, outputs, grad_outputs, block_q, block_k):
    _, pullback = jax.vjp(_reference_attention, *inputs)
    return pullback(grad_outputs[0])


@torchpjrt.kernel(name="examples::flash_attention", backward=_attention_backward)
def flash_attention(q, k, v, block_q: int = 32, block_k: int = 32):
    """Causal attention of q, k, v shaped (batch, heads, seq, head_dim)."""
    b, h, n, d = q.shape
    if n % block_q or n % block_k:
        raise ValueError(f"flash_attention: sequence length {n} must be a multiple of the blocks ({block_q}, {block_k})")
    flat = [t.reshape(b * h, n, d) for t in (q, k, v)]
    kernel = functools.partial(_flash_forward_kernel, block_k=block_k, scale=1.0 / math.sqrt(d))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(flat[0].shape, q.dtype),
        grid=(b * h, n // block_q),
        in_specs=[
            pl.BlockSpec((None, block_q, d), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, n, d), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, n, d), lambda i, j: (i, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_q, d), lambda i, j: (i, j, 0)),
        interpret=_interpret(),
    )(*flat)
    return out.reshape(b, h, n, d)


def main():
    from tiny_transformer import compare_training

    losses, reference = compare_training(attention_fn=flash_attention)
    for step, (a, b) in enumerate(zip(losses, reference)):
        print(f"step {step}: loss with Pallas flash attention on pjrt {a:.6f}   PyTorch SDPA on CPU {b:.6f}")


if __name__ == "__main__":
    main()
