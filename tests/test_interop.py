"""JAX and DLPack interop (torchpjrt.to_jax / from_jax, __dlpack__, torch.from_dlpack) and
torch._assert_async, in every eager mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchpjrt

pytestmark = pytest.mark.usefixtures("each_eager_mode")


def test_to_jax_is_the_storage_array_without_a_copy():
    x = torch.arange(12.0, device="pjrt").reshape(3, 4) * 2
    a = torchpjrt.to_jax(x)
    assert isinstance(a, jax.Array) and a.shape == (3, 4) and a.dtype == jnp.float32
    assert a is torchpjrt.to_jax(x)  # the storage's own array
    np.testing.assert_array_equal(np.asarray(a), np.arange(12.0).reshape(3, 4) * 2)
    np.testing.assert_array_equal(np.asarray(torchpjrt.to_jax(x[:, 1])), [2.0, 10.0, 18.0])  # a view's elements
    np.testing.assert_array_equal(np.asarray(torchpjrt.to_jax(x.t())), (np.arange(12.0).reshape(3, 4) * 2).T)


def test_to_jax_result_is_immutable_writes_go_through_the_tensor():
    x = torch.zeros(3, device="pjrt")
    a = torchpjrt.to_jax(x)
    x.add_(1)
    assert np.asarray(a).tolist() == [0.0, 0.0, 0.0] and x.tolist() == [1.0, 1.0, 1.0]


def test_from_jax_keeps_the_array_and_dtype():
    for array in (jnp.ones((2, 3), jnp.bfloat16), jnp.arange(5, dtype=jnp.int64), jnp.array(True)):
        t = torchpjrt.from_jax(array)
        assert type(t) is torch.Tensor and t.device.type == "pjrt"
        assert t.dtype == torchpjrt.dtypes.to_torch(array.dtype) and tuple(t.shape) == array.shape
        assert torchpjrt.to_jax(t) is array  # no copy
        np.testing.assert_array_equal(t.cpu().float().numpy(), np.asarray(array, dtype=np.float32))
    t = torchpjrt.from_jax(jnp.zeros(2))
    t.add_(3)
    assert t.tolist() == [3.0, 3.0]
    y = (t * 2).sum()
    assert y.item() == 12.0


def test_round_trip_through_a_jax_function_with_autograd_outside():
    w = torch.randn(4, 4, device="pjrt")
    out = torchpjrt.from_jax(jax.jit(lambda a: jnp.tanh(a) @ a)(torchpjrt.to_jax(w)))
    torch.testing.assert_close(out.cpu(), torch.tanh(w.cpu()) @ w.cpu(), rtol=1e-5, atol=1e-5)


def test_to_and_from_jax_refuse_other_things_clearly():
    with pytest.raises(TypeError, match="expected a pjrt tensor, got a tensor on cpu"):
        torchpjrt.to_jax(torch.ones(2))
    with pytest.raises(TypeError, match="expected a jax.Array, got ndarray"):
        torchpjrt.from_jax(np.ones(2))


def test_dlpack_exports_to_jax_and_numpy():
    x = torch.arange(6.0, device="pjrt").reshape(2, 3) + 1
    assert jnp.from_dlpack(x).sum() == 21.0
    assert x.__dlpack_device__()[0] == 1  # kDLCPU on the CPU platform
    np.testing.assert_array_equal(np.from_dlpack(x), np.arange(6.0).reshape(2, 3) + 1)
    with pytest.raises(BufferError, match="require gradient"):
        jnp.from_dlpack(torch.ones(2, device="pjrt", requires_grad=True))
    capsule = torch.utils.dlpack.to_dlpack(x)
    assert "dltensor" in repr(capsule)


def test_torch_from_dlpack_onto_pjrt():
    x = torch.arange(4.0, device="pjrt")
    alias = torch.from_dlpack(x)  # a pjrt tensor shares its memory, as for any torch tensor
    assert alias.device.type == "pjrt" and alias.data_ptr() == x.data_ptr()
    alias[0] = 10
    assert x.tolist() == [10.0, 1.0, 2.0, 3.0]
    copied = torch.from_dlpack(x, copy=True)
    copied[1] = -1
    assert x[1].item() == 1.0
    from_numpy = torch.from_dlpack(np.arange(3.0), device="pjrt")
    assert from_numpy.device.type == "pjrt" and from_numpy.tolist() == [0.0, 1.0, 2.0]
    # host arrays keep PyTorch's behaviour: a CPU tensor
    assert torch.from_dlpack(jnp.arange(3)).device.type == "cpu"
    assert torch.from_dlpack(torch.arange(3)).device.type == "cpu"
    assert torch.from_dlpack(x, device="cpu").device.type == "cpu"


@pytest.mark.parametrize("compiled", [False, True])
def test_assert_async_raises_at_the_next_synchronization(compiled):
    def step(x):
        total = x.sum()
        torch._assert_async(total > 0, "the sum must be positive")
        return total * 2

    fn = torch.compile(step, backend="pjrt") if compiled else step
    assert fn(torch.ones(3, device="pjrt")).item() == 6.0
    with pytest.raises(RuntimeError, match="the sum must be positive"):
        fn(-torch.ones(3, device="pjrt")).item()
    assert fn(torch.ones(3, device="pjrt")).item() == 6.0  # the process stays usable


def test_assert_async_messages_like_cpu():
    for device in ("cpu", "pjrt"):
        with pytest.raises(RuntimeError, match="Expected Tensor with single nonzero value, but got zero"):
            torch._assert_async(torch.tensor(0.0, device=device))
            torch.pjrt.synchronize()
        with pytest.raises(RuntimeError, match="Assertion is failed"):
            torch._assert_async(torch.tensor(0, device=device), "")
            torch.pjrt.synchronize()
        with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
            torch._assert_async(torch.ones(2, device=device))
        with pytest.raises(RuntimeError, match="no values is ambiguous"):
            torch._assert_async(torch.ones(0, device=device), "msg")
        torch._assert_async(torch.tensor(float("nan"), device=device))
        torch._assert_async(torch.tensor([3], device=device), "nonzero")
        torch.pjrt.synchronize()
