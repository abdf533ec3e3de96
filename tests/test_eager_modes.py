"""The three eager modes: selection, fused-mode flush triggers and caching, debug-mode checks."""

import gc
import logging
import os
import subprocess
import sys
import threading
import traceback

import jax
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchpjrt
from torchpjrt import fusion, padding

DEV = "pjrt"
# fused mode's compile policy and counts are checked as a first run sees them
pytestmark = pytest.mark.usefixtures("empty_kernel_cache")


@pytest.fixture(autouse=True)
def _back_to_strict():
    torchpjrt.set_eager_mode("strict")
    yield
    torchpjrt.set_eager_mode("strict", max_ops=4096, check_nans=False, log_ops=False)


def flushes(reason=None):
    if reason is None:  # any reason
        return torchpjrt.eager_stats()["flushes"]
    return torchpjrt.eager_stats()["flush_reasons"].get(reason, 0)


# ---- choosing a mode ---------------------------------------------------------------------


def test_set_get_and_context_manager():
    assert torchpjrt.get_eager_mode() == "strict"
    torchpjrt.set_eager_mode("fused")
    assert torchpjrt.get_eager_mode() == "fused"
    with pytest.raises(RuntimeError):
        with torchpjrt.eager_mode("debug"):
            assert torchpjrt.get_eager_mode() == "debug"
            raise RuntimeError("inside")
    assert torchpjrt.get_eager_mode() == "fused"


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown eager mode 'lazy'.*strict, debug, fused"):
        torchpjrt.set_eager_mode("lazy")
    with pytest.raises(ValueError, match="max_ops"):
        torchpjrt.set_eager_mode("fused", max_ops=0)


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.mark.slow  # fresh processes, one per mode
def test_environment_variable_selects_the_mode():
    ok = _python("import torchpjrt; print(torchpjrt.get_eager_mode())", TORCHPJRT_EAGER_MODE="fused")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "fused"
    cap = _python("import torchpjrt; from torchpjrt import fusion; print(fusion.max_ops)", TORCHPJRT_FUSED_MAX_OPS="64")
    assert cap.stdout.strip() == "64", cap.stderr
    bad = _python("import torchpjrt", TORCHPJRT_EAGER_MODE="fast")
    assert bad.returncode != 0
    assert "TORCHPJRT_EAGER_MODE='fast'" in bad.stderr


# ---- fused mode ------------------------------------------------------------------------------


def test_fused_records_until_a_value_is_observed():
    torchpjrt.set_eager_mode("fused")
    x = torch.arange(6.0, device=DEV)
    y = (x * 2 + 1).exp().log() - 1
    assert torchpjrt.eager_stats()["ops_pending"] >= 4
    before = flushes("host_read")
    # XLA's exp and log round differently from the CPU's: equal to float32 precision
    torch.testing.assert_close(y.cpu(), torch.tensor([0.0, 2.0, 4.0, 6.0, 8.0, 10.0]))
    assert flushes("host_read") == before + 1
    assert torchpjrt.eager_stats()["ops_pending"] == 0


def _observations():
    x = torch.arange(1.0, 5.0, device=DEV)
    model = nn.Linear(4, 1).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {
        "item": lambda: (x * 3).sum().item(),
        "bool": lambda: bool((x * 3).sum() > 0),
        "equal": lambda: torch.equal(x * 1, x),
        "print": lambda: print(x * 3),
        "cpu": lambda: (x * 3).cpu(),
        "numpy": lambda: (x * 3).cpu().numpy(),
        "synchronize": lambda: ((x * 3), torch.pjrt.synchronize()),
        "data_dependent": lambda: torch.nonzero(x > 2),
        "optimizer_step": lambda: (model(x).sum().backward(), opt.step()),
        "backward": lambda: model(x).sum().backward(),
    }


REASONS = {"item": "item", "bool": "item", "equal": "item", "print": None, "cpu": "host_read",
           "numpy": "host_read", "synchronize": "synchronize", "data_dependent": "data_dependent_op",
           "optimizer_step": "optimizer_step", "backward": "backward"}


@pytest.mark.parametrize("observation", list(REASONS))
def test_each_observation_point_flushes(observation):
    torchpjrt.set_eager_mode("fused")
    act = _observations()[observation]
    before = flushes(REASONS[observation])
    act()
    assert flushes(REASONS[observation]) > before


