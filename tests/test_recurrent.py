"""nn.LSTM and nn.GRU: PyTorch runs their steps on a PrivateUse1 device through the fused cells
(`_thnn_fused_lstm_cell`, `_thnn_fused_gru_cell` and their backward ops, as on CUDA); their
outputs, states and gradients against the CPU's."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import torchpjrt

MODES = ("strict", pytest.param("fused", marks=pytest.mark.slow))
CONFIGS = {
    "one layer": {},
    "two layers, bidirectional": {"num_layers": 2, "bidirectional": True},
    "no bias": {"bias": False},
}


@pytest.fixture(params=MODES)
def mode(request):
    with torchpjrt.eager_mode(request.param):
        yield request.param


def _state_sum(state):
    return sum(s.sum() for s in state) if isinstance(state, tuple) else state.sum()


def _train_both(model, run, steps=2):
    """`steps` SGD steps of `run(model, device)` on CPU and pjrt: the last step's output and
    gradients (taken at the weights the earlier steps trained) and the trained weights match."""
    on_pjrt = copy.deepcopy(model).to("pjrt")
    results = []
    for m, device in ((model, "cpu"), (on_pjrt, "pjrt")):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(steps):
            opt.zero_grad()
            out = run(m, device)
            out.backward()
            opt.step()
        results.append((out.detach().cpu(), [p.grad.cpu() for p in m.parameters()]))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    for p, q in zip(on_pjrt.parameters(), model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config", ["one layer"] + [pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS if c != "one layer"])
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_recurrent_layers_train_like_cpu(mode, cls, config):
    torch.manual_seed(0)
    model = cls(8, 16, batch_first=True, **CONFIGS[config])
    x = torch.randn(4, 5, 8)

    def run(m, device):
        out, state = m(x.to(device))
        return (out * out).sum() + _state_sum(state)

    _train_both(model, run)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_packed_sequences_and_initial_state(mode, cls):
    torch.manual_seed(0)
    model = cls(6, 10, num_layers=2)
    x = torch.randn(7, 3, 6)
    lengths = torch.tensor([7, 4, 2])
    h0 = torch.randn(2, 3, 10)
    state0 = (h0, torch.randn(2, 3, 10)) if cls is nn.LSTM else h0

    def run(m, device):
        packed = pack_padded_sequence(x.to(device), lengths)
        start = tuple(s.to(device) for s in state0) if cls is nn.LSTM else state0.to(device)
        out, state = m(packed, start)
        padded, _ = pad_packed_sequence(out)
        return padded.pow(2).sum() + _state_sum(state)

    _train_both(model, run)


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell])
def test_cells(mode, cls):
    torch.manual_seed(0)
    model = cls(8, 12)
    xs = torch.randn(3, 4, 8)

    def run(m, device):
        state, total = None, 0
        for x in xs.to(device):
            state = m(x, state)
            total = total + _state_sum(state)
        return total

    _train_both(model, run)


@pytest.mark.slow
def test_double_backward_through_a_gru():
    """A gradient penalty: backward with create_graph runs PyTorch's differentiable cell backward."""
    torch.manual_seed(0)
    model = nn.GRU(4, 6, batch_first=True)
    x = torch.randn(2, 3, 4)
    grads = []
    for m, device in ((model, "cpu"), (copy.deepcopy(model).to("pjrt"), "pjrt")):
        inp = x.to(device).requires_grad_()
        (g,) = torch.autograd.grad(m(inp)[0].sum(), inp, create_graph=True)
        g.pow(2).sum().backward()
        grads.append([p.grad.cpu() for p in m.parameters()])
    for g, w in zip(*reversed(grads)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    torch.manual_seed(0)
    for cls in (nn.LSTM, nn.GRU):
        model = cls(8, 16, batch_first=True).to(dtype)
        x = torch.randn(2, 5, 8, dtype=dtype)
        want = model(x)[0]
        got = copy.deepcopy(model).to("pjrt")(x.to("pjrt"))[0]
        assert got.dtype == dtype
        tol = {"rtol": 2e-2, "atol": 2e-2} if dtype is torch.bfloat16 else {}
        torch.testing.assert_close(got.cpu(), want, **tol)


def test_compiled_lstm():
    torch.manual_seed(0)
    model = nn.LSTM(8, 16, batch_first=True)
    x = torch.randn(4, 5, 8)
    want = model(x)[0]
    got = torch.compile(copy.deepcopy(model).to("pjrt"), backend="pjrt")(x.to("pjrt"))[0]
    torch.testing.assert_close(got.detach().cpu(), want.detach())
