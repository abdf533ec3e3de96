"""torch.inference_mode on pjrt behaves as on CPU: inference tensors, views of normal tensors,
in-place updates, and the errors when inference tensors meet autograd later."""

import pytest
import torch

import torchpjrt  # noqa: F401

pytestmark = pytest.mark.usefixtures("each_eager_mode")


def _outcome(fn):
    try:
        out = fn()
    except RuntimeError as e:
        return ("raised", str(e).split("\n")[0])
    if isinstance(out, torch.Tensor):
        return ("tensor", out.is_inference(), out.requires_grad, tuple(out.shape), out.detach().cpu().tolist())
    return ("value", out)


def scenario(device):
    """Each step's outcome: values, is_inference flags, and error messages."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(device)
    x = torch.randn(2, 4).to(device)
    normal = torch.ones(2, 4).to(device)
    steps = {}
    with torch.inference_mode():
        y = model(x)
        steps["forward"] = _outcome(lambda: y)
        steps["view_of_normal"] = _outcome(lambda: normal.view(8))
        steps["slice_of_normal"] = _outcome(lambda: normal[0])
        steps["transpose_of_normal"] = _outcome(lambda: normal.t())
        steps["view_of_inference"] = _outcome(lambda: y[:, 1])
        steps["inplace_on_normal"] = _outcome(lambda: normal.mul_(2))
        steps["inplace_on_inference"] = _outcome(lambda: y.add_(1))
        steps["inplace_through_view"] = _outcome(lambda: (y[0].zero_(), y)[1])
        steps["softmax"] = _outcome(lambda: torch.softmax(y, -1))
        steps["argmax_item"] = _outcome(lambda: y.argmax().item())
        steps["nested_no_grad"] = _outcome(lambda: model(x).sum())
    with torch.inference_mode(False):
        steps["disabled_inside"] = _outcome(lambda: model(x))
    steps["after_version"] = _outcome(lambda: normal._version)
    steps["inference_outside_inplace"] = _outcome(lambda: y.add_(1))
    steps["inference_in_autograd"] = _outcome(lambda: (y * model[0].weight.sum()).sum().backward())
    steps["inference_clone_in_autograd"] = _outcome(lambda: (y.clone() * model[0].weight.sum()).sum())
    steps["inference_view_outside"] = _outcome(lambda: y.view(-1))
    steps["functional_on_inference_outside"] = _outcome(lambda: y * 2)
    steps["normal_training_after"] = _outcome(lambda: model(x).sum())
    return steps


def test_inference_mode_matches_cpu():
    cpu, pjrt = scenario("cpu"), scenario("pjrt")
    for name in cpu:
        got, want = pjrt[name], cpu[name]
        if want[0] == "tensor" and got[0] == "tensor":
            assert got[1:4] == want[1:4], (name, got, want)
            torch.testing.assert_close(torch.tensor(got[4]), torch.tensor(want[4]), rtol=1e-5, atol=1e-5)
        else:
            assert got == want, (name, got, want)


def test_inference_mode_backward_after_training_step_trains():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to("pjrt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4).to("pjrt")
    losses = []
    for _ in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.inference_mode():
            losses.append(model(x).pow(2).mean().item())
    assert losses[0] > losses[1] > losses[2]


def test_compiled_model_under_inference_mode():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with torch.inference_mode():
        expected = model(x)
    compiled = torch.compile(model.to("pjrt"), backend="pjrt")
    with torch.inference_mode():
        got = compiled(x.to("pjrt"))
    assert got.is_inference()
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a real transformers model, per eager mode
def test_transformers_generate_under_inference_mode():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (1, 5))
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        got = model.to("pjrt").generate(ids.to("pjrt"), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got.cpu(), expected)