def test_a_value_computed_before_its_tensor_is_made_is_held_as_an_array():
    # with a cap of one op, each op's graph runs inside its recording, before the kernel makes
    # the result's storage: the storage takes the computed array, not the graph's placeholder
    torchpjrt.set_eager_mode("fused", max_ops=1)
    x = torch.arange(6.0, device=DEV)
    y = torch.relu(x * 2 - 3)
    z = y + x  # reads y's storage
    for t in (y, z):
        assert type(t.untyped_storage()._pjrt.array) is not fusion.Pending
    assert z.cpu().tolist() == [0.0, 1.0, 3.0, 6.0, 9.0, 12.0]
    assert torchpjrt.eager_stats()["ops_pending"] == 0


def test_size_cap_and_mode_change_flush():
    torchpjrt.set_eager_mode("fused", max_ops=5)
    x = torch.ones(3, device=DEV)
    torch.pjrt.synchronize()
    before = flushes("max_ops")
    for _ in range(12):
        x = x + 1
    assert flushes("max_ops") == before + 2
    assert torchpjrt.eager_stats()["ops_pending"] == 2
    before = flushes("mode_change")
    torchpjrt.set_eager_mode("strict")
    assert flushes("mode_change") == before + 1
    assert torchpjrt.eager_stats()["ops_pending"] == 0
    assert x.cpu().tolist() == [13.0, 13.0, 13.0]


def test_print_inside_a_fused_region_shows_the_value(capsys):
    x = torch.arange(4.0, device=DEV)
    with torchpjrt.eager_mode("fused"):
        y = x * 10
        print(y)
        y.add_(1)
        print(y[1:])
    out = capsys.readouterr().out
    assert "tensor([ 0., 10., 20., 30.], device='pjrt:0')" in out
    assert "tensor([11., 21., 31.], device='pjrt:0')" in out


def test_an_error_in_a_fused_region_surfaces_at_the_op():
    torchpjrt.set_eager_mode("fused")
    a = torch.ones(3, device=DEV)
    b = torch.ones(4, device=DEV)
    c = a * 2
    with pytest.raises(RuntimeError, match="broadcast|must match") as info:
        a + b  # noqa: B018  (the failing op)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[0].name == "test_an_error_in_a_fused_region_surfaces_at_the_op"
    assert frames[0].line.startswith("a + b")
    assert c.cpu().tolist() == [2.0, 2.0, 2.0]  # the region before the error is intact


@pytest.mark.parametrize("compile_after", [1, 2], ids=["compiled", "op_by_op"])
def test_a_graph_that_fails_to_run_reports_it_at_every_later_use(monkeypatch, compile_after):
    def fail(*inputs):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while allocating")

    torchpjrt.set_eager_mode("fused")
    x = torch.arange(5.0, device=DEV)
    torch.pjrt.synchronize()
    y = x * 7 + 3.25  # a structure no earlier test compiled
    monkeypatch.setattr(fusion, "compile_after", compile_after)
    monkeypatch.setattr(fusion, "_make_replay", lambda *args: fail)  # a graph's first sighting compiles it
    monkeypatch.setattr(fusion, "_run_op_by_op", fail)  # or its ops run alone
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        y.cpu()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="value was never computed.*RESOURCE_EXHAUSTED"):
        (y + 1).cpu()
    assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # tensors computed before are intact


def test_views_inplace_and_autograd_match_strict():
    def program():
        torch.manual_seed(0)
        w = torch.randn(4, 5, device=DEV, requires_grad=True)
        base = torch.zeros(6, 5, device=DEV)
        view = base[1:5]
        view.copy_(w * 2)
        base[0].add_(1.5)
        base.t()[2].mul_(3)
        loss = (base.sin() * base).sum() + view.pow(2).mean()
        loss.backward()
        return base.cpu(), w.grad.cpu(), loss.item()

    strict = program()
    with torchpjrt.eager_mode("fused"):
        fused = program()
    for s, f in zip(strict, fused):
        torch.testing.assert_close(f, s, rtol=1e-6, atol=1e-6)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _train(steps, opt_cls=torch.optim.AdamW, after_step=None):
    torch.manual_seed(0)
    model = _MLP().to(DEV)
    opt = opt_cls(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16).to(DEV), torch.randint(0, 4, (8,)).to(DEV)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if after_step:
            after_step(i)
    return losses


