"""Training step time of the model suite on pjrt (strict, fused, compiled) versus torch eager
(CPU, or the machine's GPU with --baseline cuda), and checkpoint throughput, measured side by
side in one run.

    python benchmarks/models.py [--size tiny|small] [--models gpt2,llama,...] [--rounds 5] [--steps 5]
                                [--baseline cpu|cuda]

The models are the benchmark workloads of torchpjrt.bench.workloads (the same ones
tests/models/ checks against the CPU): ResNet, DDPM-style UNet, and GPT-2, LLaMA, BERT, T5,
ViT, Mixtral from transformers configs with random weights. A step is forward, loss,
backward and an AdamW update, ending with `loss.item()` as a logging loop does. Rounds
alternate between targets so machine drift hits all of them alike; ratios use medians.
The checkpoint part calls benchmarks/checkpoint_io.py.
"""

import argparse
import copy
import statistics
import time

import torch

import torchpjrt
from eager_overhead import sync
from torchpjrt.bench import workloads

MODES = ("strict", "fused", "compiled")
DEFAULT_MODELS = ("resnet", "unet", "gpt2", "llama", "bert", "t5", "vit", "mixtral")


def make_step(w, target):
    device = "pjrt" if target in MODES else target
    model = copy.deepcopy(w.model).train().to(device)
    forward = torch.compile(model, backend="pjrt") if target == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(1)
    batch = tuple(t.to(device) for t in w.batch_fn(w.batch_size, "cpu"))

    def step():
        loss = w.loss_fn(forward(*batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def mode_of(target):
    return {"fused": "fused"}.get(target, "strict")


def timed(target, step, n):
    with torchpjrt.eager_mode(mode_of(target)):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync("pjrt" if target in MODES else target)
    return (time.perf_counter() - t0) / n


def measure_model(name, size, rounds, steps, baseline="cpu"):
    targets = (baseline,) + MODES
    torch.manual_seed(0)
    w = workloads.build(name, size, None, None)
    step_fns, first_step = {}, {}
    for target in targets:
        torch._dynamo.reset()
        step_fns[target] = make_step(w, target)
        first_step[target] = timed(target, step_fns[target], 1)  # includes compiling
        timed(target, step_fns[target], 2)  # warm-up: the fused graphs and the optimizer's
    times = {t: [] for t in targets}
    for _ in range(rounds):
        for target in targets:
            times[target].append(timed(target, step_fns[target], steps))
    return {t: statistics.median(v) for t, v in times.items()}, first_step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=workloads.SIZES)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpoint-mb", type=int, default=256, help="state dict size for the checkpoint part (0 skips it)")
    parser.add_argument("--baseline", default="cpu", choices=("cpu", "cuda"), help="torch eager device to compare with")
    args = parser.parse_args()
    base = args.baseline
    print(f"platform: {torch.pjrt.platform()} ({torch.pjrt.get_device_name()}); size {args.size}; "
          f"medians of {args.rounds} interleaved rounds of {args.steps} steps")
    header = f"{'model':10s}{base + ' ms':>10s}" + "".join(f"{t + '/' + base:>14s}" for t in MODES)
    header += f"{'first compiled step':>22s}"
    print(header)
    for name in args.models.split(","):
        med, first = measure_model(name, args.size, args.rounds, args.steps, base)
        row = f"{name:10s}{med[base] * 1e3:10.2f}" + "".join(f"{med[t] / med[base]:13.2f}x" for t in MODES)
        row += f"{first['compiled']:20.2f}s"
        print(row, flush=True)

    if args.checkpoint_mb:
        from checkpoint_io import measure as measure_checkpoints

        print(f"\ncheckpoint save/load, {args.checkpoint_mb} MB state dict")
        for row in measure_checkpoints(total_mb=args.checkpoint_mb, repeats=args.rounds):
            print("  " + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
