"""The parent process: probes the machine, starts one worker per target, interleaves rounds.

Workers start one after another, so each start-up is measured on an otherwise idle machine.
Then, round by round, each live worker runs K steps in turn (the order rotates every round):
slow drift of the machine (heat, other load) reaches every target alike.
"""

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import display, results, targets
from .targets import Target

LAUNCHER = Path(__file__).with_name("_launch.py")


@dataclass
class BenchConfig:
    workload: str | None
    size: str
    task: str
    model: str | None
    targets: list[str]
    steps: int
    rounds: int
    warmup: int
    batch_size: int | None
    seed: int
    lr: float
    tolerance: float
    timeout: float
    prices: str | None
    label: str | None = None  # the machine's name in reports (provider/instance), else its hardware
    threads: int | None = None  # CPU threads of every worker; None: chosen at the start (choose_threads)
    tokens: float | None = None  # the whole job, for time and cost to train (one of the two)
    samples: float | None = None

    def budget(self):
        from .prices import Budget

        if self.tokens:
            return Budget(self.tokens, "tokens")
        return Budget(self.samples, "samples") if self.samples else None

    def worker_config(self, target: Target) -> dict:
        return {
            "target": target.to_json(), "workload": self.workload, "size": self.size, "task": self.task,
            "model": self.model, "batch_size": self.batch_size, "seed": self.seed, "warmup": self.warmup, "lr": self.lr,
            "threads": self.threads,
        }


def choose_threads(usable: int, load: float) -> int:
    """CPU threads for every worker: the cores other work leaves free, at least one. Each worker
    runs alone (rounds take turns), so all get the same count; on a busy machine a thread count
    equal to the cores would have torch's and XLA's threads wait on descheduled peers (a tiny
    step measured 40x slower with 2 threads than with 1 on a loaded 2-core machine)."""
    return max(1, min(usable, usable - int(load)))


@dataclass
class TargetRecord:
    """Everything a target's worker reported, gathered as the run goes."""

    target: Target
    status: str = "running"
    reason: str | None = None
    error_kind: str | None = None
    error_detail: str | None = None  # the worker's traceback, for a bug report
    ready: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    round_times: list = field(default_factory=list)  # per round: its step times
    energy_j: list = field(default_factory=list)  # per round, or None where not measurable
    final: dict = field(default_factory=dict)

    def fail(self, failure: "WorkerFailed"):
        self.status, self.reason, self.error_kind = "failed", failure.message, failure.kind
        self.error_detail = failure.detail or None


class WorkerFailed(Exception):
    def __init__(self, kind: str, message: str, detail: str = ""):
        super().__init__(message)
        self.kind, self.message, self.detail = kind, message, detail


