"""`torchpjrt bench`: target choice, prices, statistics, workloads, workers and the CLI end to end."""

import csv
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torchpjrt.bench import measure, prices, report, results, runner, targets, workloads
from torchpjrt import cli
from torchpjrt.cli import _check_model_path

CHROMIUM = "/usr/bin/chromium"

# ---- fast: pure functions -------------------------------------------------------------------


PROBED_CPU_ONLY = {
    "jax_platforms": {"cpu": {"count": 1, "kind": "cpu"}},
    "unavailable": {"cuda": "torch.cuda.is_available() is False", "cuda-compile": "no cuda",
                    "pjrt-compile": "not implemented yet"},
}


def test_resolve_expands_pjrt_and_reports_unknown_or_unavailable_targets():
    runnable, not_run = targets.resolve(["cpu", "pjrt", "bogus", "pjrt@tpu", "pjrt-compile", "cuda", "cpu@gpu"], PROBED_CPU_ONLY)
    assert [t.name for t in runnable] == ["cpu", "pjrt@cpu"]
    status = {e["name"]: (e["status"], e["reason"]) for e in not_run}
    assert status["bogus"][0] == "failed" and "unknown target 'bogus'" in status["bogus"][1]
    assert status["cpu@gpu"][0] == "failed"
    assert status["pjrt@tpu"] == ("skipped", "JAX platform 'tpu' is not available here (found: cpu)")
    assert status["pjrt-compile@cpu"] == ("skipped", "not implemented yet")
    assert status["cuda"][0] == "skipped"


def test_default_targets_are_every_kind_on_every_platform():
    probed = {"jax_platforms": {"cpu": {}, "tpu": {}}, "unavailable": {}}
    runnable, not_run = targets.resolve([], probed)
    names = [t.name for t in runnable]
    assert names[:4] == ["cpu", "cpu-compile", "cuda", "cuda-compile"]
    assert {"pjrt@cpu", "pjrt@tpu", "pjrt-fused@tpu", "pjrt-compile@cpu"} <= set(names) and not not_run


def test_tpu_workers_never_coexist():
    ts = [targets.Target("cpu"), targets.Target("pjrt", "tpu"), targets.Target("pjrt-fused", "tpu"), targets.Target("pjrt", "cpu")]
    groups = runner.coexisting_groups(ts)
    assert [[t.name for t in g] for g in groups] == [["cpu", "pjrt@cpu", "pjrt@tpu"], ["pjrt-fused@tpu"]]


def test_default_price_table_matches_devices():
    table = prices.load()
    assert table.match("NVIDIA H100 80GB HBM3") == "H100"
    assert table.match("TPU v5 lite") == "TPU v5 lite"  # v5e, not v5p: the longest name wins
    assert table.match("TPU v5") == "TPU v5"
    assert table.match("Some Unknown Chip") is None
    hourly, basis = table.hourly("cpu", "AMD EPYC", 4)
    assert hourly == pytest.approx(4 * table.per_core_hour) and "4 cores" in basis
    assert table.hourly("tpu", "Some Unknown Chip", None)[0] is None
    # 1 USD/hour, 36 ms per step of 100 samples: 1e-5 USD per step, 1e-7 per sample, 0.1 per million.
    assert prices.cost_per_million_samples(1.0, 0.036, 100) == pytest.approx(0.1)


