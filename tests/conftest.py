import os

import pytest
import torch

import torchpjrt  # noqa: F401  (registers the pjrt device)

DEV = "pjrt"


def to_dev(x):
    if isinstance(x, torch.Tensor):
        return x.to(DEV)
    if isinstance(x, (list, tuple)):
        return type(x)(to_dev(v) for v in x)
    return x


def assert_same(cpu, pj, rtol=1e-5, atol=1e-6):
    """Compare a CPU result with a pjrt result, recursively."""
    if isinstance(cpu, torch.Tensor):
        assert isinstance(pj, torch.Tensor), f"expected a tensor, got {type(pj)}"
        assert pj.device.type == "pjrt", pj.device
        assert pj.shape == cpu.shape, (pj.shape, cpu.shape)
        assert pj.dtype == cpu.dtype, (pj.dtype, cpu.dtype)
        torch.testing.assert_close(pj.detach().cpu(), cpu.detach(), rtol=rtol, atol=atol, equal_nan=True)
    elif isinstance(cpu, (list, tuple)):
        assert len(cpu) == len(pj)
        for c, p in zip(cpu, pj):
            assert_same(c, p, rtol, atol)
    else:
        assert cpu == pj, (cpu, pj)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    os.environ.setdefault("TORCHPJRT_CPU_FALLBACK", "0")


@pytest.fixture(params=["strict", "debug", "fused"])
def each_eager_mode(request):
    """Run a test once per eager mode (modules opt in with `usefixtures`)."""
    with torchpjrt.eager_mode(request.param):
        yield request.param
