"""One target's worker process: builds the workload, runs warm-up, then rounds on request.

Protocol, JSON lines: the worker sends {"event": "ready", ...} after its warm-up (or
{"event": "error", ...}); then for each {"cmd": "round", "steps": K} on stdin it runs K
steps and sends {"event": "round", ...}; {"cmd": "finish"} gets {"event": "final", ...}.
Started by _launch.py, which keeps the torchpjrt package (and so JAX) out of the cpu and
cuda targets' start-up.
"""

import json
import os
import re
import sys
import time
import traceback

from . import measure, targets, workloads


class Channel:
    """The protocol stream: the real stdout. Anything else printed goes to stderr."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def send(self, message: dict):
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()


def limit_threads(threads: int | None) -> None:
    """Pins this worker to `threads` cores: XLA:CPU sizes its thread pool by the cores a process
    may run on, and torch's OpenMP pool by OMP_NUM_THREADS (set by the parent) as well."""
    if threads and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores[:threads])


def thread_counts(torch) -> dict:
    return {
        "torch_intra_op": torch.get_num_threads(),
        "torch_inter_op": torch.get_num_interop_threads(),
        "cores_pinned": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def import_device(target: targets.Target, threads: int | None = None):
    """Import what the target needs (this is part of its start-up time) and return its device."""
    import torch

    if threads:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # inter-op work already started (a user module imported early)
            pass

    if target.device_type == "pjrt":
        import torchpjrt

        if target.mode == "fused":
            torchpjrt.set_eager_mode("fused")
    return torch.device(target.device_type)


class Session:
    def __init__(self, config: dict, spawn_time: float):
        self.target = targets.Target(**config["target"])
        self.seed = config["seed"]
        limit_threads(config.get("threads"))
        self.device = import_device(self.target, config.get("threads"))
        imported = time.time()
        self.imported_jax = "jax" in sys.modules

        import torch

        self.torch = torch
        self.sync = measure.synchronizer(self.target.device_type)
        torch.manual_seed(self.seed)  # the same initial weights on every target: built on the CPU
        self.workload = workloads.build(config["workload"], config["size"], config["model"], config["batch_size"])
        self.workload.model.to(self.device)
        self.step_fn = make_step(self.workload, self.target, config["task"], config["lr"])
        self.energy = measure.EnergyMeter(self.target.hardware)
        self.losses, self.step_index = [], 0
        built = time.time()

        first_step_s = self.run_step()
        ready = time.time()
        for _ in range(config["warmup"] - 1):
            self.run_step()
        self.startup = {
            "time_to_first_step_s": ready - spawn_time,
            "import_s": imported - spawn_time,
            "build_s": built - imported,
            "first_step_s": first_step_s,
        }

    def run_step(self) -> float:
        """One step on the next batch of the shared stream; returns its time in seconds."""
        self.torch.default_generator.manual_seed(self.seed + 1 + self.step_index)
        batch = self.workload.batch_fn(self.workload.batch_size, self.device)
        self.sync()  # the batch copy is not part of the step (a prefetching loader hides it)
        start = time.perf_counter()
        loss = self.step_fn(batch)
        self.sync()
        elapsed = time.perf_counter() - start
        self.losses.append(loss.item())
        self.step_index += 1
        return elapsed

    def ready_message(self) -> dict:
        w = self.workload
        return {
            "event": "ready",
            **self.startup,
            "losses": self.take_losses(),
            "device_name": device_name(self.target),
            "cores": measure_cores(self.target),
            "threads": thread_counts(self.torch),
            "imported_jax": self.imported_jax,
            "batch_size": w.batch_size,
            "tokens_per_sample": w.tokens_per_sample,
            "description": w.description,
            "parameters": sum(p.numel() for p in w.model.parameters()),
            "energy_source": self.energy.source,
            "energy_unavailable": self.energy.reason,
        }

    def run_round(self, steps: int) -> dict:
        energy_start = self.energy.start()
        times = [self.run_step() for _ in range(steps)]
        joules = self.energy.joules_since(energy_start)
        return {"event": "round", "step_times": times, "losses": self.take_losses(), "energy_j": joules}

    def take_losses(self) -> list[float]:
        losses, self.losses = self.losses, []
        return losses

    def final_message(self) -> dict:
        peak, source = measure.peak_memory(self.target.device_type)
        return {"event": "final", "peak_memory_bytes": peak, "peak_memory_source": source}


def make_step(workload, target, task: str, lr: float):
    """The timed step: forward + loss (+ backward + AdamW for train); compiled for *-compile."""
    import torch

    model, loss_fn = workload.model, workload.loss_fn

    def forward_loss(*batch):
        return loss_fn(model(*batch), batch)

    if target.mode == "compile":
        forward_loss = torch.compile(forward_loss, backend="pjrt" if target.device_type == "pjrt" else "inductor")
    if task == "infer":
        model.eval()

        def infer_step(batch):
            with torch.no_grad():
                return forward_loss(*batch)

        return infer_step

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def train_step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_loss(*batch)
        loss.backward()
        optimizer.step()
        return loss

    return train_step


def device_name(target) -> str:
    import torch

    if target.hardware == "cpu":
        return targets.cpu_model()
    if target.device_type == "cuda":
        return torch.cuda.get_device_name()
    return torch.pjrt.get_device_name()


def measure_cores(target) -> int | None:
    """CPU cores the target may use (what a CPU price is charged for); None for accelerators."""
    return targets.usable_cores() if target.hardware == "cpu" else None  # after limit_threads: the pinned ones


# ---- errors ---------------------------------------------------------------------------------


def describe_error(error: BaseException) -> dict:
    message = f"{type(error).__name__}: {error}".strip()
    return {"event": "error", "kind": error_kind(error), "message": _shorten(message), "traceback": traceback.format_exc()[-4000:]}


def error_kind(error: BaseException) -> str:
    text = str(error)
    if isinstance(error, workloads.FactoryError):
        return "model factory"
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError" or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "out of memory"
    if isinstance(error, NotImplementedError):
        op = re.search(r"'(aten::[^']+)'", text)
        return f"missing op {op.group(1)}" if op else "not implemented"
    return "error"


def _shorten(text: str, limit: int = 600) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- main -----------------------------------------------------------------------------------


def main():
    spawn_time = float(os.environ.get("TORCHPJRT_BENCH_SPAWN_TIME", time.time()))
    channel = Channel()
    config = json.loads(sys.argv[1])
    try:
        if config.get("probe"):
            channel.send({"event": "probe", **targets.probe()})
            return
        session = Session(config, spawn_time)
        channel.send(session.ready_message())
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "round":
                channel.send(session.run_round(command["steps"]))
            elif command["cmd"] == "finish":
                channel.send(session.final_message())
                return
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        channel.send(describe_error(e))
        sys.exit(1)
