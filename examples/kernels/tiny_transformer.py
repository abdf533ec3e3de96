"""A small pre-norm transformer language model whose norm and attention are pluggable, so
the same model can run with plain PyTorch (the reference, on CPU) or with custom kernels."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def torch_rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def torch_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class RMSNorm(nn.Module):
    def __init__(self, dim, norm_fn):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm_fn = norm_fn

    def forward(self, x):
        return self.norm_fn(x, self.weight)


class Block(nn.Module):
    def __init__(self, dim, heads, norm_fn, attention_fn):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim, norm_fn), RMSNorm(dim, norm_fn)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attention_fn = attention_fn

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = self.attention_fn(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=128, dim=64, heads=4, layers=2, seq=64, norm_fn=torch_rms_norm,
                 attention_fn=torch_attention):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, norm_fn, attention_fn) for _ in range(layers))
        self.norm = RMSNorm(dim, norm_fn)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(model, tokens, steps=5, lr=3e-3):
    """AdamW language-model training; returns the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def compare_training(norm_fn=torch_rms_norm, attention_fn=torch_attention, steps=5, device="pjrt"):
    """Train the same initial model with the kernels on `device` and with plain PyTorch on
    the CPU; returns (kernel losses, reference losses)."""
    torch.manual_seed(0)
    reference = TinyTransformer()
    tokens = torch.randint(0, 128, (4, 65))
    with_kernels = TinyTransformer(norm_fn=norm_fn, attention_fn=attention_fn)
    with_kernels.load_state_dict(reference.state_dict())
    ref_losses = train(reference, tokens, steps)
    losses = train(with_kernels.to(device), tokens.to(device), steps)
    return losses, ref_losses
