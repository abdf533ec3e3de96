"""The view ops that reach the device (as_strided, view, _reshape_alias) run CPU's own kernels
from the compiled helper (csrc/views.cpp), or torchpjrt's Python view kernel without it. Both
must give CPU's geometry, values, storage sharing, autograd and errors; debug mode keeps the
Python kernels. A fresh machine builds the helper in the background while its first process runs."""

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import torchpjrt
from torchpjrt import dispatch, native

from conftest import DEV


@pytest.fixture(params=["native", "python"])
def view_kernels(request):
    """Run a test with CPU's view kernels from the helper, then with the Python ones."""
    if request.param == "native" and native.library() is None:
        pytest.skip(f"the compiled helper is not available: {native.failure()}")
    dispatch.native_views_wanted = request.param == "native"
    dispatch.update_view_kernels()
    assert dispatch.native_views_enabled() == (request.param == "native")
    yield request.param
    dispatch.native_views_wanted = True
    dispatch.update_view_kernels()


def _geometry(t):
    return tuple(t.shape), t.stride(), t.storage_offset()


VIEW_PROGRAMS = {
    "view": lambda x: x.view(4, 6),
    "view_-1": lambda x: x.view(-1),
    "t": lambda x: x.t(),
    "transpose": lambda x: x.transpose(0, 1),
    "permute": lambda x: x.view(2, 3, 4).permute(2, 0, 1),
    "expand": lambda x: x[0:1].expand(5, 4),
    "slice_step": lambda x: x[1::2, ::3],
    "select": lambda x: x[2],
    "split": lambda x: x.split(2, dim=1)[1],
    "unsqueeze_squeeze": lambda x: x.unsqueeze(1).squeeze(1),
    "reshape_of_transpose": lambda x: x.t().reshape(24),  # a copy on CPU: strided read on pjrt
    "diagonal": lambda x: x[:4].diagonal(),
    "unflatten": lambda x: x.unflatten(0, (3, 2)),
    "as_strided": lambda x: x.as_strided((3, 3), (1, 3), 2),
    "chain": lambda x: x.t()[1:3].unsqueeze(0).expand(2, 2, 6).select(0, 1),
}


@pytest.mark.parametrize("name", sorted(VIEW_PROGRAMS))
def test_views_match_cpu(view_kernels, name):
    program = VIEW_PROGRAMS[name]
    base = torch.arange(24.0).view(6, 4)
    cpu = program(base)
    pj_base = base.to(DEV)
    pj = program(pj_base)
    assert _geometry(pj) == _geometry(cpu)
    assert pj.device.type == "pjrt" and pj.dtype == cpu.dtype
    torch.testing.assert_close(pj.cpu(), cpu)
    if cpu.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
        assert pj.untyped_storage().data_ptr() == pj_base.untyped_storage().data_ptr()
        assert pj.data_ptr() - pj_base.data_ptr() == cpu.data_ptr() - base.data_ptr()


def test_writes_through_views_reach_the_base(view_kernels):
    cpu = torch.arange(24.0).view(6, 4)
    pj = cpu.to(DEV)
    for x in (cpu, pj):
        x.t()[1:3].mul_(-1)
        x.view(24)[::5].add_(100)
        x.as_strided((2, 2), (4, 1), 9).zero_()
    torch.testing.assert_close(pj.cpu(), cpu)


def test_as_strided_reaches_the_whole_storage_and_refuses_beyond_it(view_kernels):
    cpu = torch.arange(8.0)
    pj = cpu.to(DEV)
    # inside the storage but outside the input view: allowed, as on CPU
    torch.testing.assert_close(pj[:2].as_strided((4,), (1,), 2).cpu(), cpu[:2].as_strided((4,), (1,), 2))
    with pytest.raises(RuntimeError) as cpu_error:
        cpu.as_strided((4,), (2,), 2)
    with pytest.raises(RuntimeError) as pjrt_error:
        pj.as_strided((4,), (2,), 2)
    assert str(pjrt_error.value) == str(cpu_error.value)
    assert "out of bounds for storage of size 32" in str(pjrt_error.value)
    # a storage that grew: views reach its new elements
    cpu.resize_(12)
    pj.resize_(12)
    assert _geometry(pj.as_strided((3,), (4,), 0)) == _geometry(cpu.as_strided((3,), (4,), 0))
    assert pj.untyped_storage().nbytes() == cpu.untyped_storage().nbytes() == 48


def test_view_refusals_are_cpus(view_kernels):
    for program in (lambda x: x.t().view(24), lambda x: x.view(5, 5), lambda x: x.view(-1, -1)):
        with pytest.raises(RuntimeError) as cpu_error:
            program(torch.zeros(6, 4))
        with pytest.raises(RuntimeError) as pjrt_error:
            program(torch.zeros(6, 4, device=DEV))
        assert str(pjrt_error.value) == str(cpu_error.value)


def test_autograd_through_views(view_kernels):
    grads = []
    for device in ("cpu", DEV):
        torch.manual_seed(0)
        w = torch.randn(6, 4).to(device).requires_grad_()
        y = (w.t()[1:3].unsqueeze(0).expand(3, 2, 6) * torch.arange(6.0).to(device)).sum()
        y = y + w.view(24)[::3].pow(2).sum() + w.as_strided((2, 2), (1, 4), 5).sum()
        y.backward()
        grads.append(w.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


def test_views_follow_their_base_in_and_out_of_inference_mode(view_kernels):
    normal = torch.zeros(4, 4, device=DEV)
    with torch.inference_mode():
        inside = torch.zeros(4, 4, device=DEV)
        assert not normal.t().is_inference() and inside.view(16).is_inference()
    assert inside.t().is_inference() and not normal.view(16).is_inference()
    assert normal.t()._base is normal and normal.view(16)._version == normal._version


def test_debug_mode_uses_the_python_view_kernels():
    if native.library() is None:
        pytest.skip(f"the compiled helper is not available: {native.failure()}")
    x = torch.arange(6.0, device=DEV)
    (x + 1).sum().item()
    assert dispatch.native_views_enabled()
    with torchpjrt.eager_mode("debug"):
        assert not dispatch.native_views_enabled()
        before = torchpjrt.op_stats()["view"]
        assert x.view(2, 3).t().shape == (3, 2)
        assert torchpjrt.op_stats()["view"] == before + 2  # each view ran (and was logged) in Python
    assert dispatch.native_views_enabled()


@pytest.mark.slow
def test_a_fresh_machine_builds_the_helper_in_the_background(tmp_path):
    """The first process on a machine starts the build and runs with the Python view kernels;
    the build completes even if that process ends first, and the next process loads it."""
    program = textwrap.dedent("""
        import sys, time, torch, torchpjrt
        from torchpjrt import dispatch, native
        x = torch.arange(6.0, device="pjrt")
        y = (x.view(2, 3).t() * 2).sum().item()
        print(dispatch.native_views_enabled(), y, native.failure())
    """)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    env.pop("TORCHPJRT_NATIVE", None)
    run = lambda: subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env,
                                 timeout=300, cwd=pathlib.Path(__file__).parent)
    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.split() == ["False", "30.0", "None"]  # still building: Python kernels
    built = list((tmp_path / "torchpjrt" / "native").rglob("*.so"))
    deadline = 240
    while not [p for p in built if p.name == "torchpjrt_native.so"] and deadline > 0:
        time.sleep(1)
        deadline -= 1
        built = list((tmp_path / "torchpjrt" / "native").rglob("*.so"))
    assert [p.name for p in built] == ["torchpjrt_native.so"], built
    second = run()
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.split() == ["True", "30.0", "None"]
