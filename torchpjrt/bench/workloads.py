"""The benchmark workloads: built-in models in three sizes, or the user's own factory.

Every workload is (model, batch_fn, loss_fn):
    model(*batch)            -> output
    batch_fn(batch_size, dev) -> tuple of tensors on `dev`, drawn from the CPU generator
    loss_fn(output, batch)   -> scalar loss tensor
Batches are drawn on the CPU and then moved, so every target sees the same numbers.
Synthetic data is learnable (labels from a fixed teacher, token sequences with a pattern),
so the loss curves in the report go down and show whether targets train alike.
"""

import importlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

BUILTIN = ("mlp", "cnn", "resnet", "unet", "gpt2", "llama", "bert", "t5", "vit", "mixtral")
SIZES = ("tiny", "small", "base")
USER_BATCH_SIZE = 32


@dataclass
class Workload:
    model: nn.Module
    batch_fn: Callable
    loss_fn: Callable
    batch_size: int
    tokens_per_sample: int | None  # set for language models: throughput is also given in tokens/s
    description: str


class WithTargets(nn.Module):
    """Calls `module` on every tensor of the batch but the last (the targets, for loss_fn only)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *batch):
        return self.module(*batch[:-1])


def _teacher(in_features: int, classes: int) -> torch.Tensor:
    """A fixed random projection whose argmax labels the synthetic inputs (learnable labels)."""
    return torch.randn(in_features, classes, generator=torch.Generator().manual_seed(1234))


def _classification_loss(output, batch):
    return F.cross_entropy(output, batch[-1])


# ---- mlp ------------------------------------------------------------------------------------

MLP_SIZES = {  # input features, hidden width, hidden layers, classes, batch size
    "tiny": (64, 128, 2, 10, 32),
    "small": (512, 1024, 3, 10, 128),
    "base": (1024, 4096, 4, 10, 256),
}


def build_mlp(size: str) -> Workload:
    d_in, width, depth, classes, batch_size = MLP_SIZES[size]
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.GELU()]
        d = width
    layers.append(nn.Linear(d, classes))
    teacher = _teacher(d_in, classes)

    def batch_fn(n, device):
        x = torch.randn(n, d_in)
        return x.to(device), (x @ teacher).argmax(-1).to(device)

    desc = f"MLP {d_in}-{'-'.join([str(width)] * depth)}-{classes}, GELU"
    return Workload(WithTargets(nn.Sequential(*layers)), batch_fn, _classification_loss, batch_size, None, desc)


# ---- cnn ------------------------------------------------------------------------------------

CNN_SIZES = {  # image side, channels per stage, classes, batch size
    "tiny": (16, (8, 16), 10, 8),
    "small": (32, (32, 64, 128), 10, 32),
    "base": (64, (64, 128, 256, 512), 10, 64),
}


def build_cnn(size: str) -> Workload:
    side, channels, classes, batch_size = CNN_SIZES[size]
    layers, c_in = [], 3
    for c in channels:  # conv3x3-BN-ReLU, then halve the resolution
        layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2)]
        c_in = c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
    teacher = _teacher(3 * side * side, classes)

    def batch_fn(n, device):
        x = torch.randn(n, 3, side, side)
        return x.to(device), (x.flatten(1) @ teacher).argmax(-1).to(device)

    desc = f"CNN {len(channels)} conv-BN-ReLU-pool stages {channels}, {side}x{side} RGB"
    return Workload(WithTargets(nn.Sequential(*layers)), batch_fn, _classification_loss, batch_size, None, desc)


# ---- resnet ---------------------------------------------------------------------------------

RESNET_SIZES = {  # image side, (channels, blocks) per stage, classes, batch size
    "tiny": (16, ((8, 1), (16, 1)), 10, 8),
    "small": (32, ((32, 2), (64, 2), (128, 2)), 10, 32),
    "base": (64, ((64, 2), (128, 2), (256, 2), (512, 2)), 10, 64),  # ResNet-18's layout
}


class BasicBlock(nn.Module):
    """ResNet's basic block: two conv3x3-BN, a projection shortcut when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def build_resnet(size: str) -> Workload:
    side, stages, classes, batch_size = RESNET_SIZES[size]
    c0 = stages[0][0]
    layers = [nn.Conv2d(3, c0, 3, 1, 1, bias=False), nn.BatchNorm2d(c0), nn.ReLU()]
    c_in = c0
    for i, (c, blocks) in enumerate(stages):
        for b in range(blocks):
            layers.append(BasicBlock(c_in, c, 2 if (b == 0 and i > 0) else 1))
            c_in = c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
    teacher = _teacher(3 * side * side, classes)

    def batch_fn(n, device):
        x = torch.randn(n, 3, side, side)
        return x.to(device), (x.flatten(1) @ teacher).argmax(-1).to(device)

    desc = f"ResNet {sum(b for _, b in stages)} basic blocks, stages {[c for c, _ in stages]}, {side}x{side} RGB"
    return Workload(WithTargets(nn.Sequential(*layers)), batch_fn, _classification_loss, batch_size, None, desc)


