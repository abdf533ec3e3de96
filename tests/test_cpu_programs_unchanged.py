"""Installing torchpjrt leaves CPU programs as they are, and accelerator-generic code works on pjrt.

`import torch` autoloads the package, so pjrt is `torch.accelerator.current_accelerator()` in
every process, also in programs that never name it. Those programs (a pinned DataLoader, HF
Trainer with use_cpu=True, accelerate with cpu=True) run here in fresh processes with autoload
on and off (TORCH_DEVICE_BACKEND_AUTOLOAD=0, stock PyTorch) and must give the same results,
exception types and warnings. Where stock PyTorch raises for want of an accelerator and pjrt
now answers, the answer is pjrt's own and is checked as such.
"""

import functools
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections import OrderedDict

import pytest
import torch

import torchpjrt.accelerator as pjrt_accelerator

NO_ACCELERATOR = "Cannot access accelerator device when none is available"

MEMORY_FUNCTIONS = ["memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"]


def _run(code: str, autoload: bool = True, env: dict | None = None, cwd=None) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    if not autoload:
        full_env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=600, env=full_env, cwd=cwd or os.path.dirname(__file__))
    assert r.returncode == 0, f"autoload={autoload}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


_RECORD = """
import json, warnings, torch
out = {}

def plain(v):
    if isinstance(v, torch.Tensor):
        return {"tensor": v.tolist(), "pinned": v.is_pinned()}
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)

def record(name, fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            res = {"value": plain(fn())}
        except Exception as e:
            res = {"raises": type(e).__name__, "message": str(e)}
    res["warnings"] = [[x.category.__name__, str(x.message)] for x in w]
    out[name] = res
"""

CPU_PROGRAM = _RECORD + """
class DS(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return {"x": torch.full((3,), float(i)), "y": i}

for nw in (0, 2):
    record(f"dataloader_{nw}", lambda: list(torch.utils.data.DataLoader(
        DS(), batch_size=4, pin_memory=True, num_workers=nw)))
t = torch.arange(4.0)
record("is_pinned", lambda: t.is_pinned())
record("pin_memory", lambda: t.pin_memory())
A = torch.accelerator
for name in ("synchronize", "empty_cache", "empty_host_cache", "memory_stats", "memory_allocated",
             "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
             "reset_accumulated_memory_stats", "get_memory_info"):
    record(f"accelerator.{name}", getattr(A, name))
    if hasattr(A.memory, name):
        record(f"accelerator.memory.{name}", getattr(A.memory, name))
record("accelerator.synchronize(0)", lambda: A.synchronize(0))
if hasattr(torch, "pjrt"):
    for name in ("memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "mem_get_info"):
        record(f"pjrt.{name}", getattr(torch.pjrt, name))
print(json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def _cpu_program(autoload: bool) -> dict:
    return _run(CPU_PROGRAM, autoload)


def _pinned_warnings(ws):
    return [w for w in ws if w[0] == "UserWarning" and "pinned" in w[1]]


# ---- CPU programs in fresh processes: the same with and without the package ---------------


@pytest.mark.slow  # two fresh processes
def test_pinned_dataloader_is_unchanged():
    stock, ours = _cpu_program(False), _cpu_program(True)
    for nw in (0, 2):
        s, o = stock[f"dataloader_{nw}"], ours[f"dataloader_{nw}"]
        assert "raises" not in s and "raises" not in o, (s, o)
        assert o["value"] == s["value"], nw  # the same batches, all of them unpinned
        assert all(not b["x"]["pinned"] for b in o["value"])
        # stock warns that pinned memory won't be used; so do we, once per process (and
        # nothing else: no JAX "os.fork() was called" warning when the workers fork)
        assert _pinned_warnings(s["warnings"]) == s["warnings"] and s["warnings"], s
        assert _pinned_warnings(o["warnings"]) == o["warnings"], o
    assert len(ours["dataloader_0"]["warnings"]) == 1
    assert ours["dataloader_2"]["warnings"] == []  # the one-time warning came already


@pytest.mark.slow  # two fresh processes
def test_pin_memory_and_is_pinned():
    stock, ours = _cpu_program(False), _cpu_program(True)
    assert stock["is_pinned"] == ours["is_pinned"] == {"value": False, "warnings": []}
    # without an accelerator PyTorch refuses to pin; pjrt is an accelerator without pinned host
    # memory, so the tensor stays in pageable memory, as the DataLoader's batches do
    assert stock["pin_memory"]["raises"] == "RuntimeError" and NO_ACCELERATOR in stock["pin_memory"]["message"]
    assert ours["pin_memory"]["value"] == {"tensor": [0.0, 1.0, 2.0, 3.0], "pinned": False}


@pytest.mark.slow  # two fresh processes
def test_accelerator_functions_answer_for_pjrt():
    stock, ours = _cpu_program(False), _cpu_program(True)
    names = [k for k in stock if k.startswith("accelerator.")]
    assert len(names) == 22
    for name in names:
        # stock: no accelerator; ours: pjrt's answer, never PyTorch's C++ allocator assert
        assert stock[name]["raises"] == "RuntimeError" and NO_ACCELERATOR in stock[name]["message"], name
        # the only warning: a runtime that keeps a peak cannot reset it (none on the CPU platform)
        assert all("cannot be reset" in w[1] for w in ours[name]["warnings"]), (name, ours[name])
        short = name.split(".")[-1]
        if short == "get_memory_info":
            expected = ours["pjrt.mem_get_info"]
        elif f"pjrt.{short}" in ours:
            expected = ours[f"pjrt.{short}"]
        else:
            expected = {"value": None, "warnings": []}
        assert {k: v for k, v in ours[name].items() if k != "warnings"} == \
            {k: v for k, v in expected.items() if k != "warnings"}, (name, ours[name], expected)


TRAINER_PROGRAM = _RECORD + """
import sys, tempfile
from torch import nn
from transformers import Trainer, TrainingArguments

