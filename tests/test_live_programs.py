"""A process that meets many shapes lets go of loaded programs before it runs out of memory
mappings (each XLA:CPU executable holds some; Linux caps them per process), and the programs
it still uses come back with the same results."""

import sys

import pytest
import torch

from torchpjrt import live_programs

pytestmark = [
    pytest.mark.usefixtures("each_eager_mode"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the mapping cap is Linux's"),
]


def _mappings():
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


def _step(n):
    x = torch.arange(n)  # integers: the sum is exact in any order
    d = x.to("pjrt")
    return ((d * 2 + 1).sum() - n).cpu(), ((x * 2 + 1).sum() - n)


CAP_ABOVE = 120  # mappings


@pytest.mark.slow  # a hundred new programs per mode
def test_many_shapes_release_programs_and_keep_results(monkeypatch, each_eager_mode):
    # sizes no other test (nor another mode of this one) compiled: each step makes new programs
    first = 7919 + 100 * ("strict", "debug", "fused").index(each_eager_mode)
    base = _mappings()
    # a cap just above what the process holds now, checked often: a hundred new programs must
    # trigger releases, as tens of thousands do against the real cap
    monkeypatch.setattr(live_programs, "_limit", base + CAP_ABOVE)
    monkeypatch.setattr(live_programs, "CHECK_EVERY", 8)
    before = live_programs.stats["releases"]
    peak = 0
    for n in range(first, first + 25):
        got, want = _step(n)
        assert torch.equal(got, want), n
        if n % 5 == 0:
            peak = max(peak, _mappings())
    assert live_programs.stats["releases"] > before
    # checked every 8 programs: the count can pass the cap by those programs' mappings (a fused
    # graph's program maps about 12, an eager kernel's fewer)
    assert peak < base + CAP_ABOVE + 8 * 16
    # kernels used before a release still run after it (reloaded or recompiled)
    for n in (first, first + 7, first + 24):
        got, want = _step(n)
        assert torch.equal(got, want)


def test_no_release_below_the_cap(monkeypatch):
    monkeypatch.setattr(live_programs, "CHECK_EVERY", 1)
    monkeypatch.setattr(live_programs, "_due", False)  # a release an earlier test's low cap asked for
    before = live_programs.stats["releases"]
    for n in range(1, 9):
        _step(n)
    assert live_programs.stats["releases"] == before
    assert live_programs._map_limit() == int(int(open("/proc/sys/vm/max_map_count").read()) * live_programs.RELEASE_AT)


@pytest.mark.slow
def test_released_kernels_reload_from_the_kernel_cache(monkeypatch, each_eager_mode):
    from torchpjrt import kernel_cache

    _step(5)  # compiled (or loaded) and stored
    monkeypatch.setattr(live_programs, "_due", True)
    live_programs.release_if_due()
    hits = kernel_cache.stats["kernel_cache_hits"]
    got, want = _step(5)
    assert torch.equal(got, want)
    if kernel_cache.directory() is not None and each_eager_mode != "fused":  # fused: one jitted graph
        assert kernel_cache.stats["kernel_cache_hits"] > hits
