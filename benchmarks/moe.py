"""Mixture-of-experts training steps whose routing changes every step: pjrt strict and fused
mode against torch CPU eager, with the XLA compiles each step triggers.

    python benchmarks/moe.py [--models qwen2_moe,mixtral] [--steps 30] [--targets cpu,strict,fused]
                             [--experts grouped_mm|eager] [--interleaved ROUNDS]

Targets `strict-exact` and `fused-exact` run the mode with TORCHPJRT_PADDING=off: every
data-dependent size exact, compiled per size (the comparison for padded storages, padding.py).

transformers' default experts implementation (`grouped_mm`) sorts the tokens by expert and
calls `torch.nn.functional.grouped_mm` once per projection: the shapes stay the same whatever
the routing. Its `eager` implementation loops over the experts hit, reading the routing on the
host in every layer (`nonzero` of the expert mask, `torch.where`) and indexing the tokens each
expert got, so every step meets new shapes. Each step draws a new batch. Every target runs in
a fresh process with an empty cache directory (a user's first run), in turn, on the same
batches and weights; ratios are of medians over the steady part (the last half of the steps).

With --interleaved ROUNDS, the targets' fresh processes run ROUNDS times in turn (cpu, strict,
fused, cpu, ...), each reporting the median of its steady steps; the table gives the median over
the rounds and each round's ratio, so that a shared machine's drift hits every target alike.
(Both models in one process, alternating rounds of steps, was tried and dropped: next to a CPU
model the pjrt steps ran 20-40% slower than in a process of their own.)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ("qwen2_moe", "mixtral")
TARGETS = ("cpu", "strict", "fused")
EXACT = "-exact"  # a mode with TORCHPJRT_PADDING=off


def build(name, experts="grouped_mm"):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        max_position_embeddings=64, use_cache=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    if name == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=4, num_experts_per_tok=2, experts_implementation=experts, **common)
        return transformers.Qwen2MoeForCausalLM(config)
    if name == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                            experts_implementation=experts, **common)
        return transformers.MixtralForCausalLM(config)
    raise SystemExit(f"unknown model {name!r}: choose from {', '.join(MODELS)}")


def worker(name, target, steps, batch, seq, experts):
    """One target in this process: per-step seconds and XLA compiles, as JSON on stdout."""
    import jax
    import torch

    compiles = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.__setitem__(0, compiles[0] + (event == "/jax/core/compile/backend_compile_duration")))
    device = "cpu" if target == "cpu" else "pjrt"
    if device == "pjrt":
        import torchpjrt

        torchpjrt.set_eager_mode(target)
    model = build(name, experts).train().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    seconds, per_step, losses = [], [], []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
        before = compiles[0]
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - t0)
        per_step.append(compiles[0] - before)
    json.dump({"seconds": seconds, "compiles": per_step, "losses": losses}, sys.stdout)


def run_interleaved(args):
    """Each target's fresh process, ROUNDS times, in turn (cpu, strict, fused, cpu, ...): the median
    over the rounds of each process's steady median, and the ratio to torch CPU's."""
    steady = slice(args.steps // 2, None)
    targets = args.targets.split(",")
    if "cpu" not in targets:
        targets.insert(0, "cpu")
    print(f"experts_implementation={args.experts}, batch {args.batch} x {args.seq} tokens, a new batch each step; "
          f"{args.interleaved} rounds of a fresh process per target in turn, {args.steps} steps each; "
          f"per process the median of steps {args.steps // 2 + 1}-{args.steps}, then the median over the rounds")
    print(f"{'model':10s}{'target':14s}{'steady ms':>11s}{'vs cpu':>8s}   per round: ms (vs cpu)")
    for name in args.models.split(","):
        medians = {t: [] for t in targets}
        for _ in range(args.interleaved):
            for t in targets:
                medians[t].append(statistics.median(run_target(name, t, args)["seconds"][steady]) * 1e3)
        base = statistics.median(medians["cpu"])
        for t in targets:
            med = statistics.median(medians[t])
            rounds = ", ".join(f"{m:.1f} ({m / c:.2f}x)" for m, c in zip(medians[t], medians["cpu"]))
            print(f"{name:10s}{t:14s}{med:11.1f}{med / base:7.2f}x   {rounds}", flush=True)


def run_target(name, target, args):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHPJRT_CACHE_DIR=cache, JAX_COMPILATION_CACHE_DIR=cache)
        if target.endswith(EXACT):
            env["TORCHPJRT_PADDING"] = "off"
        out = subprocess.run(
            [sys.executable, __file__, "--worker", name, target.removesuffix(EXACT), str(args.steps), str(args.batch),
             str(args.seq), args.experts],
            env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{name} on {target} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        name, target, steps, batch, seq, experts = sys.argv[2:8]
        return worker(name, target, int(steps), int(batch), int(seq), experts)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--experts", default="grouped_mm", choices=("grouped_mm", "eager"),
                        help="transformers' experts implementation")
    parser.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                        help="each target's fresh process ROUNDS times, in turn (see above)")
    args = parser.parse_args()
    if args.interleaved:
        return run_interleaved(args)
    targets = args.targets.split(",")
    steady = slice(args.steps // 2, None)
    print(f"experts_implementation={args.experts}, {args.steps} steps, batch {args.batch} x {args.seq} tokens, "
          "a new batch each step; "
          f"steady = median of steps {args.steps // 2 + 1}-{args.steps}")
    print(f"{'model':10s}{'target':14s}{'first s':>9s}{'steady ms':>11s}{'vs cpu':>8s}{'total s':>9s}"
          f"{'compiles: step 1':>18s}{'2-10':>6s}{'11-':>6s}{'last 10':>9s}{'max |dloss|':>13s}")
    for name in args.models.split(","):
        results = {t: run_target(name, t, args) for t in targets}
        base = results.get("cpu")
        for t, r in results.items():
            s, c = r["seconds"], r["compiles"]
            med = statistics.median(s[steady])
            ratio = f"{med / statistics.median(base['seconds'][steady]):7.2f}x" if base else f"{'':>8s}"
            dloss = max(abs(a - b) for a, b in zip(r["losses"], base["losses"])) if base else float("nan")
            print(f"{name:10s}{t:14s}{s[0]:9.2f}{med * 1e3:11.1f}{ratio}{sum(s):9.2f}"
                  f"{c[0]:18d}{sum(c[1:10]):6d}{sum(c[10:]):6d}{sum(c[-10:]):9d}{dloss:13.2e}", flush=True)


if __name__ == "__main__":
    main()
