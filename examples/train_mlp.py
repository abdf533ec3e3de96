"""Train a small MLP classifier on the pjrt device — an unchanged PyTorch loop.

    python examples/train_mlp.py [--device pjrt|cpu] [--steps 200]

The only pjrt-specific line is `import torchpjrt` (it registers the device).
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchpjrt  # noqa: F401


def make_data(n=4096, dim=32, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, dim, generator=g)
    return x, y


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="pjrt")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=128)
    a = p.parse_args()
    device = torch.device(a.device)

    torch.manual_seed(0)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(f"training on {device} ({torch.pjrt.platform() if device.type == 'pjrt' else 'torch'})")
    t0 = time.perf_counter()
    for step in range(a.steps):
        idx = torch.randint(0, x.shape[0], (a.batch,))
        xb, yb = x[idx].to(device), y[idx].to(device)
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == a.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    with torch.no_grad():
        acc = (model(x.to(device)).argmax(-1).cpu() == y).float().mean().item()
    print(f"accuracy {acc:.3f}  ({time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