class DS(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": x.sum(0, keepdim=True)}

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)
    def forward(self, x, labels=None):
        y = self.l(x)
        return {"loss": nn.functional.mse_loss(y, labels), "logits": y}

torch.manual_seed(0)
m = M()
def train():
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, use_cpu=sys.argv[1] == "cpu", max_steps=3,
                                 per_device_train_batch_size=4, report_to=[], save_strategy="no",
                                 logging_steps=1, disable_tqdm=True)
        tr = Trainer(model=m, args=args, train_dataset=DS())
        tr.train()
        return {"losses": [h["loss"] for h in tr.state.log_history if "loss" in h],
                "device": str(next(m.parameters()).device),
                "weight": m.l.weight.detach().cpu().tolist()}
record("train", train)
if sys.argv[1] == "pjrt":
    record("accelerator.memory_allocated", lambda: torch.accelerator.memory_allocated())
    record("pjrt.memory_allocated", lambda: torch.pjrt.memory_allocated())
print(json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def _trainer(autoload: bool, where: str) -> dict:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    # transformers' TrainingArguments picks its device from a fixed list of backends and falls
    # back to ACCELERATE_TORCH_DEVICE; accelerate picks the current accelerator. Both must
    # name pjrt, or the model and the batches land on different devices.
    env = {"ACCELERATE_TORCH_DEVICE": "pjrt"} if where == "pjrt" else {}
    code = f"import sys; sys.argv[1:] = [{where!r}]\n" + TRAINER_PROGRAM
    return _run(code, autoload, env)


def _warnings_alike(stock, ours):
    """The same warnings, except the DataLoader's pinned-memory one, whose text names pjrt."""
    other = lambda ws: [w for w in ws if not _pinned_warnings([w])]  # noqa: E731
    assert other(ours) == other(stock), (stock, ours)
    assert len(_pinned_warnings(ours)) <= max(1, len(_pinned_warnings(stock)))


@pytest.mark.slow  # two fresh processes, each training a few steps
def test_trainer_use_cpu_is_unchanged():
    stock, ours = _trainer(False, "cpu"), _trainer(True, "cpu")
    assert "raises" not in stock["train"], stock["train"]
    assert "raises" not in ours["train"], ours["train"]
    assert ours["train"]["value"] == stock["train"]["value"]  # bit for bit: the same CPU run
    assert ours["train"]["value"]["device"] == "cpu"
    _warnings_alike(stock["train"]["warnings"], ours["train"]["warnings"])


@pytest.mark.slow  # two fresh processes
def test_trainer_on_pjrt():
    cpu, ours = _trainer(False, "cpu"), _trainer(True, "pjrt")
    assert "raises" not in ours["train"], ours["train"]
    got, want = ours["train"]["value"], cpu["train"]["value"]
    assert got["device"] == "pjrt:0"
    assert len(got["losses"]) == 3
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got["weight"]), torch.tensor(want["weight"]), rtol=1e-5, atol=1e-6)
    assert ours["accelerator.memory_allocated"]["value"] == ours["pjrt.memory_allocated"]["value"]


