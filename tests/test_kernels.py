"""`@torchpjrt.kernel`: JAX and Pallas functions as PyTorch ops, in every execution mode."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest
import torch

import torchpjrt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples", "kernels"))

from flash_attention import flash_attention  # noqa: E402
from rms_norm import rms_norm  # noqa: E402
from tiny_transformer import compare_training, torch_attention, torch_rms_norm  # noqa: E402

DEV = "pjrt"
MODES = ["strict", "debug", "fused", "compile"]


def _run(mode, fn, *args):
    """fn(*args) on pjrt in `mode`; returns (output on CPU, grads of the inputs on CPU)."""
    inputs = [a.detach().to(DEV).requires_grad_(a.is_floating_point()) for a in args]
    call = torch.compile(fn, backend="pjrt") if mode == "compile" else fn
    with torchpjrt.eager_mode("strict" if mode == "compile" else mode):
        out = call(*inputs)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device=DEV)).sum().backward()
        return out.detach().cpu(), [t.grad.cpu() if t.grad is not None else None for t in inputs]


def _reference(fn, *args):
    inputs = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*inputs)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("mode", MODES)
def test_rms_norm_kernel_matches_pytorch(mode):
    x, w = torch.randn(3, 5, 32), torch.randn(32)
    out, grads = _run(mode, lambda a, b: rms_norm(a, b) * 2, x, w)
    ref, ref_grads = _reference(lambda a, b: torch_rms_norm(a, b) * 2, x, w)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_pallas_flash_attention_matches_pytorch(mode):
    q, k, v = (torch.randn(2, 2, 64, 16) for _ in range(3))
    out, grads = _run(mode, flash_attention, q, k, v)
    ref, ref_grads = _reference(torch_attention, q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_the_compiled_graph_inlines_the_kernel():
    from torchpjrt.compile import backend

    before = dict(backend.stats)
    f = torch.compile(lambda a, b: rms_norm(a, b).sum(), backend="pjrt")
    f(torch.randn(4, 8, device=DEV), torch.randn(8, device=DEV))
    assert backend.stats["graphs"] > before.get("graphs", 0)
    assert backend.stats.get("eager_graphs", 0) == before.get("eager_graphs", 0)


@pytest.mark.slow  # a model's training steps
@pytest.mark.parametrize("norm,attention,steps", [("rms_norm", None, 5), (None, "flash_attention", 2)])
def test_a_small_transformer_trains_with_the_kernels(norm, attention, steps):
    kwargs = {}
    if norm:
        kwargs["norm_fn"] = rms_norm
    if attention:
        kwargs["attention_fn"] = flash_attention
    losses, reference = compare_training(steps=steps, **kwargs)
    torch.testing.assert_close(losses, reference, rtol=1e-4, atol=1e-5)
    assert losses[-1] < losses[0]


def test_multiple_outputs_integer_inputs_and_defaults():
    @torchpjrt.kernel(name="kernel_tests::split_scale")
    def split_scale(x, index, scale: float = 2.0) -> tuple[jax.Array, jax.Array]:
        return x * scale, jnp.take(x, index, axis=0)

    x = torch.randn(4, 3, device=DEV, requires_grad=True)
    index = torch.tensor([3, 0], device=DEV)
    scaled, picked = split_scale(x, index)
    (scaled.sum() + picked.sum() * 10).backward()
    torch.testing.assert_close(scaled.detach().cpu(), x.detach().cpu() * 2)
    torch.testing.assert_close(picked.detach().cpu(), x.detach().cpu()[[3, 0]])
    expected = torch.full((4, 3), 2.0)
    expected[[3, 0]] += 10
    torch.testing.assert_close(x.grad.cpu(), expected)
    scaled3, _ = split_scale(x, index, scale=3.0)
    torch.testing.assert_close(scaled3.detach().cpu(), x.detach().cpu() * 3)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_a_kernel_that_mutates_an_argument(mode):
    @torchpjrt.kernel(name=f"kernel_tests::ema_{mode}", mutates_args=("average",))
    def ema(x, average, decay: float = 0.9):
        new_average = decay * average + (1 - decay) * x.mean(0)
        return x - new_average, new_average

    with torchpjrt.eager_mode(mode):
        average = torch.zeros(3, device=DEV)
        x = torch.ones(5, 3, device=DEV)
        centered = ema(x, average)
        ema(x, average)
        torch.testing.assert_close(average.cpu(), torch.full((3,), 0.19))
        torch.testing.assert_close(centered.cpu(), torch.full((5, 3), 0.9))


def test_cpu_tensors_are_a_clear_error():
    with pytest.raises(RuntimeError, match="kernel 'examples::rms_norm' runs on pjrt tensors only.*cpu"):
        rms_norm(torch.randn(2, 4), torch.randn(4))
    with pytest.raises(RuntimeError, match="kernel 'examples::rms_norm': all tensors must be on pjrt, got one on cpu"):
        rms_norm(torch.randn(2, 4, device=DEV), torch.randn(4))


def test_an_output_that_disagrees_with_the_fake_is_a_clear_error():
    def wrong_fake(x):
        return x.new_empty(x.shape[0], 2 * x.shape[1])

    @torchpjrt.kernel(name="kernel_tests::double_rows", fake=wrong_fake)
    def double_rows(x):
        return jnp.concatenate([x, x], axis=0)

    with pytest.raises(RuntimeError, match=r"kernel 'kernel_tests::double_rows': output 0 is torch.float32\[6, 3\] "
                                           r"but its fake implementation says torch.float32\[3, 6\]"):
        double_rows(torch.randn(3, 3, device=DEV))


def _row_sum_with_a_wrong_fake():
    # the real output drops the summed dim; the fake keeps it (a size-1 dim that broadcasts)
    @torchpjrt.kernel(name="kernel_tests::row_sum_wrong_fake", fake=lambda x: x.new_empty(x.shape[0], 1))
    def row_sum(x):
        return x.sum(-1)

    return row_sum


def _double_with_a_wrong_fake_dtype():
    @torchpjrt.kernel(name="kernel_tests::double_wrong_fake_dtype",
                      fake=lambda x: x.new_empty(x.shape, dtype=torch.float64))
    def double(x):
        return x * 2

    return double


_row_sum_wrong_fake = _row_sum_with_a_wrong_fake()
_double_wrong_fake_dtype = _double_with_a_wrong_fake_dtype()


@pytest.mark.parametrize("mode", ["strict", "fused", "compile"])
def test_a_fake_shape_mismatch_raises_in_every_mode(mode):
    # compiled, the fake's [3, 1] would broadcast against x and return a wrong [3, 3] result
    x = torch.randn(3, 3, device=DEV)
    call = torch.compile(lambda x: _row_sum_wrong_fake(x) + x, backend="pjrt") if mode == "compile" \
        else (lambda x: _row_sum_wrong_fake(x) + x)
    with torchpjrt.eager_mode("strict" if mode == "compile" else mode):
        with pytest.raises(RuntimeError, match=r"kernel 'kernel_tests::row_sum_wrong_fake': output 0 is "
                                               r"torch.float32\[3\] but its fake implementation says "
                                               r"torch.float32\[3, 1\]"):
            call(x).cpu()


@pytest.mark.parametrize("mode", ["strict", "fused", "compile"])
def test_a_fake_dtype_mismatch_raises_in_every_mode(mode):
    # compiled, the result would be cast to the fake's float64 without a word
    x = torch.randn(3, 3, device=DEV)
    call = torch.compile(lambda x: _double_wrong_fake_dtype(x) + 1, backend="pjrt") if mode == "compile" \
        else (lambda x: _double_wrong_fake_dtype(x) + 1)
    with torchpjrt.eager_mode("strict" if mode == "compile" else mode):
        with pytest.raises(RuntimeError, match=r"kernel 'kernel_tests::double_wrong_fake_dtype': output 0 is "
                                               r"torch.float32\[3, 3\] but its fake implementation says "
                                               r"torch.float64\[3, 3\]"):
            call(x).cpu()


def test_a_matching_fake_compiles_with_no_error():
    @torchpjrt.kernel(name="kernel_tests::row_sum_right_fake", fake=lambda x: x.new_empty(x.shape[0]))
    def row_sum(x):
        return x.sum(-1)

    x = torch.randn(3, 4)
    out = torch.compile(lambda x: row_sum(x) * 2, backend="pjrt")(x.to(DEV))
    torch.testing.assert_close(out.cpu(), x.sum(-1) * 2)


def test_unsupported_signatures_are_clear_errors():
    with pytest.raises(TypeError, match="kernel 'kernel_tests::bad'.*argument 'mode'"):
        @torchpjrt.kernel(name="kernel_tests::bad")
        def bad(x, mode: dict = None):
            return x

    with pytest.raises(TypeError, match="takes no tensor argument"):
        @torchpjrt.kernel(name="kernel_tests::no_tensor")
        def no_tensor(n: int = 3):
            return jnp.zeros(n)

    with pytest.raises(ValueError, match="mutates_args names unknown arguments \\['y'\\]"):
        @torchpjrt.kernel(name="kernel_tests::unknown", mutates_args=("y",))
        def unknown(x):
            return x


def test_a_kernel_returning_the_wrong_number_of_arrays_names_itself():
    @torchpjrt.kernel(name="kernel_tests::two_declared", n_outputs=2)
    def two_declared(x):
        return x * 2

    with pytest.raises(RuntimeError, match="kernel 'kernel_tests::two_declared' returned 1 arrays; expected 2"):
        two_declared(torch.randn(3, device=DEV))


def test_torch_reference_helpers_are_what_the_examples_compare_with():
    q, k, v = (torch.randn(1, 1, 8, 4) for _ in range(3))
    manual = torch.softmax((q @ k.transpose(-1, -2) / 2).masked_fill(torch.ones(8, 8).triu(1).bool(), float("-inf")), -1) @ v
    torch.testing.assert_close(torch_attention(q, k, v), manual)
    x, w = torch.randn(2, 4), torch.randn(4)
    torch.testing.assert_close(torch_rms_norm(x, w), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w)
