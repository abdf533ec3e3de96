"""Views whose dtype differs from their storage's (`x.view(torch.uint8)`, `view_as_real`,
`view_as_complex`, `.real` / `.imag`): they read and write the storage's bytes as on CPU, with
aliasing and version counters, in every eager mode and under torch.compile; complex autograd;
a rotary-embedding attention layer written with view_as_complex trains like the CPU."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchpjrt  # noqa: F401

pytestmark = pytest.mark.usefixtures("each_eager_mode")


def cpu_randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def writes_through(make_base, write):
    """Apply `write(base)` on CPU and pjrt; return (base after, write's result) of each."""
    out = {}
    for device in ("cpu", "pjrt"):
        base = make_base().to(device)
        version = base._version
        result = write(base)
        out[device] = (base.cpu(), result.cpu() if isinstance(result, torch.Tensor) else result,
                       base._version > version)
    return out


def assert_bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    assert torch.equal(torch.view_as_real(got) if got.dtype.is_complex else got,
                       torch.view_as_real(want.resolve_conj()) if want.dtype.is_complex else want), (got, want)


READS = {
    "float32 as uint8": (lambda: cpu_randn(2, 3), lambda x: x.view(torch.uint8)),
    "float32 slice as int16": (lambda: cpu_randn(8), lambda x: x[2:].view(torch.int16)),
    "float32 as bfloat16": (lambda: cpu_randn(3, 4), lambda x: x.view(torch.bfloat16)),
    "uint8 as float32": (lambda: torch.arange(32, dtype=torch.uint8), lambda x: x.view(4, 8).view(torch.float32)),
    "int32 as float32": (lambda: torch.arange(6, dtype=torch.int32), lambda x: x.view(torch.float32)),
    "int64 as int8 transposed": (lambda: torch.arange(12).reshape(3, 4), lambda x: x.t().contiguous().view(torch.int8)),
    "view_as_real": (lambda: cpu_randn(3, 2, dtype=torch.complex64), torch.view_as_real),
    "view_as_real complex128": (lambda: cpu_randn(4, dtype=torch.complex128), torch.view_as_real),
    "view_as_complex": (lambda: cpu_randn(3, 4, 2), torch.view_as_complex),
    "view_as_complex of a slice": (lambda: cpu_randn(5, 2), lambda x: torch.view_as_complex(x[1:4])),
    "real": (lambda: cpu_randn(4, dtype=torch.complex64), lambda x: x.real),
    "imag of a transpose": (lambda: cpu_randn(3, 2, dtype=torch.complex64), lambda x: x.t().imag),
    "complex64 as int64": (lambda: cpu_randn(3, dtype=torch.complex64), lambda x: x.view(torch.int64)),
    "complex64 as float32": (lambda: cpu_randn(3, dtype=torch.complex64), lambda x: x.view(torch.float32)),
}


@pytest.mark.parametrize("name", list(READS))
def test_views_of_another_dtype_read_the_storage_bytes(name):
    make, view = READS[name]
    base = make()
    want = view(base)
    got = view(base.to("pjrt"))
    assert got.stride() == want.stride()
    assert got.data_ptr() - got.untyped_storage().data_ptr() == want.data_ptr() - want.untyped_storage().data_ptr()
    assert_bitwise(got.cpu(), want)


WRITES = {
    "real.mul_": (lambda: cpu_randn(4, dtype=torch.complex64), lambda x: x.real.mul_(2)),
    "imag.fill_": (lambda: cpu_randn(4, dtype=torch.complex64), lambda x: x.imag.fill_(7)),
    "view_as_real row write": (lambda: cpu_randn(3, dtype=torch.complex64),
                               lambda x: torch.view_as_real(x)[1].copy_(torch.tensor([5.0, -5.0]))),
    "view_as_complex add_": (lambda: cpu_randn(3, 2), lambda x: torch.view_as_complex(x).add_(1j)),
    "uint8 byte write": (lambda: torch.zeros(2), lambda x: x.view(torch.uint8)[3].fill_(0x3F)),
    "int16 halves": (lambda: cpu_randn(4), lambda x: x.view(torch.int16)[::2].zero_()),
    "float32 over uint8": (lambda: torch.zeros(8, dtype=torch.uint8), lambda x: x.view(torch.float32).fill_(1.5)),
    "out= into a real view": (lambda: cpu_randn(3, dtype=torch.complex64),
                              lambda x: torch.mul(x.real, 3, out=x.imag)),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_writes_through_views_of_another_dtype(name):
    make, write = WRITES[name]
    out = writes_through(make, write)
    (cpu_base, cpu_result, cpu_bumped), (pjrt_base, pjrt_result, pjrt_bumped) = out["cpu"], out["pjrt"]
    assert_bitwise(pjrt_base, cpu_base)
    assert_bitwise(pjrt_result, cpu_result)
    assert pjrt_bumped and cpu_bumped  # the base's version counter moved: autograd sees the write


def test_complex_construction_ops():
    re, im = cpu_randn(5, seed=1), cpu_randn(5, seed=2)
    for fn in (torch.complex, lambda a, b: torch.polar(a.abs(), b)):
        torch.testing.assert_close(fn(re.to("pjrt"), im.to("pjrt")).cpu(), fn(re, im), rtol=1e-6, atol=1e-6)


def test_complex_autograd_through_views():
    x = cpu_randn(4, 2, seed=3)
    w = cpu_randn(4, dtype=torch.complex64, seed=4)
    grads = {}
    for device in ("cpu", "pjrt"):
        xd = x.to(device).detach().requires_grad_()
        wd = w.to(device).detach().requires_grad_()
        z = torch.view_as_complex(xd) * wd
        loss = torch.view_as_real(z).pow(2).sum() + z.abs().sum() + z.real.sum() - z.imag.mean()
        loss.backward()
        grads[device] = (loss.detach().cpu(), xd.grad.cpu(), wd.grad.cpu())
    for got, want in zip(grads["pjrt"], grads["cpu"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_complex32_is_a_clear_error():
    with pytest.raises(TypeError, match="complex32 is not supported on the pjrt device"):
        torch.zeros(2, dtype=torch.complex64).to(torch.chalf).to("pjrt")


# ---- rotary position embeddings, as the reference Llama code and TorchTitan write them -------------


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RopeAttention(nn.Module):
    def __init__(self, dim=32, heads=4, seq=8):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // heads, seq), persistent=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.heads, d // self.heads) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_emb(q, k, self.freqs_cis[:s])
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


def _train_rope(device, compiled):
    torch.manual_seed(0)
    model = RopeAttention().to(device)
    step_model = torch.compile(model, backend="pjrt") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = cpu_randn(2, 8, 32, seed=5).to(device)
    target = cpu_randn(2, 8, 32, seed=6).to(device)
    losses = []
    for _ in range(5):
        loss = F.mse_loss(step_model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.slow  # five training steps against the CPU, per mode
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rope_attention_with_view_as_complex_trains_like_cpu(compiled, each_eager_mode):
    if compiled and each_eager_mode != "strict":
        pytest.skip("compiled graphs do not depend on the eager mode")
    cpu_losses, cpu_params = _train_rope("cpu", False)
    losses, params = _train_rope("pjrt", compiled)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-6)
    for got, want in zip(params, cpu_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
