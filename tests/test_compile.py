"""torch.compile(backend="pjrt"): graphs built from the lowering table, compiled by XLA."""

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchpjrt.compile import compile_stats


def test_compiled_training_step_matches_cpu():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    ref = copy.deepcopy(model)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    dev = model.to("pjrt")
    compiled = torch.compile(dev, backend="pjrt")
    before = compile_stats().get("graphs", 0)
    loss = F.cross_entropy(compiled(x.to("pjrt")), y.to("pjrt"))
    loss.backward()
    assert compile_stats()["graphs"] >= before + 2  # forward and backward
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(ref.parameters(), dev.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-4, atol=1e-6)


def test_default_backend_compiles_pjrt_graphs_through_xla(monkeypatch):
    """torch.compile(model) without a backend: inductor cannot compile pjrt tensors (it failed on
    var_mean); the graph goes to the pjrt backend, training included."""
    from torchpjrt.compile import default_backend

    monkeypatch.setattr(default_backend, "_warned", False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    ref = copy.deepcopy(model)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    dev = model.to("pjrt")
    before = compile_stats().get("graphs", 0)
    loss = F.cross_entropy(torch.compile(dev)(x.to("pjrt")), y.to("pjrt"))
    loss.backward()
    assert compile_stats()["graphs"] >= before + 2
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(ref.parameters(), dev.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-4, atol=1e-6)
    with pytest.warns(UserWarning, match="inductor's mode and options are ignored"):
        out = torch.compile(dev, mode="max-autotune")(x.to("pjrt"))
    torch.testing.assert_close(out.detach().cpu(), ref(x).detach(), rtol=1e-5, atol=1e-6)


def test_default_backend_keeps_inductor_for_cpu_graphs():
    from torchpjrt.compile import default_backend

    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert not default_backend._on_pjrt(gm, [torch.ones(2, 2)])
    assert default_backend._on_pjrt(gm, [torch.ones(2, 2, device="pjrt")])


@pytest.mark.slow  # a fresh process
def test_backend_is_found_without_importing_torchpjrt():
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: (x * 2).sum(), backend='pjrt')\n"
        "import torchpjrt\n"
        "print(f(torch.ones(3, device='pjrt')).item())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("6.0")


CACHED_RUN = r"""
import json, torch, torch.nn as nn, torchpjrt
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to("pjrt")
# torch.tensor inside the graph becomes a lifted constant: it must survive the graph cache
step = torch.compile(lambda x: (model(x) * torch.tensor([1.0, 2.0], device="pjrt")).square().mean(),
                     backend="pjrt")
loss = step(torch.arange(32.0, device="pjrt").reshape(4, 8) / 32)
loss.backward()

@torch.compile(backend="pjrt", options={"donate": True})
def update(p, g):
    p.sub_(0.5 * g)

p = torch.ones(1000, device="pjrt")
for _ in range(2):
    update(p, torch.full((1000,), 2.0, device="pjrt"))

# bucketed graphs are not stored: each process compiles them again
summed = torch.compile(lambda x: x.sum(1), backend="pjrt", dynamic=True, options={"buckets": [8, 16]})
total = summed(torch.ones(2, 5, device="pjrt"))
s = torchpjrt.compile_stats()
print(json.dumps({**{k: s[k] for k in ("persistent_cache_dir", "persistent_cache_hits", "persistent_cache_misses",
                                       "graph_cache_hits", "donated_buffers")},
                  "loss": loss.item(), "grad": model[0].weight.grad.sum().item(), "p": p[0].item(),
                  "total": total.cpu().tolist()}))
"""