class Worker:
    """One long-lived worker subprocess, spoken to in JSON lines."""

    def __init__(self, config: dict, env: dict, timeout: float):
        self.timeout = timeout
        self.stderr = tempfile.TemporaryFile()
        # An empty inductor cache: the time to first step is a cold compile, the same on every run.
        self.cache_dir = tempfile.mkdtemp(prefix="torchpjrt-bench-")
        env = {"TORCHINDUCTOR_CACHE_DIR": self.cache_dir, **env, "TORCHPJRT_BENCH_SPAWN_TIME": repr(time.time())}
        self.proc = subprocess.Popen(
            [sys.executable, str(LAUNCHER), json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env, text=True,
            start_new_session=True,  # its own process group: a kill also reaches compiler subprocesses
        )
        self.lines = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()

    def _read_lines(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def request(self, command: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: receive() says how
        return self.receive()

    def receive(self) -> dict:
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self.kill()
            raise WorkerFailed("timeout", f"no answer within {self.timeout:g} s (--timeout); the worker was stopped") from None
        if line is None:
            raise WorkerFailed("crash", self._death_message())
        message = json.loads(line)
        if message["event"] == "error":
            self.proc.wait()
            raise WorkerFailed(message["kind"], message["message"], message.get("traceback", ""))
        return message

    def _death_message(self) -> str:
        code = self.proc.wait()
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            how = f"killed by {name}" + (" (likely the kernel's out-of-memory killer)" if name == "SIGKILL" else "")
        else:
            how = f"exited with code {code}"
        return f"the worker {how} without a result; its last output: {self.stderr_tail()}"

    def stderr_tail(self, lines: int = 8) -> str:
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace").strip().splitlines()[-lines:]
        return " | ".join(tail) or "(none)"

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this worker leads
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self):
        self.kill()
        self.stderr.close()
        shutil.rmtree(self.cache_dir, ignore_errors=True)


def worker_env(target: Target | None, threads: int | None = None) -> dict:
    env = dict(os.environ)
    # The user's --model module is found from the current directory, as with `python -m`.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX would take 75% of a GPU up front
    if threads:
        # read when the thread pools start; the worker also pins itself to as many cores
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if target is not None and target.device_type == "pjrt":
        env["TORCHPJRT_PLATFORM"] = target.platform
        env["JAX_PLATFORMS"] = target.platform  # open only this platform: a TPU admits one process
    elif target is not None:
        # `import torch` would load torchpjrt (and JAX) through the device-backend entry point:
        # the cpu and cuda targets' start-up is torch's alone, as on a machine without torchpjrt
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return env


def run_probe(timeout: float) -> dict:
    """What the machine offers (targets.probe, in its own process)."""
    worker = Worker({"probe": True}, worker_env(None), timeout)
    try:
        return worker.receive()
    finally:
        worker.close()


def coexisting_groups(targets: list[Target]) -> list[list[Target]]:
    """Targets whose workers can be alive at once: at most one per exclusive chip (TPU)."""
    shared = [t for t in targets if not t.exclusive]
    exclusive = [t for t in targets if t.exclusive]
    return [shared + exclusive[:1]] + [[t] for t in exclusive[1:]]


def run_targets(config: BenchConfig, targets: list[Target], progress) -> list[TargetRecord]:
    records = [TargetRecord(t) for t in targets]
    by_target = {r.target: r for r in records}
    for group in coexisting_groups(targets):
        run_group(config, [by_target[t] for t in group], progress)
    return records


def run_group(config: BenchConfig, records: list[TargetRecord], progress):
    workers = {}
    try:
        for record in records:
            worker = start(config, record, progress)
            if worker:
                workers[record.target] = worker
        for round_index in range(config.rounds):
            live = [r for r in records if r.target in workers]
            shift = round_index % max(1, len(live))  # rotate who goes first
            for record in live[shift:] + live[:shift]:
                run_round(config, record, workers, round_index, progress)
        for record in records:
            if record.target in workers:
                finish(record, workers, progress)
    finally:
        for worker in workers.values():
            worker.close()


def start(config: BenchConfig, record: TargetRecord, progress) -> Worker | None:
    progress.update(record.target.name, "starting (import, build, first step, warm-up)")
    worker = Worker(config.worker_config(record.target), worker_env(record.target, config.threads), config.timeout)
    try:
        record.ready = worker.receive()
    except WorkerFailed as failure:
        return _drop(record, worker, failure, progress)
    record.losses += record.ready.pop("losses")
    progress.update(record.target.name, f"ready: first step after {record.ready['time_to_first_step_s']:.1f} s", advance=1)
    return worker


def run_round(config: BenchConfig, record: TargetRecord, workers: dict, round_index: int, progress):
    name = record.target.name
    progress.update(name, f"round {round_index + 1}/{config.rounds}")
    try:
        result = workers[record.target].request({"cmd": "round", "steps": config.steps})
    except WorkerFailed as failure:
        _drop(record, workers.pop(record.target), failure, progress)
        return
    record.step_times += result["step_times"]
    record.round_times.append(result["step_times"])
    record.losses += result["losses"]
    record.energy_j.append(result["energy_j"])
    median_ms = sorted(result["step_times"])[len(result["step_times"]) // 2] * 1e3
    progress.update(name, f"round {round_index + 1}/{config.rounds}: {median_ms:.2f} ms/step", advance=1)


def finish(record: TargetRecord, workers: dict, progress):
    try:
        record.final = workers[record.target].request({"cmd": "finish"})
    except WorkerFailed as failure:
        _drop(record, workers.pop(record.target), failure, progress)
        return
    record.status = "ok"
    times = sorted(record.step_times)
    progress.update(record.target.name, f"done: {times[len(times) // 2] * 1e3:.3g} ms/step (median)" if times else "done",
                    done=True)


def _drop(record: TargetRecord, worker: Worker, failure: WorkerFailed, progress) -> None:
    record.fail(failure)
    worker.close()
    progress.update(record.target.name, f"[red]failed: {failure.kind}[/red]", done=True)
    return None


def run_bench(config: BenchConfig, console, price_table) -> dict:
    """The whole benchmark: probe, run every target, and return the results (results.summarize)."""
    with console.status("probing this machine (JAX platforms, CUDA, compilers)"):
        try:
            probed = run_probe(config.timeout)
        except WorkerFailed as failure:
            console.print(f"the probe failed ({failure.kind}): {failure.message}", markup=False)
            probed = targets.probe_failed(failure.message)
    runnable, not_run = targets.resolve(config.targets, probed)
    load_before = os.getloadavg()[0]
    probed["machine"]["threads_chosen"] = "--threads" if config.threads else \
        f"the cores left free by a load average of {load_before:.1f}"
    if not config.threads:
        config.threads = choose_threads(probed["machine"]["usable_cores"], load_before)
    with display.ProgressView(console, [t.name for t in runnable], config.rounds) as progress:
        records = run_targets(config, runnable, progress)
    # Other load on the machine makes timings noisy: the report says how busy it was.
    probed["machine"]["load_average"] = {"start": load_before, "end": os.getloadavg()[0]}
    return results.summarize(config, records, not_run, probed, price_table)
