"""torch.optim's fused=True kernels (Adam, AdamW, SGD) on pjrt, against the same kernels on the CPU."""

import importlib
import unittest.mock

import jax
import pytest
import torch

import torchpjrt
from torchpjrt import fusion

CASES = [
    (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1, amsgrad=True, maximize=True)),
    (torch.optim.Adam, dict(lr=0.05, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr="tensor", betas=(0.8, 0.9))),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    (torch.optim.SGD, dict(lr=0.1)),
]


def _train(device, cls, kwargs, dtype, steps=4, scaler=None, inf_at=None):
    torch.manual_seed(0)
    params = [torch.randn(5, 3, dtype=dtype).to(device).requires_grad_(),
              torch.randn(7, dtype=dtype).to(device).requires_grad_()]
    kwargs = {k: torch.tensor(0.05) if v == "tensor" else v for k, v in kwargs.items()}
    opt = cls(params, fused=True, **kwargs)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # lr changes every step
    for step in range(steps):
        opt.zero_grad()
        loss = sum((p.float() ** 2).sum() * (step + 1) for p in params)
        if step == inf_at:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        schedule.step()
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [t.detach().cpu() for t in params + state]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cls,kwargs", CASES, ids=[f"{c.__name__}-{sorted(k)}" for c, k in CASES])
def test_fused_step_matches_cpu(cls, kwargs, dtype):
    expected = _train("cpu", cls, kwargs, dtype)
    got = _train("pjrt", cls, kwargs, dtype)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        if dtype == torch.bfloat16:  # computed in float32 and rounded once, as the CPU kernel does
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_grad_scaler_unscales_in_the_kernel_and_skips_an_inf_step(cls):
    kwargs = dict(lr=0.1, momentum=0.9) if cls is torch.optim.SGD else dict(lr=0.1)
    expected = _train("cpu", cls, kwargs, torch.float32, scaler=torch.amp.GradScaler("cpu", init_scale=256.0),
                      inf_at=1)
    got = _train("pjrt", cls, kwargs, torch.float32, scaler=torch.amp.GradScaler("pjrt", init_scale=256.0),
                 inf_at=1)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_one_call_updates_every_parameter():
    params = [torch.randn(4, device="pjrt", requires_grad=True) for _ in range(6)]
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    sum(p.sum() for p in params).backward()
    opt.step()
    before = torchpjrt.op_stats().get("lowered", 0)
    opt.step()
    # the fused kernel, plus the step counters' increment
    assert torchpjrt.op_stats()["lowered"] - before <= 2


def test_compiled_fused_step_matches_eager():
    def run(compiled):
        torch.manual_seed(0)
        params = [torch.randn(5, 3, device="pjrt", requires_grad=True), torch.randn(7, device="pjrt", requires_grad=True)]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=True)
        step = torch.compile(opt.step, backend="pjrt") if compiled else opt.step
        for i in range(3):
            opt.zero_grad()
            sum((p ** 2).sum() * (i + 1) for p in params).backward()
            step()
        return [p.detach().cpu() for p in params]

    torch._dynamo.reset()
    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", "pjrt"])
def test_integer_parameters_are_refused_as_on_the_cpu(device):
    def ints():
        return [torch.zeros(3, dtype=torch.int64, device=device)]

    steps = [torch.ones((), device=device)]
    with pytest.raises(RuntimeError):
        torch._fused_adamw_(ints(), ints(), ints(), ints(), [], steps, lr=0.1, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)


# ---- hyperparameters that change every step do not recompile -------------------------------

_lowered = [0]  # programs JAX lowered (compiled, or loaded from the persistent cache): every kind


