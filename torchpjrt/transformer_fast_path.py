"""nn.MultiheadAttention's and nn.TransformerEncoderLayer's inference fast path, composed of aten ops.

In eval mode without gradients, PyTorch sends those modules to fused native ops
(`_native_multi_head_attention`, `_transformer_encoder_layer_fwd`, which call
`_transform_bias_rescale_qkv` and `_masked_softmax`) for the CPU, CUDA and the PrivateUse1
device alike, and ships kernels for the CPU and CUDA only, with no decomposition. Here each is
written as the CPU kernel computes it (aten/src/ATen/native/transformers/), op for op, with its
argument checks: the eager paths run these through the fallback's decomposition step
(dispatch._slow_path), and compiled graphs decompose them before lowering. A
`need_weights=False` call gives None for the weights, as CPU's undefined tensor reaches Python.
"""

import numpy as np
import torch
import torch.nn.functional as F

from . import dtypes

aten = torch.ops.aten


def masked_softmax(input, mask, dim=None, mask_type=None):
    """Softmax over `dim` (the last by default) where True in `mask` leaves an element out; a row
    left out entirely is NaN, as on CPU. mask_type 0: an (L, L) attention mask, 1: a (B, L)
    padding mask, for a 4-D input and a 2-D mask; any other mask has the input's shape."""
    torch._check(mask.dtype == torch.bool, lambda: "Mask should be a boolean tensor")
    if mask.dim() != 2 or input.dim() != 4:
        mask_type = 2
    if mask_type == 2:
        torch._check(input.shape == mask.shape, lambda: "For mask_type == 2 mask shape should match input shape")
    elif mask_type == 1:
        torch._check(input.shape[0] == mask.shape[0] and input.shape[2] == mask.shape[1],
                     lambda: "For mask_type == 1 mask shape should be (B, L)")
        mask = mask.view(input.shape[0], 1, 1, input.shape[2])
    elif mask_type == 0:
        torch._check(input.shape[2] == mask.shape[0] and input.shape[2] == mask.shape[1],
                     lambda: "For mask_type == 0 mask shape should be (L, L)")
        mask = mask.view(1, 1, input.shape[2], input.shape[2])
    else:
        raise RuntimeError(f"Unknown mask_type: {mask_type}")
    if dim is None:
        dim = input.dim() - 1
    return input.masked_fill(mask, float("-inf")).softmax(dim)


def transform_bias_rescale_qkv(qkv, qkv_bias, num_heads):
    """(B, T, 3D) projections plus their bias, split into q, k and v of (B, heads, T, D/heads)
    each, q scaled by 1/sqrt(D/heads). As the CPU computes it: in float32 for float16 and
    bfloat16, rounded once at the end, with the factor a float32 (float64 for double)."""
    B, T, three_d = qkv.shape
    D = three_d // 3
    torch._check(D % num_heads == 0,
                 lambda: f"Expected D % num_heads == 0 to be true, but got false (D={D}, num_heads={num_heads})")
    torch._check(three_d % 3 == 0, lambda: "Expected _3D % 3 == 0 to be true, but got false.")
    dim_per_head = D // num_heads
    compute = dtypes.opmath(qkv.dtype)
    real = np.float64 if compute == torch.float64 else np.float32
    inv_sqrt = float(real(1.0) / np.sqrt(real(dim_per_head)))
    summed = qkv.to(compute) + qkv_bias.to(compute)
    q, k, v = summed.view(B, T, 3, num_heads, dim_per_head).permute(2, 0, 3, 1, 4).unbind(0)
    return tuple(x.to(qkv.dtype).contiguous() for x in (q * inv_sqrt, k, v))


def _qkv_projection(query, key, value, embed_dim, qkv_weight):
    if key is value:
        if query is key:
            return query.matmul(qkv_weight.t())  # self-attention: one product
        q_weight, kv_weight = qkv_weight.split([embed_dim, embed_dim * 2], 0)
        return torch.cat([query.matmul(q_weight.t()), key.matmul(kv_weight.t())], 2)
    q_weight, k_weight, v_weight = qkv_weight.chunk(3, 0)
    return torch.cat([query.matmul(q_weight.t()), key.matmul(k_weight.t()), value.matmul(v_weight.t())], 2)


