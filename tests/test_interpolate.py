"""F.interpolate (bilinear, bicubic; both align_corners; contiguous and not; float and uint8
images; antialias) against the CPU."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import torchpjrt  # noqa: F401

_G = torch.Generator().manual_seed(0)
FLOAT = torch.randn(2, 3, 7, 9, generator=_G)
UINT8 = torch.randint(0, 256, (1, 3, 7, 9), dtype=torch.uint8, generator=_G)
INPUTS = {"float": FLOAT, "float transposed": FLOAT.transpose(2, 3), "uint8": UINT8,
          "uint8 channels_last": UINT8.contiguous(memory_format=torch.channels_last)}
# CPU computes uint8 images with a separable fixed-point kernel that rounds between the passes;
# pjrt computes in float32 and rounds once: within 1 level for bilinear, up to 18 seen for bicubic
UINT8_LEVELS = {"bilinear": 1, "bicubic": 20}


@pytest.mark.parametrize("mode,align_corners,size,name", list(itertools.product(
    ["bilinear", "bicubic"], [False, True], [(5, 4), (13, 17), (3, 20)], list(INPUTS))))
def test_interpolate_matches_cpu(mode, align_corners, size, name):
    x = INPUTS[name]
    want = F.interpolate(x, size=size, mode=mode, align_corners=align_corners)
    got = F.interpolate(x.to("pjrt"), size=size, mode=mode, align_corners=align_corners).cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if x.dtype == torch.uint8:
        assert (got.int() - want.int()).abs().max().item() <= UINT8_LEVELS[mode]
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_antialiased_downscale_matches_cpu(mode):
    want = F.interpolate(FLOAT, size=(4, 5), mode=mode, antialias=True)
    got = F.interpolate(FLOAT.to("pjrt"), size=(4, 5), mode=mode, antialias=True).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
