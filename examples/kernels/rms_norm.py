"""A fused RMSNorm written in JAX, used as a PyTorch op on pjrt inside a small transformer.

    python examples/kernels/rms_norm.py

The kernel is one JAX function; `@torchpjrt.kernel` makes it a torch op with a fake
implementation (from jax.eval_shape) and a gradient (from jax.vjp). XLA fuses the whole
normalization into one loop over the data.
"""

import jax
import jax.numpy as jnp

import torchpjrt


@torchpjrt.kernel(name="examples::rms_norm")
def rms_norm(x, weight, eps: float = 1e-6):
    # accumulate in float32 even for bfloat16 activations
    x32 = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale).astype(x.dtype) * weight


def main():
    from tiny_transformer import compare_training

    losses, reference = compare_training(norm_fn=rms_norm)
    for step, (a, b) in enumerate(zip(losses, reference)):
        print(f"step {step}: loss with the JAX RMSNorm on pjrt {a:.6f}   plain PyTorch on CPU {b:.6f}")


if __name__ == "__main__":
    main()
