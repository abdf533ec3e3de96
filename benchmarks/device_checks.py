"""Cost of the asynchronous device checks (out-of-range indices, bad labels), measured side by
side in one run: the same work with checks on and off, rounds alternating.

    python benchmarks/device_checks.py

1. per checked op: an embedding lookup, an index_select and x[idx] on small tensors (strict mode,
   time until ready);
2. per training step, strict and fused mode: the MLP step of benchmarks/eager_overhead.py
   (cross_entropy: one checked nll_loss) and a small GPT-2 step (transformers; embedding lookups
   and the loss), AdamW.
Ratios (on / off) use medians.
"""

import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchpjrt
from eager_overhead import classifier_step
from torchpjrt import device_checks, storage


def op_fn(name):
    w = torch.randn(1000, 64, device="pjrt")
    idx = torch.randint(0, 1000, (32,), device="pjrt")
    ops = {
        "embedding": lambda: F.embedding(idx, w),
        "index_select": lambda: w.index_select(0, idx),
        "x[idx]": lambda: w[idx],
    }
    op = ops[name]

    def run():
        for _ in range(OPS_PER_CALL):
            storage.read(op()).block_until_ready()
        torch.pjrt.synchronize()  # reads the pending check vectors

    return run


OPS_PER_CALL = 200


def mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).to("pjrt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = classifier_step(model, opt, torch.randn(128, 256).to("pjrt"), torch.randint(0, 10, (128,)).to("pjrt"))
    return lambda: step().item()


def gpt2_step():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=128)
    model = GPT2LMHeadModel(config).to("pjrt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 1000, (8, 64)).to("pjrt")

    def step():
        opt.zero_grad()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        return loss.item()

    return step


def timed(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def compare(make, n, rounds, mode="strict"):
    """(median seconds with checks on, with them off): one instance each, rounds alternating."""
    with torchpjrt.eager_mode(mode):
        runs = {}
        for on in (True, False):
            device_checks.set_enabled(on)
            runs[on] = make()
            timed(runs[on], 3)  # compiles
        times = {True: [], False: []}
        for _ in range(rounds):
            for on in (True, False):
                device_checks.set_enabled(on)
                times[on].append(timed(runs[on], n))
        device_checks.set_enabled(True)
    return statistics.median(times[True]), statistics.median(times[False])


def main():
    rows = []
    for name in ("embedding", "index_select", "x[idx]"):
        fn = op_fn(name)
        on, off = compare(lambda: fn, 1, 9)
        rows.append((f"{name} (per op, until ready)", on / OPS_PER_CALL, off / OPS_PER_CALL))
    # a step's cost is a few percent at most: many alternating rounds, or noise decides
    rows.append(("MLP step, strict", *compare(mlp_step, 10, 21)))
    rows.append(("MLP step, fused", *compare(mlp_step, 10, 21, "fused")))
    try:
        rows.append(("GPT-2 step, strict", *compare(gpt2_step, 3, 11)))
        rows.append(("GPT-2 step, fused", *compare(gpt2_step, 3, 11, "fused")))
    except ImportError:
        print("transformers is not installed: GPT-2 rows skipped", file=sys.stderr)
    print(f"platform: {torch.pjrt.platform()}  ({torch.pjrt.get_device_name()})")
    print(f"{'benchmark':28s} {'checks on':>12s} {'checks off':>12s} {'on/off':>8s}")
    for label, on, off in rows:
        print(f"{label:28s} {on * 1e6:10.1f}us {off * 1e6:10.1f}us {on / off:7.3f}x")


if __name__ == "__main__":
    main()
