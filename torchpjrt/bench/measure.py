"""Measurement inside a worker: device synchronisation, peak memory, energy counters, and the
statistics the parent computes from them. Every metric that cannot be measured comes with
the reason, never a made-up number.
"""

import glob
import os
import resource
import statistics


def synchronizer(device_type: str):
    """A function that waits until the device has finished all queued work."""
    import torch

    if device_type == "pjrt":
        return torch.pjrt.synchronize
    if device_type == "cuda":
        return torch.cuda.synchronize
    return lambda: None  # CPU eager and inductor-compiled CPU code run synchronously


# ---- memory ---------------------------------------------------------------------------------


def process_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_memory(device_type: str) -> tuple[int, str]:
    """(bytes, source): the device runtime's own peak where it reports one, else the process RSS."""
    import torch

    if device_type == "cuda":
        return torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
    if device_type == "pjrt" and torch.pjrt.memory_stats():
        return torch.pjrt.max_memory_allocated(), "torch.pjrt.max_memory_allocated"
    return process_peak_rss(), "process peak RSS (getrusage)"


# ---- energy ---------------------------------------------------------------------------------

RAPL_GLOB = "/sys/class/powercap/intel-rapl:*"


class Rapl:
    """CPU package energy from the RAPL counters (whole packages: other processes count too)."""

    def __init__(self):
        # Package domains only (intel-rapl:0), not their sub-domains (intel-rapl:0:0) counted inside them.
        self.domains = [d for d in sorted(glob.glob(RAPL_GLOB)) if d.count(":") == 1]
        self.reason = None
        if not self.domains:
            self.reason = "no RAPL counters (/sys/class/powercap/intel-rapl:* absent)"
            return
        try:
            self.ranges = [int(_read(f"{d}/max_energy_range_uj")) for d in self.domains]
            self._read_uj()
        except OSError as e:
            self.reason = f"RAPL counters not readable ({e.strerror}; reading energy_uj usually needs root)"

    def _read_uj(self) -> list[int]:
        return [int(_read(f"{d}/energy_uj")) for d in self.domains]

    def start(self):
        return self._read_uj()

    def joules_since(self, start) -> float:
        total = 0
        for before, after, wrap in zip(start, self._read_uj(), self.ranges):
            total += after - before if after >= before else after + wrap - before  # the counter wraps
        return total / 1e6


class Nvml:
    """GPU board energy from NVML's total-energy counter (Volta and newer)."""

    def __init__(self):
        self.reason = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(_first_visible_gpu())
            self._pynvml = pynvml
            self.start()
        except ImportError:
            self.reason = "pynvml not installed (pip install nvidia-ml-py)"
        except Exception as e:  # noqa: BLE001 - NVML errors are many; each means no counter
            self.reason = f"NVML energy counter unavailable ({e})"

    def start(self):
        return self._pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)  # millijoules

    def joules_since(self, start) -> float:
        return (self.start() - start) / 1e3


def _first_visible_gpu() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


class EnergyMeter:
    """Energy over an interval from the counters that cover the target's hardware.

    CPU targets: RAPL. GPU targets: NVML for the GPU, plus RAPL for the host when readable.
    TPU and other chips expose no counter to the process.
    """

    def __init__(self, hardware: str):
        self.meters, self.reason = [], None
        if hardware == "cpu":
            self._need(Rapl(), "rapl")
        elif hardware == "gpu":
            self._need(Nvml(), "nvml")
            rapl = Rapl()
            if self.meters and rapl.reason is None:
                self.meters.append(("rapl", rapl))
        else:
            self.reason = f"no energy counter is exposed for {hardware} chips"
        self.source = "+".join(name for name, _ in self.meters) or None

    def _need(self, meter, name):
        if meter.reason is None:
            self.meters.append((name, meter))
        else:
            self.reason = meter.reason

    def start(self):
        return [meter.start() for _, meter in self.meters] if self.meters else None

    def joules_since(self, start) -> float | None:
        if not self.meters:
            return None
        return sum(meter.joules_since(s) for (_, meter), s in zip(self.meters, start))


# ---- statistics (parent side) ---------------------------------------------------------------


def spread(values: list[float]) -> dict:
    """Median, 10th and 90th percentile (inclusive interpolation; one value gives itself)."""
    if len(values) == 1:
        return {"median": values[0], "p10": values[0], "p90": values[0]}
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return {"median": statistics.median(values), "p10": deciles[0], "p90": deciles[-1]}


def relative_difference(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)
