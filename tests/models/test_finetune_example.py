"""examples/finetune_gpt2.py, the Hugging Face-style loop, runs on pjrt and matches the CPU."""

import importlib.util
from pathlib import Path

import pytest
import torch

import torchpjrt

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).parents[2] / "examples" / "finetune_gpt2.py"


def _example():
    spec = importlib.util.spec_from_file_location("finetune_gpt2", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_example_matches_cpu(tmp_path):
    pytest.importorskip("transformers")
    example = _example()
    args = ["--steps", "6", "--accumulate", "2", "--micro-batch", "4", "--seq", "32", "--lr", "3e-3"]
    cpu = example.main(args + ["--device", "cpu"])
    pjrt = example.main(args + ["--device", "pjrt", "--save", str(tmp_path / "ckpt")])
    torch.testing.assert_close(torch.tensor(pjrt["losses"]), torch.tensor(cpu["losses"]), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(pjrt["grad_norms"]), torch.tensor(cpu["grad_norms"]), rtol=1e-4, atol=0)
    assert abs(pjrt["eval_loss"] - cpu["eval_loss"]) <= 1e-4 * cpu["eval_loss"]
    assert pjrt["losses"][-1] < pjrt["losses"][0]
    fresh = example.build_model(None).to("pjrt")
    torchpjrt.load_model(fresh, tmp_path / "ckpt")
    for (name, a), b in zip(fresh.state_dict().items(), pjrt["model"].state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu()), name
