import glob
import importlib.util
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # several worker processes may share one GPU: each takes memory as it needs it, rather than
    # JAX's default of most of the GPU for the first process
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest
import torch
from hypothesis import HealthCheck, settings


def _build_compiled_helper():
    """The compiled helper (native views, strict mode's hot path) is registered when torchpjrt
    loads, if it is built by then (a machine's first process builds it in the background). It is
    built first here, so that the suite runs what a user's later processes run: native.py is
    loaded on its own (importing the package would load torchpjrt before the build)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchpjrt", "native.py")
    spec = importlib.util.spec_from_file_location("_torchpjrt_native_build", path)
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    native.library()


_build_compiled_helper()

import torchpjrt  # noqa: E402,F401  (registers the pjrt device)

DEV = "pjrt"

# Hypothesis profiles (tests/test_fuzz.py): "ci" is deterministic and short; "long" explores
# (`pytest tests/test_fuzz.py --hypothesis-profile=long`). Registered here so the option finds them.
_FUZZ_HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
                HealthCheck.filter_too_much, HealthCheck.large_base_example]
settings.register_profile("ci", derandomize=True, max_examples=300, deadline=None, print_blob=True,
                          database=None, suppress_health_check=_FUZZ_HEALTH)
settings.register_profile("long", max_examples=5000, deadline=None, print_blob=True,
                          suppress_health_check=_FUZZ_HEALTH)


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


def pytest_xdist_auto_num_workers(config):
    """Worker processes for `-n auto` (pyproject's addopts): one per core, at most 4. One where a
    TPU is attached: a TPU is held by one process at a time. (PYTEST_XDIST_AUTO_NUM_WORKERS, or
    `-n N`, chooses otherwise.)"""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return 1
    from torchpjrt.bench.targets import usable_cores

    return max(1, min(usable_cores() or 1, 4))


@pytest.fixture
def empty_kernel_cache(tmp_path, monkeypatch):
    """A kernel cache with nothing kept yet, as on a user's first run: fused mode's graphs are then
    compiled (and counted) by this process, by its policy, rather than loaded as earlier runs of
    the suite kept them."""
    from torchpjrt import kernel_cache

    if kernel_cache.directory() is not None:
        monkeypatch.setattr(kernel_cache, "_directory", str(tmp_path / "kernels"))


@pytest.fixture(params=["strict", "debug", "fused"])
def each_eager_mode(request):
    """Run a test once per eager mode (modules opt in with `usefixtures`). Fused mode compiles
    each graph at its first sighting, so that a program run once is checked as a fused graph
    (by default it would run op by op, as strict mode does, until the graph repeats)."""
    options = {"compile_after": 1} if request.param == "fused" else {}
    with torchpjrt.eager_mode(request.param, **options):
        yield request.param
