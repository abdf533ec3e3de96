"""Module moves to and from pjrt keep each Parameter object, as moves to CUDA do, so an
optimizer built before `model.to("pjrt")` trains the model."""

import copy
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

# every case runs in strict, debug and fused eager mode
pytestmark = pytest.mark.usefixtures("each_eager_mode")


class Net(nn.Module):
    def __init__(self, n_in=8, hidden=16, n_out=3):
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, n_out)

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def _ids(model):
    return [id(p) for p in model.parameters()]


def _moves():
    return [
        lambda m: m.to("pjrt"),
        lambda m: m.to(device="pjrt"),
        lambda m: m.to(torch.device("pjrt")),
        lambda m: m.to("pjrt:0", torch.float32),
        lambda m: m.pjrt(),
    ]


@pytest.mark.parametrize("move", range(len(_moves())))
def test_parameters_keep_identity_to_pjrt_and_back(move):
    model = nn.Sequential(Net(), nn.BatchNorm1d(3))
    params = list(model.parameters())
    before = _ids(model)
    _moves()[move](model)
    assert _ids(model) == before
    assert all(p.device.type == "pjrt" and type(p) is nn.Parameter for p in params)
    assert all(a is b for a, b in zip(params, model.parameters()))
    model.to(torch.float64)  # a dtype change on the device is in place too
    assert _ids(model) == before and params[0].dtype == torch.float64
    model.cpu()
    assert _ids(model) == before and params[0].device.type == "cpu"
    model.to(device="pjrt").to("cpu")
    assert _ids(model) == before and params[0].device.type == "cpu"


def test_values_attributes_hooks_and_version_follow_the_parameter():
    model = Net()
    ref = copy.deepcopy(model)
    w = model.fc1.weight
    w.note = "kept"
    alive = weakref.ref(w)
    calls = []
    w.register_hook(lambda g: calls.append("hook"))
    w.register_post_accumulate_grad_hook(lambda p: calls.append("post"))
    with torch.no_grad():
        w.mul_(1.0)
    version = w._version
    model.to("pjrt")
    assert model.fc1.weight is w and alive() is w and w.note == "kept"
    assert w._version == version and w.requires_grad and w.is_leaf
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=0, atol=0)
    x = torch.randn(4, 8)
    model(x.to("pjrt")).sum().backward()
    ref(x).sum().backward()
    assert calls == ["hook", "post"]
    torch.testing.assert_close(w.grad.cpu(), ref.fc1.weight.grad, rtol=1e-5, atol=1e-5)
    model.cpu()
    assert calls == ["hook", "post"] and w.grad.device.type == "cpu"
    model(x).sum().backward()
    assert calls == ["hook", "post"] * 2


def test_buffers_move_as_on_cuda_and_shared_ones_stay_shared():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.BatchNorm1d(4)
            self.b = nn.Module()
            self.b.register_buffer("stats", self.a.running_mean)

    model = Shared()
    with torch.no_grad():
        model.a.running_mean.add_(2.0)
    model.to("pjrt")
    assert model.a.running_mean.device.type == "pjrt"
    assert model.b.stats is model.a.running_mean
    assert torch.equal(model.a.running_mean.cpu(), torch.full((4,), 2.0))
    model.cpu()
    assert model.b.stats is model.a.running_mean and model.b.stats.device.type == "cpu"
    assert torch.equal(model.a.running_mean, torch.full((4,), 2.0))


def test_tied_weights_stay_one_parameter_across_moves():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    model = Tied()
    ref = copy.deepcopy(model)
    w = model.emb.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 1
    model.to("pjrt")
    assert model.emb.weight is w and model.head.weight is w
    ids = torch.tensor([[1, 2, 3], [4, 1, 9]])
    model(ids.to("pjrt")).pow(2).mean().backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(ids).pow(2).mean().backward()
    ref_opt.step()
    torch.testing.assert_close(w.cpu(), ref.emb.weight, rtol=1e-5, atol=1e-5)
    model.cpu()
    assert model.emb.weight is w and model.head.weight is w


def test_frozen_parameters_stay_frozen():
    model = Net()
    model.fc1.requires_grad_(False)
    frozen = model.fc1.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.to("pjrt")
    assert not model.fc1.weight.requires_grad and model.fc2.weight.requires_grad
    model(torch.randn(4, 8, device="pjrt")).sum().backward()
    opt.step()
    assert model.fc1.weight.grad is None
    assert torch.equal(model.fc1.weight.cpu(), frozen)


