"""Targets (where a workload runs), what this machine offers, and the choice the user made.

A target is a device kind plus a mode: `cpu`, `cpu-compile`, `cuda`, `cuda-compile`, and
`pjrt`, `pjrt-fused`, `pjrt-compile` on a JAX platform (`pjrt@cpu`, `pjrt@gpu`, `pjrt@tpu`).
What is available is found by a probe subprocess, so the parent process never opens an
accelerator (a TPU admits one process at a time; JAX would reserve GPU memory).
"""

import importlib.metadata
import importlib.util
import os
import platform as _platform
import shutil
import sys
from dataclasses import dataclass

KINDS = ("cpu", "cpu-compile", "cuda", "cuda-compile", "pjrt", "pjrt-fused", "pjrt-compile")
PJRT_KINDS = ("pjrt", "pjrt-fused", "pjrt-compile")
JAX_PLATFORMS = ("cpu", "gpu", "tpu")
EXCLUSIVE_PLATFORMS = ("tpu",)  # one process at a time may hold these chips
NO_COMPILER = "no C++ compiler found (torch.compile's inductor needs one for the CPU)"


@dataclass(frozen=True)
class Target:
    kind: str
    platform: str | None = None  # the JAX platform of pjrt kinds

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.platform}" if self.platform else self.kind

    @property
    def device_type(self) -> str:
        return self.kind.split("-")[0]

    @property
    def mode(self) -> str:
        return self.kind.split("-")[1] if "-" in self.kind else "eager"

    @property
    def hardware(self) -> str:
        """cpu, gpu, tpu, ...: what runs the math (for energy counters and prices)."""
        if self.device_type == "pjrt":
            return self.platform
        return "gpu" if self.device_type == "cuda" else "cpu"

    @property
    def exclusive(self) -> bool:
        return self.platform in EXCLUSIVE_PLATFORMS

    def to_json(self) -> dict:
        return {"kind": self.kind, "platform": self.platform}


# ---- the probe (runs in its own process) ----------------------------------------------------


def probe() -> dict:
    """What this machine and installation offer; run in a subprocess (see module docstring)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    import torchpjrt

    jax_devices = _jax_devices()
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "jax_platforms": jax_devices,
        "unavailable": _unavailable_reasons(torch, torchpjrt, cuda),
        "machine": machine_info(cuda, jax_devices),
        "versions": versions(),
    }


def probe_failed(reason: str) -> dict:
    """What is known without the probe: the CPU targets may run, nothing else is known to."""
    unknown = f"the probe failed: {reason}"
    unavailable = {"jax": unknown, "cuda": unknown, "cuda-compile": unknown}
    if not (shutil.which("c++") or shutil.which("g++")):
        unavailable["cpu-compile"] = NO_COMPILER
    return {"jax_platforms": {}, "unavailable": unavailable, "machine": machine_info(), "versions": versions()}


def _jax_devices() -> dict:
    """{platform: {"count", "kind"}} for each JAX platform that initialises here."""
    import jax

    found = {}
    for p in JAX_PLATFORMS:
        try:
            devices = jax.devices(p)
        except RuntimeError:
            continue
        found[p] = {"count": len(devices), "kind": devices[0].device_kind}
    return found


def _unavailable_reasons(torch, torchpjrt, cuda_names) -> dict:
    """{kind: reason} for each target kind that cannot run here."""
    reasons = {}
    if not (shutil.which("c++") or shutil.which("g++")):
        reasons["cpu-compile"] = NO_COMPILER
    if not cuda_names:
        reasons["cuda"] = reasons["cuda-compile"] = "torch.cuda.is_available() is False"
    elif importlib.util.find_spec("triton") is None:
        reasons["cuda-compile"] = "triton is not installed (inductor needs it for CUDA)"
    import torch._dynamo

    if "pjrt" not in torch._dynamo.list_backends():
        reasons["pjrt-compile"] = "not implemented yet: no torch.compile backend named 'pjrt' is registered"
    return reasons


def machine_info(cuda_names=(), jax_devices=None) -> dict:
    accelerators = list(cuda_names)
    for p, d in (jax_devices or {}).items():
        if p != "cpu":
            accelerators.append(f"{d['count']} x {d['kind']} (JAX {p})")
    return {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": round(_total_memory_bytes() / 2**30, 1) if _total_memory_bytes() else None,
        "accelerators": sorted(set(accelerators)),
        "os": f"{_platform.system()} {_platform.release()}",
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _total_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        return None


def versions() -> dict:
    found = {"python": sys.version.split()[0]}
    for package in ("torch", "jax", "jaxlib", "torchpjrt", "transformers"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


# ---- the user's choice ----------------------------------------------------------------------


def parse_target_list(text: str | None) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()] if text else []


def resolve(requested: list[str], probed: dict) -> tuple[list[Target], list[dict]]:
    """(targets to run, [{"name", "status", "reason"}] for those that will not run).

    No request means every target kind on every platform. A pjrt kind without `@platform`
    means that kind on every JAX platform found.
    """
    platforms = list(probed["jax_platforms"])
    wanted = requested or list(KINDS)
    runnable, not_run, seen = [], [], set()
    for name in wanted:
        for target, problem in _expand(name, platforms, probed["unavailable"]):
            key = target.name if target else name
            if key in seen:
                continue
            seen.add(key)
            if problem:
                not_run.append({"name": key, **problem})
            else:
                runnable.append(target)
    return runnable, not_run


def _expand(name: str, platforms: list[str], unavailable: dict):
    """Yield (target, problem) pairs for one requested name; problem is None when it can run."""
    kind, _, platform = name.partition("@")
    if kind not in KINDS or (platform and kind not in PJRT_KINDS):
        yield None, {"status": "failed", "reason": f"unknown target {name!r} (known: {', '.join(KINDS)}; pjrt kinds take @cpu/@gpu/@tpu)"}
        return
    if kind not in PJRT_KINDS:
        yield Target(kind), _skip(unavailable.get(kind))
        return
    if platform and platform not in platforms:
        found = ", ".join(platforms) or "none"
        yield Target(kind, platform), _skip(f"JAX platform {platform!r} is not available here (found: {found})")
        return
    if not platforms:
        yield Target(kind), _skip(unavailable.get("jax", "JAX found no platform"))
        return
    for p in [platform] if platform else platforms:
        yield Target(kind, p), _skip(unavailable.get(kind))


def _skip(reason: str | None) -> dict | None:
    return {"status": "skipped", "reason": reason} if reason else None
