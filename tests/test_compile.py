"""torch.compile(backend="pjrt"): graphs built from the lowering table, compiled by XLA."""

import copy
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchpjrt.compile import compile_stats


def test_compiled_training_step_matches_cpu():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    ref = copy.deepcopy(model)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    dev = model.to("pjrt")
    compiled = torch.compile(dev, backend="pjrt")
    before = compile_stats().get("graphs", 0)
    loss = F.cross_entropy(compiled(x.to("pjrt")), y.to("pjrt"))
    loss.backward()
    assert compile_stats()["graphs"] >= before + 2  # forward and backward
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(ref.parameters(), dev.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-4, atol=1e-6)


def test_backend_is_found_without_importing_torchpjrt():
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: (x * 2).sum(), backend='pjrt')\n"
        "import torchpjrt\n"
        "print(f(torch.ones(3, device='pjrt')).item())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("6.0")


CACHED_RUN = r"""
import json, torch, torch.nn as nn, torchpjrt
from torchpjrt.compile import compile_stats
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to("pjrt")
step = torch.compile(lambda x: model(x).square().mean(), backend="pjrt")
loss = step(torch.randn(4, 8, device="pjrt"))
loss.backward()
s = compile_stats()
print(json.dumps({k: s[k] for k in ("persistent_cache_dir", "persistent_cache_hits", "persistent_cache_misses")}))
"""


def test_a_second_process_loads_compiled_programs_from_the_persistent_cache(tmp_path):
    import json
    import os

    env = {**os.environ, "TORCHPJRT_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", CACHED_RUN], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["persistent_cache_dir"] == str(tmp_path / "cache")
    assert cold["persistent_cache_hits"] == 0 and cold["persistent_cache_misses"] > 0
    assert warm["persistent_cache_hits"] >= cold["persistent_cache_misses"]
    assert warm["persistent_cache_misses"] == 0
    off = subprocess.run([sys.executable, "-c", CACHED_RUN], capture_output=True, text=True, timeout=300,
                         env={**env, "TORCHPJRT_CACHE_DIR": "off"})
    assert json.loads(off.stdout.strip().splitlines()[-1])["persistent_cache_dir"] is None
