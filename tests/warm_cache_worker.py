"""One process of the warm-cache test (tests/test_warm_cache.py): OpInfo samples of every lowering
family, and programs for the families OpInfo does not reach (foreach, grouped_mm, GradScaler,
fused optimizers, a compiled graph), against the kernel cache in TORCHPJRT_CACHE_DIR. Writes what it
saw as JSON to argv[1]."""

import json
import sys

import torch

import torchpjrt
from torchpjrt import conformance, dispatch, kernel_cache

# a few ops per lowering file, and every LAPACK-backed linalg op of the baseline
OPS = [
    "add", "mul", "sin", "where", "sum", "var_mean", "cumsum", "amax",
    "linalg.cholesky", "linalg.inv", "linalg.solve", "linalg.svdvals", "linalg.lu_factor", "linalg.qr",
    "linalg.det", "linalg.eig", "linalg.lstsq", "linalg.pinv", "cholesky_solve", "triangular_solve", "matmul",
    "cat", "flip", "roll", "sort", "topk", "index_select", "gather", "nn.functional.embedding",
    "nn.functional.layer_norm", "nn.functional.nll_loss", "nn.functional.max_pool2d",
    "nn.functional.grid_sample", "nn.functional.conv2d", "normal", "bernoulli", "arange", "linspace",
    "eye", "fft.fft", "fft.rfft", "special.erfcx", "special.bessel_j0", "special.airy_ai", "lgamma", "digamma",
    "cdist",
]

families = set()
_compute = dispatch.LoweredKernel.compute_keyed  # every eager kernel computes through it


def _recording_compute(self, vals):
    families.add(self.lowering.fn.__module__.rsplit(".", 1)[1])
    return _compute(self, vals)


dispatch.LoweredKernel.compute_keyed = _recording_compute


def programs(device):
    """Values of programs whose lowerings OpInfo's op_db does not reach."""
    torch.manual_seed(0)
    out = {}
    a = torch.randn(4, 4).to(device)
    out["foreach"] = [t.cpu().tolist() for t in torch._foreach_mul([a, a + 1], 2.0)]
    experts = torch.randn(2, 4, 4).to(device)
    offsets = torch.tensor([1, 4], dtype=torch.int32, device=device)
    out["grouped_mm"] = torch.nn.functional.grouped_mm(a, experts, offs=offsets).cpu().tolist()
    torch._assert_async(a.abs().sum() > 0, "a is not all zeros")
    out["assert_async"] = a.abs().sum().item()
    model = torch.nn.Linear(4, 2).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=256.0)
    for _ in range(2):
        loss = model(a).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    out["adamw_gradscaler"] = [p.detach().cpu().tolist() for p in model.parameters()]

    def solve(m, b):
        spd = m @ m.mT + 4 * torch.eye(m.shape[0], device=m.device)
        return torch.linalg.cholesky(spd), torch.linalg.solve(spd, b), torch.linalg.eigvalsh(spd)

    compiled = torch.compile(solve, backend="pjrt") if device == "pjrt" else solve
    out["compiled_linalg"] = [t.cpu().tolist() for t in compiled(a, a[:, :1])]
    return out


def main(path):
    by_key = {conformance.op_key(o): o for o in conformance.op_db()}
    results = {name: conformance.check_op(by_key[name], torch.float32, max_samples=2) for name in OPS}
    report = {
        "results": results,
        "programs": programs("pjrt"),
        "cpu_programs": programs("cpu"),
        "families": sorted(families),
        "kernel_cache": dict(kernel_cache.stats),
    }
    with open(path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
