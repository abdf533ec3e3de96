"""Mixed precision on pjrt: torch.autocast("pjrt") with CUDA's op lists, GradScaler("pjrt")."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchpjrt import autocast as pjrt_autocast

DEV = "pjrt"
BF16 = torch.bfloat16


def _cpu(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _to(xs, device):
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in xs]


def _close(pj, ref):
    assert pj.device.type == DEV
    assert pj.dtype == ref.dtype, (pj.dtype, ref.dtype)
    if ref.dtype in (torch.bfloat16, torch.float16):
        torch.testing.assert_close(pj.detach().cpu(), ref.detach(), rtol=1.6e-2, atol=1e-2)
    else:
        torch.testing.assert_close(pj.detach().cpu(), ref.detach(), rtol=1e-4, atol=1e-5)


# ---- how low-precision results are compared -------------------------------------------------
# bfloat16 keeps 8 significant bits: rounding a value to it moves it by at most u = 2**-8 (half
# of finfo(bfloat16).eps) of its magnitude. Kernels differ in what else they round on the way.
# oneDNN and XLA accumulate in float32 and round once; on x86-64 CPUs without AVX512 (AVX2-only
# ones such as AMD EPYC Milan) PyTorch's CPU kernel computes conv_transpose2d as one GEMM per
# kernel tap, rounds each tap's result to bfloat16 and adds the taps in bfloat16 (col2im). Each
# such rounding of a partial result moves it by at most u times the sum of the magnitudes of the
# terms in it, which is at most `mag`, the op applied to the inputs' absolute values. Where the
# terms cancel, that is far more than u * |result|, so the two kernels legitimately differ by
# several units in the last place of a small result. Results are therefore compared with the
# exact value (float64 on the inputs as autocast casts them), not with each other:
#     |y - exact| <= u * (|exact| + roundings * mag)
# with `roundings` the partial results a kernel for the op may round. That envelope cannot see
# a small systematic error (a result scaled by 1.01 stays inside it wherever terms cancel), so
# each op also runs on small-integer inputs: every product and partial sum is then an integer
# below 256, exact in bfloat16, and any correct kernel, in any order and at any accumulation
# precision, returns the exact result.

U_BF16 = torch.finfo(BF16).eps / 2

# Partial results a kernel may round to bfloat16 besides the output (default 1: a GEMM result
# rounded before a bias or `input` term is added to it).
_ROUNDINGS = {
    "prelu": 0,  # one product of two bfloat16 values: exact in float32, rounded once
    "addbmm": 2,  # the CPU kernel adds each batch's product into the bfloat16 result
    "conv_transpose2d.input": 3 * 3,  # one per kernel tap (col2im in bfloat16, see above)
}


def _cast(inputs, to_type):
    """The inputs as autocast hands them to the op, in float64 (exact for bfloat16 values)."""
    return [x.to(to_type).double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in inputs]


def _sdpa_magnitude(q, k, v):
    # a kernel may round q * scale and the scores s = q k^T scale (each rounding moves a score by
    # at most u |q||k|^T scale) and the weights p = softmax(s) (by u p). A change ds of the scores
    # moves p_j by p_j (ds_j - sum_i p_i ds_i), so the output by at most 2 max|ds| (p @ |v|).
    scale = q.shape[-1] ** -0.5
    p = torch.softmax(q @ k.transpose(-2, -1) * scale, -1)
    s_abs = (q.abs() @ k.abs().transpose(-2, -1) * scale).amax(-1, keepdim=True)
    return (p @ v.abs()) * (1 + 4 * s_abs)


def _magnitude(name, fn, cast, exact):
    if name == "scaled_dot_product_attention":
        return _sdpa_magnitude(*cast)
    if name == "prelu":
        return exact.abs()
    # a sum of products of inputs (matmuls, convolutions, bias terms): the sum of |terms|
    return fn(*[x.abs() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in cast])


def _within(y, exact, bound, what):
    y = y.detach().cpu().double().flatten()
    exact = exact.flatten()
    assert y.shape == exact.shape, (what, y.shape, exact.shape)
    err = (y - exact).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).flatten().expand_as(err)
    i = int((err - bound).argmax())
    assert err[i] <= bound[i], (f"{what}: |y - exact| = {err[i]:.4g} > {bound[i]:.4g} at flat index {i} "
                                f"(y {y[i]:.6g}, exact {exact[i]:.6g})")


def _integer_valued(name, inputs):
    """Same shapes and dtypes, values in {-2, ..., 2}: with at most 27 products (of at most 4) and
    a bias term in a sum, every partial sum is an integer below 256, exact in bfloat16. For
    attention q = 0: the weights are exactly 1/8 (eight keys), the output the exact mean of v."""
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(-2, 3, x.shape, generator=g).to(x.dtype) if isinstance(x, torch.Tensor)
           and x.is_floating_point() else x for x in inputs]
    if name == "scaled_dot_product_attention":
        out[0] = torch.zeros_like(out[0])
    return out


def _check_low_precision(name, fn, inputs, to_type, run):
    """run(fn, inputs) -> result in bfloat16: within the rounding envelope of the exact result on
    `inputs`, and exact on small-integer inputs of the same shapes."""
    cast = _cast(inputs, to_type)
    exact = fn(*cast)
    bound = U_BF16 * (exact.abs() + _ROUNDINGS.get(name, 1) * _magnitude(name, fn, cast, exact))
    _within(run(fn, inputs), exact, bound, f"{name} on random inputs")
    ints = _integer_valued(name, inputs)
    # exact, up to a float32 residue far below the grid of possible results (an FFT or Winograd
    # convolution, as a GPU may pick, can leave 1e-7 where the result is 0)
    _within(run(fn, ints), fn(*_cast(ints, to_type)), 2.0**-10, f"{name} on integer inputs")


# ---- the lists ------------------------------------------------------------------------------


def test_lists_are_pytorchs_cuda_autocast_lists():
    """The data lists name exactly the ops PyTorch registers on its AutocastCUDA key, once."""
    lists = [pjrt_autocast.LOWER_PRECISION_FP, pjrt_autocast.FP32, pjrt_autocast.FP32_SET_OPT_DTYPE,
             list(pjrt_autocast.FP32_APPEND_DTYPE), pjrt_autocast.PROMOTE, list(pjrt_autocast.BANNED)]
    names = [n for names in lists for n in names]
    assert len(names) == len(set(names)), "an op is in two lists"
    cuda = {n.removeprefix("aten::") for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")}
    assert set(names) == cuda
    ours = {n.removeprefix("aten::") for n in
            torch._C._dispatch_get_registrations_for_dispatch_key("AutocastPrivateUse1")}
    assert ours == cuda


def test_state_defaults_as_on_cuda():
    assert torch.amp.is_autocast_available(DEV)
    assert torch.get_autocast_dtype(DEV) == torch.float16  # CUDA's default
    assert not torch.is_autocast_enabled(DEV)
    lin = nn.Linear(8, 4).to(DEV)
    x = torch.randn(2, 8, device=DEV)
    with torch.autocast(DEV):
        assert torch.is_autocast_enabled(DEV)
        assert not torch.is_autocast_enabled("cpu")
        assert lin(x).dtype == torch.float16
    with torch.autocast(DEV, dtype=BF16):
        assert torch.get_autocast_dtype(DEV) == BF16
        assert lin(x).dtype == BF16
    assert torch.get_autocast_dtype(DEV) == torch.float16
    assert not torch.is_autocast_enabled(DEV)
    assert lin(x).dtype == torch.float32


def test_unsupported_dtype_disables_with_torchs_warning():
    with pytest.warns(UserWarning, match="pjrt Autocast only supports dtypes of torch.bfloat16, torch.float16"):
        with torch.autocast(DEV, dtype=torch.float64):
            assert not torch.is_autocast_enabled(DEV)


def test_enabled_false_nesting():
    lin = nn.Linear(8, 4).to(DEV)
    x = torch.randn(2, 8, device=DEV)
    with torch.autocast(DEV, dtype=BF16):
        assert lin(x).dtype == BF16
        with torch.autocast(DEV, enabled=False):
            assert not torch.is_autocast_enabled(DEV)
            assert lin(x).dtype == torch.float32
            with torch.autocast(DEV, dtype=torch.float16):
                assert lin(x).dtype == torch.float16
            assert lin(x).dtype == torch.float32
        assert torch.is_autocast_enabled(DEV)
        assert lin(x).dtype == BF16
        # the usual way out for one op: disable, then cast its inputs up
        with torch.autocast(DEV, enabled=False):
            assert torch.mm(lin(x).float(), torch.ones(4, 3, device=DEV)).dtype == torch.float32


# ---- output dtypes and values per category --------------------------------------------------

# Ops where PyTorch's CPU and CUDA policies agree: pjrt under autocast("pjrt", bf16) must give
# what CPU gives under autocast("cpu", bf16), dtype and values.
# (name in the lists, function, inputs (fp32 for the low-precision ops: they cast down, bf16
# for the fp32 ops: they cast up)).
_LONG = torch.tensor([1, 0, 3, 2])
AGREE = [
    ("linear", F.linear, lambda: [_cpu(4, 8), _cpu(5, 8), _cpu(5)]),
    ("mm", torch.mm, lambda: [_cpu(4, 8), _cpu(8, 5)]),
    ("bmm", torch.bmm, lambda: [_cpu(2, 4, 8), _cpu(2, 8, 5)]),
    ("matmul", torch.matmul, lambda: [_cpu(3, 4, 8), _cpu(8, 5)]),
    ("addmm", torch.addmm, lambda: [_cpu(5), _cpu(4, 8), _cpu(8, 5)]),
    ("baddbmm", torch.baddbmm, lambda: [_cpu(2, 4, 5), _cpu(2, 4, 8), _cpu(2, 8, 5)]),
    ("addbmm", torch.addbmm, lambda: [_cpu(4, 5), _cpu(2, 4, 8), _cpu(2, 8, 5)]),
    ("conv1d", F.conv1d, lambda: [_cpu(2, 3, 10), _cpu(4, 3, 3)]),
    ("conv2d", F.conv2d, lambda: [_cpu(2, 3, 6, 6), _cpu(4, 3, 3, 3), _cpu(4)]),
    ("conv_transpose2d.input", F.conv_transpose2d, lambda: [_cpu(2, 3, 5, 5), _cpu(3, 4, 3, 3)]),
    ("prelu", F.prelu, lambda: [_cpu(4, 3, 5), _cpu(3)]),
    ("scaled_dot_product_attention", F.scaled_dot_product_attention,
     lambda: [_cpu(1, 2, 8, 8), _cpu(1, 2, 8, 8), _cpu(1, 2, 8, 8)]),
    ("mse_loss", F.mse_loss, lambda: [_cpu(4, 5, dtype=BF16), _cpu(4, 5, dtype=BF16)]),
    ("l1_loss", F.l1_loss, lambda: [_cpu(4, 5, dtype=BF16), _cpu(4, 5, dtype=BF16)]),
    ("smooth_l1_loss", F.smooth_l1_loss, lambda: [_cpu(4, 5, dtype=BF16), _cpu(4, 5, dtype=BF16)]),
    ("huber_loss", F.huber_loss, lambda: [_cpu(4, 5, dtype=BF16), _cpu(4, 5, dtype=BF16)]),
    ("nll_loss", F.nll_loss, lambda: [_cpu(4, 5, dtype=BF16).log_softmax(1), _LONG]),
    ("kl_div", lambda a, b: F.kl_div(a, b, reduction="batchmean"),
     lambda: [_cpu(4, 5, dtype=BF16).log_softmax(1), _cpu(4, 5, dtype=BF16).softmax(1)]),
    ("binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits,
     lambda: [_cpu(4, 5, dtype=BF16), torch.rand(4, 5).to(BF16)]),
    ("cosine_embedding_loss", F.cosine_embedding_loss,
     lambda: [_cpu(4, 5, dtype=BF16), _cpu(4, 5, dtype=BF16), torch.tensor([1, -1, 1, -1])]),
    ("margin_ranking_loss", F.margin_ranking_loss,
     lambda: [_cpu(6, dtype=BF16), _cpu(6, dtype=BF16), torch.tensor([1, -1, 1, -1, 1, 1])]),
    ("soft_margin_loss", F.soft_margin_loss, lambda: [_cpu(4, 5, dtype=BF16), torch.ones(4, 5).to(BF16)]),
    ("poisson_nll_loss", F.poisson_nll_loss, lambda: [_cpu(4, 5, dtype=BF16), torch.rand(4, 5).to(BF16)]),
]


@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("name, fn, make", AGREE, ids=[c[0] for c in AGREE])
def test_matches_cpu_autocast_where_the_lists_agree(name, fn, make):
    policy = pjrt_autocast.policy_of(name)
    assert policy in ("lower_precision_fp", "fp32")
    to_type = BF16 if policy == "lower_precision_fp" else torch.float32
    inputs = make()
    with torch.autocast("cpu", dtype=BF16):
        expected = fn(*inputs)
    with torch.autocast(DEV, dtype=BF16):
        got = fn(*_to(inputs, DEV))
    assert got.device.type == DEV
    assert got.dtype == expected.dtype == to_type
    if to_type == torch.float32:  # computed in float32 from the bfloat16 inputs, on both
        exact = fn(*_cast(inputs, torch.float32))
        for y in (expected, got):
            torch.testing.assert_close(y.detach().cpu().double(), exact, rtol=1e-4, atol=1e-5)
        return
    # both against the exact result: CPU autocast's kernels are one valid rounding, not the truth
    _check_low_precision(name, fn, inputs, to_type, _on_cpu)
    _check_low_precision(name, fn, inputs, to_type, _on_pjrt)


def _on_cpu(fn, inputs):
    with torch.autocast("cpu", dtype=BF16):
        return fn(*inputs)


def _on_pjrt(fn, inputs):
    with torch.autocast(DEV, dtype=BF16):
        y = fn(*_to(inputs, DEV))
    assert y.device.type == DEV and y.dtype == BF16
    return y.cpu()


_WRONG = {
    "scaled by 1.01": lambda y: (y.float() * 1.01).to(y.dtype),
    "shifted by one": lambda y: y.roll(1, -1),
}


@pytest.mark.parametrize("wrong", list(_WRONG))
@pytest.mark.parametrize("name", ["mm", "conv_transpose2d.input", "prelu", "scaled_dot_product_attention"])
def test_low_precision_check_rejects_wrong_results(name, wrong):
    # the check as a whole (envelope and integer inputs) must fail a result 1% off or off by one
    # position, also for conv_transpose2d, whose envelope is the widest (nine roundings)
    _, fn, make = next(c for c in AGREE if c[0] == name)
    inputs = make()
    assert _check_low_precision(name, fn, inputs, BF16, _on_pjrt) is None
    with pytest.raises(AssertionError, match=name):
        _check_low_precision(name, fn, inputs, BF16, lambda f, xs: _WRONG[wrong](_on_pjrt(f, xs)))


# Ops whose CUDA policy differs from CPU's (or that CPU leaves alone): checked against the
# lists. The reference is the op on the CPU without autocast, on inputs cast as the policy says.
CUDA_ONLY = [
    ("mv", torch.mv, lambda: [_cpu(4, 8), _cpu(8)]),
    ("addmv", torch.addmv, lambda: [_cpu(4), _cpu(4, 8), _cpu(8)]),
    ("addr", torch.addr, lambda: [_cpu(4, 5), _cpu(4), _cpu(5)]),
    ("einsum", lambda a, b: torch.einsum("ij,jk->ik", a, b), lambda: [_cpu(4, 8), _cpu(8, 5)]),
    ("linalg_multi_dot", lambda a, b, c: torch.linalg.multi_dot([a, b, c]), lambda: [_cpu(3, 4), _cpu(4, 5), _cpu(5, 2)]),
    ("exp", torch.exp, lambda: [_cpu(4, 5, dtype=BF16)]),
    ("log", torch.log, lambda: [_cpu(4, 5, dtype=BF16).abs() + 0.5]),
    ("rsqrt", torch.rsqrt, lambda: [_cpu(4, 5, dtype=BF16).abs() + 0.5]),
    ("pow.Tensor_Scalar", lambda a: a ** 3, lambda: [_cpu(4, 5, dtype=BF16)]),
    ("layer_norm", lambda a, w, b: F.layer_norm(a, (5,), w, b),
     lambda: [_cpu(4, 5, dtype=BF16), _cpu(5, dtype=BF16), _cpu(5, dtype=BF16)]),
    ("group_norm", lambda a: F.group_norm(a, 2), lambda: [_cpu(2, 4, 3, dtype=BF16)]),
    ("logsumexp", lambda a: torch.logsumexp(a, 1), lambda: [_cpu(4, 5, dtype=BF16)]),
    ("cosine_similarity", F.cosine_similarity, lambda: [_cpu(4, 5, dtype=BF16), _cpu(4, 5, dtype=BF16)]),
    ("softplus", F.softplus, lambda: [_cpu(4, 5, dtype=BF16)]),
    ("softmax.int", lambda a: torch.softmax(a, -1), lambda: [_cpu(4, 5, dtype=BF16)]),
    ("log_softmax.int", lambda a: torch.log_softmax(a, -1), lambda: [_cpu(4, 5, dtype=BF16)]),
    ("sum", torch.sum, lambda: [_cpu(4, 5, dtype=BF16)]),
    ("sum.dim_IntList", lambda a: a.sum(1), lambda: [_cpu(4, 5, dtype=BF16)]),
    ("cumsum", lambda a: a.cumsum(1), lambda: [_cpu(4, 5, dtype=BF16)]),
    ("prod.dim_int", lambda a: a.prod(1), lambda: [_cpu(4, 5, dtype=BF16)]),
    ("linalg_vector_norm", torch.linalg.vector_norm, lambda: [_cpu(4, 5, dtype=BF16)]),
    # torch.norm() itself calls linalg_vector_norm: the aten overloads are called directly
    ("norm.Scalar", lambda a: torch.ops.aten.norm.Scalar(a, 2), lambda: [_cpu(4, 5, dtype=BF16)]),
    ("norm.ScalarOpt_dim", lambda a: torch.ops.aten.norm.ScalarOpt_dim(a, 2, [1]), lambda: [_cpu(4, 5, dtype=BF16)]),
    ("addcmul", torch.addcmul, lambda: [_cpu(4, 5), _cpu(4, 5, dtype=BF16), _cpu(4, 5, dtype=BF16)]),
    ("addcdiv", torch.addcdiv, lambda: [_cpu(4, 5, dtype=BF16), _cpu(4, 5, dtype=BF16), _cpu(4, 5, dtype=BF16) + 3]),
    ("atan2", torch.atan2, lambda: [_cpu(4, 5), _cpu(4, 5, dtype=BF16)]),
    ("dot", torch.dot, lambda: [_cpu(6, dtype=BF16), _cpu(6, dtype=BF16)]),
    ("cross", lambda a, b: torch.cross(a, b, dim=1), lambda: [_cpu(4, 3, dtype=BF16), _cpu(4, 3)]),
    ("scatter_add", lambda a, s: a.scatter_add(0, torch.tensor([[0, 1, 2]]).to(a.device), s),
     lambda: [_cpu(3, 3), _cpu(1, 3, dtype=BF16)]),
]


def _policy_reference(name, fn, inputs):
    policy = pjrt_autocast.policy_of(name)
    floats = [x for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if policy == "lower_precision_fp":
        to_type = BF16
    elif policy == "promote":
        to_type = torch.float32 if any(x.dtype == torch.float32 for x in floats) else BF16
    else:
        assert policy in ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype"), (name, policy)
        to_type = torch.float32
    return to_type, fn(*[x.to(to_type) if any(x is f for f in floats) else x for x in inputs])


@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("name, fn, make", CUDA_ONLY, ids=[c[0] for c in CUDA_ONLY])
def test_cuda_policy_per_category(name, fn, make):
    inputs = make()
    to_type, expected = _policy_reference(name, fn, inputs)
    assert expected.dtype == to_type
    with torch.autocast(DEV, dtype=BF16):
        got = fn(*_to(inputs, DEV))
    _close(got, expected)


def test_policy_details():
    x32 = torch.randn(4, 5, device=DEV)
    x16 = x32.to(BF16)
    with torch.autocast(DEV, dtype=BF16):
        # ops in no list fall through: PyTorch's own promotion
        assert F.relu(x16).dtype == BF16 and F.relu(x32).dtype == torch.float32
        assert (x16 + x32).dtype == torch.float32
        # an explicit dtype is kept (fp32_set_opt_dtype only fills in a missing one)
        assert torch.softmax(x16, -1, dtype=BF16).dtype == BF16
        # an ineligible first input is left alone: integer sum stays int64, norm of float64 stays float64
        assert torch.arange(6, device=DEV).sum().dtype == torch.int64
        assert torch.ops.aten.norm.Scalar(x32.double(), 2).dtype == torch.float64
        # float64 is never cast, integer tensors neither
        assert torch.mm(x32.double(), x32.double().t()).dtype == torch.float64
        assert torch.mm(x32, x32.t()).dtype == BF16
        # only tensors on the autocast device: CPU tensors inside autocast("pjrt") stay float32
        assert torch.mm(x32.cpu(), x32.cpu().t()).dtype == torch.float32
        # promote: float32 wins; a float16 tensor in a bfloat16 region is PyTorch's error
        assert torch.addcmul(x16, x16, x16).dtype == BF16
        assert torch.addcmul(x16, x16, x32).dtype == torch.float32
        with pytest.raises(RuntimeError, match="Unexpected floating ScalarType in at::autocast::prioritize"):
            torch.addcmul(x16, x16, x32.half())
        # promote ignores float64 inputs when choosing the type (and does not cast them)
        assert torch.atan2(x16, x32.double()).dtype == torch.float64


def test_banned_op_raises_pytorchs_error():
    p = torch.rand(4, 3, device=DEV)
    t = torch.rand(4, 3, device=DEV)
    with torch.autocast(DEV, dtype=BF16):
        with pytest.raises(RuntimeError) as err:
            F.binary_cross_entropy(p, t)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            nn.BCELoss()(p, t)
        with torch.autocast(DEV, enabled=False):
            F.binary_cross_entropy(p, t)  # allowed where autocast is off
    assert str(err.value) == pjrt_autocast.BANNED["binary_cross_entropy"]
    assert "binary_cross_entropy_with_logits" in str(err.value)
    F.binary_cross_entropy(p, t)


# ---- autograd and the weight cast cache -----------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc1 = nn.Linear(6 * 8 * 8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        x = F.relu(self.conv(x))
        return self.fc2(F.gelu(self.fc1(x.flatten(1))))


def _net_step(device, net, x, y):
    net = net.to(device)
    with torch.autocast(device, dtype=BF16):
        out = net(x.to(device))
        loss = F.mse_loss(out, y.to(device))
    loss.backward()
    return out, loss, [p.grad for p in net.parameters()]


@pytest.mark.usefixtures("each_eager_mode")
def test_forward_backward_vs_cpu_autocast():
    net = _Net()
    x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 4)
    out_c, loss_c, grads_c = _net_step("cpu", copy.deepcopy(net), x, y)
    out_p, loss_p, grads_p = _net_step(DEV, copy.deepcopy(net), x, y)
    assert out_p.dtype == BF16 and loss_p.dtype == torch.float32
    _close(out_p, out_c)
    torch.testing.assert_close(loss_p.detach().cpu(), loss_c.detach(), rtol=2e-2, atol=1e-3)
    for gp, gc in zip(grads_p, grads_c):
        assert gp.dtype == torch.float32  # the fp32 weights get fp32 gradients through the casts
        torch.testing.assert_close(gp.cpu(), gc, rtol=5e-2, atol=2e-2)


def test_weight_casts_are_cached_within_a_region():
    lin = nn.Linear(8, 8).to(DEV)
    x = torch.randn(2, 8, device=DEV)
    entries = lambda: pjrt_autocast._cache.entries  # noqa: E731
    with torch.autocast(DEV, dtype=BF16):
        lin(x)
        first = entries()[lin.weight][BF16][1]
        lin(lin(x))
        assert entries()[lin.weight][BF16][1] is first  # one cast per weight per region
        assert x not in entries()  # not a leaf requiring grad: cast every time
        with torch.no_grad():
            lin.weight.add_(1.0)  # a weight updated inside the region is cast again
        lin(x)
        assert entries()[lin.weight][BF16][1] is not first
        with torch.autocast(DEV, dtype=torch.float16):
            lin(x)
            assert set(entries()[lin.weight]) == {BF16, torch.float16}
    assert len(entries()) == 0  # cleared on leaving the outermost region, as torch does
    with torch.autocast(DEV, dtype=BF16, cache_enabled=False):
        lin(x)
        assert len(entries()) == 0
    # the cached cast stays in the graph: the weight still gets its gradient
    with torch.autocast(DEV, dtype=BF16):
        loss = lin(x).float().sum() + lin(x).float().sum()
    loss.backward()
    expected = 2 * x.sum(0).to(BF16).float().expand(8, 8)
    torch.testing.assert_close(lin.weight.grad.cpu(), expected.cpu(), rtol=2e-2, atol=2e-2)


# ---- torch.compile --------------------------------------------------------------------------


def test_compile_autocast_inside_and_around():
    torch._dynamo.reset()
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(DEV)
    x = torch.randn(5, 8, device=DEV)

    def f(x):
        with torch.autocast(DEV, dtype=BF16):
            h = net(x)
            return h, torch.softmax(h, -1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a graph running eagerly would warn: the casts must compile
        h, s = torch.compile(f, backend="pjrt")(x)
        compiled_net = torch.compile(net, backend="pjrt")
        with torch.autocast(DEV, dtype=BF16):
            around = compiled_net(x)
    eager_h, eager_s = f(x)
    assert h.dtype == BF16 and s.dtype == torch.float32 and around.dtype == BF16
    torch.testing.assert_close(h.cpu(), eager_h.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(s.cpu(), eager_s.cpu(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(around.cpu(), eager_h.cpu(), rtol=0, atol=0)


# ---- GradScaler -----------------------------------------------------------------------------


def test_unscale_kernel_matches_cpu():
    def case(device, found_start, inv):
        g16 = torch.tensor([1.0, -2.5, 65504.0, 3e-5], dtype=torch.float16)
        g32 = torch.tensor([[1.0, float("nan")], [7.0, -0.0]])
        gbf = torch.tensor([1.0, 3.0], dtype=BF16)
        grads = [t.clone().to(device) for t in (g16, g32, gbf)]
        found = torch.full((), found_start).to(device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads[:1], found, torch.full((), inv).to(device))
        after_finite = found.clone()
        torch._amp_foreach_non_finite_check_and_unscale_(grads[1:2], found, torch.full((), inv).to(device))
        torch._amp_foreach_non_finite_check_and_unscale_(grads[2:], found, torch.full((), inv).to(device))
        return [g.cpu() for g in grads], after_finite.cpu(), found.cpu()

    for found_start in (0.0, 1.0):
        for inv in (1.0, 1 / 3, 2.0**-10):
            cpu, pj = case("cpu", found_start, inv), case(DEV, found_start, inv)
            for c, p in zip(cpu[0], pj[0]):
                assert p.dtype == c.dtype
                torch.testing.assert_close(p, c, rtol=0, atol=0, equal_nan=True)
            assert pj[1].item() == cpu[1].item() == found_start  # finite grads leave found_inf as it was
            assert pj[2].item() == cpu[2].item() == 1.0
    inf_grad = [torch.tensor([1.0, float("-inf")], device=DEV)]
    found = torch.zeros((), device=DEV)
    torch._amp_foreach_non_finite_check_and_unscale_(inf_grad, found, torch.full((), 0.5, device=DEV))
    assert found.item() == 1.0 and inf_grad[0].cpu().tolist() == [0.5, float("-inf")]
    # functional form (PyTorch's composite: clone, then the in-place kernel)
    out, found_out = torch.ops.aten._amp_foreach_non_finite_check_and_unscale(
        [torch.ones(3, device=DEV)], torch.zeros(1, device=DEV), torch.full((1,), 0.25, device=DEV))
    assert out[0].cpu().tolist() == [0.25] * 3 and found_out.item() == 0.0
    with pytest.raises(RuntimeError, match="found_inf must be a 1-element tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(3, device=DEV)], torch.zeros(2, device=DEV),
                                                         torch.ones((), device=DEV))
    with pytest.raises(RuntimeError, match="inv_scale must be a float tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(3, device=DEV)], torch.zeros((), device=DEV),
                                                         torch.ones((), device=DEV, dtype=torch.float64))


def test_update_scale_kernel_matches_cpu():
    cases = [  # scale, tracker, found_inf, growth, backoff, interval
        (1024.0, 0, 0.0, 2.0, 0.5, 3), (1024.0, 2, 0.0, 2.0, 0.5, 3), (1024.0, 2, 1.0, 2.0, 0.5, 3),
        (1024.0, 1, float("nan"), 2.0, 0.5, 3), (3e38, 0, 0.0, 2.0, 0.5, 1), (1.0, 0, 0.0, 1.1, 0.3, 1),
        (1.0, 0, 1.0, 1.1, 0.3, 1), (65536.0, 4, 0.0, 3.0, 0.25, 6),
    ]
    for scale, tracker, found, growth, backoff, interval in cases:
        results = []
        for device in ("cpu", DEV):
            s = torch.full((), scale).to(device)
            t = torch.full((), tracker, dtype=torch.int32).to(device)
            returned = torch._amp_update_scale_(s, t, torch.full((), found).to(device), growth, backoff, interval)
            assert returned is s
            fs, ft = torch.ops.aten._amp_update_scale(  # the functional form, on 1-D tensors
                torch.full((1,), scale).to(device), torch.full((1,), tracker, dtype=torch.int32).to(device),
                torch.full((1,), found).to(device), growth, backoff, interval)
            results.append((s.item(), t.item(), fs.item(), ft.item()))
        assert results[0] == results[1], (scale, tracker, found, results)
    with pytest.raises(RuntimeError, match="growth_tracker must be an int tensor"):
        torch._amp_update_scale_(torch.ones((), device=DEV), torch.zeros((), device=DEV), torch.zeros((), device=DEV),
                                 2.0, 0.5, 2)


def _scaler_loop(device, steps=12, inf_steps=(3, 4, 9)):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=3)
    g = torch.Generator().manual_seed(1)
    history = []
    for i in range(steps):
        x, y = torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device)
        with torch.autocast(device, dtype=torch.float16):
            loss = F.mse_loss(net(x), y)
        scaler.scale(loss).backward()
        if i in inf_steps:
            net[0].weight.grad[1, 2] = float("inf") if i != 9 else float("nan")
        before = [p.detach().clone() for p in net.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        stepped = any(not torch.equal(b, p.detach()) for b, p in zip(before, net.parameters()))
        history.append((scaler.get_scale(), scaler._growth_tracker.item(), stepped, loss.item()))
    return history, [p.detach().cpu() for p in net.parameters()]


@pytest.mark.slow
@pytest.mark.usefixtures("each_eager_mode")
def test_gradscaler_loop_matches_cpu():
    cpu_history, cpu_params = _scaler_loop("cpu")
    pj_history, pj_params = _scaler_loop(DEV)
    scales = [h[:3] for h in pj_history]
    assert scales == [h[:3] for h in cpu_history]  # same scales, trackers and skipped steps
    assert [h[2] for h in pj_history] == [i not in (3, 4, 9) for i in range(12)]
    # grows after 3 clean steps, halves (and restarts counting) on each inf/NaN step
    assert [h[:2] for h in scales] == [(4096.0, 1), (4096.0, 2), (8192.0, 0), (4096.0, 0), (2048.0, 0), (2048.0, 1),
                                       (2048.0, 2), (4096.0, 0), (4096.0, 1), (2048.0, 0), (2048.0, 1), (2048.0, 2)]
    for h_c, h_p in zip(cpu_history, pj_history):
        assert abs(h_c[3] - h_p[3]) < 2e-2 * max(1.0, abs(h_c[3]))
    for c, p in zip(cpu_params, pj_params):
        torch.testing.assert_close(p, c, rtol=2e-2, atol=2e-2)


def test_gradscaler_refuses_fp16_gradients_as_on_cuda():
    net = nn.Linear(4, 2).to(DEV).half()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(DEV)
    scaler.scale(net(torch.randn(3, 4, device=DEV).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)


# ---- a real model ---------------------------------------------------------------------------


def _sequences(g, n=8, seq=32, vocab=256):
    """Arithmetic progressions mod vocab with a random start and step: the next token is
    predictable from the context, so the loss really goes down."""
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    return (start + step * torch.arange(seq)) % vocab


def _train_gpt2(use_autocast, steps=50):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    dtypes_seen = set()
    hook = model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: dtypes_seen.add(o.dtype))
    losses = []
    for _ in range(steps):
        ids = _sequences(g).to(DEV)
        with torch.autocast(DEV, dtype=BF16, enabled=use_autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    hook.remove()
    return losses, dtypes_seen


@pytest.mark.slow
def test_gpt2_bf16_autocast_tracks_float32():
    pytest.importorskip("transformers")
    fp32, seen32 = _train_gpt2(False)
    bf16, seen16 = _train_gpt2(True)
    assert seen32 == {torch.float32} and seen16 == {BF16}
    deviation = max(abs(a - b) for a, b in zip(fp32, bf16))
    print(f"GPT-2 (2 layers, n_embd 64), 50 AdamW steps: loss {fp32[0]:.3f} -> {fp32[-1]:.3f} (float32), "
          f"{bf16[0]:.3f} -> {bf16[-1]:.3f} (bf16 autocast); max |bf16 - fp32| = {deviation:.4f}")
    assert fp32[-1] < fp32[0] - 2.0  # the task is learned
    assert deviation < 0.03  # measured 0.0024 (CPU platform)
