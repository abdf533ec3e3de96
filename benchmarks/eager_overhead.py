"""Eager overhead of the pjrt device versus torch eager, measured side by side in one run.

    python benchmarks/eager_overhead.py [--baseline cpu|cuda]

1. a 64x64 float32 add, time until the result is ready;
2. an MLP training step (Linear 256-512-512-10, GELU, batch 128, SGD).
The baseline is torch eager on the CPU, or with `--baseline cuda` on the same machine's GPU
(what pjrt on a GPU competes with). Rounds alternate between targets so machine drift hits
both alike; ratios use medians.
"""

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchpjrt  # noqa: F401


def sync(device):
    """Wait until the device has finished what was issued (torch CPU eager is synchronous)."""
    if device == "pjrt":
        torch.pjrt.synchronize()
    elif device == "cuda":
        torch.cuda.synchronize()


def time_add(device, n):
    a = torch.randn(64, 64, device=device)
    b = torch.randn(64, 64, device=device)
    from torchpjrt import storage

    t0 = time.perf_counter()
    for _ in range(n):
        c = a + b
        if device == "pjrt":
            storage.read(c).block_until_ready()
        elif device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def time_jax_add(n):
    """Raw jax.jit dispatch of the same add: the floor any JAX-backed device pays."""
    import jax
    import jax.numpy as jnp

    add = jax.jit(jnp.add)
    a = jnp.ones((64, 64), jnp.float32)
    b = jnp.ones((64, 64), jnp.float32)
    t0 = time.perf_counter()
    for _ in range(n):
        add(a, b).block_until_ready()
    return (time.perf_counter() - t0) / n


def mlp_step_fn(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(128, 256).to(device)
    y = torch.randint(0, 10, (128,)).to(device)

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def time_steps(step, device, n):
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync(device)
    return (time.perf_counter() - t0) / n


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="cpu", choices=("cpu", "cuda"), help="torch eager device to compare with")
    baseline = parser.parse_args().baseline
    devices = [baseline, "pjrt"]
    add_t = {d: [] for d in devices}
    jax_t = []
    for d in devices:
        time_add(d, 200)  # warm-up (compiles)
    time_jax_add(200)
    for _ in range(7):
        for d in devices:
            add_t[d].append(time_add(d, 500))
        jax_t.append(time_jax_add(500))
    steps = {d: mlp_step_fn(d) for d in devices}
    for d in devices:
        time_steps(steps[d], d, 5)
    mlp_t = {d: [] for d in devices}
    for _ in range(7):
        for d in devices:
            mlp_t[d].append(time_steps(steps[d], d, 10))
    med = {k: {d: statistics.median(v[d]) for d in devices} for k, v in (("add", add_t), ("mlp", mlp_t))}
    print(f"platform: {torch.pjrt.platform()}  ({torch.pjrt.get_device_name()})")
    print(f"{'benchmark':28s} {'torch ' + baseline:>12s} {'pjrt':>12s} {'pjrt/' + baseline:>10s}")
    for name, label in (("add", "add 64x64 (until ready)"), ("mlp", "MLP train step (SGD)")):
        c, p = med[name][baseline], med[name]["pjrt"]
        print(f"{label:28s} {c * 1e6:10.1f}us {p * 1e6:10.1f}us {p / c:9.2f}x")
    j = statistics.median(jax_t)
    print(f"raw jax.jit add (until ready): {j * 1e6:.1f}us = {j / med['add'][baseline]:.2f}x torch {baseline}; "
          f"pjrt / raw jax = {med['add']['pjrt'] / j:.2f}x")


if __name__ == "__main__":
    main()
