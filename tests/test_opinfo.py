"""PyTorch's OpInfo samples on pjrt vs CPU, for every op in the committed baseline.

The baseline (tests/opinfo_baseline.json) lists the ops that passed when it was written;
an op that stops passing fails here. Regenerate after adding lowerings with:
    python -m torchpjrt.conformance --write-baseline tests/opinfo_baseline.json
    python -m torchpjrt.conformance --grad --write-baseline tests/opinfo_baseline.json
    python -m torchpjrt.conformance --error-inputs --write-baseline tests/opinfo_baseline.json
"""

import json
import os
import pathlib

import pytest
import torch

from torchpjrt import conformance

# CI checks the first samples of each op (the full sweep is the conformance CLI's job);
# TORCHPJRT_OPINFO_SAMPLES=0 checks them all.
MAX_SAMPLES = int(os.environ.get("TORCHPJRT_OPINFO_SAMPLES", "4")) or None
BASELINE = json.loads((pathlib.Path(__file__).parent / "opinfo_baseline.json").read_text())
_BY_KEY = {conformance.op_key(o): o for o in conformance.op_db()}


def _cases(kind):
    return [k for k in BASELINE.get(f"{kind}_float32", []) if k in _BY_KEY]


@pytest.mark.slow
@pytest.mark.parametrize("key", _cases("forward"))
def test_forward_float32(key):
    status, detail = conformance.check_op(_BY_KEY[key], torch.float32, grad=False, max_samples=MAX_SAMPLES)
    assert status == "pass", detail


@pytest.mark.slow
@pytest.mark.parametrize("key", _cases("backward"))
def test_backward_float32(key):
    status, detail = conformance.check_op(_BY_KEY[key], torch.float32, grad=True, max_samples=MAX_SAMPLES)
    assert status == "pass", detail


@pytest.mark.slow
@pytest.mark.parametrize("key", [k for k in BASELINE.get("error_inputs", []) if k in _BY_KEY])
def test_error_inputs_raise_the_cpu_exception_type(key):
    status, detail, same, total = conformance.check_error_inputs(_BY_KEY[key])
    assert status == "pass", detail
