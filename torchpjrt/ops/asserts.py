"""Assertions on tensor values (`torch._assert_async`): checked on the device, raised at the next
synchronization point like the other device checks (device_checks.py), as CUDA does."""

import jax.numpy as jnp
import torch

from . import DeviceCheck, check_vector, lower

aten = torch.ops.aten

def _single_value(self):
    if self.size == 0:
        raise RuntimeError("Boolean value of Tensor with no values is ambiguous")
    if self.size > 1:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
    return self.reshape(())


def _is_zero(self, msg=None, dep_token=None):
    # the message travels in the vector as its UTF-8 bytes: a program loaded from the kernel cache
    # by another process still names it
    text = () if msg is None else tuple((msg or "Assertion is failed").encode())
    return check_vector(_single_value(self) == 0, *text)


def _assertion_error(*text):
    if not text:
        return RuntimeError("Expected Tensor with single nonzero value, but got zero")
    return RuntimeError(bytes(text).decode(errors="replace"))


_ASSERT = DeviceCheck(_is_zero, _assertion_error)


@lower(aten._assert_async.default, check=_ASSERT)
def _assert_async(self):
    _single_value(self)
    return ()


@lower(aten._assert_async.msg, check=_ASSERT)
def _assert_async_msg(self, assert_msg):
    _single_value(self)
    return ()


@lower(aten._functional_assert_async.msg, check=_ASSERT)
def _functional_assert_async(self, assert_msg, dep_token):
    """Compiled graphs' form: passes a dependency token on."""
    _single_value(self)
    return jnp.zeros((0,), jnp.float32) if dep_token is None else dep_token