def test_bad_price_tables_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[cpu\n")
    with pytest.raises(prices.PriceTableError, match="not valid TOML"):
        prices.load(bad)
    bad.write_text('[accelerator]\n"H100" = -1\n')
    with pytest.raises(prices.PriceTableError, match="number >= 0"):
        prices.load(bad)
    with pytest.raises(prices.PriceTableError, match="cannot read"):
        prices.load(tmp_path / "missing.toml")


def test_spread_and_relative_difference():
    s = measure.spread([float(i) for i in range(1, 12)])  # 1..11
    assert (s["median"], s["p10"], s["p90"]) == (6.0, 2.0, 10.0)
    assert measure.spread([3.0]) == {"median": 3.0, "p10": 3.0, "p90": 3.0}
    assert measure.relative_difference(1.001, 1.0) == pytest.approx(1e-3)


def test_agreement_flags_differences_and_nan():
    rows = [
        {"name": "cpu", "status": "ok", "losses": [2.0, 1.0], "loss_rel_diff": None},
        {"name": "pjrt@cpu", "status": "ok", "losses": [2.0, 1.0 + 1e-6], "loss_rel_diff": None},
        {"name": "cpu-compile", "status": "ok", "losses": [2.0, 1.1], "loss_rel_diff": None},
        {"name": "pjrt@gpu", "status": "ok", "losses": [2.0, math.nan], "loss_rel_diff": None},
    ]
    assert results._add_agreement(rows, tolerance=1e-3) == "cpu"
    assert [r["agrees"] for r in rows] == [True, True, False, False]
    assert rows[2]["loss_rel_diff"] == pytest.approx(0.1)


def test_model_path_checks():
    assert "package.module:factory" in _check_model_path("no_colon_here")
    assert "no module named 'surely_not_a_module_xyz'" in _check_model_path("surely_not_a_module_xyz:make")
    assert _check_model_path("torchpjrt.bench.workloads:build_mlp") is None


# ---- workloads ------------------------------------------------------------------------------


def _check_workload(w: workloads.Workload):
    batch_a = _batch(w, seed=5)
    batch_b = _batch(w, seed=5)
    for a, b in zip(batch_a, batch_b):
        assert torch.equal(a, b)  # the bench reseeds before every batch: same stream everywhere
    loss = w.loss_fn(w.model(*batch_a), batch_a)
    assert loss.dim() == 0 and math.isfinite(loss.item())


def _batch(w, seed):
    torch.default_generator.manual_seed(seed)
    return w.batch_fn(w.batch_size, "cpu")


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet", "unet"])
def test_builtin_workloads_tiny(name):
    _check_workload(workloads.build(name, "tiny", None, None))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "vit", "mixtral"])
def test_transformers_workloads_tiny(name):
    pytest.importorskip("transformers", reason="these workloads need transformers (torchpjrt[bench])")
    w = workloads.build(name, "tiny", None, 2)
    assert w.batch_size == 2
    assert w.tokens_per_sample == {"vit": None, "t5": 64}.get(name, 32)
    _check_workload(w)


def test_same_seed_same_weights():
    torch.manual_seed(0)
    a = workloads.build("mlp", "tiny", None, None).model.state_dict()
    torch.manual_seed(0)
    b = workloads.build("mlp", "tiny", None, None).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


USER_MODULE = """
import torch
import torch.nn.functional as F
from torch import nn


def make():
    model = nn.Linear(8, 3)

    def batch_fn(batch_size, device):
        x = torch.randn(batch_size, 8)
        return (x.to(device),)

    def loss_fn(output, batch):
        return F.mse_loss(output, batch[0][:, :3])

    return model, batch_fn, loss_fn


def broken():
    raise ValueError("boom")


def wrong_shape():
    return nn.Linear(2, 2)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "bench_user_model.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "bench_user_model"
    sys.modules.pop("bench_user_model", None)


def test_user_factory_contract(user_module):
    w = workloads.build(None, "small", f"{user_module}:make", 4)
    assert w.batch_size == 4 and w.tokens_per_sample is None
    _check_workload(w)
    with pytest.raises(workloads.FactoryError, match="raised ValueError: boom"):
        workloads.build(None, "small", f"{user_module}:broken", None)
    with pytest.raises(workloads.FactoryError, match=r"must return \(model, batch_fn, loss_fn\)"):
        workloads.build(None, "small", f"{user_module}:wrong_shape", None)
    with pytest.raises(workloads.FactoryError, match="no callable 'absent'"):
        workloads.build(None, "small", f"{user_module}:absent", None)


# ---- workers (real subprocesses) ------------------------------------------------------------


class _Silent:
    def update(self, *args, **kwargs):
        pass


def _config(**overrides) -> runner.BenchConfig:
    base = dict(workload="mlp", size="tiny", task="train", model=None, targets=[], steps=2, rounds=2, warmup=1,
                batch_size=None, seed=0, lr=1e-3, tolerance=1e-3, timeout=300, prices=None)
    return runner.BenchConfig(**{**base, **overrides})


@pytest.mark.slow
def test_worker_runs_a_user_model_and_reports_a_raising_factory(user_module):
    cpu = [targets.Target("cpu")]
    good = runner.run_targets(_config(workload=None, model=f"{user_module}:make", task="infer"), cpu, _Silent())[0]
    assert good.status == "ok", good.reason
    assert len(good.losses) == 1 + 2 * 2 and len(good.step_times) == 4
    assert good.ready["batch_size"] == 32 and good.final["peak_memory_source"] == "process peak RSS (getrusage)"
    bad = runner.run_targets(_config(workload=None, model=f"{user_module}:broken"), cpu, _Silent())[0]
    assert bad.status == "failed" and bad.error_kind == "model factory"
    assert "raised ValueError: boom" in bad.reason


# ---- the CLI end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One `python -m torchpjrt bench` run: mlp tiny on cpu, pjrt and a bogus target."""
    out = tmp_path_factory.mktemp("bench")
    paths = {k: out / f"result.{k}" for k in ("json", "csv", "html")}
    command = [
        sys.executable, "-m", "torchpjrt", "bench", "mlp", "--size", "tiny", "--targets", "cpu,pjrt,bogus",
        "--steps", "2", "--rounds", "2", "--warmup", "2", "--timeout", "300",
        "--json", str(paths["json"]), "--csv", str(paths["csv"]), "--report", str(paths["html"]),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=out)
    return proc, paths


