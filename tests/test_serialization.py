"""copy.deepcopy, torch.save and torch.load with pjrt tensors."""

import copy
import io
import pickle

import pytest
import torch


def test_deepcopy_tensor_and_module():
    x = torch.randn(3, 4)
    p = x.to("pjrt")
    y = copy.deepcopy(p)
    assert y.device.type == "pjrt" and torch.equal(y.cpu(), x)
    y.add_(1)  # the copy is independent
    assert torch.equal(p.cpu(), x)
    m = torch.nn.Linear(3, 2).to("pjrt")
    m2 = copy.deepcopy(m)
    assert torch.equal(m2.weight.cpu(), m.weight.cpu())
    assert m2.weight.device.type == "pjrt"


def test_save_and_load_keep_views_and_dtypes():
    x = torch.randn(3, 4)
    p = x.to("pjrt")
    buf = io.BytesIO()
    torch.save({"a": p, "b": p[1:], "h": p.bfloat16(), "i": torch.arange(5, device="pjrt")}, buf)
    buf.seek(0)
    d = torch.load(buf)
    assert d["a"].device.type == "pjrt"
    assert torch.equal(d["a"].cpu(), x) and torch.equal(d["b"].cpu(), x[1:])
    assert torch.equal(d["h"].cpu(), x.bfloat16()) and d["i"].cpu().tolist() == [0, 1, 2, 3, 4]
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert on_cpu["a"].device.type == "cpu" and torch.equal(on_cpu["a"], x)


def test_load_cpu_checkpoint_onto_pjrt_weights_only():
    m = torch.nn.Linear(4, 3)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, map_location="pjrt", weights_only=True)
    assert sd["weight"].device.type == "pjrt"
    assert torch.equal(sd["weight"].cpu(), m.weight.detach())
    m2 = torch.nn.Linear(4, 3).to("pjrt")
    m2.load_state_dict(sd)
    assert torch.equal(m2.bias.cpu(), m.bias.detach())


_unpickle_calls = []


def _record_unpickle_call():
    _unpickle_calls.append(True)


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (_record_unpickle_call, ())


def test_load_onto_pjrt_uses_the_default_weights_only(tmp_path):
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / "train.pt"
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "tags": ["a"]}, path)
    for kwargs in ({"map_location": "pjrt"}, {"map_location": torch.device("pjrt"), "mmap": True}):
        ck = torch.load(path, **kwargs)  # no weights_only argument: PyTorch's default (True)
        assert ck["epoch"] == 3 and ck["tags"] == ["a"]
        assert ck["model"]["weight"].device.type == "pjrt"
        assert torch.equal(ck["model"]["weight"].cpu(), m.weight.detach())
        exp_avg = ck["optimizer"]["state"][0]["exp_avg"]
        assert exp_avg.device.type == "pjrt" and torch.equal(exp_avg.cpu(), opt.state[m.weight]["exp_avg"])
    on_device = torch.nn.Linear(4, 3).to("pjrt")
    on_device.load_state_dict(ck["model"])
    torch.optim.AdamW(on_device.parameters()).load_state_dict(ck["optimizer"])

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2), "payload": _RunsCodeWhenUnpickled()}, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(buf, map_location="pjrt")
    assert _unpickle_calls == []
