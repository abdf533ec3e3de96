"""Several Python threads using pjrt tensors at once: independent training loops and readers of
shared weights give the same results as one thread would, in each eager mode and compiled."""

import threading

import pytest
import torch

import torchpjrt

DEV = "pjrt"
THREADS = 4
STEPS = 15


def run_in_threads(fn, n=THREADS):
    """fn(i) in n threads started together; their results, or the first exception raised."""
    barrier = threading.Barrier(n)
    results, errors = [None] * n, []

    def target(i):
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    if errors:
        raise errors[0]
    return results


def make_model(seed):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(32, 8, generator=g)
    y = torch.randn(32, 4, generator=g)
    return model, x, y


def train(seed, device, compiled=False, steps=STEPS):
    """Losses of a small SGD training loop whose data and weights depend on `seed`."""
    model, x, y = make_model(seed)
    model.to(device)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    forward = torch.compile(model, backend="pjrt") if compiled else model
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in torch.stack(losses).cpu()], [p.detach().cpu() for p in model.parameters()]


@pytest.fixture(scope="module")
def cpu_runs():
    return [train(seed, "cpu") for seed in range(THREADS)]


def check_against_cpu(results, cpu_runs):
    for (losses, params), (cpu_losses, cpu_params) in zip(results, cpu_runs):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-5)
        for p, c in zip(params, cpu_params):
            torch.testing.assert_close(p, c, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
def test_independent_training_loops(mode, cpu_runs):
    with torchpjrt.eager_mode(mode):
        results = run_in_threads(lambda i: train(i, DEV))
    check_against_cpu(results, cpu_runs)


def test_independent_compiled_training_loops(cpu_runs):
    train(0, DEV, compiled=True, steps=2)  # Dynamo compiles once here; the threads reuse it
    results = run_in_threads(lambda i: train(i, DEV, compiled=True))
    check_against_cpu(results, cpu_runs)


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
def test_shared_read_only_weights(mode):
    model, _, _ = make_model(7)
    inputs = [torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + i)) for i in range(THREADS)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    model.to(DEV)
    weights_before = [p.detach().cpu().clone() for p in model.parameters()]

    def infer(i):
        x = inputs[i].to(DEV)
        with torch.no_grad():
            outs = [model(x) for _ in range(10)]
            views = [model[0].weight[:, :4].sum() for _ in range(10)]  # views of the shared weights
        return outs[-1].cpu(), torch.stack(views).cpu()

    with torchpjrt.eager_mode(mode):
        results = run_in_threads(infer)
    for (out, views), e in zip(results, expected):
        torch.testing.assert_close(out, e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(views, weights_before[0][:, :4].sum().expand(10), rtol=1e-5, atol=1e-5)
    for p, before in zip(model.parameters(), weights_before):
        torch.testing.assert_close(p.detach().cpu(), before, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_random_numbers_are_not_repeated_across_threads(mode):
    torch.pjrt.manual_seed(0)
    with torchpjrt.eager_mode(mode):
        draws = run_in_threads(lambda i: torch.stack([torch.rand(64, device=DEV) for _ in range(20)]).cpu())
    rows = torch.cat(draws)
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]  # every op got its own offset


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_each_thread_writes_its_own_tensors(mode):
    """In-place writes through views in parallel: each thread's storage ends as it would alone."""
    def work(i):
        t = torch.zeros(8, 8, dtype=torch.float64, device=DEV)
        for k in range(30):
            t[:, i].add_(1)
            t[i].mul_(1.5).add_(k)
            t.diagonal().add_(t[i, 0].item() % 7)
        return t.cpu()

    def reference(i):
        t = torch.zeros(8, 8, dtype=torch.float64)
        for k in range(30):
            t[:, i].add_(1)
            t[i].mul_(1.5).add_(k)
            t.diagonal().add_(t[i, 0].item() % 7)
        return t

    with torchpjrt.eager_mode(mode):
        results = run_in_threads(work)
    for i, r in enumerate(results):
        torch.testing.assert_close(r, reference(i))


_BACKWARD_THREAD_PROGRAM = """
import threading, torch, torchpjrt
x = torch.ones(4, device="pjrt", requires_grad=True)
seen = []
y = x * 3.0
y.register_hook(lambda g: seen.append(threading.get_ident() == threading.main_thread().ident))
(y * y).sum().backward()
print(seen[0], x.grad.cpu().tolist())
"""


@pytest.mark.slow  # fresh processes
@pytest.mark.parametrize("setting, on_main", [(None, True), ("device", False)])
def test_backward_runs_on_the_calling_thread_unless_asked_otherwise(setting, on_main):
    """By default the loading thread's backward runs where it is called (no hand-off to the
    autograd engine's device worker); TORCHPJRT_BACKWARD_THREAD=device keeps the worker. The
    gradients are the same either way."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("TORCHPJRT_BACKWARD_THREAD", None)
    if setting is not None:
        env["TORCHPJRT_BACKWARD_THREAD"] = setting
    out = subprocess.run([sys.executable, "-c", _BACKWARD_THREAD_PROGRAM], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == str(on_main)
    assert "[18.0, 18.0, 18.0, 18.0]" in out.stdout


@pytest.mark.slow  # a fresh process
def test_an_unknown_backward_thread_setting_is_refused():
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHPJRT_BACKWARD_THREAD="gpu")
    out = subprocess.run([sys.executable, "-c", "import torch, torchpjrt"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0
    assert "TORCHPJRT_BACKWARD_THREAD='gpu'" in out.stderr and "'caller' or 'device'" in out.stderr
