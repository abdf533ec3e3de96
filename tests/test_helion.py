"""Helion kernels (Meta's kernel DSL, Pallas backend) on pjrt tensors.

A Helion kernel compiled for Pallas has a pure-JAX form, `kernel.jax_fn`, which
`@torchpjrt.kernel` turns into a torch op whose pjrt implementation is that JAX function: it
runs on the device in every eager mode and is inlined into compiled graphs, with no copy through
the host. Pallas runs in interpret mode on the CPU platform. Calling the Helion kernel itself on
pjrt tensors computes the right values, but Helion's torch-tensor launcher converts its inputs
through the host (DLPack of `.cpu()`) and, in interpret mode, returns its new outputs on the CPU
(helion/runtime/pallas/launcher.py): that is Helion's choice, recorded here so a change shows.
"""

import jax.numpy as jnp
import pytest
import torch

import torchpjrt

pytestmark = pytest.mark.slow  # the real library in the loop

helion = pytest.importorskip("helion")
hl = pytest.importorskip("helion.language")


@helion.kernel(backend="pallas", config=helion.Config(block_sizes=[8, 128]), pallas_interpret=True)
def scaled_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for tile in hl.tile(out.size()):
        out[tile] = x[tile] + 2.0 * y[tile]
    return out


def _scaled_add_backward(inputs, outputs, grad_outputs):
    (g,) = grad_outputs
    return g, 2.0 * g


@torchpjrt.kernel(name="helion_tests::scaled_add", backward=_scaled_add_backward)
def scaled_add_pjrt(x, y):
    return scaled_add.jax_fn(x, y)


def _inputs():
    torch.manual_seed(0)
    return torch.randn(16, 256), torch.randn(16, 256)


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
def test_helion_pallas_kernel_as_a_pjrt_op_matches_cpu(mode):
    x, y = _inputs()
    expected = (x + 2 * y).relu()
    px, py = x.to("pjrt"), y.to("pjrt")

    def f(a, b):
        return scaled_add_pjrt(a, b).relu()

    if mode == "compiled":
        out = torch.compile(f, backend="pjrt", fullgraph=True)(px, py)
    else:
        with torchpjrt.eager_mode(mode, **({"compile_after": 1} if mode == "fused" else {})):
            out = f(px, py)
    assert out.device.type == "pjrt"
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-6)


def test_helion_kernel_trains_with_its_backward():
    x, y = _inputs()
    w = torch.zeros(256, requires_grad=True)
    pw = torch.zeros(256, device="pjrt", requires_grad=True)
    opt, popt = torch.optim.SGD([w], lr=0.1), torch.optim.SGD([pw], lr=0.1)
    px, py = x.to("pjrt"), y.to("pjrt")
    for _ in range(3):
        loss = ((x + w) + 2 * y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ploss = scaled_add_pjrt(px + pw, py).square().mean()
        ploss.backward()
        popt.step()
        popt.zero_grad()
        torch.testing.assert_close(ploss.item(), loss.item(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pw.detach().cpu(), w.detach(), rtol=1e-5, atol=1e-6)


def test_jax_fn_is_the_same_program_jax_runs():
    x, y = _inputs()
    direct = scaled_add.jax_fn(jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    assert jnp.array_equal(direct, jnp.asarray((x + 2 * y).numpy()))


def test_calling_the_helion_kernel_on_pjrt_tensors_goes_through_the_host():
    x, y = _inputs()
    out = scaled_add(x.to("pjrt"), y.to("pjrt"))
    assert out.device.type == "cpu"  # Helion's interpret-mode launcher: new outputs on the CPU
    torch.testing.assert_close(out, x + 2 * y, rtol=1e-6, atol=1e-6)