@pytest.mark.slow
def test_fused_training_matches_strict_and_compiles_only_in_the_first_steps():
    strict = _train(6)
    compiled_after = {}
    with torchpjrt.eager_mode("fused"):
        fused = _train(6, after_step=lambda i: compiled_after.__setitem__(i, torchpjrt.eager_stats()["graphs_compiled"]))
    torch.testing.assert_close(fused, strict, rtol=1e-5, atol=1e-6)
    # AdamW's first step creates its state; from the second step on the same graphs run again,
    # op by op at their first sighting and compiled at the second
    assert compiled_after[5] == compiled_after[2] > compiled_after[1], compiled_after
    with torchpjrt.eager_mode("fused"):
        sgd = {}
        _train(3, torch.optim.SGD, after_step=lambda i: sgd.__setitem__(i, torchpjrt.eager_stats()["graphs_compiled"]))
    assert sgd[2] == sgd[1] > sgd[0], sgd  # plain SGD: the second step compiles, the third nothing


def test_host_scalars_of_a_compiled_graph_keep_their_values_and_types(monkeypatch):
    """A compiled graph gets its host scalars packed by dtype: each keeps its value (changing
    every run, without a recompile) and the type promotion it had as a separate argument (a
    Python float times a float32 tensor computes in float32), so the results are those of the
    same graph with every scalar passed on its own."""
    x32 = torch.randn(4, 3).to(DEV)
    i32 = torch.arange(12, dtype=torch.int32).reshape(4, 3).to(DEV)
    step_count = torch.tensor(0.0)  # a CPU scalar tensor, as an optimizer's step

    def region(k):
        step_count.add_(1)
        lr, wd = 0.1 * (k + 1), 1e-8 * k
        a = x32 * lr
        e = x32 - wd
        s = step_count * x32
        b = i32 * (k + 3) + 2**40 // (k + 1)  # a Python int times int32 stays int32 (wrapping as CPU)
        c = (x32 > 0) & (k % 2 == 0)  # a bool
        d = x32.add(x32, alpha=1.0 / (k + 7)).div(3.0 + k)
        return a, e, s, b, c, d

    def run(pack_from):
        monkeypatch.setattr(fusion, "pack_host_scalars_from", pack_from)
        fusion._compiled.clear()
        step_count.zero_()
        with torchpjrt.eager_mode("fused"):
            compiled = torchpjrt.eager_stats()["graphs_compiled"]
            results = [[t.cpu() for t in region(k)] for k in range(5)]
            # a bool is a static argument: two graphs (even and odd k), each compiled at its second sighting
            assert torchpjrt.eager_stats()["graphs_compiled"] == compiled + 2
        return results

    step_count.zero_()
    strict = [[t.cpu() for t in region(k)] for k in range(5)]
    separate, packed = run(10**9), run(2)
    for k in range(5):
        for p, s, c in zip(packed[k], separate[k], strict[k]):
            assert p.dtype == s.dtype == c.dtype
            torch.testing.assert_close(p, s, rtol=0, atol=0)
            torch.testing.assert_close(p, c)


