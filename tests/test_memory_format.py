"""Memory formats: pjrt tensors have the CPU's strides (channels_last in, channels_last out;
preserve_format copies, empty/resize_ with a memory format), in every eager mode."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchpjrt  # noqa: F401

pytestmark = pytest.mark.usefixtures("each_eager_mode")

CL, CL3 = torch.channels_last, torch.channels_last_3d


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _w(*shape):
    return _x(*shape, seed=1)


CASES = {
    "contiguous(channels_last)": lambda d: _x(2, 3, 4, 5).to(d).contiguous(memory_format=CL),
    "contiguous(channels_last_3d)": lambda d: _x(2, 3, 2, 4, 5).to(d).contiguous(memory_format=CL3),
    "clone preserves": lambda d: _x(2, 3, 4, 5).to(d).contiguous(memory_format=CL).clone(),
    "clone to contiguous": lambda d: _x(2, 3, 4, 5).to(d).contiguous(memory_format=CL).clone(
        memory_format=torch.contiguous_format),
    "empty_like preserves": lambda d: torch.empty_like(_x(2, 3, 4, 5).to(d).contiguous(memory_format=CL)).zero_(),
    "to(dtype) preserves": lambda d: _x(2, 3, 4, 5).to(d).contiguous(memory_format=CL).to(torch.float64),
    "to(memory_format)": lambda d: _x(2, 3, 4, 5).to(d).to(memory_format=CL),
    "CPU channels_last to the device": lambda d: _x(2, 3, 4, 5).contiguous(memory_format=CL).to(d),
    "transpose clone preserves": lambda d: _x(3, 5).to(d).t().clone(),
    "empty(memory_format)": lambda d: torch.empty(2, 3, 4, 5, device=d, memory_format=CL).fill_(1),
    "resize_(memory_format)": lambda d: torch.zeros(0, device=d).resize_(2, 3, 4, 5, memory_format=CL).fill_(2),
    "conv2d": lambda d: F.conv2d(_x(2, 3, 6, 7).to(d).contiguous(memory_format=CL), _w(4, 3, 3, 3).to(d)),
    "conv2d with channels_last weight": lambda d: F.conv2d(_x(2, 3, 6, 7).to(d),
                                                           _w(4, 3, 3, 3).to(d).contiguous(memory_format=CL)),
    "batch_norm": lambda d: F.batch_norm(_x(2, 3, 4, 5).to(d).contiguous(memory_format=CL), None, None, training=True),
    "max_pool2d": lambda d: F.max_pool2d(_x(2, 3, 4, 6).to(d).contiguous(memory_format=CL), 2),
    "avg_pool2d": lambda d: F.avg_pool2d(_x(2, 3, 4, 6).to(d).contiguous(memory_format=CL), 2),
    "relu": lambda d: torch.relu(_x(2, 3, 4, 5).to(d).contiguous(memory_format=CL)),
    "add scalar": lambda d: _x(2, 3, 4, 5).to(d).contiguous(memory_format=CL) + 1,
    "add mixed formats": lambda d: _x(2, 3, 4, 5).to(d).contiguous(memory_format=CL) + _x(2, 3, 4, 5).to(d),
    "mul of transposes": lambda d: _x(3, 5).to(d).t() * _x(5, 3, seed=2).to(d),
}


@pytest.mark.parametrize("name", list(CASES))
def test_strides_and_values_match_cpu(name):
    want = CASES[name]("cpu")
    got = CASES[name]("pjrt")
    assert got.shape == want.shape and got.stride() == want.stride(), (got.stride(), want.stride())
    for fmt in (torch.contiguous_format, CL, CL3):
        if want.dim() == {CL: 4, CL3: 5}.get(fmt, want.dim()):
            assert got.is_contiguous(memory_format=fmt) == want.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    assert got.cpu().stride() == want.stride()  # .cpu() keeps the layout, as CUDA's does


def test_view_of_a_laid_out_result_refuses_as_on_cpu():
    for device in ("cpu", "pjrt"):
        y = _x(3, 5).to(device).t() + 1  # strides (1, 3): not viewable as one dim
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            y.view(-1)
        assert y.reshape(-1).tolist() == (_x(3, 5).t() + 1).reshape(-1).tolist()


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.relu(self.conv2(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _train(device):
    torch.manual_seed(0)
    model = ConvNet().to(device).to(memory_format=CL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = _x(4, 3, 10, 10).to(device).contiguous(memory_format=CL)
    y = torch.tensor([0, 1, 2, 3]).to(device)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.conv1.weight.is_contiguous(memory_format=CL), [p.detach().cpu() for p in model.parameters()]


@pytest.mark.slow
def test_channels_last_cnn_trains_like_cpu():
    cpu, pjrt = _train("cpu"), _train("pjrt")
    torch.testing.assert_close(torch.tensor(pjrt[0]), torch.tensor(cpu[0]), rtol=1e-4, atol=1e-5)
    assert pjrt[1] == cpu[1]
    for got, want in zip(pjrt[2], cpu[2]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_transposed_and_channels_last_cpu_tensors_are_laid_out_on_the_host(each_eager_mode):
    from torchpjrt import live_programs

    torch.manual_seed(0)
    cases = [torch.randn(5, 9).t(), torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
             torch.randn(3, 4, 6).permute(2, 0, 1), torch.randn(4, 1, 3).transpose(0, 2)]
    before = live_programs.stats["xla_compiles"]
    moved = [(x, x.to("pjrt")) for x in cases] + [(x.half(), x.to("pjrt", torch.float16)) for x in cases]
    if each_eager_mode != "debug":  # (debug mode checks each result with programs of its own)
        assert live_programs.stats["xla_compiles"] == before  # no transpose (or cast) program on the device
    for x, y in moved:
        assert y.stride() == x.stride() and y.dtype == x.dtype and torch.equal(y.cpu(), x)
        assert (y * 2).stride() == (x * 2).stride() and torch.equal((y * 2).cpu(), x * 2)