def test_existing_grad_moves_with_its_parameter():
    model = Net()
    x = torch.randn(4, 8)
    model(x).sum().backward()
    w = model.fc1.weight
    g = w.grad
    first = g.clone()
    model.to("pjrt")
    assert w.grad is g and g.device.type == "pjrt" and not g.requires_grad
    torch.testing.assert_close(g.cpu(), first, rtol=0, atol=0)
    model(x.to("pjrt")).sum().backward()  # accumulates into the moved grad
    torch.testing.assert_close(w.grad.cpu(), 2 * first, rtol=1e-5, atol=1e-5)
    model.cpu()
    assert w.grad is g and g.device.type == "cpu"


def _train(model, opt, batches, device):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
], ids=["sgd", "adamw"])
def test_optimizer_built_before_the_move_trains_the_model(make_opt):
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(6)]
    cpu_model = Net()
    model = copy.deepcopy(cpu_model)
    cpu_losses = _train(cpu_model, make_opt(cpu_model.parameters()), batches, "cpu")
    opt = make_opt(model.parameters())
    model.to("pjrt")
    losses = _train(model, opt, batches, "pjrt")
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-5)


def test_optimizer_state_follows_cuda_rules():
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(4)]
    cpu_model = Net()
    model = copy.deepcopy(cpu_model)
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cpu_losses = _train(cpu_model, cpu_opt, batches, "cpu")
    losses = _train(model, opt, batches[:2], "cpu")
    model.to("pjrt")
    assert opt.state[model.fc1.weight]["exp_avg"].device.type == "cpu"  # state stays, as on CUDA
    opt.load_state_dict(opt.state_dict())  # casts the state to each parameter's device
    assert opt.state[model.fc1.weight]["exp_avg"].device.type == "pjrt"
    losses += _train(model, opt, batches[2:], "pjrt")
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-5)


def test_optimizer_state_left_on_the_cpu_is_a_device_error_as_on_cuda():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, [(torch.randn(16, 8), torch.randint(0, 3, (16,)))], "cpu")
    model.to("pjrt")
    model(torch.randn(4, 8, device="pjrt")).sum().backward()
    with pytest.raises(RuntimeError, match="same device"):
        opt.step()


@pytest.mark.slow
def test_accelerate_quicktour_pattern_reaches_cpu_accuracy():
    # optimizer first, then model.to(device), as accelerate's quicktour writes it
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 8, generator=g) * 2
    labels = torch.randint(0, 4, (512,), generator=g)
    data = centers[labels] + torch.randn(512, 8, generator=g)

    def run(device):
        torch.manual_seed(0)
        model = Net(n_out=4)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
        model.to(device)
        for epoch in range(4):
            for i in range(0, 512, 64):
                opt.zero_grad()
                F.cross_entropy(model(data[i:i + 64].to(device)), labels[i:i + 64].to(device)).backward()
                opt.step()
        with torch.no_grad():
            pred = model(data.to(device)).argmax(-1).cpu()
        return (pred == labels).float().mean().item()

    cpu_acc = run("cpu")
    assert cpu_acc > 0.8
    assert run("pjrt") == pytest.approx(cpu_acc, abs=1e-6)


def test_graph_recorded_before_the_move_refuses_backward():
    model = Net()
    loss = model(torch.randn(2, 8)).sum()
    loss.backward(retain_graph=True)
    model.to("pjrt")
    with pytest.raises(RuntimeError, match="recorded before its module moved"):
        loss.backward()


def test_cpu_moves_and_pytorch_flags_keep_stock_behaviour():
    model = Net()
    before = _ids(model)
    mean = nn.BatchNorm1d(3)
    buf = mean.running_mean
    model.to(torch.float64)  # CPU -> CPU: PyTorch's own `param.data = ...`
    mean.to(torch.float64)
    assert _ids(model) == before and mean.running_mean is not buf
    lazy = nn.Linear(2, 2, device="meta")
    w = lazy.weight
    lazy.to_empty(device="pjrt")  # meta is no dense device: a new Parameter, as for CUDA
    assert lazy.weight is not w and lazy.weight.device.type == "pjrt"
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        w = model.fc1.weight
        model.to("pjrt")
        assert model.fc1.weight is not w
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


def test_a_parameter_that_cannot_be_swapped_warns_and_still_moves():
    model = Net()
    w = model.fc1.weight
    held = torch._C._WeakTensorRef(w)  # a C++ weak reference blocks the swap
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.to("pjrt")
    assert any("build it after" in str(c.message) for c in caught)
    assert model.fc1.weight.device.type == "pjrt" and w.device.type == "cpu"
    assert model.fc2.weight.device.type == "pjrt"
    del held


def test_lazy_module_stays_lazy_and_materializes_on_the_device():
    model = nn.LazyLinear(3)
    w = model.weight
    model.to("pjrt")
    assert model.weight is w and isinstance(w, nn.parameter.UninitializedParameter)
    out = model(torch.randn(2, 5, device="pjrt"))
    assert out.shape == (2, 3) and model.weight is w and w.device.type == "pjrt"
    assert type(w) is nn.Parameter and w.shape == (3, 5)