@pytest.mark.slow  # three fresh processes
def test_a_second_process_loads_graphs_and_programs_from_the_persistent_cache(tmp_path):
    import json
    import os

    env = {**os.environ, "TORCHPJRT_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", CACHED_RUN], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["persistent_cache_dir"] == str(tmp_path / "cache")
    assert cold["persistent_cache_hits"] == 0 and cold["persistent_cache_misses"] > 0
    # every program the second process runs comes from the cache (it runs fewer: no tracing)
    assert warm["persistent_cache_hits"] > 0 and warm["persistent_cache_misses"] == 0
    # forward and backward of the training step, and the update: AOTAutograd skipped
    assert cold["graph_cache_hits"] == 0 and warm["graph_cache_hits"] == 3
    for key in ("loss", "grad", "p", "total", "donated_buffers"):
        assert warm[key] == cold[key], key
    assert cold["p"] == -1.0 and cold["total"] == [5.0, 5.0] and cold["donated_buffers"] >= 1
    off = subprocess.run([sys.executable, "-c", CACHED_RUN], capture_output=True, text=True, timeout=300,
                         env={**env, "TORCHPJRT_CACHE_DIR": "off"})
    off_stats = json.loads(off.stdout.strip().splitlines()[-1])
    assert off_stats["persistent_cache_dir"] is None and off_stats["graph_cache_hits"] == 0


PRECOMPILE = r"""
import json, sys, torch, torch.nn as nn, torchpjrt
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2)).to("pjrt")
x = torch.linspace(-1, 1, 32, device="pjrt").reshape(4, 8)

def loss_fn(model, x):
    return model(x).square().mean()

if sys.argv[1] == "save":
    compiled = torch.compile(loss_fn, backend="pjrt", fullgraph=True).aot_compile(((model, x), {}))
    compiled.save_compiled_function(sys.argv[2])
else:
    with open(sys.argv[2], "rb") as f:
        compiled = torch.compiler.load_compiled_function(f)
loss = compiled(model, x)
loss.backward()
s = torchpjrt.compile_stats()
print(json.dumps({"loss": loss.item(), "grad": model[0].weight.grad.sum().item(),
                  "eager": loss_fn(model, x).item(), "graphs": s["graphs"], "graph_cache_hits": s["graph_cache_hits"]}))
"""


@pytest.mark.slow  # two fresh processes
def test_torch_precompile_saves_and_loads_a_pjrt_training_graph(tmp_path):
    """torch.compile(...).aot_compile + save_compiled_function: a new process skips Dynamo too."""
    import json
    import os

    env = {**os.environ, "TORCHPJRT_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for what in ("save", "load"):
        r = subprocess.run([sys.executable, "-c", PRECOMPILE, what, str(tmp_path / "loss.pt2")], capture_output=True,
                           text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    saved, loaded = runs
    assert loaded["loss"] == saved["loss"] == saved["eager"]
    assert loaded["grad"] == saved["grad"]
    assert saved["graphs"] == 2 and loaded["graph_cache_hits"] == 2  # forward and backward restored


def _compile_models():
    torch.manual_seed(0)

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.conv2, self.fc = nn.Conv2d(8, 8, 3, stride=2), nn.Linear(8, 4)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
            return self.fc(F.silu(self.conv2(x)).mean((2, 3)))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(32, 4)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)).mean(1))

    return {
        "mlp": (nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)), torch.randn(16, 8)),
        "cnn": (CNN(), torch.randn(4, 3, 12, 12)),
        "transformer": (Transformer(), torch.randint(0, 50, (4, 10))),
    }




@pytest.mark.parametrize("name", ["mlp", pytest.param("cnn", marks=pytest.mark.slow), pytest.param("transformer", marks=pytest.mark.slow)])
def test_compiled_outputs_and_gradients_match_eager_and_cpu(name):
    torch._dynamo.reset()
    model, x = _compile_models()[name]
    y = torch.randint(0, 4, (x.shape[0],))
    results = {}
    for target in ("cpu", "eager", "compiled"):
        m = copy.deepcopy(model)
        dev = "cpu" if target == "cpu" else "pjrt"
        m = m.to(dev)
        run = torch.compile(m, backend="pjrt") if target == "compiled" else m
        out = run(x.to(dev))
        F.cross_entropy(out, y.to(dev)).backward()
        results[target] = (out.detach().cpu(), [p.grad.cpu() for p in m.parameters()])
    for target in ("eager", "compiled"):
        out, grads = results[target]
        torch.testing.assert_close(out, results["cpu"][0], rtol=1e-4, atol=1e-5)
        for g, r in zip(grads, results["cpu"][1]):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    assert compile_stats().get("eager_graphs", 0) == 0  # every graph became one XLA program