def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                proj_bias, mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    D = embed_dim
    torch._check(query.dim() == 3, lambda: f"expected 3-D `query`, got {query.dim()}-D tensor")
    torch._check(query.shape[2] == embed_dim,
                 lambda: f"passed-in embed_dim {embed_dim} didn't match last dim of query {query.shape[2]}")
    torch._check(key.dim() == 3, lambda: f"expected 3-D `key`, got {key.dim()}-D tensor")
    torch._check(value.dim() == 3, lambda: f"expected 3-D `value`, got {value.dim()}-D tensor")
    torch._check(query.shape == key.shape == value.shape, lambda: "expected `query`/`key`/`value` shapes to match")
    torch._check(qkv_weight.dim() == 2, lambda: f"expected 2-D `qkv_weight`, got {qkv_weight.dim()}-D tensor")
    torch._check(D * 3 == qkv_weight.shape[0], lambda: "expected `qkv_weight` first dim to be 3x embed_dim")
    torch._check(D == qkv_weight.shape[1], lambda: "expected `qkv_weight` second dim to be embed_Dim")
    torch._check(qkv_bias.dim() == 1, lambda: f"expected 1-D `qkv_bias`, got {qkv_bias.dim()}-D tensor")
    torch._check(qkv_bias.shape[0] == 3 * D, lambda: "expected `qkv_bias` first dim and first dim of query to be equal")
    torch._check(D % num_head == 0, lambda: "`embed_dim` must divide evenly by `num_heads`")

    qkv = _qkv_projection(query, key, value, embed_dim, qkv_weight)
    if qkv.numel() == 0:
        return torch.empty_like(query), None
    q, k, v = torch._transform_bias_rescale_qkv(qkv, qkv_bias, num_head)
    scores = q.matmul(k.transpose(-1, -2))  # (B, heads, T, T)
    if mask is not None:
        if mask.dtype != torch.bool:
            mask = mask.to(torch.bool)
        weights = torch._masked_softmax(scores, mask, scores.dim() - 1, mask_type)
    else:
        weights = scores.softmax(-1)
    context = weights.matmul(v)  # (B, heads, T, D/heads)
    B, T = context.shape[0], context.shape[2]
    proj = F.linear(context.permute(0, 2, 1, 3).reshape(B, T, D), proj_weight, proj_bias)
    if not need_weights:
        return proj, None
    if average_attn_weights:
        weights = weights.sum(1) / num_head
    return proj, weights


def _norm(x, embed_dim, eps, weight, bias):
    return F.layer_norm(x, (embed_dim,), weight, bias, eps)


def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                                  norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                                  ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    if src.numel() == 0:
        return src.clone()
    x = _norm(src, embed_dim, eps, norm_weight_1, norm_bias_1) if norm_first else src
    x = torch._native_multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                           proj_bias, mask, False, True, mask_type)[0]
    x = x + src
    if not norm_first:
        x = _norm(x, embed_dim, eps, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = _norm(x, embed_dim, eps, norm_weight_2, norm_bias_2)
    hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
    hidden = F.gelu(hidden) if use_gelu else F.relu(hidden)
    x = F.linear(hidden, ffn_weight_2, ffn_bias_2) + residual
    if not norm_first:
        x = _norm(x, embed_dim, eps, norm_weight_2, norm_bias_2)
    return x


def nested_tensor_from_mask(*args, **kwargs):
    """nn.TransformerEncoder's other fast path (eval, no gradients, a src_key_padding_mask) packs
    the batch into a nested tensor, which pjrt does not hold: refused by name, since running the
    layers on the padded batch instead would leave computed values where CPU gives zeros."""
    raise NotImplementedError(
        "torchpjrt: nested tensors are not supported on the pjrt device. nn.TransformerEncoder makes one "
        "in eval mode without gradients when given a src_key_padding_mask (its nested-tensor fast path); "
        "build it with enable_nested_tensor=False to run it on pjrt (the outputs at padded positions are "
        "then computed values rather than the zeros of the nested path)")


DECOMPOSITIONS = {
    aten._masked_softmax.default: masked_softmax,
    aten._transform_bias_rescale_qkv.default: transform_bias_rescale_qkv,
    aten._native_multi_head_attention.default: native_multi_head_attention,
    aten._transformer_encoder_layer_fwd.default: transformer_encoder_layer_fwd,
    aten._nested_tensor_from_mask_left_aligned.default: nested_tensor_from_mask,
    aten._nested_tensor_from_mask.default: nested_tensor_from_mask,
}