def test_an_inference_loop_compiles_once():
    torchpjrt.set_eager_mode("fused", max_ops=50)  # a cap that would cut mid-iteration
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(DEV).eval()
    inputs = [torch.randn(2, 8) for _ in range(30)]
    with torch.no_grad():
        expected = [model.cpu()(x) for x in inputs]
        model.to(DEV)
        compiled, capped = torchpjrt.eager_stats()["graphs_compiled"], flushes("max_ops")
        outs = [model(x.to(DEV)) for x in inputs]
        assert torchpjrt.eager_stats()["graphs_compiled"] == compiled + 1  # cut where each call ends
        assert flushes("max_ops") == capped
    torch.testing.assert_close(torch.stack(outs).cpu(), torch.stack(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a long loop
def test_a_long_fused_loop_has_flat_memory():
    torchpjrt.set_eager_mode("fused")
    torch.manual_seed(0)
    model = _MLP().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(8, 16).to(DEV), torch.randint(0, 4, (8,)).to(DEV)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def snapshot():
        # after the device's work: device checks keep a step's check vectors until they are read,
        # and how many are still unread at a step's end depends on the machine's load
        torch.pjrt.synchronize()
        gc.collect()
        return len(jax.live_arrays()), torchpjrt.eager_stats()["cached_graphs"], len(fusion._out_avals)

    for _ in range(20):
        step()
    early = snapshot()
    for _ in range(1000):
        step()
    late = snapshot()
    assert late == early
    assert torchpjrt.eager_stats()["ops_pending"] == 0  # the optimizer step ended every graph


def test_compiled_function_inside_a_fused_region():
    model = _MLP().to(DEV)
    x = torch.randn(8, 16).to(DEV)
    compiled = torch.compile(model, backend="pjrt")
    expected = model(x).cpu()
    with torchpjrt.eager_mode("fused"):
        got = (compiled(x) * 1).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_two_threads_record_concurrently():
    torchpjrt.set_eager_mode("fused")
    results, errors = {}, []

    def work(k):
        try:
            x = torch.full((64,), float(k), device=DEV)
            for _ in range(200):
                x = x * 1.0 + 1
            results[k] = x.cpu()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        assert results[k].eq(k + 200).all()


# ---- debug mode ------------------------------------------------------------------------------


def test_debug_mode_runs_each_op_to_completion():
    from torchpjrt import storage

    torchpjrt.set_eager_mode("debug")
    y = torch.randn(256, 256, device=DEV) @ torch.randn(256, 256, device=DEV)
    assert storage.read(y).is_ready()


def test_debug_errors_name_the_op_and_the_user_line():
    torchpjrt.set_eager_mode("debug")
    a, b = torch.ones(3, device=DEV), torch.ones(4, device=DEV)
    with pytest.raises(RuntimeError) as info:
        a + b  # noqa: B018
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "aten::add.Tensor" in note
    assert f"{__file__}:" in note and "test_debug_errors_name_the_op_and_the_user_line" in note


def test_debug_nan_check_names_the_op_that_produced_it():
    torchpjrt.set_eager_mode("debug", check_nans=True)
    x = torch.tensor([1.0, -1.0], device=DEV)
    with pytest.raises(RuntimeError, match="aten::log.default produced NaN/Inf.*test_eager_modes.py"):
        torch.log(x)
    # an explicit -inf (attention masks) is not an error, nor is passing it along
    masked = torch.zeros(2, device=DEV).masked_fill(x < 0, float("-inf"))
    assert masked.softmax(0).cpu().tolist() == [1.0, 0.0]
    torchpjrt.set_eager_mode("strict")
    assert torch.log(x).isnan().any().item()  # strict mode does not check


@pytest.mark.slow
def test_debug_nan_check_takes_the_users_nan_and_inf_for_data():
    # non-finite values from the host, a factory or a scalar argument are the user's, not a fault
    inf, nan = float("inf"), float("nan")
    torchpjrt.set_eager_mode("debug", check_nans=True)
    mask = torch.full((3, 3), -inf).triu(1).to(DEV)  # a causal mask made on the host
    assert mask[0, 1].item() == -inf
    torch.tensor([-inf, 0.0], device=DEV)
    torch.tensor([nan, 1.0], device=DEV, dtype=torch.bfloat16)
    torch.tensor([complex(inf, 0)], device=DEV)
    torch.tensor([inf]).to(DEV).clone()
    torch.full((2,), -inf, device=DEV)
    torch.zeros(2, device=DEV).fill_(inf)
    torch.zeros(4, device=DEV)[::2].copy_(torch.tensor([inf, 0.0]))
    keep = torch.tensor([True, False], device=DEV)
    torch.zeros(2, device=DEV).masked_fill(keep, -inf)
    torch.zeros(2, device=DEV).masked_fill(keep, torch.tensor(-inf))  # a 0-dim host tensor
    t = torch.zeros(2, device=DEV)
    t[0] = -inf
    torch._foreach_add_([torch.zeros(2, device=DEV)], inf)
    q = torch.randn(1, 3, 4, device=DEV)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert out.isfinite().all().item()


def test_debug_nan_check_still_names_faults_in_place_and_out():
    # the inputs an in-place or out= op overwrites count with what they held before it ran
    torchpjrt.set_eager_mode("debug", check_nans=True)
    produced = "produced NaN/Inf.*from finite inputs"
    with pytest.raises(RuntimeError, match="aten::log.default " + produced):
        torch.log(torch.zeros(3, device=DEV) - 1)
    with pytest.raises(RuntimeError, match="aten::div.Tensor " + produced):
        torch.zeros(3, device=DEV) / torch.zeros(3, device=DEV)
    with pytest.raises(RuntimeError, match="aten::div.Tensor " + produced):
        torch.ones(2, device=DEV) / torch.tensor(0.0)  # a finite host scalar tensor
    with pytest.raises(RuntimeError, match="aten::div_.Tensor " + produced):
        torch.ones(2, device=DEV).div_(0)
    with pytest.raises(RuntimeError, match="aten::log_.default " + produced):
        torch.tensor([-float("inf"), -1.0, 2.0, 3.0], device=DEV)[1:3].log_()  # a view; its base holds -inf elsewhere
    with pytest.raises(RuntimeError, match="aten::log.out " + produced):
        torch.log(torch.tensor([-1.0, 1.0], device=DEV), out=torch.full((2,), float("nan"), device=DEV))
    with pytest.raises(RuntimeError, match="aten::div.out " + produced):
        a = torch.zeros(2, device=DEV)
        torch.div(a, a, out=a)
    with pytest.raises(RuntimeError, match="aten::_foreach_div_.Scalar " + produced):
        torch._foreach_div_([torch.zeros(2, device=DEV)], 0.0)
    with pytest.raises(RuntimeError, match="aten::_to_copy.default " + produced):
        torch.tensor([1e6]).to(DEV).half()  # an overflow made on the device
    # a NaN already in self is passed along, not blamed again
    torch.tensor([float("nan"), 1.0], device=DEV).add_(1)


def test_debug_op_log(caplog):
    torchpjrt.set_eager_mode("debug", log_ops=True)
    a = torch.ones(2, 3, device=DEV)
    with caplog.at_level(logging.INFO, logger="torchpjrt.ops"):
        a + a  # noqa: B018
    line = next(r.getMessage() for r in caplog.records if "aten::add.Tensor" in r.getMessage())
    assert "(float32[2, 3], float32[2, 3]) -> (float32[2, 3])" in line
    assert line.endswith(" ms")


def test_eager_stats_reports_what_the_issue_names():
    stats = torchpjrt.eager_stats()
    for key in ("mode", "ops_dispatched", "graphs_compiled", "cache_hits", "cache_misses", "compile_seconds",
                "flush_reasons"):
        assert key in stats


# ---- which graphs are compiled ---------------------------------------------------------------


def test_a_graph_seen_once_runs_op_by_op_with_strict_results():
    x = torch.randn(7, 3).to(DEV)

    def program():
        return ((x * 1.5).sin() @ x.t()).softmax(-1).sum(0)

    strict = program().cpu()
    torchpjrt.set_eager_mode("fused")
    before = torchpjrt.eager_stats()
    first = program().cpu()
    after = torchpjrt.eager_stats()
    assert after["graphs_run_op_by_op"] == before["graphs_run_op_by_op"] + 1
    assert after["graphs_compiled"] == before["graphs_compiled"]
    assert torch.equal(first, strict)  # the same kernels as strict mode, bit for bit
    second = program().cpu()  # the graph came back: compiled now, and a cache hit afterwards
    assert torchpjrt.eager_stats()["graphs_compiled"] == before["graphs_compiled"] + 1
    program().cpu()
    assert torchpjrt.eager_stats()["graphs_compiled"] == before["graphs_compiled"] + 1
    torch.testing.assert_close(second, strict, rtol=1e-6, atol=1e-6)


def _rows_region(counts, w):
    outs, expected = [], []
    for n in counts:
        mask = torch.arange(8) < n
        x = torch.randn(8, 4)
        rows = x.to(DEV)[mask.to(DEV)]  # a data-dependent shape: flushes before and after
        outs.append(((rows @ w).relu() * 2).sum(0).cpu())
        expected.append(((x[mask] @ w.cpu()).relu() * 2).sum(0))
    for o, e in zip(outs, expected):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)


def test_padded_routed_rows_share_one_graph():
    # an expert-loop-like region: a host read picks rows, whose count changes every iteration;
    # the rows are padded to one bucket (padding.py), so the region after them is one graph
    torchpjrt.set_eager_mode("fused")
    w = torch.randn(4, 4).to(DEV)
    before = torchpjrt.eager_stats()["graphs_compiled"]
    _rows_region([3, 5, 2, 6, 4, 7], w)
    assert torchpjrt.eager_stats()["graphs_compiled"] == before + 1


@pytest.mark.slow
def test_shapes_that_follow_the_data_compile_no_graph(monkeypatch):
    monkeypatch.setattr(padding, "enabled", False)  # exact sizes: every count is a new shape
    torchpjrt.set_eager_mode("fused")
    w = torch.randn(4, 4).to(DEV)
    before = torchpjrt.eager_stats()["graphs_compiled"]
    _rows_region([3, 5, 2, 6, 4, 1, 7], w)
    assert torchpjrt.eager_stats()["graphs_compiled"] == before  # each graph was new: op by op


def test_compile_after_one_compiles_at_first_sighting_and_is_restored():
    default = fusion.compile_after
    y = torch.arange(4.0, device=DEV)
    with torchpjrt.eager_mode("fused", compile_after=1):
        before = torchpjrt.eager_stats()["graphs_compiled"]
        assert ((y * 5.5 + 0.25) ** 2).cpu().tolist() == [(v * 5.5 + 0.25) ** 2 for v in range(4)]
        assert torchpjrt.eager_stats()["graphs_compiled"] == before + 1
    assert fusion.compile_after == default
    with pytest.raises(ValueError, match="compile_after must be at least 1"):
        torchpjrt.set_eager_mode("fused", compile_after=0)


def test_op_by_op_drops_values_after_their_last_use(monkeypatch):
    # a chain of 40 ops on 1 MB: at most a few intermediates are alive at any op
    x = torch.ones(256, 1024).to(DEV)
    torch.pjrt.synchronize()
    alive = []
    real = fusion._run_op_by_op

    def watching(g, out_slots):
        runners = g.runners

        def watch(runner):
            def run(*args):
                alive.append(len(jax.live_arrays()))
                return runner(*args)
            return run

        g.runners = [watch(r) for r in runners]
        return real(g, out_slots)

    monkeypatch.setattr(fusion, "_run_op_by_op", watching)
    torchpjrt.set_eager_mode("fused")
    base = len(jax.live_arrays())
    y = x
    for i in range(40):
        y = y * 1.01 + 0.5
    assert y.sum().item() > 0
    assert len(alive) > 40 and max(alive) - base <= 4, (base, alive)


@pytest.mark.slow
def test_graphs_that_come_back_far_apart_are_compiled_only_once_they_would_pay(monkeypatch):
    """A generate()-like loop: one small graph per length, each length once per call. Their
    second sightings are far apart (more than reuse_distance flushes), so they keep running op
    by op until the dispatches they paid for reach their estimated compile cost."""
    x = torch.arange(64.0).reshape(16, 4)  # integers: sums exact in any order

    def call(device):
        d = x.to(device)
        return [(d[:n] * 2 + 1).sum().item() for n in range(1, 11)]  # 10 graphs of new shapes

    expected = call("cpu")
    torchpjrt.set_eager_mode("fused")
    monkeypatch.setattr(fusion, "passthrough_ops", 0)  # this test is about the graphs' sightings
    monkeypatch.setattr(fusion, "reuse_distance", 4)
    # the compile cost estimate as before any measurement: earlier tests' compiles (fast when
    # JAX's persistent cache has them) would make these compiles look cheap enough to pay
    monkeypatch.setattr(fusion, "_compile_seconds_per_op", [2e-3, 0])
    before = torchpjrt.eager_stats()["graphs_compiled"]
    assert call(DEV) == expected and call(DEV) == expected
    assert torchpjrt.eager_stats()["graphs_compiled"] == before  # deferred: 10 compiles would not pay
    assert fusion.stats["compiles_deferred"] >= 10
    monkeypatch.setattr(fusion, "DISPATCH_SECONDS_PER_OP", 1.0)  # now every sighting pays for a compile
    assert call(DEV) == expected
    assert torchpjrt.eager_stats()["graphs_compiled"] >= before + 10
    assert call(DEV) == expected


@pytest.mark.slow
def test_flush_heavy_regions_run_their_ops_at_once_and_training_loops_stay_fused():
    """Fused mode is never slower than strict: where most ops of the recent flushes ran op by op
    (a host read every few ops, shapes that never come back), ops stop being recorded for a while
    and run at once, as strict mode runs them; a training loop, whose graphs come back and
    compile, keeps recording."""
    x = torch.arange(48.0).reshape(16, 3)  # integers: sums exact in any order (shapes no other test uses)

    def generate_like(device):
        d = x.to(device)
        return [(d[:n].neg() * 2 + 1).sum().item() for n in range(1, 17)]  # a new shape per read

    expected = generate_like("cpu")
    torchpjrt.set_eager_mode("fused")
    stats = torchpjrt.eager_stats()
    assert generate_like(DEV) == expected  # 16 flushes, each of a graph seen once: run op by op
    assert generate_like(DEV) == expected
    after = torchpjrt.eager_stats()
    assert after["passthrough_regions"] > stats["passthrough_regions"]
    assert after["ops_passed_through"] >= stats["ops_passed_through"] + 3 * 15
    assert after["graphs_compiled"] == stats["graphs_compiled"]

    torchpjrt.set_eager_mode("fused")  # a new mode setting starts a new look
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = torchpjrt.eager_stats()
    for _ in range(20):
        loss = model(x.to(DEV) / 48).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
    done = torchpjrt.eager_stats()
    assert done["ops_passed_through"] == before["ops_passed_through"]
    assert done["cache_hits"] - before["cache_hits"] >= 30  # its graphs compiled and came back


def test_graphs_seen_before_a_passthrough_region_do_not_compile_by_distance(monkeypatch):
    """A generate()-like loop that leaves and re-enters flush-heavy regions: each length's graph
    comes back once per call, and no flushes happen while ops run at once, so counted in flushes
    its second sighting looks close. It must not compile for that (it would not come back soon)."""
    x = torch.arange(40.0).reshape(8, 5)  # integers: sums exact in any order (shapes no other test uses)

    def generate_like(device):
        d = x.to(device)
        return [(d[:n].abs() + 3).sum().item() for n in range(1, 9)]

    expected = generate_like("cpu")
    torchpjrt.set_eager_mode("fused")
    monkeypatch.setattr(fusion, "passthrough_window", 4)
    monkeypatch.setattr(fusion, "passthrough_ops", 7)  # recording resumes within a call
    monkeypatch.setattr(fusion, "_compile_seconds_per_op", [2e-3, 0])
    before = torchpjrt.eager_stats()
    for _ in range(6):
        assert generate_like(DEV) == expected
    after = torchpjrt.eager_stats()
    assert after["passthrough_regions"] - before["passthrough_regions"] >= 3
    assert after["graphs_compiled"] == before["graphs_compiled"]


def test_a_look_after_a_region_compiles_nothing_unless_recording_stays_on(monkeypatch):
    """A look after a flush-heavy region decides before it compiles: a small graph seen twice
    within a look whose verdict is "still flush-heavy" (an expert loop's bucketed graphs between
    reads of new shapes) is not compiled for nothing; a training loop that starts after the
    region keeps recording, and its graphs compile at their next sighting."""
    monkeypatch.setattr(fusion, "passthrough_window", 4)
    monkeypatch.setattr(fusion, "passthrough_ops", 6)
    rows = torch.arange(64 * 3.0).reshape(64, 3)  # integers: sums exact in any order
    blocks = [torch.full((5 + k,), float(k)) for k in range(12)]  # shapes no other test uses

    def loop(device, compiled_at_first_region, regions_before=0):
        d = rows.to(device)
        small = [b.to(device) for b in blocks]
        out = []
        for i in range(40):
            # a graph of a new shape every iteration, of most of the ops ...
            x = d[:i + 1]
            out.append((((x.neg() * 2 + 1).abs() - 3).square().sqrt() * 0.5 + x).sum().item())
            # ... and a small one whose shape stays for 4 iterations (seen twice in a look)
            out.append((small[i // 4].abs() + 1).sum().item())
            if device == DEV and not compiled_at_first_region and \
                    torchpjrt.eager_stats()["passthrough_regions"] > regions_before:
                compiled_at_first_region.append(torchpjrt.eager_stats()["graphs_compiled"])
        return out

    expected = loop("cpu", None)
    torchpjrt.set_eager_mode("fused")
    compiled_at_first_region = []
    before = torchpjrt.eager_stats()
    assert loop(DEV, compiled_at_first_region, before["passthrough_regions"]) == expected
    stats = torchpjrt.eager_stats()
    assert stats["passthrough_regions"] - before["passthrough_regions"] >= 3
    assert stats["compiles_deferred_in_looks"] > before["compiles_deferred_in_looks"]
    assert stats["graphs_compiled"] == compiled_at_first_region[0]

    # right after the region (no new mode setting): a training loop, two flushes a step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = torchpjrt.eager_stats()
    for _ in range(30):
        loss = model(rows[:7].to(DEV) / 192).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
    done = torchpjrt.eager_stats()
    assert done["graphs_compiled"] > before["graphs_compiled"]
    assert done["cache_hits"] - before["cache_hits"] >= 20  # its graphs compiled and came back
