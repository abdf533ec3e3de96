"""copy.deepcopy, torch.save and torch.load with pjrt tensors."""

import copy
import io

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
