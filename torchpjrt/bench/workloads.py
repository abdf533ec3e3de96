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
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

BUILTIN = ("mlp", "cnn", "gpt2", "llama", "bert")
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


# ---- language models (Hugging Face transformers, random weights) ---------------------------

LM_SIZES = {  # layers, hidden, heads, vocab, sequence length, batch size
    "gpt2": {"tiny": (2, 64, 2, 512, 32, 4), "small": (4, 256, 4, 8192, 128, 8), "base": (12, 768, 12, 50257, 256, 8)},
    "llama": {"tiny": (2, 64, 4, 512, 32, 4), "small": (4, 256, 8, 8192, 128, 8), "base": (12, 768, 12, 32000, 256, 8)},
    "bert": {"tiny": (2, 64, 2, 512, 32, 4), "small": (4, 256, 4, 8192, 128, 8), "base": (12, 768, 12, 30522, 128, 16)},
}


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
        raise ImportError(f"the gpt2, llama and bert workloads need transformers: pip install 'torchpjrt[bench]' ({e})") from None
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


BUILDERS = {"mlp": build_mlp, "cnn": build_cnn, "gpt2": build_gpt2, "llama": build_llama, "bert": build_bert}


# ---- the user's factory ---------------------------------------------------------------------


class FactoryError(Exception):
    """The user's --model factory could not be loaded or called, or returned the wrong thing."""


def parse_model_path(path: str) -> tuple[str, str]:
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise FactoryError(f"--model {path!r} must look like package.module:factory")
    return module, attr


def load_factory(path: str) -> Callable:
    module_name, attr = parse_model_path(path)
    try:
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
