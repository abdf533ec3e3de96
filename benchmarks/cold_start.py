"""Cold start of eager pjrt: how long a fresh process takes to its first training step (or
first `generate()`), and how many XLA programs that compiles, with an empty cache (a user's
first run) and with the cache that run left behind (every later run), next to torch CPU eager.

    python benchmarks/cold_start.py [--workloads mlp,gpt2,generate,generate_static] [--targets strict,fused]

Workloads: the benchmark's `mlp` and `gpt2` (size tiny) training steps with AdamW; `generate`:
GPT-2 tiny's `generate()` of 32 new tokens, greedy, with transformers' default (dynamic) KV
cache, whose length grows every token; `generate_static`: the same with
`cache_implementation="static"`. Each run is its own process; "import" is `import torch` plus
building the model, "first" the first step (or the whole generate call), "to first" the two
together (what a user waits for from the start of the process), "second" the next step.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

WORKLOADS = ("mlp", "gpt2", "generate", "generate_static")
NEW_TOKENS = 32


def worker(workload, target):
    started = time.perf_counter()
    import torch

    device = "cpu" if target == "cpu" else "pjrt"
    if device == "pjrt":
        import torchpjrt

        torchpjrt.set_eager_mode(target)
    torch.manual_seed(0)
    if workload.startswith("generate"):
        import transformers

        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)
        model = transformers.GPT2LMHeadModel(config).eval().to(device)
        ids = torch.randint(0, 256, (1, 8)).to(device)
        extra = {"cache_implementation": "static"} if workload == "generate_static" else {}

        def step():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **extra)
            return out[0, -1].item()
    else:
        from torchpjrt.bench import workloads

        w = workloads.build(workload, "tiny", None, None)
        model = w.model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = [t.to(device) for t in w.batch_fn(w.batch_size, "cpu")]

        def step():
            opt.zero_grad(set_to_none=True)
            loss = w.loss_fn(model(*batch), batch)
            loss.backward()
            opt.step()
            return loss.item()

    imported = time.perf_counter()
    step()
    first = time.perf_counter()
    compiles = loads = 0
    if device == "pjrt":
        from torchpjrt import kernel_cache

        compiles, loads = torchpjrt.eager_stats()["xla_compiles"], kernel_cache.stats["kernel_cache_hits"]
    step()
    second = time.perf_counter()
    json.dump({"import": imported - started, "first": first - imported, "second": second - first,
               "compiles": compiles, "loads": loads}, sys.stdout)


def run(workload, target, cache):
    env = dict(os.environ, TORCHPJRT_CACHE_DIR=cache, JAX_COMPILATION_CACHE_DIR=os.path.join(cache, "jax"))
    out = subprocess.run([sys.executable, __file__, "--worker", workload, target], env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise SystemExit(f"{workload} on {target} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--targets", default="strict,fused")
    args = parser.parse_args()
    print(f"{'workload':16s}{'run':14s}{'import s':>9s}{'first s':>9s}{'vs cpu':>8s}{'to first s':>11s}"
          f"{'vs cpu':>8s}{'second s':>10s}{'compiles':>10s}{'loaded':>8s}")
    for workload in args.workloads.split(","):
        if workload not in WORKLOADS:
            raise SystemExit(f"unknown workload {workload!r}: choose from {', '.join(WORKLOADS)}")
        with tempfile.TemporaryDirectory() as cache:
            base = run(workload, "cpu", cache)
            rows = [("cpu", base)]
            for target in args.targets.split(","):
                with tempfile.TemporaryDirectory() as own:
                    rows.append((f"{target} cold", run(workload, target, own)))
                    rows.append((f"{target} warm", run(workload, target, own)))
        for name, r in rows:
            start, base_start = r["import"] + r["first"], base["import"] + base["first"]
            print(f"{workload:16s}{name:14s}{r['import']:9.2f}{r['first']:9.2f}{r['first'] / base['first']:7.1f}x"
                  f"{start:11.2f}{start / base_start:7.2f}x{r['second']:10.3f}{r['compiles']:10d}{r['loads']:8d}",
                  flush=True)


if __name__ == "__main__":
    main()