def test_a_compiled_training_loop_matches_cpu_losses():
    torch._dynamo.reset()
    model, x = _compile_models()["cnn"]
    y = torch.randint(0, 4, (x.shape[0],))

    def train(m, dev, compiled):
        m = m.to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        run = torch.compile(m, backend="pjrt") if compiled else m
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = F.cross_entropy(run(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    reference = train(copy.deepcopy(model), "cpu", False)
    compiled = train(copy.deepcopy(model), "pjrt", True)
    torch.testing.assert_close(compiled, reference, rtol=1e-4, atol=0)


def test_a_new_batch_size_recompiles_with_its_reason():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to("pjrt")
    run = torch.compile(model, backend="pjrt", dynamic=False)
    run(torch.randn(4, 8, device="pjrt"))
    before = compile_stats()
    run(torch.randn(4, 8, device="pjrt"))
    assert compile_stats()["graphs"] == before["graphs"]  # same shapes: cached
    run(torch.randn(6, 8, device="pjrt"))
    after = compile_stats()
    # the forward and the backward compiled with it (AOTAutograd lowers both up front)
    new_reasons = after["recompile_reasons"][len(before["recompile_reasons"]):]
    assert after["recompiles"] == before["recompiles"] + len(new_reasons)
    assert new_reasons[0] == "input 2: (4, 8) -> (6, 8)"


def test_modes_are_accepted_and_bad_options_are_clear_errors():
    torch._dynamo.reset()
    x = torch.ones(3, device="pjrt")
    assert torch.compile(lambda a: a * 2, backend="pjrt", mode="max-autotune")(x).cpu().tolist() == [2.0] * 3
    bad = [({"donat": True}, "unknown torch.compile option\\(s\\) \\['donat'\\]"),
           ({"donate": "yes"}, "option 'donate' must be True or False"),
           ({"buckets": [16, 8]}, "option 'buckets' must be .*strictly increasing"),
           ({"buckets": "fib"}, "option 'buckets' must be 'pow2'"),
           ({"buckets": [0]}, "option 'buckets' must be")]
    for options, message in bad:
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(lambda a: a * 3, backend="pjrt", options=options)(x)


def _sgd_step(params, grads):
    for p, g in zip(params, grads):
        p.sub_(0.5 * g)


def test_donated_parameter_updates_are_correct_and_counted():
    torch._dynamo.reset()
    params = [torch.randn(5, device="pjrt") for _ in range(3)]
    grads = [torch.randn(5, device="pjrt") for _ in range(3)]
    expected = [p.cpu() - 0.5 * g.cpu() for p, g in zip(params, grads)]
    before = compile_stats()
    step = torch.compile(_sgd_step, backend="pjrt", options={"donate": True})
    step(params, grads)
    after = compile_stats()
    assert after["donatable_inputs"] - before["donatable_inputs"] == 3
    assert after["donated_buffers"] - before["donated_buffers"] == 3
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.cpu(), e)
    step(params, grads)  # the new buffers are donated again
    assert compile_stats()["donated_buffers"] - before["donated_buffers"] == 6
    for p, e, g in zip(params, expected, grads):
        torch.testing.assert_close(p.cpu(), e - 0.5 * g.cpu())


def test_an_array_shared_with_another_tensor_is_not_donated():
    from torchpjrt import storage

    torch._dynamo.reset()
    params = [torch.randn(5, device="pjrt") for _ in range(2)]
    grads = [torch.ones(5, device="pjrt") for _ in range(2)]
    copy_of_first = torch.empty(5, device="pjrt")
    copy_of_first.copy_(params[0])  # a copy that shares the first parameter's array
    assert storage.storage_of(copy_of_first).array is storage.storage_of(params[0]).array
    kept = copy_of_first.cpu()
    view_of_second = params[1][1:]  # a view shares the storage: it must see the update
    before = compile_stats()
    torch.compile(_sgd_step, backend="pjrt", options={"donate": True})(params, grads)
    after = compile_stats()
    assert after["donated_buffers"] - before["donated_buffers"] == 1
    assert after["donation_declined"] - before["donation_declined"] == 1
    assert torch.equal(copy_of_first.cpu(), kept)  # still readable, still the old value
    torch.testing.assert_close(params[0].cpu(), kept - 0.5)
    torch.testing.assert_close(view_of_second.cpu(), params[1].cpu()[1:])


def test_without_the_option_nothing_is_donated():
    torch._dynamo.reset()
    params, grads = [torch.randn(4, device="pjrt")], [torch.ones(4, device="pjrt")]
    before = compile_stats()
    torch.compile(_sgd_step, backend="pjrt")(params, grads)
    assert compile_stats()["donated_buffers"] == before["donated_buffers"]


class _TinyTransformer(nn.Module):
    """Embedding, one attention layer with a padding mask, layer norm, mean-pooled loss."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, tokens, mask):
        h = self.embed(tokens)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(~mask[:, None, :], float("-inf"))
        h = self.norm(h + scores.softmax(-1) @ v)
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1)).square().mean()


def _train_steps(model, lengths, **compile_kwargs):
    torch.manual_seed(1)
    run = torch.compile(model, backend="pjrt", **compile_kwargs)
    losses, grads = [], []
    for n in lengths:
        tokens = torch.randint(0, 50, (3, n))
        mask = torch.ones(3, n, dtype=torch.bool)
        mask[0, n - 2:] = False
        model.zero_grad()
        loss = run(tokens.to("pjrt"), mask.to("pjrt"))
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.cpu() for p in model.parameters()])
    return losses, grads


@pytest.mark.slow  # about 12 s: six compiles of a training step without buckets
def test_buckets_match_the_unbucketed_run_and_compile_once_per_bucket():
    lengths = (5, 7, 11, 6)
    torch.manual_seed(0)
    model = _TinyTransformer().to("pjrt")
    runs = {}
    for name, options in (("exact", None), ("buckets", {"buckets": [8, 16]})):
        torch._dynamo.reset()
        before = compile_stats()
        runs[name] = _train_steps(copy.deepcopy(model), lengths, dynamic=True, options=options)
        after = compile_stats()
        runs[name] += (after["xla_compiles"] - before["xla_compiles"],
                       after["bucketed_graphs"] - before["bucketed_graphs"])
    exact_losses, exact_grads, exact_compiles, _ = runs["exact"]
    losses, grads, compiles, bucketed = runs["buckets"]
    torch.testing.assert_close(losses, exact_losses, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, exact_grads):
        for a, b in zip(g, e):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert exact_compiles == 2 * len(set(lengths))  # forward and backward per length
    assert bucketed == 2 and compiles == 2 * 2  # forward and backward per bucket


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "softmax", "log_softmax", "matmul"])
def test_reductions_over_a_padded_dim_are_masked(reduce):
    functions = {
        "sum": lambda x: (x.exp() + 1).sum(1),
        "mean": lambda x: (x + 3).mean(1, keepdim=True),
        "amax": lambda x: (x - 10).amax(1),
        "softmax": lambda x: (x + 1).softmax(-1),
        "log_softmax": lambda x: (x * 2).log_softmax(1),
        "matmul": lambda x: (x + 1) @ (x + 1).transpose(0, 1).sin(),
    }
    torch._dynamo.reset()
    f = torch.compile(functions[reduce], backend="pjrt", dynamic=True, options={"buckets": "pow2"})
    before = compile_stats()
    for n in (3, 5, 6, 7):
        x = torch.randn(2, n) if reduce != "matmul" else torch.randn(n, n)
        torch.testing.assert_close(f(x.to("pjrt")).cpu(), functions[reduce](x), rtol=1e-5, atol=1e-5)
    after = compile_stats()
    assert after["bucketed_graphs"] - before["bucketed_graphs"] == 1
    assert after["xla_compiles"] - before["xla_compiles"] == 2  # buckets 4 and 8


def test_an_op_that_cannot_be_masked_falls_back_to_exact_sizes_with_its_reason():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x.sort(dim=1).values[:, :1] + x.var(1, keepdim=True), backend="pjrt",
                      dynamic=True, options={"buckets": [8]})
    before = compile_stats()
    for n in (3, 5):
        x = torch.randn(2, n)
        torch.testing.assert_close(f(x.to("pjrt")).cpu(), x.sort(dim=1).values[:, :1] + x.var(1, keepdim=True))
    after = compile_stats()
    assert after["unbucketed_graphs"] - before["unbucketed_graphs"] == 1
    assert "over a padded dimension cannot be masked" in after["bucket_fallback_reasons"][-1]
    assert after["xla_compiles"] - before["xla_compiles"] == 2  # one per size, as without buckets


def test_dynamic_shapes_trace_once_and_compile_once_per_size():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    compiled = torch.compile(copy.deepcopy(model).to("pjrt"), backend="pjrt", dynamic=True)
    before = compile_stats()
    for batch in (3, 5, 7, 5):
        x = torch.randn(batch, 8)
        out = compiled(x.to("pjrt"))
        out.sum().backward()
        torch.testing.assert_close(out.detach().cpu(), model(x), rtol=1e-5, atol=1e-6)
    after = compile_stats()
    assert after["graphs"] - before.get("graphs", 0) == 2  # one forward and one backward graph
    assert after["xla_compiles"] - before.get("xla_compiles", 0) == 6  # per size, not per call


def test_casts_and_integer_indexing_compile_and_a_copy_to_the_cpu_stays_eager():
    torch._dynamo.reset()
    before = dict(compile_stats())
    x = torch.randn(6, 4)
    idx = torch.tensor([5, 0, 0, 2])
    f = torch.compile(lambda a, i: (a[i].half() * 2, a.double().sum()), backend="pjrt")
    h, s = f(x.to("pjrt"), idx.to("pjrt"))
    assert h.dtype == torch.float16 and s.dtype == torch.float64
    assert torch.equal(h.cpu(), x[idx].half() * 2) and torch.allclose(s.cpu(), x.double().sum())
    assert compile_stats()["eager_graphs"] == before.get("eager_graphs", 0)  # one XLA program

    to_host = torch.compile(lambda a: (a + 1).cpu(), backend="pjrt")
    with pytest.warns(UserWarning, match="running a compiled graph eagerly"):
        out = to_host(x.to("pjrt"))
    assert out.device.type == "cpu" and torch.equal(out, x + 1)


def test_shift_overloads():
    """Every overload of << and >> (PyTorch's uint8 bicubic decomposition writes `1 << t`)."""
    a = torch.tensor([1, -8, 100, 7, -1], dtype=torch.int32)
    b = torch.tensor([0, 1, 3, 31, 40], dtype=torch.int32)
    cases = [lambda x, y: x >> y, lambda x, y: x << y, lambda x, y: x >> 2, lambda x, y: x << 2,
             lambda x, y: torch.bitwise_left_shift(1, y), lambda x, y: torch.bitwise_right_shift(1024, y),
             lambda x, y: torch.bitwise_right_shift(x, 2), lambda x, y: torch.bitwise_left_shift(x, 3),
             lambda x, y: x.to(torch.uint8) << 3]
    for fn in cases:
        want = fn(a, b)
        for run in (fn, torch.compile(fn, backend="pjrt", fullgraph=True)):
            got = run(a.to("pjrt"), b.to("pjrt")).cpu()
            assert got.dtype == want.dtype and torch.equal(got, want), (want, got)


@pytest.mark.parametrize("backend", ["inductor", "pjrt"])
def test_graph_breaks_run_the_device_kernels_outside_dynamo(backend):
    """nn.RNN breaks Dynamo's graph; the rest of the frame runs eagerly with Dynamo's frame hook on,
    and the device's kernels (with the storage code and JAX under them) must run as they are, not
    be traced (Dynamo traced torchpjrt's fill kernel into JAX's device_put, which failed)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    rnn = torch.nn.RNN(8, 16, batch_first=True)
    x = torch.randn(4, 5, 8)
    want = rnn(x)[0]
    got = torch.compile(copy.deepcopy(rnn).to("pjrt"), backend=backend)(x.to("pjrt"))[0]
    torch.testing.assert_close(got.detach().cpu(), want.detach())
