"""torchpjrt.export: StableHLO text, save/load, and the saved program running under plain JAX."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import torchpjrt

DEV = "pjrt"


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean((2, 3)))


def _models():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    encoder = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return {
        "mlp": (mlp, torch.randn(5, 16)),
        "cnn": (CNN(), torch.randn(2, 3, 8, 8)),
        "transformer": (encoder, torch.randn(2, 10, 32)),
    }


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_export_matches_cpu_and_round_trips(name, tmp_path):
    model, x = _models()[name]
    model.eval()
    with torch.no_grad():
        expected = model(x)
    exported = torchpjrt.export(model.to(DEV), (x.to(DEV),))
    text = exported.stablehlo()
    assert "stablehlo." in text and "func.func public @main" in text
    torch.testing.assert_close(exported(x.to(DEV)).cpu(), expected, rtol=1e-5, atol=1e-5)
    exported.save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["program.jax", "program.mlirbc", "signature.json", "weights.safetensors"]
    loaded = torchpjrt.load_exported(tmp_path)
    torch.testing.assert_close(loaded(x.to(DEV)).cpu(), expected, rtol=1e-5, atol=1e-5)
    with torchpjrt.eager_mode("fused"):
        torch.testing.assert_close((loaded(x.to(DEV)) * 1).cpu(), expected, rtol=1e-5, atol=1e-5)


PLAIN_JAX = r"""
import json, sys
import numpy as np, jax
from safetensors.numpy import load_file
d = sys.argv[1]
signature = json.load(open(f"{d}/signature.json"))
program = jax.export.deserialize(bytearray(open(f"{d}/program.jax", "rb").read()))
weights = load_file(f"{d}/weights.safetensors")
out = program.call(*[weights[w["name"]] for w in signature["weights"]], np.load(f"{d}/x.npy"))
np.save(f"{d}/out.npy", np.asarray(out[0]))
assert "torch" not in sys.modules and "torchpjrt" not in sys.modules
print("ran without torch")
"""


def test_the_saved_program_runs_with_plain_jax(tmp_path):
    model, x = _models()["cnn"]
    model.eval()
    with torch.no_grad():
        expected = model(x)
    torchpjrt.export(model.to(DEV), (x.to(DEV),)).save(tmp_path)
    np.save(tmp_path / "x.npy", x.numpy())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPJRT")}
    done = subprocess.run([sys.executable, "-c", PLAIN_JAX, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "ran without torch" in done.stdout
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected.numpy(), rtol=1e-5, atol=1e-5)
    signature = json.loads((tmp_path / "signature.json").read_text())
    assert signature["inputs"] == [{"shape": [2, 3, 8, 8], "dtype": "float32"}]
    assert signature["outputs"] == [{"shape": [2, 4], "dtype": "float32"}]
    # BatchNorm's num_batches_tracked is not read in eval mode, so it is not an input
    assert "bn.num_batches_tracked" not in [w["name"] for w in signature["weights"]]


def test_export_errors_are_clear(tmp_path):
    class Factor(nn.Module):
        def forward(self, a):
            return torch.linalg.ldl_factor(a)[0]

    with pytest.raises(torchpjrt.ExportError, match="without a lowering: .*linalg_ldl_factor"):
        torchpjrt.export(Factor(), (torch.eye(4, device=DEV),))
    model, x = _models()["mlp"]
    exported = torchpjrt.export(model.to(DEV), (x.to(DEV),))
    with pytest.raises(ValueError, match=r"input 0 is torch.float32\[3, 16\], exported for torch.float32\[5, 16\]"):
        exported(torch.randn(3, 16, device=DEV))
    with pytest.raises(FileNotFoundError, match="is not an exported program"):
        torchpjrt.load_exported(tmp_path / "nothing")
    exported.save(tmp_path)
    (tmp_path / "program.jax").write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="damaged or not an exported program"):
        torchpjrt.load_exported(tmp_path)
