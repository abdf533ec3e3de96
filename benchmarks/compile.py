"""torch.compile(backend="pjrt") versus torch CPU eager and inductor, measured side by side.

    python benchmarks/compile.py [--rounds 5] [--steps 5]

Workload: a GPT-2-style language-model training step (transformers GPT2LMHeadModel with
random weights: 4 layers, d_model 256, 4 heads, seq 128, batch 8, AdamW; forward and backward
compiled, the optimizer step eager).

1. Steady-state step time of pjrt compiled, torch CPU eager and inductor on the CPU, in one
   process, rounds interleaved so machine drift hits all alike (medians).
2. Cold compile: the first step of a fresh process (compilation included) for pjrt compiled
   and inductor, each with an empty cache directory.
3. Warm start: the same first step in a second fresh process that finds the persistent
   compilation cache the cold one wrote (AOTAutograd's graphs, the XLA programs as
   executables; Dynamo traces the Python again), as a fraction of the cold time; inductor's
   warm cache alongside.
   Then the same GPT-2 shape written in plain PyTorch through torch's precompile
   (aot_compile + save_compiled_function with backend="pjrt"): a new process loading the
   saved artifact skips Dynamo too.
4. Buffer donation (options={"donate": True}): peak resident memory of a fresh process running
   a compiled SGD-with-momentum update of 256 MiB of parameters, with and without donation.
5. Shape buckets (options={"buckets": ...}): XLA programs compiled for a small transformer
   trained on 12 different sequence lengths, with dynamic=True alone and with buckets.

    python benchmarks/compile.py --parts donation,buckets   # only some parts (steady,cold,donation,buckets)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def build(device):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=4096,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (8, 128)).to(device)
    return model, opt, tokens


def make_step(target):
    import torch

    device = "pjrt" if target == "pjrt-compile" else "cpu"
    model, opt, tokens = build(device)
    if target == "pjrt-compile":
        forward = torch.compile(model, backend="pjrt")
    elif target == "inductor":
        forward = torch.compile(model)
    else:
        forward = model

    def step():
        opt.zero_grad()
        loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        return loss.item()

    return step


class Block(nn.Module):
    """A pre-norm GPT-2 block in plain PyTorch."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class PlainGPT(nn.Module):
    """The benchmark's GPT-2 shape written in plain PyTorch: torch's precompile cannot yet save
    transformers' GPT-2 (its compiled code refers to objects by their id in the saving process),
    and it needs classes defined at module level."""

    def __init__(self, vocab=4096, d=256, heads=4, layers=4, positions=128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def plain_gpt_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def precompiled_first_step_child(mode, path):
    """In a fresh process: the plain GPT's first step, compiling and saving with torch's
    precompile (mode 'save') or loading what a previous process saved (mode 'load')."""
    import torch

    import torchpjrt

    torch.manual_seed(0)
    model = PlainGPT().to("pjrt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 4096, (8, 128)).to("pjrt")
    t0 = time.perf_counter()
    if mode == "save":
        compiled = torch.compile(plain_gpt_loss, backend="pjrt", fullgraph=True).aot_compile(((model, tokens), {}))
        compiled.save_compiled_function(path)
    else:
        with open(path, "rb") as f:
            compiled = torch.compiler.load_compiled_function(f)

    def step():
        opt.zero_grad()
        loss = compiled(model, tokens)
        loss.backward()
        opt.step()
        return loss.item()

    step()
    t1 = time.perf_counter()
    stats = torchpjrt.compile_stats()
    print(json.dumps({"first_step": t1 - t0, "steady_step": _steady(step), "cache_hits": stats["persistent_cache_hits"],
                      "cache_misses": stats["persistent_cache_misses"], "graph_cache_hits": stats["graph_cache_hits"],
                      "kernel_cache_hits": stats["kernel_cache_hits"]}))


def _steady(step, n=3):
    """Median seconds of n more steps: what the first step costs beyond compiling."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def first_step_child(target):
    """In a fresh process: seconds from the start of the step to its end (compile included)."""
    start = time.perf_counter()
    import torch  # noqa: F401

    import torchpjrt  # noqa: F401

    step = make_step(target)
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    from torchpjrt.compile import compile_stats

    stats = compile_stats()
    print(json.dumps({"first_step": t1 - t0, "steady_step": _steady(step), "process": t1 - start,
                      "graph_cache_hits": stats["graph_cache_hits"],
                      "cache_hits": stats["persistent_cache_hits"], "cache_misses": stats["persistent_cache_misses"],
                      "kernel_cache_hits": stats["kernel_cache_hits"]}))


DONATION_CHILD = r"""
import json, resource, sys, torch, torchpjrt
donate = sys.argv[1] == "1"
params = [torch.randn(16 << 20, device="pjrt") for _ in range(4)]     # 4 x 64 MiB
momenta = [torch.zeros_like(p) for p in params]
grads = [torch.randn_like(p) for p in params]
torch.pjrt.synchronize()

@torch.compile(backend="pjrt", options={"donate": donate})
def update(params, momenta, grads):
    for p, m, g in zip(params, momenta, grads):
        m.mul_(0.9).add_(g)
        p.sub_(0.01 * m)

update(params, momenta, grads)   # compiles
torch.pjrt.synchronize()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for _ in range(3):
    update(params, momenta, grads)
    torch.pjrt.synchronize()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from torchpjrt.compile import compile_stats
print(json.dumps({"peak_mib": peak / 1024, "growth_mib": (peak - base) / 1024,
                  "donated": compile_stats()["donated_buffers"]}))
"""


def donation_memory():
    rows = {}
    for donate in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", DONATION_CHILD, donate], capture_output=True, text=True,
                             timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"donation child failed:\n{out.stderr[-3000:]}")
        rows[donate] = json.loads(out.stdout.strip().splitlines()[-1])
    print("compiled SGD-momentum update of 256 MiB of parameters (+256 MiB momenta), peak RSS of the process:")
    for donate, label in (("0", "without donation"), ("1", "donate=True")):
        r = rows[donate]
        print(f"  {label:17s} peak {r['peak_mib']:7.0f} MiB   (+{r['growth_mib']:5.0f} MiB over the first call; "
              f"{r['donated']} buffers donated)")


def bucket_compiles():
    import torch
    import torch.nn as nn

    from torchpjrt.compile import compile_stats

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.qkv = nn.Embedding(100, 32), nn.Linear(32, 96)
            self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 1)

        def forward(self, tokens, mask):
            h = self.embed(tokens)
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            scores = (q @ k.transpose(1, 2) / 32 ** 0.5).masked_fill(~mask[:, None, :], float("-inf"))
            h = self.norm(h + scores.softmax(-1) @ v)
            m = mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * m).sum(1) / m.sum(1)).square().mean()

    lengths = [9, 14, 17, 23, 30, 31, 40, 47, 55, 60, 63, 64]
    print(f"small transformer, forward+backward at {len(lengths)} sequence lengths (9..64):")
    for label, options in (("dynamic=True", None), ("buckets pow2", {"buckets": "pow2"}),
                           ("buckets [32, 64]", {"buckets": [32, 64]})):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Tiny().to("pjrt")
        run = torch.compile(model, backend="pjrt", dynamic=True, options=options)
        before, t0 = compile_stats(), time.perf_counter()
        for n in lengths:
            tokens = torch.randint(0, 100, (4, n), device="pjrt")
            run(tokens, torch.ones(4, n, dtype=torch.bool, device="pjrt")).backward()
        torch.pjrt.synchronize()
        after = compile_stats()
        print(f"  {label:17s} {after['xla_compiles'] - before['xla_compiles']:3d} XLA programs  "
              f"{time.perf_counter() - t0:6.1f} s for the {len(lengths)} steps")


def run_child(target, env, *extra):
    out = subprocess.run([sys.executable, __file__, "--child", target, *extra], capture_output=True, text=True,
                         env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{target} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--parts", default="steady,cold,donation,buckets")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child and args.child[0] == "precompile":
        precompiled_first_step_child(*args.child[1:])
        return
    if args.child:
        first_step_child(args.child[0])
        return
    parts = set(args.parts.split(","))

    import torch

    import torchpjrt  # noqa: F401

    if "steady" in parts:
        steady_state(args)
    if "cold" in parts:
        cold_and_warm()
    if "donation" in parts:
        donation_memory()
    if "buckets" in parts:
        bucket_compiles()


def steady_state(args):
    import torch

    targets = ("cpu", "inductor", "pjrt-compile")
    steps = {t: make_step(t) for t in targets}
    for t in targets:
        for _ in range(2):
            steps[t]()  # warm-up: compiles
    times = {t: [] for t in targets}
    for _ in range(args.rounds):
        for t in targets:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[t]()
            times[t].append((time.perf_counter() - t0) / args.steps)
    med = {t: statistics.median(v) for t, v in times.items()}
    print(f"platform: {torch.pjrt.platform()}; GPT-2-style step (4 layers, d_model 256, seq 128, batch 8, AdamW); "
          f"medians of {args.rounds} interleaved rounds of {args.steps} steps")
    for t in targets:
        print(f"  {t:14s} {med[t] * 1e3:9.1f} ms/step   {med[t] / med['cpu']:5.2f}x torch CPU eager")
    print(f"  pjrt compiled / inductor: {med['pjrt-compile'] / med['inductor']:.2f}x")


def cold_and_warm():
    with tempfile.TemporaryDirectory() as tmp:
        base = {k: v for k, v in os.environ.items() if k not in ("TORCHPJRT_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
        env = {**base, "TORCHPJRT_CACHE_DIR": os.path.join(tmp, "pjrt"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}
        cold_inductor = run_child("inductor", env)
        warm_inductor = run_child("inductor", env)
        cold = run_child("pjrt-compile", env)
        warm = run_child("pjrt-compile", env)
        artifact = os.path.join(tmp, "gpt.pt2")
        saved = run_child("precompile", env, "save", artifact)
        loaded = run_child("precompile", env, "load", artifact)

    def programs_from_disk(run):
        return (f"{run['kernel_cache_hits']} XLA programs loaded as executables, {run['cache_hits']} found in "
                f"JAX's cache, {run['cache_misses']} compiled")

    def compile_time(run):
        return run["first_step"] - run["steady_step"]

    def row(label, run, cold=None, note=""):
        ratio = f"{compile_time(run) / compile_time(cold):6.0%}" if cold else "      "
        first = f"{run['first_step'] / cold['first_step']:4.0%}" if cold else "    "
        print(f"  {label:32s} {run['first_step']:7.2f} s {first}  {compile_time(run):7.2f} s {ratio}  {note}")

    print("a fresh process: first step (compilation included; share of cold) and compile time = first step "
          "minus a steady step (share of cold)")
    print("transformers GPT-2:")
    row("inductor, cold cache", cold_inductor)
    row("inductor, warm cache", warm_inductor, cold_inductor)
    row("pjrt compiled, cold", cold, note=f"{compile_time(cold) / compile_time(cold_inductor):.2f}x inductor's cold compile")
    row("pjrt compiled, warm", warm, cold,
        note=f"{warm['graph_cache_hits']} graphs restored, {programs_from_disk(warm)}; Dynamo traces again")
    print("the same shape in plain PyTorch through torch's precompile "
          "(torch.compile(..., backend='pjrt', fullgraph=True).aot_compile, save_compiled_function):")
    row("compile and save", saved)
    row("load in a new process", loaded, saved,
        note=f"{loaded['graph_cache_hits']} graphs restored, {programs_from_disk(loaded)}")


if __name__ == "__main__":
    main()
