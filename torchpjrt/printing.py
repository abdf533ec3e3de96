"""Printing a pjrt tensor formats a CPU copy of it.

PyTorch's tensor formatting runs tensor ops on the tensor's own device (abs, comparisons,
masked_select, nonzero to choose a number format; slices to summarize a large tensor). On an
XLA device each is a program compiled per shape: printing a tensor of a new shape compiled
about 18 programs (half a second on a cold cache). PyTorch copies xla, lazy, ipu and mtia
tensors to the CPU before formatting them for this reason; pjrt tensors are copied the same
way, in the function that formats the elements only, so that the suffixes (device, dtype,
requires_grad, grad_fn) are still the pjrt tensor's own. A tensor of more than COPIED_ELEMENTS
is formatted on the device as before: PyTorch summarizes it there (its corners) before reading
anything, where a copy would move all of it.
"""

import torch
import torch._tensor_str

_format_elements = torch._tensor_str._tensor_str
COPIED_ELEMENTS = 1 << 22


def _tensor_str(self, indent):
    if self.device.type == "pjrt" and self.numel() <= COPIED_ELEMENTS:
        self = self.detach().to("cpu")
    return _format_elements(self, indent)


def install() -> None:
    torch._tensor_str._tensor_str = _tensor_str
