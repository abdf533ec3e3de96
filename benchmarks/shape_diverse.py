"""Shape-diverse eager code: PyTorch's OpInfo forward samples (many ops, each at a few sizes of its
own), run once each, in a fresh process: torch CPU eager against pjrt strict mode with an empty
cache (a first run: every op compiles per shape) and with the cache that run left (a later run).

    python benchmarks/shape_diverse.py [--ops 150] [--samples 3]

The ops are the first `--ops` of the committed OpInfo baseline (tests/opinfo_baseline.json, the
ones pjrt passes), float32, their first `--samples` samples each. The samples are made on the CPU
before the clock starts and moved to the device inside it (as a program's inputs would be); each
sample's result is read back to the host, so pjrt's time includes its device work.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

BASELINE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "opinfo_baseline.json"


def worker(target, n_ops, n_samples):
    import warnings

    import torch

    from torchpjrt import conformance

    warnings.simplefilter("ignore")
    device = "cpu" if target == "cpu" else "pjrt"
    by_key = {conformance.op_key(o): o for o in conformance.op_db()}
    keys = [k for k in json.loads(BASELINE.read_text())["forward_float32"] if k in by_key][:n_ops]
    work = []
    for key in keys:
        opinfo = by_key[key]
        try:
            samples = list(opinfo.sample_inputs("cpu", torch.float32))[:n_samples]
        except Exception:  # noqa: BLE001 - an op whose samples cannot be made here is left out
            continue
        work += [(opinfo, s) for s in samples]
    seconds = failed = 0
    for opinfo, sample in work:
        t0 = time.perf_counter()
        try:
            out = opinfo.op(conformance._to(sample.input, device), *conformance._to(sample.args, device),
                            **conformance._to(sample.kwargs, device))
            for t in conformance._tensors(out):
                t.cpu()
        except Exception:  # noqa: BLE001 - error samples raise on the CPU too; timed all the same
            failed += 1
        seconds += time.perf_counter() - t0
    compiles = 0
    if device == "pjrt":
        import torchpjrt

        compiles = torchpjrt.eager_stats()["xla_compiles"]
    json.dump({"seconds": seconds, "samples": len(work), "raised": failed, "compiles": compiles}, sys.stdout)


def run(target, cache, args):
    env = dict(os.environ, TORCHPJRT_CACHE_DIR=cache, JAX_COMPILATION_CACHE_DIR=os.path.join(cache, "jax"))
    out = subprocess.run([sys.executable, __file__, "--worker", target, str(args.ops), str(args.samples)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{target} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=150)
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        rows = [("torch CPU", run("cpu", cache, args))]
        rows.append(("pjrt cold", run("strict", cache, args)))
        rows.append(("pjrt warm", run("strict", cache, args)))
    base = rows[0][1]["seconds"]
    print(f"{rows[0][1]['samples']} samples of {args.ops} ops ({rows[0][1]['raised']} raise on the CPU too)")
    print(f"{'run':12s}{'seconds':>10s}{'vs cpu':>9s}{'compiles':>10s}{'ms/sample':>11s}")
    for name, r in rows:
        print(f"{name:12s}{r['seconds']:10.2f}{r['seconds'] / base:8.1f}x{r['compiles']:10d}"
              f"{r['seconds'] / max(r['samples'], 1) * 1e3:11.2f}")


if __name__ == "__main__":
    main()
