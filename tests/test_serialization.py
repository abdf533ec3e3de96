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


# ---- storage sharing across torch.save / torch.load -----------------------------------------
# Each case builds the same objects on CPU and on pjrt, saves and loads them, and compares what
# comes back with what CPU gives: which tensors share a storage, their geometry, their values, and
# that a write through one of them is seen by the others.


def _views(device):
    base = torch.arange(24.0, device=device).reshape(4, 6)
    other = (torch.arange(10.0, device=device) - 5) / 4
    ints = torch.arange(12, device=device).reshape(3, 4)
    return {
        "base": base, "rows": base[1:3], "col": base[:, 2], "t": base.t(), "view": base.view(6, 4),
        "flat": base.view(-1)[5:17], "step": base[::2, 1::3],
        "other": other, "other_tail": other[4:], "other_2d": other.view(2, 5).t(),
        "ints": ints, "ints_row": ints[2], "bf16": torch.ones(3, device=device, dtype=torch.bfloat16),
    }


def _tied(device):
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    return torch.nn.Sequential(emb, torch.nn.Linear(4, 4), head).to(device)  # .to keeps the tie


def _tensors(obj, prefix=""):
    """The tensors inside nested dicts, lists and tuples, by path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    out = {}
    for k, v in items:
        out.update(_tensors(v, f"{prefix}/{k}"))
    return out


def _structure(tensors):
    """Which tensors share a storage (numbered by first appearance), geometry, storage size, dtype."""
    groups = {}
    return {
        k: (groups.setdefault(t.untyped_storage()._cdata, len(groups)), tuple(t.shape), t.stride(),
            t.storage_offset(), t.untyped_storage().nbytes(), t.dtype)
        for k, t in tensors.items()
    }


def _assert_like_cpu(cpu, loaded, device_type):
    """`loaded` shares storage, holds values and sees writes as `cpu` (the same objects, saved and
    loaded on CPU) does."""
    c, p = _tensors(cpu), _tensors(loaded)
    assert list(c) == list(p)
    assert all(t.device.type == device_type for t in p.values())
    assert _structure(p) == _structure(c)
    for k in c:
        assert torch.equal(p[k].detach().cpu(), c[k].detach()), k
    # a write through each tensor in turn is seen by every tensor on its storage, and nowhere else
    for n, k in enumerate(c):
        c_versions, p_versions = [t._version for t in c.values()], [t._version for t in p.values()]
        with torch.no_grad():
            for t in (c[k], p[k]):
                t[(-1,) * t.dim()].fill_(-1 - n)  # the last element, through a view of the tensor
        for j in c:
            assert torch.equal(p[j].detach().cpu(), c[j].detach()), (k, j)
        # version counters move as CPU's do (per tensor, not per storage)
        assert [t._version - v for t, v in zip(p.values(), p_versions)] == \
            [t._version - v for t, v in zip(c.values(), c_versions)]


def _round_trip(obj, tmp_path=None, **load_kwargs):
    if tmp_path is None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, **load_kwargs)
    path = tmp_path / "ck.pt"
    torch.save(obj, path)
    return torch.load(path, **load_kwargs)


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("map_location", [None, "pjrt", torch.device("pjrt:0"), {"pjrt:0": "pjrt"}])
def test_views_share_storage_after_load_onto_pjrt(map_location, weights_only):
    cpu = _round_trip(_views("cpu"), weights_only=weights_only)
    loaded = _round_trip(_views("pjrt"), map_location=map_location, weights_only=weights_only)
    _assert_like_cpu(cpu, loaded, "pjrt")


def test_reported_case_views_share_one_storage():
    a = torch.arange(6.0, device="pjrt")
    d = _round_trip({"a": a, "v": a[2:4], "w": a.view(2, 3)})
    assert d["v"].untyped_storage()._cdata == d["a"].untyped_storage()._cdata == d["w"].untyped_storage()._cdata
    assert d["v"].storage_offset() == 2
    d["v"][0] = 100.0
    assert d["a"].cpu().tolist() == [0.0, 1.0, 100.0, 3.0, 4.0, 5.0]
    assert d["w"].cpu().tolist() == [[0.0, 1.0, 100.0], [3.0, 4.0, 5.0]]
    d["a"].add_(1)  # a write through the base is read back through the views (cached views refreshed)
    assert d["v"].cpu().tolist() == [101.0, 4.0]


@pytest.mark.parametrize("mmap", [False, True])
def test_cpu_checkpoint_onto_pjrt_keeps_sharing(tmp_path, mmap):
    cpu = _round_trip(_views("cpu"))
    loaded = _round_trip(_views("cpu"), tmp_path, map_location="pjrt", mmap=mmap)
    _assert_like_cpu(cpu, loaded, "pjrt")


def test_pjrt_checkpoint_onto_cpu_keeps_sharing():
    for map_location in ("cpu", {"pjrt:0": "cpu"}, lambda s, loc: s.cpu()):
        cpu = _round_trip(_views("cpu"))
        _assert_like_cpu(cpu, _round_trip(_views("pjrt"), map_location=map_location), "cpu")


def test_pjrt_to_cpu_to_pjrt_round_trip_keeps_sharing():
    cpu = _round_trip(_round_trip(_views("cpu")))
    on_cpu = _round_trip(_views("pjrt"), map_location="cpu")
    _assert_like_cpu(cpu, _round_trip(on_cpu, map_location="pjrt"), "pjrt")
    # and pjrt -> pjrt -> pjrt: a loaded checkpoint saved again
    _assert_like_cpu(_round_trip(_round_trip(_views("cpu"))), _round_trip(_round_trip(_views("pjrt"))), "pjrt")


@pytest.mark.parametrize("map_location", [None, "pjrt", "cpu"])
@pytest.mark.parametrize("weights_only", [True, False])
def test_tied_weights_in_a_state_dict(map_location, weights_only):
    cpu = _round_trip(_tied("cpu").state_dict(), weights_only=weights_only)
    loaded = _round_trip(_tied("pjrt").state_dict(), map_location=map_location, weights_only=weights_only)
    assert loaded["0.weight"].untyped_storage()._cdata == loaded["2.weight"].untyped_storage()._cdata
    _assert_like_cpu(cpu, loaded, "cpu" if map_location == "cpu" else "pjrt")
    # and it loads into a model on the device
    model = _tied("pjrt")
    model.load_state_dict(loaded)
    assert torch.equal(model[0].weight.cpu(), loaded["0.weight"].cpu())


def test_cpu_state_dict_with_tied_weights_onto_pjrt():
    cpu = _round_trip(_tied("cpu").state_dict())
    loaded = _round_trip(_tied("cpu").state_dict(), map_location="pjrt")
    _assert_like_cpu(cpu, loaded, "pjrt")


@pytest.mark.parametrize("map_location", [None, "cpu"])
def test_whole_pickled_model_keeps_tied_weights_and_views(map_location):
    def build(device):
        model = _tied(device)
        # a buffer viewing part of a parameter's storage: only the storage ties them
        model.register_buffer("first_rows", model[1].weight.detach()[:2])
        return model

    cpu = _round_trip(build("cpu"), weights_only=False)
    loaded = _round_trip(build("pjrt"), map_location=map_location, weights_only=False)
    assert loaded[0].weight is loaded[2].weight
    _assert_like_cpu(cpu.state_dict(keep_vars=True), loaded.state_dict(keep_vars=True),
                     "cpu" if map_location == "cpu" else "pjrt")
    # the loaded model still trains with its weights tied
    x = torch.tensor([1, 2, 3], device=loaded[0].weight.device)
    loaded(x).sum().backward()
    assert loaded[0].weight.grad is not None


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_storages_and_tensors_saved_together():
    def objs(device):
        a = torch.arange(8, dtype=torch.uint8, device=device)
        return {"storage": a.untyped_storage(), "a": a, "half": a[4:]}

    cpu = _round_trip(objs("cpu"), weights_only=False)
    loaded = _round_trip(objs("pjrt"), weights_only=False)
    assert type(loaded["storage"]) is type(cpu["storage"])
    assert loaded["storage"].device.type == "pjrt" and loaded["storage"].nbytes() == 8
    ids = {k: loaded[k].untyped_storage()._cdata for k in ("a", "half")}
    assert ids["a"] == ids["half"] == loaded["storage"]._cdata
    _assert_like_cpu({k: cpu[k] for k in ("a", "half")}, {k: loaded[k] for k in ("a", "half")}, "pjrt")


def test_views_of_one_storage_in_two_dtypes_never_load_with_the_wrong_dtype():
    # CPU refuses to save this (its check compares data pointers); where pjrt saves it, loading
    # must not read one view with the other's dtype
    a = torch.arange(4.0, device="pjrt")
    buf = io.BytesIO()
    try:
        torch.save([a, a.view(torch.int32)], buf)
    except RuntimeError as e:
        assert "view the same data as different types" in str(e)
        return
    for map_location in (None, "cpu"):
        buf.seek(0)
        d = torch.load(buf, map_location=map_location, weights_only=False)
        assert d[0].dtype == torch.float32 and d[1].dtype == torch.int32
        assert torch.equal(d[0].cpu(), torch.arange(4.0))
        assert torch.equal(d[1].cpu(), torch.arange(4.0).view(torch.int32))


def test_autograd_sees_writes_through_a_loaded_view():
    a = torch.arange(4.0, device="pjrt")
    d = _round_trip({"a": a, "v": a[1:]})
    w = torch.ones(4, device="pjrt", requires_grad=True)
    y = (w * d["a"]).sum()  # mul saves d["a"] for backward
    d["a"].add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    assert d["v"].cpu().tolist() == [2.0, 3.0, 4.0]
