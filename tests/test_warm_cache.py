"""A program run twice in fresh processes: the second loads every kernel from the on-disk kernel
cache the first wrote, and must neither crash (a loaded executable whose custom calls the new
process had not initialized segfaulted: cholesky, inv, solve, eigh, qr, svd on CPU) nor compute
anything else."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from torchpjrt.ops import TABLE

WORKER = pathlib.Path(__file__).with_name("warm_cache_worker.py")


def _run(cache, out):
    env = dict(os.environ, TORCHPJRT_CACHE_DIR=str(cache), TORCHPJRT_KERNEL_CACHE="on")
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"worker exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
def test_second_run_loads_every_kernel_and_matches(tmp_path):
    cold = _run(tmp_path / "cache", tmp_path / "cold.json")
    warm = _run(tmp_path / "cache", tmp_path / "warm.json")
    assert warm["kernel_cache"].get("kernel_cache_hits", 0) > 100, warm["kernel_cache"]
    assert warm["kernel_cache"].get("kernel_cache_misses", 0) <= cold["kernel_cache"].get("kernel_cache_misses", 0) // 10
    failing = {k: v for k, v in warm["results"].items() if v[0] != "pass"}
    assert not failing, failing
    assert warm["results"] == cold["results"]
    assert warm["programs"] == cold["programs"]  # bit for bit
    for name, values in warm["programs"].items():
        torch.testing.assert_close(torch.tensor(values[0]) if name == "compiled_linalg" else values,
                                   torch.tensor(warm["cpu_programs"][name][0]) if name == "compiled_linalg"
                                   else warm["cpu_programs"][name], rtol=1e-4, atol=1e-5)
    # every lowering file that eager execution uses was exercised
    eager_families = {lowering.fn.__module__.rsplit(".", 1)[1] for lowering in TABLE.values()
                      if lowering.eager and not lowering.user_code}  # custom kernels other tests made: not ours
    assert eager_families <= set(cold["families"]), eager_families - set(cold["families"])
