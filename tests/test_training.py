"""Unchanged PyTorch training loops give the same losses on pjrt as on CPU."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

# every case runs in strict, debug and fused eager mode
pytestmark = pytest.mark.usefixtures("each_eager_mode")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 64)
        self.out = nn.Linear(64, 5)

    def forward(self, x):
        x = F.gelu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.out(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        # no bias before BatchNorm: its true gradient is 0, so AdamW would amplify rounding noise
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.silu(self.conv2(x))
        return self.fc(self.pool(x).flatten(1))


def _data(kind, steps):
    """Batches labelled by a fixed random teacher, so the loss really goes down."""
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        teacher = torch.randn(20, 5, generator=g)
        xs = [torch.randn(32, 20, generator=g) for _ in range(steps)]
        return [(x, (x @ teacher).argmax(1)) for x in xs]
    teacher = torch.randn(3, 4, generator=g)
    xs = [torch.randn(8, 3, 16, 16, generator=g) for _ in range(steps)]
    return [(x, (x.mean((2, 3)) @ teacher).argmax(1)) for x in xs]


def _train(model, device, opt_name, batches, foreach=None):
    model = copy.deepcopy(model).to(device)
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, foreach=foreach)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    losses = []
    for xb, yb in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(xb.to(device)), yb.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, model, opt


@pytest.mark.parametrize("kind", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_losses_match_cpu(kind, opt_name):
    torch.manual_seed(0)
    model = MLP() if kind == "mlp" else CNN()
    batches = _data(kind, 20)
    cpu_losses, cpu_model, _ = _train(model, "cpu", opt_name, batches)
    dev_losses, dev_model, _ = _train(model, "pjrt", opt_name, batches)
    assert sum(cpu_losses[-5:]) < sum(cpu_losses[:5])
    torch.testing.assert_close(torch.tensor(dev_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-5)
    for (n, a), b in zip(cpu_model.state_dict().items(), dev_model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-3, atol=1e-4, msg=n)


@pytest.mark.parametrize("foreach", [True, False])
def test_optimizer_implementations_and_state_dict(foreach):
    torch.manual_seed(0)
    model = MLP()
    batches = _data("mlp", 5)
    cpu_losses, _, _ = _train(model, "cpu", "adamw", batches, foreach=foreach)
    dev_losses, dev_model, dev_opt = _train(model, "pjrt", "adamw", batches, foreach=foreach)
    torch.testing.assert_close(torch.tensor(dev_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-5)
    # state_dict / load_state_dict round trip of model and optimizer, on the device
    sd, osd = dev_model.state_dict(), dev_opt.state_dict()
    assert all(v.device.type == "pjrt" for v in sd.values())
    clone = MLP().to("pjrt")
    clone.load_state_dict(sd)
    opt2 = torch.optim.AdamW(clone.parameters(), lr=1e-2, foreach=foreach)
    opt2.load_state_dict(osd)
    xb = torch.randn(4, 20).to("pjrt")
    torch.testing.assert_close(clone(xb).cpu(), dev_model(xb).cpu())
    state = next(iter(opt2.state.values()))
    assert state["exp_avg"].device.type == "pjrt"


def test_zero_grad_and_grad_accumulation():
    torch.manual_seed(0)
    model = MLP().to("pjrt")
    x = torch.randn(4, 20).to("pjrt")
    model(x).sum().backward()
    g1 = model.fc1.weight.grad.clone()
    model(x).sum().backward()
    torch.testing.assert_close(model.fc1.weight.grad.cpu(), 2 * g1.cpu())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    assert model.fc1.weight.grad is None


def test_tied_weights_stay_tied_after_to():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    torch.manual_seed(0)
    model = Tied()
    ids = torch.tensor([[1, 2, 3], [4, 1, 9]])
    ref = copy.deepcopy(model)
    ref(ids).pow(2).sum().backward()
    dev = model.to("pjrt")
    assert dev.head.weight is dev.emb.weight
    dev(ids.to("pjrt")).pow(2).sum().backward()
    torch.testing.assert_close(dev.emb.weight.grad.cpu(), ref.emb.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 1])
def test_weight_norm_trains_like_cpu(dim):
    """parametrizations.weight_norm: its backward (_weight_norm_interface_backward) along the
    first and the last dimension, a linear layer and a convolution."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Conv1d(4, 6, 3), dim=0), nn.Flatten(), weight_norm(nn.Linear(30, 3), dim=dim))
    x = torch.randn(2, 4, 7)
    twin = copy.deepcopy(model).to("pjrt")
    for m, inp in ((model, x), (twin, x.to("pjrt"))):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            m(inp).pow(2).sum().backward()
            opt.step()
    for p, q in zip(twin.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)