ACCELERATE_PROGRAM = _RECORD + """
import sys
from torch import nn
from accelerate import Accelerator
from accelerate.utils import release_memory

def train():
    torch.manual_seed(0)
    acc = Accelerator(cpu=sys.argv[1] == "cpu")
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = torch.randn(16, 4)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, xs.sum(1, keepdim=True)),
                                     batch_size=4, pin_memory=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    losses = []
    for x, y in dl:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        losses.append(loss.item())
    acc.wait_for_everyone()
    device = str(next(model.parameters()).device)
    release_memory(model)  # gc and the accelerator's empty_cache()
    return {"losses": losses, "device": device}
record("train", train)
print(json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def _accelerate(autoload: bool, where: str) -> dict:
    pytest.importorskip("accelerate")
    return _run(f"import sys; sys.argv[1:] = [{where!r}]\n" + ACCELERATE_PROGRAM, autoload)


@pytest.mark.slow  # two fresh processes
def test_accelerate_cpu_is_unchanged():
    stock, ours = _accelerate(False, "cpu"), _accelerate(True, "cpu")
    assert "raises" not in stock["train"], stock["train"]
    assert "raises" not in ours["train"], ours["train"]
    assert ours["train"]["value"] == stock["train"]["value"]
    assert ours["train"]["value"]["device"] == "cpu"
    _warnings_alike(stock["train"]["warnings"], ours["train"]["warnings"])


@pytest.mark.slow  # two fresh processes
def test_accelerate_on_pjrt():
    cpu, ours = _accelerate(False, "cpu"), _accelerate(True, "pjrt")
    assert "raises" not in ours["train"], ours["train"]
    assert ours["train"]["value"]["device"] == "pjrt:0"
    torch.testing.assert_close(torch.tensor(ours["train"]["value"]["losses"]),
                               torch.tensor(cpu["train"]["value"]["losses"]), rtol=1e-5, atol=1e-6)


# ---- pjrt programs, in this process -------------------------------------------------------


def test_accelerator_memory_equals_torch_pjrt():
    x = torch.randn(256, 256, device="pjrt") @ torch.randn(256, 256, device="pjrt")
    torch.accelerator.synchronize()
    for name in MEMORY_FUNCTIONS:
        want = getattr(torch.pjrt, name)()
        for fn in (getattr(torch.accelerator, name), getattr(torch.accelerator.memory, name)):
            for arg in ((), (0,), ("pjrt",), ("pjrt:0",), (torch.device("pjrt", 0),)):
                assert fn(*arg) == want, (name, arg)
    stats = torch.accelerator.memory_stats()
    assert isinstance(stats, OrderedDict) and stats == OrderedDict(sorted(torch.pjrt.memory_stats().items()))
    if "bytes_limit" in torch.pjrt.memory_stats():
        assert torch.accelerator.get_memory_info() == torch.pjrt.mem_get_info()
    else:  # the runtime says nothing about its limit (the CPU platform)
        with pytest.raises(RuntimeError, match="reports no memory limit"):
            torch.accelerator.get_memory_info()
    del x


def test_accelerator_synchronize_and_caches():
    y = (torch.ones(64, device="pjrt") * 3).sum()
    for arg in ((), (0,), ("pjrt:0",), (torch.device("pjrt"),)):
        assert torch.accelerator.synchronize(*arg) is None
    assert y.item() == 192.0
    torch.accelerator.empty_cache()
    torch.accelerator.empty_host_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # where the runtime keeps a peak it cannot reset
        torch.accelerator.reset_peak_memory_stats()
        torch.accelerator.reset_accumulated_memory_stats()
    # PyTorch's own argument check: a device of another type is refused
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        torch.accelerator.synchronize("cpu")
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        torch.accelerator.memory_allocated("cpu")


def test_pin_memory_stays_pageable_with_one_warning(monkeypatch):
    monkeypatch.setattr(pjrt_accelerator, "_warned_pin", False)
    t = torch.arange(6.0).reshape(2, 3)
    with pytest.warns(UserWarning, match="pjrt has no pinned"):
        p = t.pin_memory()
    assert p is t and not p.is_pinned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.ones(2).pin_memory().tolist() == [1.0, 1.0]  # warned once only
        batches = list(torch.utils.data.DataLoader(torch.arange(8.0), batch_size=4, pin_memory=True))
    assert [b.tolist() for b in batches] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert not any(b.is_pinned() for b in batches)
    assert batches[1].to("pjrt", non_blocking=True).cpu().tolist() == [4.0, 5.0, 6.0, 7.0]
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        torch.ones(2, device="pjrt").pin_memory()  # PyTorch's own refusal


def test_other_accelerators_reach_pytorchs_own_functions(monkeypatch):
    """The routing answers for pjrt only; otherwise PyTorch's function runs, arguments untouched."""
    assert torch.accelerator.empty_cache.__wrapped__ is pjrt_accelerator._original["empty_cache"]
    monkeypatch.setattr(pjrt_accelerator, "_current_is_pjrt", lambda: False)
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_isAllocatorInitialized", lambda: calls.append("init") or False)
    assert torch.accelerator.empty_cache() is None and calls == ["init"]  # stock empty_cache ran
    assert torch.accelerator.memory_stats() == OrderedDict() and calls == ["init", "init"]
    monkeypatch.setitem(pjrt_accelerator._original, "pin_memory",
                        lambda self, *a, **k: calls.append(("pin", a, k)) or "stock")
    t = torch.ones(2)
    assert t.pin_memory() == "stock" and calls[-1] == ("pin", (), {})
    assert t.pin_memory(device="cpu") == "stock" and calls[-1] == ("pin", (), {"device": "cpu"})
