"""torch.optim's fused=True kernels (Adam, AdamW, SGD) on pjrt, against the same kernels on the CPU."""

import pytest
import torch

import torchpjrt

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
