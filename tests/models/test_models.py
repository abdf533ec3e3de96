"""Real models train unchanged on pjrt and match the CPU, in every execution mode.

The suite is the benchmark's own workloads (torchpjrt.bench.workloads) at their tiny size:
Hugging Face transformers models built from configs with random weights (nothing is
downloaded) and plain-PyTorch ResNet and DDPM-style UNet. For each model and mode the first
step's output, loss and every parameter gradient equal the CPU's, and five AdamW steps give
the same losses, parameters and buffers (BatchNorm running statistics included).
"""

import copy

import pytest
import torch

import torchpjrt
from torchpjrt.bench import workloads
from torchpjrt.compile import compile_stats

pytestmark = pytest.mark.slow

MODELS = ["cnn", "resnet", "unet", "gpt2", "llama", "bert", "t5", "vit", "mixtral"]
MODES = ["strict", "fused", "compiled"]
STEPS = 5
RTOL = 1e-4
LR = 1e-3


def _build(name):
    if name not in ("cnn", "resnet", "unet"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    return workloads.build(name, "tiny", None, None)


def _batches(w, device):
    """One batch, repeated: the loss must then go down in five steps."""
    torch.manual_seed(1)
    return [w.batch_fn(w.batch_size, "cpu")] * STEPS


def _close(actual, expected, what, rtol=RTOL):
    """Relative to the tensor's scale: gradients that are mathematically zero (a key bias under
    softmax) come out as rounding noise of ~1e-12 on both sides and must not fail a rtol check."""
    expected = expected.detach()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.detach().cpu(), expected, rtol=rtol, atol=rtol * scale + 1e-7, msg=lambda m: f"{what}: {m}")


def _train(model, w, batches, device, forward):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first = [], None
    for step, cpu_batch in enumerate(batches):
        batch = tuple(t.to(device) for t in cpu_batch)
        out = forward(*batch)
        loss = w.loss_fn(out, batch)
        loss.backward()
        if step == 0:
            first = (out.detach().cpu(), {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None})
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, first


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
def test_model_trains_like_cpu(name, mode):
    w = _build(name)
    batches = _batches(w, "cpu")
    cpu_model = copy.deepcopy(w.model).train()
    cpu_losses, (cpu_out, cpu_grads) = _train(cpu_model, w, batches, "cpu", cpu_model)

    model = copy.deepcopy(w.model).train().to("pjrt")
    if mode == "compiled":
        torch._dynamo.reset()
        forward = torch.compile(model, backend="pjrt")
        eager = torchpjrt.eager_mode("strict")
    else:
        forward = model
        eager = torchpjrt.eager_mode(mode)
    eager_graphs = compile_stats()["eager_graphs"]
    with eager:
        losses, (out, grads) = _train(model, w, batches, "pjrt", forward)
    # every graph Dynamo captured became one XLA program: none fell back to eager execution
    assert compile_stats()["eager_graphs"] == eager_graphs, compile_stats()["eager_fallback_reasons"]

    _close(out, cpu_out, "first step output")
    assert grads.keys() == cpu_grads.keys()
    for n, g in cpu_grads.items():
        _close(grads[n], g, f"gradient of {n}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=RTOL, atol=0)
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"
    # Adam moves every parameter by about LR per step whatever its gradient's scale, so an
    # element whose gradient is rounding noise (a key bias under softmax) moves by noise of that
    # size on both devices: such tensors (gradient below 1e-6 of the largest) are left out.
    # The others are compared as a whole: the difference must be small next to how far
    # training moved them.
    initial = w.model.state_dict()
    largest = max(g.abs().max().item() for g in cpu_grads.values())
    noise_only = {n for n, g in cpu_grads.items() if g.abs().max().item() < 1e-6 * largest}
    for (n, a), b in zip(model.state_dict().items(), cpu_model.state_dict().values()):
        if n in noise_only:
            continue
        if a.is_floating_point():
            moved = (b - initial[n]).norm().item()
            error = (a.cpu() - b).norm().item()
            assert error <= 1e-2 * moved + 1e-6, f"{n} after {STEPS} steps: differs by {error:.3g}, moved {moved:.3g}"
        else:
            assert torch.equal(a.cpu(), b), n  # BatchNorm's num_batches_tracked


DECODERS = ["gpt2", "llama", "mixtral", "t5"]


@pytest.mark.parametrize("name, mode", [(name, "strict") for name in DECODERS] + [("gpt2", "fused")])
def test_generate_matches_cpu_greedy_tokens(name, mode):
    w = _build(name)
    hf_model = w.model.module.hf_model if name == "t5" else w.model.hf_model
    hf_model.config.use_cache = True
    hf_model.eval()
    torch.manual_seed(2)
    prompt = torch.randint(2, hf_model.config.vocab_size, (2, 8))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    hf_model.to("pjrt")
    with torchpjrt.eager_mode(mode):
        tokens = hf_model.generate(prompt.to("pjrt"), attention_mask=torch.ones_like(prompt).to("pjrt"), **kwargs)
    assert tokens.device.type == "pjrt"
    assert torch.equal(tokens.cpu(), expected), (tokens.cpu(), expected)
