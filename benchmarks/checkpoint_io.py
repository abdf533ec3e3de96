"""Checkpoint throughput: torchpjrt's safetensors path on pjrt tensors against
`safetensors.torch.save_file` / `load_file` on CPU tensors.

    python benchmarks/checkpoint_io.py [--total-mb 256] [--repeats 5] [--dir DIR]

The state dict is float32 and bfloat16 tensors of about 16 MB each. Every repeat runs each
measurement once, the two paths interleaved and their order alternating, so slow phases of a
shared machine hit both; the table shows the median throughput of each and their ratio
(torchpjrt / safetensors: above 1 means torchpjrt is faster). Files stay in the page cache,
so this measures the software path, not the disk.

Rows:
- save: `save_safetensors` (device to host copy, serialize, fsync, rename) against `save_file`
  (serialize only, no fsync);
- save, both fsynced: the same, with the baseline's file fsynced too (the like-for-like cost);
- load: `load_safetensors` until the device arrays are ready, against `load_file` (which only
  maps the file: its tensors are read later, on first use);
- load, both copied: against `load_file` followed by a copy of every tensor into memory.

`measure()` returns the rows for other scripts.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import safetensors.torch
import torch

import torchpjrt


def make_state(total_mb: float, tensor_mb: float = 16.0) -> dict:
    """float32 and bfloat16 tensors (alternating) adding up to about `total_mb` megabytes."""
    total = int(total_mb * 1e6)
    per_tensor = max(int(tensor_mb * 1e6), 4096)
    state, used, i = {}, 0, 0
    while used < total:
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        numel = max(min(per_tensor, total - used) // dtype.itemsize, 1)
        state[f"layer{i}.weight"] = torch.randn(numel, dtype=torch.float32).to(dtype)
        used += numel * dtype.itemsize
        i += 1
    return state


def _fsynced_save_file(state, path):
    safetensors.torch.save_file(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_and_copy(path):
    return {k: v.clone() for k, v in safetensors.torch.load_file(path).items()}


def _load_onto_device(path):
    state = torchpjrt.load_safetensors(path)
    torch.pjrt.synchronize()
    return state


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    result = fn(*args)
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def measure(total_mb: float = 256, repeats: int = 5, directory=None) -> list:
    """Median save/load throughput (MB/s, 1 MB = 10**6 bytes) of both paths, one dict per row."""
    cpu_state = make_state(total_mb)
    device_state = {k: v.to("pjrt") for k, v in cpu_state.items()}
    torch.pjrt.synchronize()
    megabytes = sum(v.numel() * v.element_size() for v in cpu_state.values()) / 1e6
    workdir = tempfile.mkdtemp(prefix="checkpoint_io_", dir=directory)
    ours_file = os.path.join(workdir, "torchpjrt.safetensors")
    cpu_file = os.path.join(workdir, "cpu.safetensors")
    rows = [
        ("save", "save_file", lambda: torchpjrt.save_safetensors(device_state, ours_file),
         lambda: safetensors.torch.save_file(cpu_state, cpu_file)),
        ("save, both fsynced", "save_file + fsync", lambda: torchpjrt.save_safetensors(device_state, ours_file),
         lambda: _fsynced_save_file(cpu_state, cpu_file)),
        ("load", "load_file", lambda: _load_onto_device(ours_file), lambda: safetensors.torch.load_file(cpu_file)),
        ("load, both copied", "load_file + clone", lambda: _load_onto_device(ours_file), lambda: _load_and_copy(cpu_file)),
    ]
    times = {name: ([], []) for name, *_ in rows}
    try:
        # warm-up: compiles, first file creation, page cache
        for _, _, ours, theirs in rows:
            ours()
            theirs()
        for r in range(repeats):
            for name, _, ours, theirs in rows:
                ours_times, their_times = times[name]
                if r % 2 == 0:
                    ours_times.append(_timed(ours))
                    their_times.append(_timed(theirs))
                else:
                    their_times.append(_timed(theirs))
                    ours_times.append(_timed(ours))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = []
    for name, baseline, _, _ in rows:
        ours_times, their_times = times[name]
        ours_rate = megabytes / statistics.median(ours_times)
        their_rate = megabytes / statistics.median(their_times)
        result.append({"operation": name, "baseline": f"safetensors.torch.{baseline}", "megabytes": megabytes,
                       "repeats": repeats, "torchpjrt_mb_s": ours_rate, "safetensors_cpu_mb_s": their_rate,
                       "ratio": ours_rate / their_rate})
    return result


def format_table(rows) -> str:
    lines = ["| operation | torchpjrt (pjrt tensors) | baseline (CPU tensors) | baseline | torchpjrt / baseline |",
             "| --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['operation']} | {row['torchpjrt_mb_s']:.0f} MB/s | {row['safetensors_cpu_mb_s']:.0f} MB/s "
                     f"| `{row['baseline']}` | {row['ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=float, default=256, help="state dict size in MB (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default 5)")
    parser.add_argument("--dir", default=None, help="directory for the files (default: the system temp directory)")
    args = parser.parse_args(argv)
    rows = measure(args.total_mb, args.repeats, args.dir)
    print(f"platform {torch.pjrt.platform()}, {rows[0]['megabytes']:.0f} MB state dict, "
          f"medians of {args.repeats} interleaved repeats")
    print(format_table(rows))


if __name__ == "__main__":
    main()
