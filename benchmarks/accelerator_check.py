"""The accelerator check: what torchpjrt does on a GPU or TPU machine, in under 10 minutes.

    python benchmarks/accelerator_check.py [--out DIR] [--budget 540] [--parts bench,overhead,...] [--quick]

Run it on a machine with an NVIDIA GPU (`jax[cuda]` installed) or a TPU (`jax[tpu]`). Each
part runs in its own process under its own time limit (and never past the overall budget);
a part that runs out of time is reported with what it finished:

  env       versions, the accelerator JAX sees, one op on it
  bench     `torchpjrt bench gpt2 --size small`, every target (torch CPU, CUDA eager and
            `torch.compile` where CUDA is present, pjrt strict, fused and compiled on the
            accelerator); its JSON is kept for `torchpjrt bench compare`
  overhead  benchmarks/eager_overhead.py against torch eager on the same GPU (else the CPU)
  modes     benchmarks/eager_modes.py, likewise
  tests     the semantics and training suites on the accelerator (every eager mode)
  models    a model-suite subset (GPT-2, LLaMA) in strict, fused and compiled mode against
            the CPU, then benchmarks/models.py's step times for them
  ddp       a 2-process DDP run (one chip per process) when the machine has 2 chips
  pipeline  a model split across pjrt:0 and pjrt:1 in one process (pipeline style), trained
            against the CPU in strict and fused mode, when the machine has 2 chips

If `env` fails (torchpjrt cannot run one op there), the other parts are skipped at once rather
than each failing the same way. It writes DIR/accelerator_check.json (every part: command,
status, seconds, parsed figures, the tail of its output), DIR/accelerator_check.txt (a short
report) and DIR/bench_gpt2.json.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = ("env", "bench", "overhead", "modes", "tests", "models", "ddp", "pipeline")
# each part's own limit in seconds; the overall budget cuts the last ones short
LIMITS = {"env": 60, "bench": 180, "overhead": 45, "modes": 70, "tests": 100, "models": 70, "ddp": 90, "pipeline": 90}

ENV_PROBE = r"""
import json, time, torch, jax
t0 = time.perf_counter()
import torchpjrt
x = torch.randn(256, 256, device="pjrt")
y = (x @ x).sum().item()
info = {
    "torch": torch.__version__, "jax": jax.__version__,
    "jax_devices": [str(d) for d in jax.devices()],
    "pjrt_platform": torch.pjrt.platform(), "pjrt_device": torch.pjrt.get_device_name(),
    "pjrt_device_count": torch.pjrt.device_count(),
    "cuda_available": torch.cuda.is_available(),
    "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "first_op_s": round(time.perf_counter() - t0, 3),
    "matmul_matches_cpu": abs(y - (x.cpu() @ x.cpu()).sum().item()) <= 1e-3 * max(1.0, abs(y)),
}
print("ENV " + json.dumps(info))
"""

DDP_WORKER = r"""
import os, torch, torch.distributed as dist, torch.nn as nn
import torchpjrt
dist.init_process_group("pjrt")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
ref = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
ref.load_state_dict(model.state_dict())
ddp = nn.parallel.DistributedDataParallel(model.to("pjrt"))
x = torch.randn(world * 16, 64)
ddp(x[rank * 16:(rank + 1) * 16].to("pjrt")).square().mean().backward()
ref(x).square().mean().backward()  # per-rank means averaged = the mean over ranks' batches
worst = max((p.grad.cpu() - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))
print(f"DDP rank {rank}/{world} on {torch.pjrt.get_device_name()}: max |grad - single-process grad| {worst:.2e}")
assert worst < 1e-4
dist.destroy_process_group()
"""


PIPELINE_WORKER = r"""
import torch, torch.nn as nn
import torchpjrt