@pytest.mark.slow
def test_cli_end_to_end(cli_run):
    proc, paths = cli_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torchpjrt bench: mlp (tiny, train, batch 32)" in proc.stdout

    result = json.loads(paths["json"].read_text())
    assert result["schema"] == results.SCHEMA
    assert {"config", "workload", "machine", "versions", "method", "reference", "fastest", "cheapest"} <= set(result)
    assert result["versions"]["torch"] and result["machine"]["usable_cores"] >= 1
    rows = {r["name"]: r for r in result["targets"]}
    assert all(set(r) == set(results.TARGET_KEYS) for r in rows.values())
    assert set(rows) == {"cpu", "pjrt@cpu", "bogus"}

    cpu = rows["cpu"]
    assert cpu["status"] == "ok" and result["reference"] == "cpu" and result["fastest"]
    assert len(cpu["losses"]) == 2 + 2 * 2
    assert cpu["step_time_s"]["p10"] <= cpu["step_time_s"]["median"] <= cpu["step_time_s"]["p90"]
    assert cpu["samples_per_s"] > 0 and cpu["time_to_first_step_s"] > 0 and cpu["peak_memory_bytes"] > 0
    assert cpu["cost_per_million_samples"] > 0
    assert cpu["loss_rel_diff"] == 0.0 and cpu["agrees"] is True
    assert cpu["energy_j_per_step"] is not None or cpu["energy_source"].startswith("n/a: ")

    pjrt = rows["pjrt@cpu"]  # a missing op on pjrt is a finding: reported, and the run goes on
    if pjrt["status"] == "ok":
        assert pjrt["loss_rel_diff"] is not None and pjrt["agrees"] is True, pjrt["loss_rel_diff"]
    else:
        assert pjrt["status"] == "failed" and pjrt["reason"]
    assert rows["bogus"]["status"] == "failed" and "unknown target 'bogus'" in rows["bogus"]["reason"]

    with open(paths["csv"], newline="") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == report.CSV_COLUMNS
    assert {r["target"] for r in table} == set(rows)
    assert float(next(r for r in table if r["target"] == "cpu")["step_median_ms"]) > 0


@pytest.mark.slow
def test_html_report_renders_in_chromium(cli_run, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (torchpjrt[bench])")
    _, paths = cli_run
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path}",
         "--dump-dom", paths["html"].as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout
    assert dom.count('src="data:image/png;base64,') == 3  # step time, cost, loss curves
    assert "Machine" in dom and "Method" in dom and "unknown target" in dom


def test_cli_exit_code_is_nonzero_when_no_target_runs(monkeypatch, capsys):
    probed = {**PROBED_CPU_ONLY, "machine": targets.machine_info(), "versions": targets.versions()}
    monkeypatch.setattr(runner, "run_probe", lambda timeout: probed)  # no accelerator discovery needed here
    assert cli.main(["bench", "--targets", "bogus,pjrt@tpu"]) == 1
    out, err = capsys.readouterr()
    assert "no target could run" in err and "unknown target 'bogus'" in out and "'tpu' is not available" in out


def test_cli_rejects_a_missing_model_module(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--model", "no_such_module_here:make"]) == 2
    assert "no module named 'no_such_module_here'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: an unknown workload
        cli.main(["bench", "resnet9000"])
