"""Fine-tune a GPT-2 language model on the pjrt device with the usual Hugging Face loop.

    python examples/finetune_gpt2.py [--device pjrt|cpu] [--steps 60] [--accumulate 4]
    python examples/finetune_gpt2.py --pretrained gpt2   # start from the Hub's weights (downloads)

The loop is the one people write without `Trainer`: model.to(device), AdamW with weight
decay on the weights only, a linear warm-up schedule, gradient accumulation, gradient
clipping, a held-out evaluation and a checkpoint at the end. Nothing in it names pjrt except
the default of --device. Without --pretrained the model is a small GPT-2 with random weights
learning a synthetic text (arithmetic token sequences), so it runs anywhere in a minute.
"""

import argparse
import os
import time

import torch

import torchpjrt


def synthetic_corpus(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Token sequences `start, start+k, start+2k, ...` mod vocab: learnable after two tokens."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % vocab


def build_model(pretrained: str | None):
    import transformers

    transformers.logging.set_verbosity_error()
    if pretrained:
        return transformers.GPT2LMHeadModel.from_pretrained(pretrained)
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def parameter_groups(model, weight_decay: float):
    """Weight decay on matrices only: biases and LayerNorm parameters are left undecayed."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def main(argv=None) -> dict:
    from transformers import get_linear_schedule_with_warmup

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="pjrt")
    p.add_argument("--pretrained", default=None, help="a Hub model name or local path (default: random small GPT-2)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--save", default=None, help="directory for the final safetensors checkpoint")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = build_model(args.pretrained).to(device)
    model.train()
    vocab = model.config.vocab_size
    train = synthetic_corpus(args.steps * args.accumulate * args.micro_batch, args.seq, vocab, seed=args.seed)
    held_out = synthetic_corpus(4 * args.micro_batch, args.seq, vocab, seed=args.seed + 1)

    optimizer = torch.optim.AdamW(parameter_groups(model, 0.01), lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=args.steps // 10, num_training_steps=args.steps)

    losses, grad_norms = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        step_loss = 0.0
        for micro in range(args.accumulate):
            i = (step * args.accumulate + micro) * args.micro_batch
            ids = train[i : i + args.micro_batch].to(device)
            loss = model(input_ids=ids, labels=ids).loss / args.accumulate
            loss.backward()
            step_loss += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss.item())
        grad_norms.append(grad_norm.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  grad norm {grad_norms[-1]:.3f}  lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    elapsed = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        ids = held_out.to(device)
        eval_loss = model(input_ids=ids, labels=ids).loss.item()
    print(f"held-out loss {eval_loss:.4f}  ({elapsed / args.steps * 1000:.1f} ms per optimizer step on {device})")

    if args.save:
        # save_model keeps one key of the tied input/output embedding; load_model ties it back
        os.makedirs(args.save, exist_ok=True)  # a directory holds the Hugging Face layout
        torchpjrt.save_model(model, args.save, max_shard_size="200MB")
        print(f"saved to {args.save}")
    return {"losses": losses, "grad_norms": grad_norms, "eval_loss": eval_loss, "model": model}


if __name__ == "__main__":
    main()
