"""The bad-input catalogue (docs/errors.md): each mistake raises PyTorch's CPU exception type with
a clear message, and leaves the process, the device and every other tensor intact."""

import os
import subprocess
import sys
import textwrap

import pytest
import safetensors
import torch

import torchpjrt
from torchpjrt import checkpoint

DEV = "pjrt"


@pytest.fixture(autouse=True)
def device_survives():
    """Tensors made before the error keep their values, and the device still computes."""
    witness = torch.arange(6, dtype=torch.float32, device=DEV).reshape(2, 3)
    view = witness[:, 1]
    yield
    torch.testing.assert_close(witness.cpu(), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    torch.testing.assert_close(view.cpu(), torch.tensor([1.0, 4.0]))
    torch.testing.assert_close((witness @ witness.T).sum().item(), 83.0)


def raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what is raised is the result
        return e
    return None


def assert_same_error(fn, exact=True):
    """fn(device) raises the same exception type on pjrt as on CPU (and the same message)."""
    cpu, dev = raised(lambda: fn("cpu")), raised(lambda: fn(DEV))
    assert cpu is not None, "CPU raised nothing"
    assert type(dev) is type(cpu), f"pjrt raised {type(dev).__name__}: {dev}; CPU {type(cpu).__name__}: {cpu}"
    if exact:
        assert str(dev).splitlines()[0] == str(cpu).splitlines()[0]
    return dev


# ---- unsupported ops and dtypes -----------------------------------------------------------------


@torch.library.custom_op("torchpjrt_errors::cpu_only", mutates_args=(), device_types="cpu")
def cpu_only(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_unsupported_op_names_the_operator():
    with pytest.raises(NotImplementedError, match=r"'torchpjrt_errors::cpu_only\.default'.*TORCHPJRT_CPU_FALLBACK=1"):
        cpu_only(torch.ones(2, device=DEV))


def test_dtype_a_kernel_lacks_is_not_implemented():
    e = assert_same_error(lambda d: torch.bitwise_not(torch.ones(2, device=d)), exact=False)
    assert str(e).startswith("\"bitwise_not\" not implemented for 'Float'")


def test_dtype_jax_cannot_hold():
    with pytest.raises(TypeError, match=r"dtype torch\.complex32 is not supported on the pjrt device"):
        torch.ones(2, dtype=torch.complex32, device=DEV)
    with pytest.raises(TypeError, match=r"dtype torch\.complex32 is not supported"):
        torch.ones(2, device=DEV).to(torch.complex32)


# ---- devices ---------------------------------------------------------------------------------------

_MISMATCH = "Expected all tensors to be on the same device, but found at least two devices, pjrt:0 and cpu!"


@pytest.mark.parametrize("op", [
    lambda a, c: a + c,
    lambda a, c: c * a,
    lambda a, c: a @ c,
    lambda a, c: a.add_(c),
    lambda a, c: torch.where(a > 0, a, c),
])
def test_device_mismatch(op):
    a = torch.ones(3, 3, device=DEV)
    with pytest.raises(RuntimeError) as info:
        op(a, torch.ones(3, 3))
    assert str(info.value).splitlines()[0] == _MISMATCH
    torch.testing.assert_close(a.cpu(), torch.ones(3, 3))  # the failed add_ wrote nothing


def test_cpu_scalar_tensors_are_allowed_as_on_cuda():
    a = torch.ones(3, device=DEV)
    torch.testing.assert_close((a * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))


@pytest.mark.slow  # a fresh process
def test_missing_platform_is_a_clear_error():
    code = textwrap.dedent("""
        import torch
        try:
            torch.ones(1, device="pjrt")
        except RuntimeError as e:
            print(type(e).__name__, e)
    """)
    env = dict(os.environ, TORCHPJRT_PLATFORM="no_such_platform")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RuntimeError torchpjrt: TORCHPJRT_PLATFORM='no_such_platform' is not available to JAX" in out.stdout
    assert "unset TORCHPJRT_PLATFORM" in out.stdout


# ---- memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
def test_out_of_memory(mode):
    with torchpjrt.eager_mode(mode):
        with pytest.raises(torch.OutOfMemoryError, match=r"pjrt device out of memory \(.*Out of memory"):
            # not a new allocation but an op's result (16 TiB): the runtime refuses it
            torch.ones(1, device=DEV).expand(2**42).contiguous().cpu()
        # the same process goes on allocating normally
        torch.testing.assert_close(torch.ones(1000, device=DEV).sum().item(), 1000.0)


# 10**13 float32 elements: 40 TB, more than any device or host holds
_TOO_MANY = 10**13
_NOT_ENOUGH = (r"pjrt: not enough memory: you tried to allocate {} bytes, but pjrt:0 \(\w+\) holds at most "
               r"\d+ bytes \((the device's memory limit|the host's physical memory)\)\.")


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
@pytest.mark.parametrize("case, nbytes", [
    pytest.param(lambda: torch.empty(_TOO_MANY, device=DEV), 4 * _TOO_MANY, id="empty"),
    pytest.param(lambda: torch.empty(10**7, 10**6, device=DEV), 4 * _TOO_MANY, id="empty_2d"),
    pytest.param(lambda: torch.empty_strided((10**7, 10**6), (1, 10**7), device=DEV), 4 * _TOO_MANY,
                 id="empty_strided"),
    pytest.param(lambda: torch.zeros(_TOO_MANY, device=DEV), 4 * _TOO_MANY, id="zeros"),
    pytest.param(lambda: torch.ones(_TOO_MANY, dtype=torch.float64, device=DEV), 8 * _TOO_MANY, id="ones"),
    pytest.param(lambda: torch.full((_TOO_MANY,), 2.0, device=DEV), 4 * _TOO_MANY, id="full"),
    pytest.param(lambda: torch.rand(_TOO_MANY, device=DEV), 4 * _TOO_MANY, id="rand"),
    pytest.param(lambda: torch.randn(_TOO_MANY, device=DEV), 4 * _TOO_MANY, id="randn"),
    pytest.param(lambda: torch.randint(0, 9, (_TOO_MANY,), device=DEV), 8 * _TOO_MANY, id="randint"),
    pytest.param(lambda: torch.ones(2, device=DEV).new_empty(_TOO_MANY), 4 * _TOO_MANY, id="new_empty"),
    pytest.param(lambda: torch.ones(2, device=DEV).new_zeros(_TOO_MANY), 4 * _TOO_MANY, id="new_zeros"),
    pytest.param(lambda: torch.ones(2, device=DEV).new_full((_TOO_MANY,), 3.0), 4 * _TOO_MANY, id="new_full"),
    pytest.param(lambda: torch.empty_like(torch.ones(1, device=DEV).expand(_TOO_MANY)), 4 * _TOO_MANY,
                 id="empty_like"),
    pytest.param(lambda: torch.ones(2, device=DEV).resize_(_TOO_MANY), 4 * _TOO_MANY, id="resize_"),
    pytest.param(lambda: torch.UntypedStorage(4 * _TOO_MANY, device=DEV), 4 * _TOO_MANY, id="untyped_storage"),
    pytest.param(lambda: torch.ones(2, device=DEV).untyped_storage().resize_(4 * _TOO_MANY), 4 * _TOO_MANY,
                 id="untyped_storage_resize_"),  # FSDP2 re-allocates parameters this way
    pytest.param(lambda: torch.arange(_TOO_MANY, device=DEV), 8 * _TOO_MANY, id="arange"),
    pytest.param(lambda: torch.linspace(0, 1, _TOO_MANY, device=DEV), 4 * _TOO_MANY, id="linspace"),
    pytest.param(lambda: torch.eye(10**7, 10**6, device=DEV), 4 * _TOO_MANY, id="eye"),
])
def test_impossible_allocation_raises_at_the_call(mode, case, nbytes):
    """As the CPU allocator: a size the device cannot hold raises when it is asked for, not at
    the tensor's first use (empty() allocates lazily; fused mode records factories lazily)."""
    with torchpjrt.eager_mode(mode):
        with pytest.raises(torch.OutOfMemoryError, match=_NOT_ENOUGH.format(nbytes)):
            case()
        # nothing was left behind: the next flush and the next allocations work
        torch.testing.assert_close(torch.ones(1000, device=DEV).sum().item(), 1000.0)


def test_impossible_allocation_against_the_runtimes_memory_limit(monkeypatch):
    """Where the runtime reports a memory limit (GPU, TPU), it is the bound."""
    from torchpjrt import storage

    class Device:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 1 << 20, "bytes_in_use": 0}

    monkeypatch.setattr(storage, "default_device", lambda: Device())
    monkeypatch.setattr(storage, "_capacity", 0)
    monkeypatch.setattr(storage, "_capacity_source", None)
    assert storage.device_capacity() == (1 << 20, "the device's memory limit")
    with pytest.raises(torch.OutOfMemoryError, match=r"you tried to allocate 1048580 bytes, but pjrt:0 \(gpu\) "
                                                     r"holds at most 1048576 bytes \(the device's memory limit\)"):
        storage.check_allocation((1 << 20) + 4)
    storage.check_allocation(1 << 20)  # exactly the limit fits


def test_allocation_below_capacity_still_works():
    from torchpjrt import storage

    t = torch.empty(3, 4, device=DEV)
    assert storage._capacity > 0 and t.shape == (3, 4)
    t = torch.ones(2, device=DEV).resize_(5)
    assert t.shape == (5,)
    s = torch.UntypedStorage(16, device=DEV)
    assert s.device.type == DEV and s.nbytes() == 16
    u = torch.empty(0, device=DEV).set_(s, 0, (4,), (1,))
    torch.testing.assert_close(u.cpu(), torch.zeros(4))


def test_size_overflow_matches_cpu():
    assert_same_error(lambda d: torch.empty(2**61, device=d))


def test_out_of_memory_is_a_runtime_error_as_in_pytorch():
    assert issubclass(torch.OutOfMemoryError, RuntimeError)


# ---- shapes and indices ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
@pytest.mark.parametrize("case", [
    pytest.param(lambda d: torch.ones(2, 3, device=d) @ torch.ones(4, 5, device=d), id="matmul"),
    pytest.param(lambda d: torch.ones(2, 3, device=d) + torch.ones(4, 5, device=d), id="broadcast"),
    pytest.param(lambda d: torch.ones(2, 3, device=d).t().view(6), id="view_of_non_contiguous"),
    pytest.param(lambda d: torch.ones(3, device=d).add_(torch.ones(2, 3, device=d)), id="inplace_broadcast"),
    pytest.param(lambda d: torch.ones(2, 3, device=d)[5], id="index_int"),
    pytest.param(lambda d: torch.ones(2, 3, device=d)[:, 7], id="index_int_dim1"),
    pytest.param(lambda d: torch.ones(2, 3, device=d).reshape(4), id="reshape_numel"),
    pytest.param(lambda d: torch.cat([torch.ones(2, 3, device=d), torch.ones(2, 4, device=d)]), id="cat"),
    pytest.param(lambda d: torch.ones(2, 3, device=d).sum(dim=5), id="dim_out_of_range"),
])
def test_shape_errors_match_cpu(mode, case):
    with torchpjrt.eager_mode(mode):
        assert_same_error(case)


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
def test_inplace_result_type_cannot_be_cast(mode):
    with torchpjrt.eager_mode(mode):
        def iadd(d):
            x = torch.ones(2, dtype=torch.long, device=d)
            x += torch.ones(2, device=d)
        e = assert_same_error(iadd)
        assert str(e) == "result type Float can't be cast to the desired output type Long"
        x = torch.ones(2, dtype=torch.long, device=DEV)
        assert raised(lambda: x.mul_(torch.full((2,), 1.5, device=DEV))) is not None
        assert x._version == 0 and x.tolist() == [1, 1]  # nothing was written


@pytest.mark.parametrize("case", [
    pytest.param(lambda d: torch.add(torch.ones(2, device=d), 1, out=torch.empty(2, dtype=torch.long, device=d)),
                 id="add_float_into_long"),
    pytest.param(lambda d: torch.neg(torch.ones(2, device=d), out=torch.empty(2, dtype=torch.float64, device=d)),
                 id="neg_exact_dtype"),
    pytest.param(lambda d: torch.all(torch.ones(2, device=d), out=torch.empty((), dtype=torch.long, device=d)),
                 id="all_bool_result"),
    pytest.param(lambda d: torch.index_select(torch.ones(2, device=d), 0, torch.tensor([0], device=d),
                                              out=torch.empty(1, dtype=torch.float64, device=d)),
                 id="index_select_exact_dtype"),
])
def test_out_with_wrong_dtype(case):
    assert_same_error(case, exact=False)


def test_out_with_castable_dtype_works_as_on_cpu():
    out = torch.empty(2, dtype=torch.float64, device=DEV)
    torch.add(torch.ones(2, device=DEV), 1, out=out)
    assert out.dtype == torch.float64 and out.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("case", [
    pytest.param(lambda a, d: a[torch.tensor([5], device=d)], id="index"),
    pytest.param(lambda a, d: a[:, torch.tensor([-4], device=d)], id="index_negative"),
    pytest.param(lambda a, d: a.__setitem__(torch.tensor([4], device=d), 1.0), id="index_put"),
    pytest.param(lambda a, d: torch.index_select(a, 0, torch.tensor([7], device=d)), id="index_select_dim0"),
    pytest.param(lambda a, d: torch.index_select(a, 1, torch.tensor([7], device=d)), id="index_select_dim1"),
    pytest.param(lambda a, d: torch.gather(a, 1, torch.tensor([[7]], device=d)), id="gather"),
    pytest.param(lambda a, d: a.scatter(1, torch.tensor([[4]], device=d), 1.0), id="scatter"),
    pytest.param(lambda a, d: torch.nn.functional.embedding(torch.tensor([9], device=d), a), id="embedding"),
])
def test_index_out_of_bounds_in_debug_mode(case):
    a = torch.ones(2, 3)
    with torchpjrt.eager_mode("debug"):
        e = assert_same_error(lambda d: case(a.clone().to(d), d), exact=False)
    assert str(e)  # a message naming the index


# ---- NaN in debug mode -----------------------------------------------------------------------------


def test_nan_check_names_the_op_and_the_source_line():
    x = torch.tensor([1.0, -1.0], device=DEV)
    with torchpjrt.eager_mode("debug", check_nans=True):
        try:
            with pytest.raises(RuntimeError) as info:
                torch.log(x)  # the line the error names
            line = sys._getframe().f_lineno - 1
        finally:
            torchpjrt.set_eager_mode("debug", check_nans=False)
    msg = str(info.value)
    assert "aten::log.default produced NaN/Inf in output 0" in msg
    assert f"{__file__}:{line} in test_nan_check_names_the_op_and_the_source_line" in msg


# ---- checkpoints -----------------------------------------------------------------------------------


def test_corrupted_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    checkpoint.save_safetensors({"w": torch.ones(64, device=DEV)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated, as by an interrupted copy
    with pytest.raises(checkpoint.CheckpointError, match=str(path)):
        checkpoint.load_safetensors(path)
    path.write_bytes(b"\x00" * 7)
    with pytest.raises(checkpoint.CheckpointError, match=str(path)):
        checkpoint.load_safetensors(path)
    assert issubclass(checkpoint.CheckpointError, safetensors.SafetensorError)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    checkpoint.save_safetensors({"w": torch.ones(4, device=DEV)}, path)

    def interrupted(specs, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors, "serialize_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_safetensors({"w": torch.zeros(4, device=DEV)}, path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary left
    assert checkpoint.load_safetensors(path)["w"].tolist() == [1.0] * 4
