"""Storage identity: every pjrt storage has a distinct, stable data_ptr(), views sit at base +
offset x element size, and the aliasing checks of torch.save, safetensors, transformers and
accelerate give the CPU's answers."""

import io

import pytest
import safetensors.torch
import torch

import torchpjrt  # noqa: F401

pytestmark = pytest.mark.usefixtures("each_eager_mode")


def pointers_like_cpu(make):
    """Run `make(device)` on CPU and pjrt; compare which results share an address, and each
    result's offset from the first result's address."""
    out = {}
    for device in ("cpu", "pjrt"):
        tensors = make(device)
        base = tensors[0].data_ptr()
        out[device] = [(t.data_ptr() == base, t.data_ptr() - base if t.untyped_storage().data_ptr()
                        == tensors[0].untyped_storage().data_ptr() else None, t.data_ptr() == 0)
                       for t in tensors]
    assert out["pjrt"] == out["cpu"]


def test_views_sit_at_base_plus_offset():
    pointers_like_cpu(lambda d: (x := torch.randn(4, 6, device=d), x[1:, 2:], x.t(), x[:, 3], x.view(-1)[5:],
                                 x.view(torch.int32), x.unsqueeze(0).expand(2, 4, 6), x.narrow(1, 2, 3)))


def test_copies_have_addresses_of_their_own():
    def make(d):
        x = torch.randn(4, 6, device=d)
        y = x[:, 1:].reshape(-1)  # a non-contiguous slice reshaped: a copy
        return x, y, x.clone(), x.contiguous(), x + 0, x.t().contiguous(), x.to(torch.float64)

    pointers_like_cpu(make)
    x = torch.randn(4, 6, device="pjrt")
    addresses = {t.data_ptr() for t in (x, x[:, 1:].reshape(-1), x.clone(), x * 2, torch.empty_like(x))}
    assert len(addresses) == 5 and 0 not in addresses


def test_address_is_stable_across_in_place_writes_and_alignment():
    x = torch.zeros(3, 5, device="pjrt")
    before = (x.data_ptr(), x.untyped_storage().data_ptr())
    x.add_(1)
    x[1].mul_(3)
    x.copy_(torch.ones(3, 5))
    torch.add(x, 1, out=x)
    assert (x.data_ptr(), x.untyped_storage().data_ptr()) == before
    assert x.data_ptr() % 64 == 0  # as aligned as CPU memory
    assert x.tolist() == [[2.0] * 5] * 3


def test_empty_storages_report_null_like_cpu():
    assert torch.empty(0, device="pjrt").data_ptr() == torch.empty(0).data_ptr() == 0


def test_storages_do_not_overlap():
    tensors = [torch.empty(n, device="pjrt") for n in (1, 7, 100, 3)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors)
    assert all(stop <= start for (_, stop), (start, _) in zip(spans, spans[1:]))


def test_grown_storage_gets_a_new_range():
    x = torch.ones(2, device="pjrt")
    neighbour = torch.ones(2, device="pjrt")
    old = x.data_ptr()
    x.resize_(1000)
    assert x.data_ptr() != old
    assert not (x.data_ptr() <= neighbour.data_ptr() < x.data_ptr() + 4000)


def test_torch_save_refuses_one_memory_in_two_dtypes_like_cpu():
    for device in ("cpu", "pjrt"):
        x = torch.randn(4, device=device)
        with pytest.raises(RuntimeError, match="view the same data as different types"):
            torch.save([x, x.view(torch.int32)], io.BytesIO())


def test_safetensors_shared_tensor_check_like_cpu(tmp_path):
    for device in ("cpu", "pjrt"):
        w = torch.randn(4, 4, device=device)
        with pytest.raises(RuntimeError, match="share memory"):
            safetensors.torch.save_file({"a": w, "b": w}, tmp_path / f"{device}.safetensors")
        safetensors.torch.save_file({"a": w, "b": w.clone()}, tmp_path / f"{device}.safetensors")


def _tiny_gpt2(seed):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.slow  # a real transformers model, per eager mode
def test_transformers_save_pretrained_from_pjrt_round_trips(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _tiny_gpt2(0).to("pjrt")
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        expected = model(ids.to("pjrt")).logits.cpu()
    model.save_pretrained(tmp_path)  # raised "contained shared tensors" when every pointer was 0
    with safetensors.safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # the tied pair saved once
    assert "transformer.h.0.attn.c_attn.weight" in keys
    fresh = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).to("pjrt").eval()
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    with torch.no_grad():
        assert torch.equal(fresh(ids.to("pjrt")).logits.cpu(), expected)


@pytest.mark.slow  # accelerate, per eager mode
def test_accelerate_save_model_keeps_equal_shaped_layers(tmp_path):
    """accelerate dropped all but one of several equal-shaped tensors ("Removed shared tensor")."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to("pjrt")
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    accelerator = accelerate.Accelerator()
    accelerator.save_model(model, tmp_path)
    loaded = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert set(loaded) == set(expected)
    for k in expected:
        assert torch.equal(loaded[k], expected[k]), k
