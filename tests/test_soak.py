"""Soak: 2,000 training steps per eager mode (and compiled) with steady host memory, steady
device memory and no new compilations once warmed up.

Memory is sampled every SAMPLE_EVERY steps after a sync; after warm-up a least-squares line
is fitted to the samples and its growth over the measured steps must stay under a small bound
(a leak of one tensor per step would grow device memory by STEPS arrays, RSS by megabytes).
Run with `-s` to see the slopes.
"""

import gc
import os
import time

import jax
import numpy as np
import pytest
import torch

import torchpjrt
from torchpjrt import dispatch, fusion

DEV = "pjrt"
STEPS = 2000
WARMUP = 400  # steps before measuring: caches fill, allocator pools settle
SAMPLE_EVERY = 50
RSS_GROWTH_BOUND = 24 * 2**20  # bytes over the measured steps (allocator noise is a few MiB)
ARRAY_GROWTH_BOUND = 8  # live device arrays over the measured steps
DEVICE_BYTES_GROWTH_BOUND = 2**20

pytestmark = pytest.mark.slow


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_memory():
    """(live arrays, bytes): the runtime's bytes in use where it reports them, else the bytes of
    the live jax arrays (XLA's CPU client reports no memory stats)."""
    arrays = jax.live_arrays()
    stats = torch.pjrt.memory_stats()
    used = stats.get("bytes_in_use") if stats else None
    if used is None:
        used = sum(a.nbytes for a in arrays)
    return len(arrays), used


def compile_counters() -> dict:
    from torchpjrt.compile import compile_stats

    compiled = compile_stats()
    return {
        "eager_kernels_built": dispatch.stats["compiled"],
        "fused_graphs_compiled": fusion.stats["graphs_compiled"],
        "fused_graph_cache": len(fusion._compiled),
        "fused_cache_misses": fusion.stats["cache_misses"],
        "dynamo_graphs": compiled["graphs"],
        "recompiles": compiled["recompiles"],
        "xla_compiles": compiled["xla_compiles"],
    }


def growth(steps, values):
    """Slope of the least-squares line through (step, value), and its rise over the steps."""
    slope = np.polyfit(np.asarray(steps, float), np.asarray(values, float), 1)[0]
    return slope, slope * (steps[-1] - steps[0])


def soak(compiled=False):
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = [(torch.randn(16, 16, generator=g).to(DEV), torch.randn(16, 4, generator=g).to(DEV)) for _ in range(8)]
    forward = torch.compile(model, backend="pjrt") if compiled else model
    samples = {"step": [], "rss": [], "arrays": [], "device_bytes": []}
    counters_after_warmup = None
    first_loss = last_loss = None
    t0 = time.perf_counter()
    for step in range(1, STEPS + 1):
        x, y = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        if step % SAMPLE_EVERY == 0:
            last_loss = loss.item()  # a sync: everything dispatched so far has run
            first_loss = first_loss if first_loss is not None else last_loss
            if step == WARMUP:
                counters_after_warmup = compile_counters()
            if step >= WARMUP:
                gc.collect()
                arrays, used = device_memory()
                samples["step"].append(step)
                samples["rss"].append(rss_bytes())
                samples["arrays"].append(arrays)
                samples["device_bytes"].append(used)
    elapsed = time.perf_counter() - t0
    return samples, counters_after_warmup, compile_counters(), (first_loss, last_loss), elapsed


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
def test_soak(mode):
    eager = "strict" if mode == "compiled" else mode
    # objects from earlier tests are frozen out of the collector: a full collection every
    # SAMPLE_EVERY steps then walks the soak's own objects, not the whole test session's heap
    gc.collect()
    gc.freeze()
    try:
        with torchpjrt.eager_mode(eager):
            samples, warm, final, (first_loss, last_loss), elapsed = soak(compiled=mode == "compiled")
    finally:
        gc.unfreeze()
    steps = samples["step"]
    rss_slope, rss_rise = growth(steps, samples["rss"])
    arr_slope, arr_rise = growth(steps, samples["arrays"])
    dev_slope, dev_rise = growth(steps, samples["device_bytes"])
    print(f"\n[soak {mode}] {STEPS} steps in {elapsed:.1f} s; over steps {steps[0]}..{steps[-1]}: "
          f"RSS {rss_slope:+.1f} B/step ({rss_rise / 2**20:+.2f} MiB), live arrays {arr_slope:+.4f}/step "
          f"({samples['arrays'][0]}..{samples['arrays'][-1]}), device bytes {dev_slope:+.1f} B/step; "
          f"loss {first_loss:.4f} -> {last_loss:.4f}")
    assert last_loss < first_loss, "the model did not train"
    assert arr_rise < ARRAY_GROWTH_BOUND, f"live device arrays grow: {samples['arrays']}"
    assert dev_rise < DEVICE_BYTES_GROWTH_BOUND, f"device memory grows: {samples['device_bytes']}"
    assert rss_rise < RSS_GROWTH_BOUND, f"host RSS grows {rss_rise / 2**20:.1f} MiB: {samples['rss']}"
    assert final == warm, f"compilations after warm-up: {warm} -> {final}"