def _on_duration(event, duration, **kwargs):
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _lowered[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _compiles():
    """Eager kernels compiled, fused-mode graphs compiled, and every program JAX lowered."""
    return (torchpjrt.op_stats().get("compiled", 0), torchpjrt.eager_stats()["graphs_compiled"], _lowered[0])


FORMS = [
    # fused kernels
    (torch.optim.AdamW, dict(fused=True, weight_decay=0.1)),
    (torch.optim.Adam, dict(fused=True, weight_decay=0.01, amsgrad=True)),
    (torch.optim.Adam, dict(fused=True, maximize=True)),
    (torch.optim.SGD, dict(fused=True, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(fused=True, momentum=0.9, dampening=0.1, maximize=True)),
    (torch.optim.SGD, dict(fused=True, weight_decay=0.1)),
    (torch.optim.AdamW, dict(fused=True, weight_decay=0.1, lr="tensor")),
    (torch.optim.SGD, dict(fused=True, momentum=0.9, lr="tensor")),
    # foreach (the default on pjrt) and single-tensor
    (torch.optim.AdamW, dict(foreach=True, weight_decay=0.1)),
    (torch.optim.Adam, dict(foreach=True, weight_decay=0.01, amsgrad=True)),
    (torch.optim.SGD, dict(foreach=True, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.AdamW, dict(foreach=False, weight_decay=0.1)),
    (torch.optim.Adam, dict(foreach=False, weight_decay=0.01)),
    (torch.optim.SGD, dict(foreach=False, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (torch.optim.Adam, dict(foreach=False, weight_decay=0.01, lr="tensor")),
    # capturable: step counts and bias corrections on the device
    (torch.optim.AdamW, dict(foreach=True, capturable=True, weight_decay=0.1)),
    (torch.optim.Adam, dict(foreach=False, capturable=True, weight_decay=0.01)),
    (torch.optim.AdamW, dict(foreach=True, capturable=True, weight_decay=0.1, lr="tensor")),
]


def _form_id(cls, kwargs):
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kwargs.items())


def _retune(opt, kwargs, step):
    """What a program may change in param_groups mid-run: weight decay, betas, momentum."""
    for group in opt.param_groups:
        if step == 7:
            if group.get("weight_decay"):
                group["weight_decay"] *= 0.5
            if "betas" in group:
                group["betas"] = (0.85, 0.99)
            if group.get("momentum"):
                group["momentum"] = 0.8
                if group["dampening"]:  # torch.optim's int 0 makes alpha=1 - dampening the static 1
                    group["dampening"] *= 0.5
        if step == 13 and kwargs.get("fused"):
            group["weight_decay"] = 0.0  # a value for the fused kernels (the others skip ops)


def _run(device, cls, kwargs, schedule="lambda", steps=20, after=2):
    """Parameters and state after `steps` steps with an lr that changes every step, and the
    compiles counted from the end of step `after` to the end."""
    torch.manual_seed(0)
    params = [torch.randn(5, 3).to(device).requires_grad_(), torch.randn(7).to(device).requires_grad_()]
    kw = dict(kwargs)
    kw["lr"] = torch.tensor(0.05) if kw.get("lr") == "tensor" else 0.05
    opt = cls(params, **kw)
    if schedule == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.3 * s))
    elif schedule == "step":
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    elif schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    else:  # OneCycleLR cycles Adam's beta1 and SGD's momentum against the lr, every step
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps + 1, cycle_momentum=True)
    before = None
    for step in range(steps):
        opt.zero_grad()
        sum((p ** 2).sum() * (step + 1) for p in params).backward()
        opt.step()
        sched.step()
        if schedule == "lambda":
            _retune(opt, kwargs, step)
        if step + 1 == after and device != "cpu":
            torch.pjrt.synchronize()
            before = _compiles()
    compiles = None
    if device != "cpu":
        torch.pjrt.synchronize()
        compiles = tuple(b - a for a, b in zip(before, _compiles()))
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [t.detach().cpu().float() for t in params + state], compiles


def _settled(mode):
    """Steps after which nothing compiles: the first creates the optimizer's state; in fused
    mode a repeated step's graphs run op by op until their `compile_after`-th sighting."""
    return 2 if mode == "strict" else 1 + fusion.compile_after


def _capturable_on_cpu():
    """torch.optim refuses capturable=True on the CPU only by a device check: lifted, the CPU
    runs the capturable arithmetic (bias corrections in float32 tensors) as a reference."""
    adam = importlib.import_module("torch.optim.adam")  # torch.optim.adam is also a function's name
    devices = adam._get_capturable_supported_devices
    return unittest.mock.patch.object(adam, "_get_capturable_supported_devices",
                                      lambda supports_xla=True: devices(supports_xla) + ["cpu"])


def _on_cpu(cls, kwargs, schedule="lambda"):
    """The same optimizer on the CPU."""
    with _capturable_on_cpu():
        return _run("cpu", cls, kwargs, schedule)[0]


def _assert_matches_cpu(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("cls,kwargs", FORMS, ids=[_form_id(*f) for f in FORMS])
def test_changing_hyperparameters_never_recompile(cls, kwargs, mode):
    expected = _on_cpu(cls, kwargs)
    with torchpjrt.eager_mode(mode):
        got, compiles = _run("pjrt", cls, kwargs, after=_settled(mode))
    # eager kernels, fused graphs, any program: none once the steps repeat
    assert compiles == (0, 0, 0)
    _assert_matches_cpu(got, expected)


SCHEDULES = [
    ("step", torch.optim.AdamW, dict(fused=True, weight_decay=0.1)),
    ("cosine", torch.optim.SGD, dict(fused=True, momentum=0.9)),
    ("onecycle", torch.optim.AdamW, dict(fused=True, weight_decay=0.1)),
    ("onecycle", torch.optim.SGD, dict(fused=True, momentum=0.9, nesterov=True)),
    ("onecycle", torch.optim.Adam, dict(foreach=True)),
    ("onecycle", torch.optim.SGD, dict(foreach=True, momentum=0.9, nesterov=True)),
    ("onecycle", torch.optim.AdamW, dict(foreach=False, capturable=True)),
]


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("schedule,cls,kwargs", SCHEDULES, ids=[f"{s}-{_form_id(c, k)}" for s, c, k in SCHEDULES])
def test_schedulers_never_recompile(schedule, cls, kwargs, mode):
    expected = _on_cpu(cls, kwargs, schedule)
    with torchpjrt.eager_mode(mode):
        got, compiles = _run("pjrt", cls, kwargs, schedule, after=_settled(mode))
    assert compiles == (0, 0, 0)
    _assert_matches_cpu(got, expected)


def test_a_zero_weight_decay_is_a_value_with_the_cpu_kernels_results():
    """A traced weight decay of 0 skips its term as the CPU kernels do: a -0.0 gradient stays
    -0.0 and an infinite parameter does not turn its gradient into NaN."""

    def run(device, op):
        p = torch.tensor([1.0, float("inf"), -2.0, -0.0], device=device)
        g = torch.tensor([-0.0, 1.0, 0.5, -0.0], device=device)
        if op == "sgd":
            torch._fused_sgd_([p], [g], [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=False)
            return [p.cpu(), g.cpu()]
        m, v, step = torch.zeros(4, device=device), torch.zeros(4, device=device), torch.ones((), device=device)
        torch._fused_adam_([p], [g], [m], [v], [], [step], lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0,
                           eps=1e-8, amsgrad=False, maximize=False)
        return [p.cpu(), g.cpu(), m.cpu(), v.cpu()]

    for op in ("sgd", "adam"):
        for a, b in zip(run("pjrt", op), run("cpu", op)):
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
            assert torch.equal(torch.signbit(a), torch.signbit(b))



@pytest.mark.slow
@pytest.mark.parametrize("form", ["fused-float-lr", "capturable-tensor-lr"])
def test_compiled_training_step_with_a_schedule_stops_compiling(form):
    """torch.compile: the fused kernels run as eager calls between Dynamo's graphs (torch.optim
    keeps Dynamo out of them), so a float lr is a traced argument; the foreach forms are traced
    by Dynamo, which guards on a float lr (a recompile per value up to its recompile limit):
    PyTorch's recommendation is lr as a tensor with capturable=True, one graph for every lr."""

    def run(device, steps=12, after=3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(device)
        x = torch.randn(4, 6).to(device)
        if form == "fused-float-lr":
            opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.05), weight_decay=0.1, foreach=True,
                                    capturable=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.3 * s))

        def opt_step():  # PyTorch's recipe: the step and the schedule in one compiled function
            opt.step()
            sched.step()

        forward, opt_step = (torch.compile(model, backend="pjrt"), torch.compile(opt_step, backend="pjrt")) \
            if device == "pjrt" else (model, opt_step)
        for i in range(steps):
            opt.zero_grad()
            forward(x).square().mean().backward()
            opt_step()
            if i + 1 == after and device == "pjrt":
                torch.pjrt.synchronize()
                s = torchpjrt.compile_stats()
                before = (s["graphs"], s["xla_compiles"]) + _compiles()
        counts = None
        if device == "pjrt":
            torch.pjrt.synchronize()
            s = torchpjrt.compile_stats()
            counts = tuple(b - a for a, b in zip(before, (s["graphs"], s["xla_compiles"]) + _compiles()))
        return [p.detach().cpu() for p in model.parameters()], counts

    with _capturable_on_cpu():
        expected, _ = run("cpu")
    torch._dynamo.reset()
    got, counts = run("pjrt")
    # Dynamo graphs, their XLA programs, eager kernels, fused graphs, any program: none after step 3
    assert counts == (0, 0, 0, 0, 0)
    _assert_matches_cpu(got, expected)


@pytest.mark.slow  # transformers' Trainer in the loop
def test_trainer_default_optimizer_with_a_linear_schedule_stops_compiling(tmp_path, monkeypatch):
    """transformers' Trainer with its default optimizer (adamw_torch_fused) and a linear warm-up
    and decay: a new lr every step, no compile after the second."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 2)

        def forward(self, x, labels=None):
            logits = self.lin(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return {"x": torch.randn(8, generator=torch.Generator().manual_seed(i)), "labels": torch.tensor(i % 2)}

    class Count(transformers.TrainerCallback):
        def __init__(self):
            self.lrs, self.before = [], None

        def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
            self.lrs.append(lr_scheduler.get_last_lr()[0])
            if state.global_step == 2:
                torch.pjrt.synchronize()
                self.before = _compiles()

    def train(device):
        # accelerate keeps its device in process-wide state: each run (and the tests after) starts afresh
        accelerate_state = importlib.import_module("accelerate.state")
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        try:
            return _train(device)
        finally:
            accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)

    def _train(device):
        torch.manual_seed(0)
        kwargs = dict(output_dir=str(tmp_path / device), per_device_train_batch_size=8, max_steps=12,
                      learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=3, logging_strategy="no",
                      save_strategy="no", report_to=[], dataloader_pin_memory=False, seed=0)
        args = transformers.TrainingArguments(use_cpu=device == "cpu", **kwargs)
        assert args.device.type == device
        assert args.optim == "adamw_torch_fused"
        count = Count()
        trainer = transformers.Trainer(model=Tiny().to(device), args=args, train_dataset=Data(), callbacks=[count])
        trainer.train()
        torch.pjrt.synchronize()
        params = [p.detach().cpu() for p in trainer.model.parameters()]
        return params, count

    expected, _ = train("cpu")
    # TrainingArguments falls back to ACCELERATE_TORCH_DEVICE for a backend it does not know
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "pjrt")
    got, count = train("pjrt")
    assert len(count.lrs) == 12 and all(a != b for a, b in zip(count.lrs, count.lrs[1:]))  # a new lr every step
    assert tuple(b - a for a, b in zip(count.before, _compiles())) == (0, 0, 0)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
