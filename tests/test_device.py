"""The device itself: registration, torch.pjrt, errors for what is not supported."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import torchpjrt
from torchpjrt import native


def test_plain_tensor_on_pjrt_device():
    x = torch.randn(4, 8, device="pjrt")
    assert type(x) is torch.Tensor
    assert x.device == torch.device("pjrt:0")
    assert x.is_pjrt
    assert torch.device("pjrt").type == "pjrt"


def test_device_module():
    assert torch.pjrt.is_available()
    assert torch.pjrt.device_count() >= 1
    assert torch.pjrt.current_device() == 0
    torch.pjrt.set_device(0)
    import jax

    assert torch.pjrt.platform() == jax.devices()[0].platform
    torch.pjrt.synchronize()
    assert isinstance(torch.pjrt.memory_stats(), dict)
    assert torch.pjrt.memory_allocated() >= 0
    assert isinstance(torch.pjrt.get_device_name(), str)


def test_manual_seed_reproduces_random_numbers():
    torch.manual_seed(123)
    a = torch.randn(5, device="pjrt").cpu()
    b = torch.rand(5, device="pjrt").cpu()
    torch.manual_seed(123)
    assert torch.equal(a, torch.randn(5, device="pjrt").cpu())
    assert torch.equal(b, torch.rand(5, device="pjrt").cpu())
    assert not torch.equal(a, torch.randn(5, device="pjrt").cpu())
    torch.pjrt.manual_seed(7)
    c = torch.randn(3, device="pjrt").cpu()
    torch.pjrt.manual_seed_all(7)
    assert torch.equal(c, torch.randn(3, device="pjrt").cpu())


def test_rng_state_roundtrip():
    torch.manual_seed(5)
    state = torch.pjrt.get_rng_state()
    a = torch.randn(4, device="pjrt").cpu()
    torch.pjrt.set_rng_state(state)
    assert torch.equal(a, torch.randn(4, device="pjrt").cpu())


def test_int64_and_float64_are_kept():
    x = torch.tensor([2**40, 3], device="pjrt")
    assert x.dtype == torch.int64
    assert (x * 2).cpu().tolist() == [2**41, 6]
    d = torch.tensor([1e-300], dtype=torch.float64, device="pjrt")
    assert (d * 1e-5).cpu().item() == pytest.approx(1e-305)


def _symmetric():
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    return a @ a.T + torch.eye(4)


# linalg.ldl_factor has no lowering (JAX has no Bunch-Kaufman factorization)
def test_unsupported_op_names_the_overload():
    with pytest.raises(NotImplementedError, match=r"aten::linalg_ldl_factor_ex\.out.*TORCHPJRT_CPU_FALLBACK=1"):
        torch.linalg.ldl_factor(_symmetric().to("pjrt"))


def test_cpu_fallback_is_opt_in_warns_and_counts(monkeypatch):
    monkeypatch.setenv("TORCHPJRT_CPU_FALLBACK", "1")
    name = "aten::linalg_ldl_factor_ex.out"
    before = torchpjrt.cpu_fallback_counts[name]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        ld, pivots = torch.linalg.ldl_factor(_symmetric().to("pjrt"))
    assert ld.device.type == "pjrt" and pivots.device.type == "pjrt"
    expected_ld, expected_pivots = torch.linalg.ldl_factor(_symmetric())
    torch.testing.assert_close(ld.cpu(), expected_ld)
    assert pivots.cpu().tolist() == expected_pivots.tolist()
    assert torchpjrt.cpu_fallback_counts[name] == before + 1


def test_other_device_index_is_a_clear_error():
    with pytest.raises((RuntimeError, NotImplementedError), match="pjrt:3"):
        torch.zeros(2, device="pjrt:3")


@pytest.mark.slow  # a fresh process
def test_missing_platform_is_a_clear_error():
    code = "import torch, torchpjrt; torch.zeros(1, device='pjrt')"
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**__import__("os").environ, "TORCHPJRT_PLATFORM": "no_such_platform"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "TORCHPJRT_PLATFORM='no_such_platform'" in r.stderr


def _dispatched():
    stats = torchpjrt.op_stats()
    return stats.get("lowered", 0) + stats["hot_path"]


def test_op_stats_counts_paths():
    # a key's first call takes the Python kernel, later ones the hot path (an earlier test in this
    # process may have made the first already)
    before = _dispatched()
    torch.ones(3, device="pjrt") + 1
    assert _dispatched() > before
    x = torch.arange(7.0, device="pjrt")
    before, served = _dispatched(), torchpjrt.op_stats()["hot_path"]
    for _ in range(3):
        x.mul(3.0)
    assert _dispatched() == before + 3
    if native.library() is not None:
        assert torchpjrt.op_stats()["hot_path"] >= served + 2  # served from the second call on


@pytest.mark.slow  # a fresh process
def test_import_torch_alone_makes_pjrt_usable():
    code = (
        "import sys, torch\n"
        "x = torch.ones(3, device='pjrt') * 2\n"
        "print(x.sum().item(), torch.pjrt.is_available(), 'torchpjrt' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["6.0", "True", "True"]
    off = subprocess.run([sys.executable, "-c", "import sys, torch; print('torchpjrt' in sys.modules)"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert off.stdout.strip() == "False", off.stderr[-2000:]


def test_copying_to_the_device_leaves_the_cpu_tensor_resizable():
    """x.to("pjrt") reads x without marking its storage as never resizable (Tensor.numpy() would;
    CUDA's copy does not)."""
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.uint16):
        x = torch.arange(6.0).to(dtype).view(2, 3).t()
        on_device = x.to("pjrt")
        assert torch.equal(on_device.cpu(), x)
        x.resize_(12)  # raised "Trying to resize storage that is not resizable"
        assert x.shape == (12,)
