"""Eager overhead of the pjrt device versus torch eager, measured side by side in one run.

    python benchmarks/eager_overhead.py [--baseline cpu|cuda]

1. a 64x64 float32 add, time until the result is ready;
2. an MLP training step (Linear 256-512-512-10, GELU, batch 128, SGD);
3. host cost per op by kind (elementwise, reduction, matmul, view, in-place; factories, fills,
   a cast, cat and a gather) on 64x64 float32:
   a loop of the op with one wait at the end, next to raw `jax.jit` of the same computation
   (the floor any JAX-backed device pays) and torch eager; best of several repeats;
4. fused mode's cost of recording an op (`a + b` and `relu` alternating, 8x32, 50 ops timed
   before the flush that runs them) next to strict mode's and torch eager's cost of the same ops;
5. view kernels: the transformers training steps of benchmarks/models.py (GPT-2, LLaMA, tiny)
   in strict and fused mode with the compiled helper's view kernels and with the Python ones,
   switched back and forth in this process (skipped without the helper, or with --quick).
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

import torchpjrt


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


def classifier_step(model, opt, x, y):
    """A classifier's training step (forward, cross-entropy, backward, optimizer step), returning
    the loss tensor; shared by the benchmarks' MLP workloads."""

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def mlp_step_fn(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(128, 256).to(device)
    y = torch.randint(0, 10, (128,)).to(device)
    return classifier_step(model, opt, x, y)


def time_steps(step, device, n):
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync(device)
    return (time.perf_counter() - t0) / n


def op_kinds(baseline, n=2000, repeats=7):
    """{kind: (pjrt s/op, jax.jit s/op, torch s/op)} for a loop of one op with a wait at the end."""
    import jax
    import jax.numpy as jnp
    from torchpjrt import storage

    a, b = torch.randn(64, 64, device="pjrt"), torch.randn(64, 64, device="pjrt")
    ta, tb = a.to(baseline), b.to(baseline)
    ja, jb = storage.read(a), storage.read(b)
    add, row_sum, matmul, flat = (jax.jit(jnp.add), jax.jit(lambda x: x.sum(1)), jax.jit(jnp.matmul),
                                  jax.jit(lambda x: x.reshape(4096)))
    scale = jax.jit(jnp.multiply)
    linear = jax.jit(lambda x, w: x @ w.T)
    c, i = torch.randn(64, 64, device="pjrt"), torch.randint(0, 64, (64,), device="pjrt")
    tc, ti = c.to(baseline), i.to(baseline)
    ji = storage.read(i)
    zeros, ones_like, full = (jax.jit(lambda: jnp.zeros((64, 64))), jax.jit(jnp.ones_like),
                              jax.jit(lambda: jnp.full((64, 64), 2.0)))
    half, cat, gather = (jax.jit(lambda x: x.astype(jnp.float16)), jax.jit(lambda x, y: jnp.concatenate([x, y])),
                         jax.jit(lambda x, j: x[j]))
    cases = {
        "elementwise a + b": (lambda: a + b, lambda: ta + tb, lambda: add(ja, jb)),
        # a Python number as an argument (jit is handed the float, as a JAX program passes one)
        "with a number a * 2.5": (lambda: a * 2.5, lambda: ta * 2.5, lambda: scale(ja, 2.5)),
        "reduction a.sum(1)": (lambda: a.sum(1), lambda: ta.sum(1), lambda: row_sum(ja)),
        "matmul a @ b": (lambda: a @ b, lambda: ta @ tb, lambda: matmul(ja, jb)),
        # a view argument: the weight as nn.Linear reads it (w.t(), read in the program at its offset)
        "linear F.linear(a, b)": (lambda: torch.nn.functional.linear(a, b), lambda: torch.nn.functional.linear(ta, tb),
                                  lambda: linear(ja, jb)),
        "view a.view(4096)": (lambda: a.view(4096), lambda: ta.view(4096), lambda: flat(ja)),
        "in-place a.add_(b)": (lambda: a.add_(b), lambda: ta.add_(tb), lambda: add(ja, jb)),
        # factories, fills, casts and data movement: what autograd, optimizers and models make
        # between their math ops (ones_like seeds backward; torch.zeros, full: empty + fill_)
        "factory torch.zeros": (lambda: torch.zeros(64, 64, device="pjrt"), lambda: torch.zeros(64, 64, device=baseline),
                                lambda: zeros()),
        "factory ones_like(a)": (lambda: torch.ones_like(a), lambda: torch.ones_like(ta), lambda: ones_like(ja)),
        "factory torch.full": (lambda: torch.full((64, 64), 2.0, device="pjrt"),
                               lambda: torch.full((64, 64), 2.0, device=baseline), lambda: full()),
        "fill c.fill_(1.0)": (lambda: c.fill_(1.0), lambda: tc.fill_(1.0), lambda: ones_like(ja)),
        "cast a.to(float16)": (lambda: a.to(torch.float16), lambda: ta.to(torch.float16), lambda: half(ja)),
        "cat torch.cat([a, b])": (lambda: torch.cat([a, b]), lambda: torch.cat([ta, tb]), lambda: cat(ja, jb)),
        "gather a[i]": (lambda: a[i], lambda: ta[ti], lambda: gather(ja, ji)),
    }
    waits = {"pjrt": lambda r: storage.read(r).block_until_ready(), "jax": lambda r: r.block_until_ready(),
             "torch": lambda r: sync(baseline)}

    def per_op(fn, wait):
        for _ in range(200):
            r = fn()
        wait(r)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                r = fn()
            wait(r)
            best = min(best, (time.perf_counter() - t0) / n)
        return best

    return {kind: (per_op(p, waits["pjrt"]), per_op(j, waits["jax"]), per_op(t, waits["torch"]))
            for kind, (p, t, j) in cases.items()}


def recording_cost(baseline, n=50, repeats=300):
    """{target: s per op} for a chain of n elementwise ops: fused mode recording them (timed
    before the flush that runs them), strict mode dispatching them, torch eager running them."""
    x0, b0 = torch.randn(8, 32), torch.randn(8, 32)

    def chain(x, b):
        for i in range(n):
            x = x + b if i % 2 else torch.relu(x)
        return x

    costs = {}
    for target in ("fused", "strict", baseline):
        on_pjrt = target in ("fused", "strict")
        x, b = x0.to("pjrt" if on_pjrt else baseline), b0.to("pjrt" if on_pjrt else baseline)
        with torchpjrt.eager_mode(target if on_pjrt else "strict"):
            for _ in range(5):
                chain(x, b).sum().item()  # compiles (fused: the graph, at its second sighting)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = chain(x, b)
                best = min(best, time.perf_counter() - t0)
                out.sum().item()  # fused: the flush, outside the timed part
        costs[target] = best / n
    return costs


def view_kernel_steps(models=("gpt2", "llama"), rounds=5, steps=5):
    """{(model, mode): (native s/step, Python s/step)}: the same step with each view path."""
    from models import make_step  # imported here: models.py imports this module
    from torchpjrt import dispatch, native
    from torchpjrt.bench import workloads

    if native.library() is None:
        return {}
    results = {}
    for name in models:
        for mode in ("strict", "fused"):
            torchpjrt.set_eager_mode(mode)
            torch.manual_seed(0)
            step = make_step(workloads.build(name, "tiny", None, None), mode)
            times = {True: [], False: []}
            for r in range(rounds + 1):
                for native_views in (True, False):
                    dispatch.native_views_wanted = native_views
                    dispatch.update_view_kernels()
                    t0 = time.perf_counter()
                    for _ in range(steps if r else 3):  # round 0 warms up (compiles) both
                        step()
                    if r:
                        times[native_views].append((time.perf_counter() - t0) / steps)
            results[(name, mode)] = (statistics.median(times[True]), statistics.median(times[False]))
    dispatch.native_views_wanted = True
    dispatch.update_view_kernels()
    torchpjrt.set_eager_mode("strict")
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="cpu", choices=("cpu", "cuda"), help="torch eager device to compare with")
    parser.add_argument("--quick", action="store_true", help="skip part 4 (model steps with each view path)")
    args = parser.parse_args()
    baseline = args.baseline
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
    print("\nhost cost per op (a loop of the op, one wait at the end; best of 7)")
    print(f"{'op kind':22s} {'pjrt':>9s} {'jax.jit':>9s} {'torch ' + baseline:>10s} {'pjrt/jit':>9s} {'pjrt/' + baseline:>10s}")
    for kind, (p, jt, t) in op_kinds(baseline).items():
        print(f"{kind:22s} {p * 1e6:7.1f}us {jt * 1e6:7.1f}us {t * 1e6:8.1f}us {p / jt:8.2f}x {p / t:9.2f}x")
    costs = recording_cost(baseline)
    print("\nfused mode: recording an op (a + b and relu alternating, 50 ops timed before their flush)")
    print(f"{'recorded op':>12s} {'strict op':>10s} {'torch ' + baseline:>10s} {'recorded/strict':>16s} "
          f"{'recorded/' + baseline:>14s}")
    f, st, t = costs["fused"], costs["strict"], costs[baseline]
    print(f"{f * 1e6:10.2f}us {st * 1e6:8.2f}us {t * 1e6:8.2f}us {f / st:15.2f}x {f / t:13.2f}x")
    if args.quick:
        return
    steps = view_kernel_steps()
    if not steps:
        from torchpjrt import native

        print(f"\nview kernels: the compiled helper is not available ({native.failure()})")
        return
    print("\ntraining step with the compiled helper's view kernels vs the Python ones (medians, same process)")
    print(f"{'model':8s} {'mode':7s} {'native':>10s} {'python':>10s} {'python/native':>14s}")
    for (name, mode), (n, py) in steps.items():
        print(f"{name:8s} {mode:7s} {n * 1e3:8.2f}ms {py * 1e3:8.2f}ms {py / n:13.2f}x")


if __name__ == "__main__":
    main()