# ---- unet (diffusion-style noise prediction) ------------------------------------------------

UNET_SIZES = {  # image side, channels per level, batch size
    "tiny": (16, (16, 32), 4),
    "small": (32, (32, 64, 128), 16),
    "base": (64, (64, 128, 256, 256), 32),
}
DIFFUSION_STEPS = 1000


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of the diffusion step, as in DDPM."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, with the time embedding added in between."""

    def __init__(self, c_in: int, c_out: int, t_dim: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(min(8, c_in), c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.time = nn.Linear(t_dim, c_out)
        self.norm2 = nn.GroupNorm(min(8, c_out), c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x, t_emb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(F.silu(t_emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class SelfAttention2d(nn.Module):
    """Multi-head self-attention over the pixels of the lowest resolution."""

    def __init__(self, c: int, heads: int = 4):
        super().__init__()
        self.norm = nn.GroupNorm(min(8, c), c)
        self.attn = nn.MultiheadAttention(c, heads, batch_first=True)

    def forward(self, x):
        n, c, h, w = x.shape
        seq = self.norm(x).flatten(2).transpose(1, 2)
        out, _ = self.attn(seq, seq, seq, need_weights=False)
        return x + out.transpose(1, 2).reshape(n, c, h, w)


class UNet(nn.Module):
    """A small DDPM-style UNet: predicts the noise added to an image at diffusion step t."""

    def __init__(self, channels: tuple):
        super().__init__()
        self.t_dim = 4 * channels[0]
        self.time_mlp = nn.Sequential(nn.Linear(channels[0], self.t_dim), nn.SiLU(), nn.Linear(self.t_dim, self.t_dim))
        self.stem = nn.Conv2d(3, channels[0], 3, padding=1)
        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        c_in = channels[0]
        for c in channels:
            self.down.append(ResBlock(c_in, c, self.t_dim))
            self.downsample.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
            c_in = c
        self.mid = ResBlock(c_in, c_in, self.t_dim)
        self.mid_attn = SelfAttention2d(c_in)
        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for c in reversed(channels):
            self.upsample.append(nn.ConvTranspose2d(c_in, c_in, 4, stride=2, padding=1))
            self.up.append(ResBlock(c_in + c, c, self.t_dim))
            c_in = c
        self.head = nn.Sequential(nn.GroupNorm(min(8, c_in), c_in), nn.SiLU(), nn.Conv2d(c_in, 3, 3, padding=1))

    def forward(self, noisy, t):
        t_emb = self.time_mlp(_timestep_embedding(t, self.stem.out_channels))
        h = self.stem(noisy)
        skips = []
        for block, down in zip(self.down, self.downsample):
            h = block(h, t_emb)
            skips.append(h)
            h = down(h)
        h = self.mid_attn(self.mid(h, t_emb))
        for up, block in zip(self.upsample, self.up):
            h = block(torch.cat([up(h), skips.pop()], dim=1), t_emb)
        return self.head(h)


def _noise_prediction_loss(predicted, batch):
    return F.mse_loss(predicted, batch[-1])


def build_unet(size: str) -> Workload:
    side, channels, batch_size = UNET_SIZES[size]
    betas = torch.linspace(1e-4, 0.02, DIFFUSION_STEPS, dtype=torch.float64)
    alpha_bar = torch.cumprod(1 - betas, 0).float()

    def batch_fn(n, device):
        # Images with structure (smooth gradients plus a bright square) so the noise is learnable.
        ramp = torch.linspace(-1, 1, side)
        clean = (ramp[None, None, :, None] * torch.randn(n, 3, 1, 1)).expand(n, 3, side, side).clone()
        corner = torch.randint(0, side // 2, (n, 2))
        for i in range(n):
            r, c = corner[i].tolist()
            clean[i, :, r : r + side // 4, c : c + side // 4] = 1.0
        t = torch.randint(0, DIFFUSION_STEPS, (n,))
        noise = torch.randn(n, 3, side, side)
        a = alpha_bar[t][:, None, None, None]
        noisy = a.sqrt() * clean + (1 - a).sqrt() * noise
        return noisy.to(device), t.to(device), noise.to(device)

    desc = f"UNet (DDPM noise prediction) levels {channels}, GroupNorm, attention at the bottom, {side}x{side} RGB"
    return Workload(WithTargets(UNet(channels)), batch_fn, _noise_prediction_loss, batch_size, None, desc)


# ---- language models (Hugging Face transformers, random weights) ---------------------------

LM_SIZES = {  # layers, hidden, heads, vocab, sequence length, batch size
    "gpt2": {"tiny": (2, 64, 2, 512, 32, 4), "small": (4, 256, 4, 8192, 128, 8), "base": (12, 768, 12, 50257, 256, 8)},
    "llama": {"tiny": (2, 64, 4, 512, 32, 4), "small": (4, 256, 8, 8192, 128, 8), "base": (12, 768, 12, 32000, 256, 8)},
    "bert": {"tiny": (2, 64, 2, 512, 32, 4), "small": (4, 256, 4, 8192, 128, 8), "base": (12, 768, 12, 30522, 128, 16)},
    "t5": {"tiny": (2, 64, 2, 512, 32, 4), "small": (4, 256, 4, 8192, 128, 8), "base": (12, 768, 12, 32128, 256, 8)},
    "mixtral": {"tiny": (2, 64, 4, 512, 32, 4), "small": (4, 256, 8, 8192, 128, 8), "base": (8, 768, 12, 32000, 256, 8)},
}
VIT_SIZES = {  # layers, hidden, heads, image side, patch, classes, batch size
    "tiny": (2, 64, 2, 32, 8, 10, 4), "small": (4, 256, 4, 64, 8, 10, 16), "base": (12, 768, 12, 224, 16, 1000, 16),
}
MOE_EXPERTS = (4, 2)  # experts per layer, experts per token


class Logits(nn.Module):
    """A Hugging Face model called on input ids, returning only the logits."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model

    def forward(self, input_ids):
        return self.hf_model(input_ids=input_ids).logits


def _pattern_tokens(n: int, length: int, vocab: int) -> torch.Tensor:
    """Arithmetic sequences mod vocab with a random start and stride: predictable after two tokens."""
    start = torch.randint(0, vocab, (n, 1))
    stride = torch.randint(1, 8, (n, 1))
    return (start + stride * torch.arange(length)) % vocab


def _next_token_loss(logits, batch):
    ids = batch[0]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _masked_lm_loss(logits, batch):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[-1].reshape(-1), ignore_index=-100)


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"the gpt2, llama, bert, t5, vit and mixtral workloads need transformers: pip install 'torchpjrt[bench]' ({e})") from None
    transformers.logging.set_verbosity_error()
    return transformers


# Dropout is off in every config: it would draw from each device's own generator and the
# targets would no longer compute the same thing.
def build_gpt2(size: str) -> Workload:
    tf = _import_transformers()
    layers, hidden, heads, vocab, seq, batch_size = LM_SIZES["gpt2"][size]
    config = tf.GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )
    return _causal_lm(tf.GPT2LMHeadModel(config), vocab, seq, batch_size, f"GPT-2 {layers} layers, hidden {hidden}, vocab {vocab}")


def build_llama(size: str) -> Workload:
    tf = _import_transformers()
    layers, hidden, heads, vocab, seq, batch_size = LM_SIZES["llama"][size]
    config = tf.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), intermediate_size=_llama_mlp_width(hidden), vocab_size=vocab,
        max_position_embeddings=seq, attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )
    return _causal_lm(tf.LlamaForCausalLM(config), vocab, seq, batch_size, f"Llama {layers} layers, hidden {hidden}, GQA, vocab {vocab}")


def _llama_mlp_width(hidden: int) -> int:
    return int(math.ceil(hidden * 8 / 3 / 16)) * 16  # Llama's 8/3 ratio, rounded to a multiple of 16


def _causal_lm(hf_model, vocab, seq, batch_size, desc) -> Workload:
    def batch_fn(n, device):
        return (_pattern_tokens(n, seq, vocab).to(device),)

    return Workload(Logits(hf_model), batch_fn, _next_token_loss, batch_size, seq, f"{desc}, sequence {seq}")


def build_bert(size: str) -> Workload:
    tf = _import_transformers()
    layers, hidden, heads, vocab, seq, batch_size = LM_SIZES["bert"][size]
    config = tf.BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden,
        vocab_size=vocab, max_position_embeddings=seq, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    mask_id = vocab - 1  # the last id is [MASK]; sequences use the others

    def batch_fn(n, device):
        ids = _pattern_tokens(n, seq, vocab - 1)
        masked = torch.rand(n, seq) < 0.15
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return torch.where(masked, torch.full_like(ids, mask_id), ids).to(device), labels.to(device)

    desc = f"BERT masked LM {layers} layers, hidden {hidden}, vocab {vocab}, sequence {seq}"
    return Workload(WithTargets(Logits(tf.BertForMaskedLM(config))), batch_fn, _masked_lm_loss, batch_size, seq, desc)


def build_mixtral(size: str) -> Workload:
    tf = _import_transformers()
    layers, hidden, heads, vocab, seq, batch_size = LM_SIZES["mixtral"][size]
    experts, per_token = MOE_EXPERTS
    config = tf.MixtralConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), intermediate_size=_llama_mlp_width(hidden), vocab_size=vocab,
        num_local_experts=experts, num_experts_per_tok=per_token, max_position_embeddings=seq,
        attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    desc = f"Mixtral mixture of experts {layers} layers, hidden {hidden}, {experts} experts top-{per_token}, vocab {vocab}"
    return _causal_lm(tf.MixtralForCausalLM(config), vocab, seq, batch_size, desc)


class Seq2SeqLogits(nn.Module):
    """An encoder-decoder Hugging Face model called with teacher forcing, returning the logits."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model

    def forward(self, input_ids, decoder_input_ids):
        return self.hf_model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits


def build_t5(size: str) -> Workload:
    tf = _import_transformers()
    layers, hidden, heads, vocab, seq, batch_size = LM_SIZES["t5"][size]
    config = tf.T5Config(
        num_layers=layers, num_decoder_layers=layers, d_model=hidden, d_ff=4 * hidden, num_heads=heads,
        d_kv=hidden // heads, vocab_size=vocab, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1, use_cache=False,
    )
    hf_model = tf.T5ForConditionalGeneration(config)

    def batch_fn(n, device):
        source = _pattern_tokens(n, seq, vocab - 2) + 2  # ids 0 and 1 are pad/start and end
        target = source.flip(1)  # the task: reverse the sequence
        decoder_input = torch.cat([torch.zeros(n, 1, dtype=target.dtype), target[:, :-1]], dim=1)
        return source.to(device), decoder_input.to(device), target.to(device)

    desc = f"T5 encoder-decoder {layers}+{layers} layers, hidden {hidden}, vocab {vocab}, sequence {seq} (reversal)"
    return Workload(WithTargets(Seq2SeqLogits(hf_model)), batch_fn, _seq2seq_loss, batch_size, 2 * seq, desc)


def _seq2seq_loss(logits, batch):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[-1].reshape(-1))


class ImageLogits(nn.Module):
    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model

    def forward(self, pixel_values):
        return self.hf_model(pixel_values=pixel_values).logits


def build_vit(size: str) -> Workload:
    tf = _import_transformers()
    layers, hidden, heads, side, patch, classes, batch_size = VIT_SIZES[size]
    config = tf.ViTConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden,
        image_size=side, patch_size=patch, num_labels=classes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    teacher = _teacher(3 * side * side, classes)

    def batch_fn(n, device):
        x = torch.randn(n, 3, side, side)
        return x.to(device), (x.flatten(1) @ teacher).argmax(-1).to(device)

    desc = f"ViT {layers} layers, hidden {hidden}, {side}x{side} images in {patch}x{patch} patches, {classes} classes"
    return Workload(WithTargets(ImageLogits(tf.ViTForImageClassification(config))), batch_fn, _classification_loss,
                    batch_size, None, desc)


BUILDERS = {
    "mlp": build_mlp, "cnn": build_cnn, "resnet": build_resnet, "unet": build_unet, "gpt2": build_gpt2,
    "llama": build_llama, "bert": build_bert, "t5": build_t5, "vit": build_vit, "mixtral": build_mixtral,
}


# ---- the user's factory ---------------------------------------------------------------------


class FactoryError(Exception):
    """The user's --model factory could not be loaded or called, or returned the wrong thing."""


def parse_model_path(path: str) -> tuple[str, str]:
    """(module name or .py file, factory name) of a --model argument."""
    module, sep, attr = path.rpartition(":")
    if not sep or not module or not attr or not attr.isidentifier():
        raise FactoryError(f"--model {path!r} must look like package.module:factory or path/to/file.py:factory")
    return module, attr


def is_file_path(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


def load_factory(path: str) -> Callable:
    module_name, attr = parse_model_path(path)
    try:
        if is_file_path(module_name):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None:
                raise FileNotFoundError(f"no Python file at {module_name}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # pickling and dataclasses look the module up by name
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's
        raise FactoryError(f"cannot import {module_name!r} for --model {path}: {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise FactoryError(f"{module_name!r} has no callable {attr!r} (--model {path})")
    return factory


def build_user(path: str, batch_size: int | None) -> Workload:
    factory = load_factory(path)
    try:
        made = factory()
    except Exception as e:  # noqa: BLE001 - report the factory's own error
        raise FactoryError(f"the factory {path} raised {type(e).__name__}: {e}") from e
    if not (isinstance(made, tuple) and len(made) == 3):
        raise FactoryError(f"the factory {path} must return (model, batch_fn, loss_fn), got {type(made).__name__}")
    model, batch_fn, loss_fn = made
    if not isinstance(model, nn.Module) or not callable(batch_fn) or not callable(loss_fn):
        raise FactoryError(f"the factory {path} must return (nn.Module, callable, callable)")
    return Workload(model, batch_fn, loss_fn, batch_size or USER_BATCH_SIZE, None, f"user model {path}")


def build(name: str | None, size: str, model_path: str | None, batch_size: int | None) -> Workload:
    """Build on the CPU; the caller seeds the generator first so every target gets the same weights."""
    if model_path:
        return build_user(model_path, batch_size)
    workload = BUILDERS[name](size)
    if batch_size:
        workload.batch_size = batch_size
    return workload
