"""nn.MultiheadAttention and nn.TransformerEncoderLayer in eval mode without gradients: PyTorch's
fused inference ops (torchpjrt/transformer_fast_path.py) against the CPU's, in strict and fused
mode and compiled."""

import copy
import re

import pytest
import torch
import torch.nn as nn

import torchpjrt
from torchpjrt import dispatch

MODES = ("strict", pytest.param("fused", marks=pytest.mark.slow))


@pytest.fixture(params=MODES)
def mode(request):
    with torchpjrt.eager_mode(request.param):
        yield request.param


def _on_pjrt(module):
    return copy.deepcopy(module).to("pjrt")


def _decomposed(name):
    return dispatch.decomposed_counts[f"aten.{name}.default"]


def _assert_matches(got, want):
    if want is None:
        assert got is None
        return
    torch.testing.assert_close(got.cpu(), want, equal_nan=True)


def _masks(batch, length, heads):
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[1, -2:] = True
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
    return {
        "none": {},
        "padding": {"key_padding_mask": pad},
        "causal bool": {"attn_mask": causal},
        "both": {"attn_mask": causal, "key_padding_mask": pad},
    }


@pytest.mark.parametrize("masks", ["none", "padding", "causal bool", "both"])  # float masks: no fast path
@pytest.mark.parametrize("weights", ["averaged", pytest.param("per head", marks=pytest.mark.slow), "none"])
def test_multihead_attention_fast_path_matches_cpu(mode, masks, weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(3, 5, 8)
    kwargs = dict(_masks(3, 5, 2)[masks], need_weights=weights != "none", average_attn_weights=weights == "averaged")
    pjrt_kwargs = {k: v.to("pjrt") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    before = _decomposed("_native_multi_head_attention")
    with torch.no_grad():
        want = mha(x, x, x, **kwargs)
        px = x.to("pjrt")
        got = _on_pjrt(mha)(px, px, px, **pjrt_kwargs)
    assert _decomposed("_native_multi_head_attention") == before + 1  # the fast path ran
    for g, w in zip(got, want):
        _assert_matches(g, w)


def test_native_multi_head_attention_with_separate_key_and_value(mode):
    """The op itself (the module sends self-attention only): key and value apart, or one tensor."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 4, batch_first=True)
    weights = (mha.in_proj_weight.detach(), mha.in_proj_bias.detach(), mha.out_proj.weight.detach(),
               mha.out_proj.bias.detach())
    q, k, v = torch.randn(2, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    pq, pk, pv = q.to("pjrt"), k.to("pjrt"), v.to("pjrt")
    pweights = tuple(w.to("pjrt") for w in weights)
    for args, pargs in (((q, k, k), (pq, pk, pk)), ((q, k, v), (pq, pk, pv))):
        want = torch._native_multi_head_attention(*args, 8, 4, *weights, None, True, False)
        got = torch._native_multi_head_attention(*pargs, 8, 4, *pweights, None, True, False)
        for g, w in zip(got, want):
            _assert_matches(g, w)


@pytest.mark.parametrize("norm_first", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("activation", ["relu", pytest.param("gelu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("masks", ["none", "padding", "causal"])
def test_transformer_encoder_layer_fast_path_matches_cpu(mode, norm_first, activation, masks):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, activation=activation, batch_first=True,
                                       norm_first=norm_first).eval()
    x = torch.randn(3, 5, 8)
    kwargs = {"none": {}, "padding": {"src_key_padding_mask": _masks(3, 5, 2)["padding"]["key_padding_mask"]},
              "causal": {"src_mask": _masks(3, 5, 2)["causal bool"]["attn_mask"]}}[masks]
    before = _decomposed("_transformer_encoder_layer_fwd")
    with torch.no_grad():
        want = layer(x, **kwargs)
        got = _on_pjrt(layer)(x.to("pjrt"), **{k: v.to("pjrt") for k, v in kwargs.items()})
    assert _decomposed("_transformer_encoder_layer_fwd") == before + 1
    _assert_matches(got, want)


def test_transformer_encoder_and_decoder_in_eval_match_cpu(mode):
    torch.manual_seed(0)
    model = nn.Transformer(8, 2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16, dropout=0.0,
                           batch_first=True).eval()
    src, tgt = torch.randn(2, 7, 8), torch.randn(2, 5, 8)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        want = model(src, tgt, tgt_mask=tgt_mask)
        got = _on_pjrt(model)(src.to("pjrt"), tgt.to("pjrt"), tgt_mask=tgt_mask.to("pjrt"))
    _assert_matches(got, want)


def test_transformer_encoder_with_padding_mask():
    """Without nested tensors it matches CPU; the nested-tensor path is refused by name."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    x = torch.randn(3, 5, 8)
    pad = _masks(3, 5, 2)["padding"]["key_padding_mask"]
    plain = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with torch.no_grad():
        want = plain(x, src_key_padding_mask=pad)
        got = _on_pjrt(plain)(x.to("pjrt"), src_key_padding_mask=pad.to("pjrt"))
    _assert_matches(got, want)
    nested = _on_pjrt(nn.TransformerEncoder(layer, 2).eval())
    with torch.no_grad(), pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
        nested(x.to("pjrt"), src_key_padding_mask=pad.to("pjrt"))


@pytest.mark.slow
def test_encoder_layer_fast_path_compiled():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    pad = _masks(2, 5, 2)["padding"]["key_padding_mask"]
    with torch.no_grad():
        want = layer(x, src_key_padding_mask=pad)
        compiled = torch.compile(_on_pjrt(layer), backend="pjrt")
        got = compiled(x.to("pjrt"), src_key_padding_mask=pad.to("pjrt"))
    _assert_matches(got, want)


@pytest.mark.parametrize("mask_type", [0, 1, 2])
def test_masked_softmax_matches_cpu(mode, mask_type):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    mask = {0: torch.triu(torch.ones(4, 4, dtype=torch.bool), 1),
            1: torch.tensor([[False, False, True, True], [False, True, True, True]]),
            2: torch.rand(2, 3, 4, 4) > 0.5}[mask_type]
    mask[..., 0, :] = True if mask_type != 1 else mask[..., 0, :]  # a row left out entirely: NaN
    want = torch._masked_softmax(x, mask, 3, mask_type)
    got = torch._masked_softmax(x.to("pjrt"), mask.to("pjrt"), 3, mask_type)
    _assert_matches(got, want)


def test_masked_softmax_refuses_what_cpu_refuses():
    x = torch.randn(2, 3, 4, 4)
    for mask, mask_type in ((torch.zeros(2, 3, 4, 4), 2), (torch.zeros(2, 3, 4, 2, dtype=torch.bool), 2),
                            (torch.zeros(3, 4, dtype=torch.bool), 1), (torch.zeros(4, 3, dtype=torch.bool), 0)):
        with pytest.raises(RuntimeError) as on_cpu:
            torch._masked_softmax(x, mask, 3, mask_type)
        with pytest.raises(RuntimeError, match=re.escape(str(on_cpu.value).splitlines()[0])):
            torch._masked_softmax(x.to("pjrt"), mask.to("pjrt"), 3, mask_type)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_transform_bias_rescale_qkv_matches_cpu(dtype):
    torch.manual_seed(0)
    qkv, bias = torch.randn(2, 5, 3 * 12).to(dtype), torch.randn(3 * 12).to(dtype)
    want = torch._transform_bias_rescale_qkv(qkv, bias, 4)
    got = torch._transform_bias_rescale_qkv(qkv.to("pjrt"), bias.to("pjrt"), 4)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
