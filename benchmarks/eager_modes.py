"""Step time of the three eager modes versus torch eager, measured side by side in one run.

    python benchmarks/eager_modes.py [--rounds 5] [--steps 10] [--baseline cpu|cuda]

Workloads:
  (a) MLP training step: Linear 256-512-512-10, GELU, batch 128, SGD;
  (b) small transformer training step: 2 encoder layers, d_model 256, 4 heads, seq 128,
      batch 8, causal mask, language-model loss, AdamW;
  (c) overhead-bound step: 4 Linear 32-32 layers with GELU and a 32-10 head, batch 8, AdamW,
      where host cost per op decides the step time.
Each step ends with `loss.item()`, as a training loop that logs its loss does. The baseline
is torch eager on the CPU, or with `--baseline cuda` on the machine's GPU. Rounds
alternate between targets so machine drift hits all of them alike; ratios use medians.
Also reported: graphs compiled per steady-state step in fused mode (0 means every step hits
the compiled-graph cache).
"""

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchpjrt
from eager_overhead import classifier_step, mlp_step_fn, sync

MODES = ("debug", "strict", "fused")


def mlp_workload(device):
    step = mlp_step_fn(device)  # the foundation's MLP step, shared with eager_overhead.py
    return lambda: step().item()


class TinyLM(nn.Module):
    def __init__(self, vocab=1000, d_model=256, heads=4, layers=2, seq=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        return self.head(self.encoder(h, mask=self.mask, is_causal=True))


def transformer_workload(device):
    torch.manual_seed(0)
    model = TinyLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 1000, (8, 129)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return step


def tiny_mlp_workload(device):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(32, 32), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(32, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = classifier_step(model, opt, torch.randn(8, 32).to(device), torch.randint(0, 10, (8,)).to(device))
    return lambda: step().item()


def run(target, step, n):
    device_mode = target if target in MODES else None
    if device_mode:
        torchpjrt.set_eager_mode(device_mode)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync("pjrt" if device_mode else target)
    elapsed = (time.perf_counter() - t0) / n
    torchpjrt.set_eager_mode("strict")
    return elapsed


def measure(make, baseline, rounds, steps):
    targets = (baseline,) + MODES
    steps_by_target = {}
    for target in targets:
        device = "pjrt" if target in MODES else target
        if target in MODES:
            torchpjrt.set_eager_mode(target)
        steps_by_target[target] = make(device)
        torchpjrt.set_eager_mode("strict")
        run(target, steps_by_target[target], 3)  # warm-up: compiles
    times = {t: [] for t in targets}
    compiled_before = torchpjrt.eager_stats()["graphs_compiled"]
    fused_steps = 0
    for _ in range(rounds):
        for target in targets:
            n = max(1, steps // 4) if target == "debug" else steps
            times[target].append(run(target, steps_by_target[target], n))
            fused_steps += n if target == "fused" else 0
    compiles_per_step = (torchpjrt.eager_stats()["graphs_compiled"] - compiled_before) / fused_steps
    med = {t: statistics.median(v) for t, v in times.items()}
    return med, compiles_per_step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--baseline", default="cpu", choices=("cpu", "cuda"), help="torch eager device to compare with")
    args = parser.parse_args()
    base = args.baseline
    print(f"platform: {torch.pjrt.platform()} ({torch.pjrt.get_device_name()}); "
          f"medians of {args.rounds} interleaved rounds of {args.steps} steps")
    header = f"{'workload':26s}" + "".join(f"{t:>12s}" for t in (base,) + MODES)
    header += f"{'strict/fused':>14s}{'fused/' + base:>12s}{'compiles/step':>15s}"
    print(header)
    for name, make in (("MLP step (SGD)", mlp_workload), ("transformer step (AdamW)", transformer_workload),
                       ("tiny MLP step (AdamW)", tiny_mlp_workload)):
        med, cps = measure(make, base, args.rounds, args.steps)
        row = f"{name:26s}" + "".join(f"{med[t] * 1e3:10.2f}ms" for t in (base,) + MODES)
        row += f"{med['strict'] / med['fused']:13.2f}x{med['fused'] / med[base]:11.2f}x{cps:15.2f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
