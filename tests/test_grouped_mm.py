"""aten._grouped_mm (torch.nn.functional.grouped_mm), the product transformers' MoE experts use:
its four forms against the CPU, forward and backward, in every mode; a routing that changes
every step compiles nothing after the first step."""

import pytest
import torch

import torchpjrt
from torchpjrt import dispatch

OFFS = [3, 3, 7, 10]  # an empty group, and rows/columns past offs[-1] (ignored)

# form -> (mat_a shape, mat_b shape, the valid region of the output, of mat_a's and of mat_b's
# gradient: the CPU leaves what lies past offs[-1] unset)
FORMS = {
    "2d x 3d": ((12, 8), (4, 8, 16), (slice(0, 10),), (slice(0, 10),), ()),
    "3d x 2d": ((4, 12, 8), (8, 12), (slice(None), slice(0, 10)), (), (slice(None), slice(0, 10))),
    "2d x 2d": ((8, 12), (12, 16), (), (slice(None), slice(0, 10)), (slice(0, 10),)),
    "3d x 3d": ((4, 8, 12), (4, 12, 16), (), (), ()),
}


def _run(form, device, dtype=torch.float32):
    a_shape, b_shape, *_ = FORMS[form]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(a_shape, generator=gen).to(dtype).to(device).requires_grad_()
    b = torch.randn(b_shape, generator=gen).to(dtype).to(device).requires_grad_()
    offs = None if form == "3d x 3d" else torch.tensor(OFFS, dtype=torch.int32, device=device)
    out = torch.nn.functional.grouped_mm(a, b, offs=offs)
    grad = torch.randn(out.shape, generator=gen).to(dtype).to(device)
    out.backward(grad)
    return out.detach().cpu(), a.grad.cpu(), b.grad.cpu()


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("form", FORMS)
def test_forms_match_cpu(form, mode):
    _, _, *valid = FORMS[form]
    expected = _run(form, "cpu")
    with torchpjrt.eager_mode(mode):
        got = _run(form, "pjrt")
    for name, g, e, region in zip(("output", "mat_a grad", "mat_b grad"), got, expected, valid):
        torch.testing.assert_close(g[region], e[region], rtol=1e-5, atol=1e-5, msg=name)
    if form == "2d x 3d":
        assert got[0][10:].abs().sum() == 0 and got[1][10:].abs().sum() == 0  # zero, never stale


def test_bfloat16_accumulates_in_float32():
    expected = _run("2d x 3d", "cpu", torch.bfloat16)
    got = _run("2d x 3d", "pjrt", torch.bfloat16)
    assert got[0].dtype == torch.bfloat16
    assert torch.equal(got[0][:10], expected[0][:10])


def test_compiled():
    def f(a, b, offs):
        return torch.nn.functional.grouped_mm(a, b, offs=offs)[:10].float().square().sum()

    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(12, 8, generator=gen).bfloat16(), torch.randn(4, 8, 16, generator=gen).bfloat16()
    offs = torch.tensor(OFFS, dtype=torch.int32)
    compiled = torch.compile(f, backend="pjrt", fullgraph=True)
    for routing in (OFFS, [1, 5, 9, 10]):  # one graph for both
        offs = torch.tensor(routing, dtype=torch.int32)
        got = compiled(a.to("pjrt"), b.to("pjrt"), offs.to("pjrt"))
        torch.testing.assert_close(got.cpu(), f(a, b, offs), rtol=1e-5, atol=0)


def test_errors_as_on_cpu():
    a, b = torch.randn(12, 8), torch.randn(4, 8, 16)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    bad = [
        (lambda d: (a.to(d).long(), b.to(d), offs.to(d)), "Float32, BFloat16 or Float16"),
        (lambda d: (a.to(d), b.to(d)[:3], offs.to(d)), "matrix batch sizes have to match"),
        (lambda d: (a.to(d), b.to(d), offs.to(d).long()), "Offsets have to be int32"),
        (lambda d: (a.to(d)[:, :4], b.to(d), offs.to(d)), "contraction dimension"),
    ]
    for make, message in bad:
        for device in ("cpu", "pjrt"):
            with pytest.raises(RuntimeError, match=message):
                torch._grouped_mm(*make(device)).cpu()


@pytest.mark.slow
def test_moe_routing_compiles_nothing_after_the_first_step():
    """transformers' Mixtral experts (grouped_mm by default): a new batch, hence a new routing,
    every step; before aten._grouped_mm had a lowering, PyTorch's own loop ran one matmul per
    expert at the routed size, and each step compiled about 50 new kernels."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    model = transformers.MixtralForCausalLM(config)
    assert model.config._experts_implementation == "grouped_mm"
    cpu_model = model
    model = type(model)(config)
    model.load_state_dict(cpu_model.state_dict())
    model.to("pjrt")
    gen = torch.Generator().manual_seed(1)
    built = []
    for step in range(4):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        before = dispatch.stats["compiled"]
        loss = model(input_ids=ids.to("pjrt"), labels=ids.to("pjrt")).loss
        loss.backward()
        built.append(dispatch.stats["compiled"] - before)
        expected = cpu_model(input_ids=ids, labels=ids).loss
        expected.backward()
        torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), cpu_model.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-6)
            p.grad = q.grad = None
    assert built[0] > 0 and built[2:] == [0, 0], built