def train(d0, d1):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(64, 128), nn.GELU()).to(d0)
    b = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)).to(d1)
    opt = torch.optim.AdamW(list(a.parameters()) + list(b.parameters()), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 8, (32,), generator=gen)
        loss = nn.functional.cross_entropy(b(a(x.to(d0)).to(d1)), y.to(d1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {str(p.device) for p in b.parameters()}

torch.pjrt.init()
cpu, _ = train("cpu", "cpu")
for mode in ("strict", "fused"):
    torchpjrt.set_eager_mode(mode)
    losses, devices = train("pjrt:0", "pjrt:1")
    worst = max(abs(p - c) for p, c in zip(losses, cpu))
    print(f"PIPELINE {mode}: pjrt:0 -> pjrt:1 ({torch.pjrt.get_device_name(1)}), stage 2 on {sorted(devices)}, "
          f"max |loss - CPU loss| {worst:.2e}")
    assert devices == {"pjrt:1"} and worst < 1e-3
"""


def accelerator_count():
    """Chips of the machine's accelerator, without starting JAX in this process."""
    probe = ("import jax\nds=[d for d in jax.devices() if d.platform!='cpu']\n"
             "print(len(ds), ds[0].platform if ds else 'cpu')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    count, kind = (out.stdout.split() + ["0", "cpu"])[:2]
    return int(count), kind


def run_part(name, cmd, limit, env=None):
    """Run one part; return its record (status ok / failed / timeout, seconds, output)."""
    t0 = time.perf_counter()
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=limit)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        status = f"timeout after {limit:.0f} s"
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    seconds = round(time.perf_counter() - t0, 1)
    print(f"[{name}] {status} in {seconds} s", flush=True)
    return {"part": name, "command": cmd if isinstance(cmd, str) else " ".join(cmd), "status": status,
            "seconds": seconds, "output": output}


def pytest_counts(output):
    """Outcome counts of a pytest -v run, also of one stopped before its summary line."""
    counts = {}
    for outcome in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"):
        counts[outcome.lower()] = len(re.findall(rf"::\S+ {outcome}\b", output))
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)))
    counts["failed_tests"] = failed[:40]
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="accelerator_check", help="folder for the JSON, the report and the bench JSON")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all parts together (default 540)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--label", default=None, help="this machine's name in the bench JSON (torchpjrt bench --label)")
    parser.add_argument("--quick", action="store_true",
                        help="the overhead part without its model steps (eager_overhead.py --quick): for a slow CPU")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; known: {', '.join(PARTS)}")

    deadline = time.perf_counter() + args.budget
    chips, kind = accelerator_count()
    has_cuda = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                              capture_output=True, text=True).stdout.strip() == "True"
    baseline = "cuda" if has_cuda else "cpu"
    py = sys.executable
    print(f"accelerator: {chips} x {kind}; torch baseline: {baseline}; budget {args.budget:.0f} s", flush=True)
    if not chips:
        print("no accelerator found by JAX: the parts run on the CPU platform", flush=True)
    bench_json = out / "bench_gpt2.json"
    bench_targets = ["cpu"] + (["cuda", "cuda-compile"] if has_cuda else []) + \
        [f"{t}@{kind}" for t in ("pjrt", "pjrt-fused", "pjrt-compile")]
    commands = {
        "env": [py, "-c", ENV_PROBE],
        "bench": [py, "-m", "torchpjrt", "bench", "gpt2", "--size", "small", "--targets", ",".join(bench_targets),
                  "--rounds", "3", "--steps", "5", "--timeout", "150", "--json", str(bench_json)]
                 + (["--label", args.label] if args.label else []),
        "overhead": [py, str(HERE / "eager_overhead.py"), "--baseline", baseline] + (["--quick"] if args.quick else []),
        "modes": [py, str(HERE / "eager_modes.py"), "--baseline", baseline, "--rounds", "3", "--steps", "5"],
        "tests": [py, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider",
                  "tests/test_semantics.py", "tests/test_training.py"],
        "models": [py, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider",
                   "tests/models/test_models.py", "-k", "test_model_trains_like_cpu and (gpt2 or llama)"],
        "ddp": ["torchrun", "--standalone", "--nproc_per_node=2", str(out / "ddp_worker.py")],
        "pipeline": [py, "-c", PIPELINE_WORKER],
    }
    models_speed = [py, str(HERE / "models.py"), "--models", "gpt2,llama", "--rounds", "3", "--steps", "3",
                    "--checkpoint-mb", "0", "--baseline", baseline]
    records = []
    for name in parts:
        left = deadline - time.perf_counter()
        if records and records[0]["part"] == "env" and records[0]["status"] != "ok":
            # torchpjrt does not even run one op here: the other parts would fail the same way
            records.append({"part": name, "status": "skipped: env failed", "seconds": 0, "output": ""})
            continue
        if name in ("ddp", "pipeline") and chips < 2:
            records.append({"part": name, "status": f"skipped: {chips} chip(s)", "seconds": 0, "output": ""})
            continue
        if left < 10:
            records.append({"part": name, "status": "skipped: budget spent", "seconds": 0, "output": ""})
            continue
        if name == "ddp":
            (out / "ddp_worker.py").write_text(DDP_WORKER)
        record = run_part(name, commands[name], min(LIMITS[name], left))
        if name == "ddp":
            (out / "ddp_worker.py").unlink()
        if name in ("tests", "models"):
            record["counts"] = pytest_counts(record["output"])
        if name == "env":
            found = re.search(r"^ENV (.*)$", record["output"], re.M)
            record["info"] = json.loads(found.group(1)) if found else None
        records.append(record)
        if name == "models" and time.perf_counter() < deadline - 30:
            records.append(run_part("models-speed", models_speed, min(90, deadline - time.perf_counter())))

    summary = {"host": platform.node(), "python": sys.version.split()[0], "accelerator": {"kind": kind, "chips": chips},
               "baseline": baseline, "budget_s": args.budget, "parts": [dict(r, output=r["output"][-6000:]) for r in records]}
    (out / "accelerator_check.json").write_text(json.dumps(summary, indent=1))
    lines = [f"accelerator check: {chips} x {kind}, torch baseline {baseline}"]
    for r in records:
        lines.append(f"\n== {r['part']}: {r['status']} ({r['seconds']} s)")
        if "counts" in r:
            c = r["counts"]
            lines.append("   " + ", ".join(f"{k} {v}" for k, v in c.items() if k != "failed_tests"))
            lines += [f"   failed: {t}" for t in c["failed_tests"]]
        if r["part"] == "env" and r.get("info"):
            lines.append("   " + json.dumps(r["info"]))
        elif r["part"] in ("bench", "overhead", "modes", "models-speed", "ddp", "pipeline"):
            lines += ["   " + line for line in r["output"].strip().splitlines()[-28:]]
        elif "failed" in r["status"] or "timeout" in r["status"]:
            lines += ["   " + line for line in r["output"].strip().splitlines()[-12:]]
    report = "\n".join(lines) + "\n"
    (out / "accelerator_check.txt").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
