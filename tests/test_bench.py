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


def test_agreement_is_judged_on_the_first_steps_and_a_late_nan_still_fails():
    steps = results.AGREEMENT_STEPS
    ref = [3.0 - 0.01 * i for i in range(steps + 40)]
    drifted = ref[:steps] + [v * 1.03 for v in ref[steps:]]  # chaotic drift after the window
    early = [ref[0] * 1.01] + ref[1:]  # a wrong first step
    late_nan = ref[:-1] + [math.nan]
    rows = [{"name": n, "status": "ok", "losses": l}
            for n, l in (("cpu", ref), ("a", drifted), ("b", early), ("c", late_nan))]
    results._add_agreement(rows, tolerance=1e-3)
    a, b, c = rows[1:]
    assert a["agrees"] is True and a["loss_rel_diff"] == 0.0
    assert a["final_loss_rel_diff"] == pytest.approx(0.03) and a["max_loss_rel_diff"] == pytest.approx(0.03)
    assert b["agrees"] is False and b["loss_rel_diff"] == pytest.approx(0.01)
    assert c["agrees"] is False and math.isnan(c["loss_rel_diff"])


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


def _rendered(html_path, profile_dir) -> str:
    """The report's DOM as headless Chromium renders it."""
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile_dir}",
         "--dump-dom", html_path.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout


@pytest.mark.slow
def test_html_report_renders_in_chromium(cli_run, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (torchpjrt[bench])")
    _, paths = cli_run
    dom = _rendered(paths["html"], tmp_path)
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


# ---- runs compared across machines, budgets, thread counts ----------------------------------

from torchpjrt.bench import compare, display  # noqa: E402


def _row(name, step_s, losses, hardware="cpu", device="Some CPU", price=0.1, batch=32):
    row = dict.fromkeys(results.TARGET_KEYS)
    kind, _, platform = name.partition("@")
    row.update(name=name, kind=kind, platform=platform or None, hardware=hardware, status="ok", device_name=device,
               step_time_s={"median": step_s, "p10": step_s * 0.9, "p90": step_s * 1.1}, samples_per_s=batch / step_s,
               tokens_per_s=batch * 16 / step_s, time_to_first_step_s=2.0, peak_memory_bytes=2**30,
               peak_memory_source="process peak RSS (getrusage)", energy_source="n/a: none", cores=4,
               threads={"torch_intra_op": 4}, price_per_hour=price,
               cost_per_million_samples=prices.cost_per_million_samples(price, step_s, batch),
               losses=losses, final_loss=losses[-1], busy_machine=False)
    return row


def _run(label, rows, seed=0, versions=None, path=None):
    return {
        "schema": results.SCHEMA, "created": "2026-12-04T00:00:00+00:00", "_path": path or f"{label}.json",
        "config": {"workload": "gpt2", "size": "tiny", "task": "train", "model": None, "seed": seed, "lr": 1e-3,
                   "warmup": 1},
        "workload": {"name": "gpt2", "description": "GPT-2", "batch_size": 32, "tokens_per_sample": 16, "parameters": 10},
        "machine": {"cpu_model": "Some CPU", "logical_cores": 4, "usable_cores": 4, "memory_gib": 16, "accelerators": [],
                    "os": "Linux", "label": label},
        "versions": versions or {"torch": "2.13.0", "jax": "0.10.2"}, "method": "m", "tolerance": 1e-3,
        "currency": "USD", "prices": "p.toml", "price_source": "p.toml (examples)", "targets": rows,
    }


LOSSES = [2.0, 1.5, 1.2]


def test_compare_merges_machines_and_ranks_the_whole_job():
    a = _run("cloud-a", [_row("cpu", 0.010, LOSSES, price=0.2)])
    b = _run("cloud-b", [_row("pjrt@gpu", 0.002, [2.0, 1.5, 1.2000001], hardware="gpu", device="NVIDIA H100", price=3.0),
                         _row("cpu", 0.012, LOSSES, price=0.1)], versions={"torch": "2.13.0", "jax": "0.10.1"})
    merged = compare.merge([a, b], budget=prices.Budget(1.6e7, "tokens"))
    rows = {r["name"]: r for r in merged["targets"]}
    assert set(rows) == {"cpu [cloud-a]", "pjrt@gpu [cloud-b]", "cpu [cloud-b]"}
    assert rows["pjrt@gpu [cloud-b]"]["machine"] == "cloud-b" and rows["pjrt@gpu [cloud-b]"]["target"] == "pjrt@gpu"
    assert merged["reference"] == "cpu [cloud-a]"  # the first run's cpu
    assert rows["pjrt@gpu [cloud-b]"]["agrees"] is True and rows["cpu [cloud-b]"]["loss_rel_diff"] == 0.0
    # 1.6e7 tokens at 16 tokens per sample = 1e6 samples
    gpu = rows["pjrt@gpu [cloud-b]"]
    assert gpu["time_to_train_s"] == pytest.approx(1e6 / (32 / 0.002))
    assert gpu["cost_to_train"] == pytest.approx(3.0 * gpu["time_to_train_s"] / 3600)
    assert merged["rank_by_time"][0] == "pjrt@gpu [cloud-b]" and merged["fastest"] == "pjrt@gpu [cloud-b]"
    costs = {n: rows[n]["cost_to_train"] for n in rows}
    assert merged["rank_by_cost"] == sorted(costs, key=costs.get) and merged["ranked_by_job"]
    assert any("jax differs" in n and "0.10.1 on cloud-b" in n for n in merged["version_notes"])
    assert merged["schema"] == compare.SCHEMA and [r["label"] for r in merged["runs"]] == ["cloud-a", "cloud-b"]
    # another reference, by bare target name (its first run)
    assert compare.merge([a, b], reference="pjrt@gpu")["reference"] == "pjrt@gpu [cloud-b]"
    with pytest.raises(compare.CompareError, match="--reference 'tpu' is not a target that ran"):
        compare.merge([a, b], reference="tpu")


@pytest.mark.parametrize("field,change,named", [
    ("config", {"seed": 1}, "seed 1 vs 0"),
    ("config", {"task": "infer"}, "task 'infer' vs 'train'"),
    ("config", {"size": "small"}, "size 'small' vs 'tiny'"),
    ("workload", {"batch_size": 64}, "batch size 64 vs 32"),
    ("workload", {"name": "llama"}, "workload 'llama' vs 'gpt2'"),
])
def test_compare_refuses_runs_of_different_workloads(field, change, named):
    a = _run("a", [_row("cpu", 0.01, LOSSES)])
    b = _run("b", [_row("cpu", 0.01, LOSSES)])
    b[field] = {**b[field], **change}
    with pytest.raises(compare.CompareError, match=named):
        compare.merge([a, b])


def test_compare_cli_errors_are_clear(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    (tmp_path / "bad.json").write_text("not json")
    assert cli.main(["bench", "compare", str(tmp_path / "x.json")]) == 2
    assert "is not a `torchpjrt bench --json` file" in capsys.readouterr().err
    assert cli.main(["bench", "compare", str(tmp_path / "bad.json")]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert cli.main(["bench", "compare", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_table_fits_100_columns_without_cutting_values():
    from rich.console import Console

    a = _run("a-provider-with-a-long-name", [_row("cpu", 0.0123, LOSSES)])
    b = _run("b", [_row("pjrt-fused@gpu", 0.00123, LOSSES, hardware="gpu", device="NVIDIA H100 80GB HBM3", price=3.0)])
    merged = compare.merge([a, b], budget=prices.Budget(1e9, "samples"))
    console = Console(width=100, record=True, file=__import__("io").StringIO())
    display.print_table(console, merged)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    table_text = text.split("left out")[0] if "left out" in text else text
    words = table_text.split()
    for value in ("(fastest)", "pjrt-fused@gpu", "a-provider-with-a-long-name", "12.3", "days", "32.03"):
        assert value in words, value  # whole, not cut or folded
    assert "left out for the width of the terminal: " in text
    assert "ranked by cost for 1e+09 samples" in text and "cheapest" in text


def test_title_says_when_no_target_ran(capsys):
    from rich.console import Console

    failed = dict.fromkeys(results.TARGET_KEYS)
    failed.update(name="pjrt@tpu", status="skipped", reason="no TPU", losses=[])
    run = _run("m", [failed])
    run["workload"]["batch_size"] = None
    console = Console(width=120, record=True, file=__import__("io").StringIO())
    display.print_table(console, {**run, "reference": None, "fastest": None, "cheapest": None})
    assert "torchpjrt bench: gpt2 (tiny, train): no target ran" in console.export_text()


def test_progress_off_a_terminal_is_a_line_per_finished_target():
    from rich.console import Console

    console = Console(record=True, file=__import__("io").StringIO(), force_terminal=False)
    with display.ProgressView(console, ["cpu", "pjrt@cpu"], rounds=2) as progress:
        progress.update("cpu", "round 1/2")
        progress.update("cpu", "done: 1.2 ms/step (median)", done=True)
        progress.update("pjrt@cpu", "[red]failed: crash[/red]", done=True)
    lines = console.export_text().splitlines()
    assert lines == ["running 2 target(s): cpu, pjrt@cpu", "cpu: done: 1.2 ms/step (median)", "pjrt@cpu: failed: crash"]


def test_instance_prices_and_job_figures(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('currency = "EUR"\nsource = "my provider"\ndate = 2026-11-01\n[cpu]\nper_core_hour = 0.05\n'
                    '[accelerator]\n"H100" = 3.0\n[instance]\n"aws-p5" = { hourly = 96.0, chips = 8 }\n')
    table = prices.load(path)
    assert table.hourly("gpu", "NVIDIA H100", None, "aws-p5") == (12.0, "instance 'aws-p5': 96.0 EUR/hour / 8 chips")
    assert table.hourly("cpu", "x", 4, "aws-p5")[0] == 96.0
    assert table.hourly("gpu", "NVIDIA H100", None, "elsewhere")[0] == 3.0
    assert "my provider, as of 2026-11-01" in table.provenance()
    bad = tmp_path / "bad.toml"
    bad.write_text('[instance]\n"x" = { hourly = -1 }\n')
    with pytest.raises(prices.PriceTableError, match=r"\[instance\] 'x' must be"):
        prices.load(bad)
    row = {"status": "ok", "samples_per_s": 100.0, "tokens_per_s": None, "price_per_hour": 36.0}
    assert prices.job_figures(row, prices.Budget(3.6e5, "samples")) == {"time_to_train_s": 3600.0, "cost_to_train": 36.0}
    assert prices.job_figures(row, prices.Budget(1e6, "tokens")) == {"time_to_train_s": None, "cost_to_train": None}


def test_thread_choice_and_worker_environment():
    assert runner.choose_threads(2, 0.3) == 2
    assert runner.choose_threads(2, 1.4) == 1 and runner.choose_threads(2, 7.0) == 1
    assert runner.choose_threads(16, 3.9) == 13
    cpu_env = runner.worker_env(targets.Target("cpu"), threads=3)
    assert cpu_env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0" and cpu_env["OMP_NUM_THREADS"] == "3"
    pjrt_env = runner.worker_env(targets.Target("pjrt", "cpu"), threads=3)
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD" not in pjrt_env or pjrt_env["TORCH_DEVICE_BACKEND_AUTOLOAD"] != "0"


def test_model_given_as_a_file_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.py").write_text(textwrap.dedent(USER_MODULE) + "\nif __name__ == '__main__':\n    pass\n")
    assert _check_model_path("models/mine.py:make") is None
    assert "defines no 'maker' at its top level" in _check_model_path("models/mine.py:maker")
    assert "no file 'models/other.py'" in _check_model_path("models/other.py:make")
    w = workloads.build(None, "small", "models/mine.py:make", 4)
    assert isinstance(w.model, torch.nn.Linear)


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    """Two real runs, as two machines would make them: cpu on one, cpu and pjrt on the other."""
    out = tmp_path_factory.mktemp("machines")
    common = [sys.executable, "-m", "torchpjrt", "bench", "mlp", "--size", "tiny", "--steps", "2", "--rounds", "2",
              "--warmup", "1", "--timeout", "300", "--threads", "1"]
    for label, target_list in (("machine-a", "cpu"), ("machine-b", "cpu,pjrt")):
        proc = subprocess.run(common + ["--targets", target_list, "--label", label, "--json", str(out / f"{label}.json")],
                              capture_output=True, text=True, timeout=600, cwd=out)
        assert proc.returncode == 0, proc.stderr[-3000:]
    paths = {k: out / f"merged.{k}" for k in ("json", "csv", "html")}
    proc = subprocess.run(
        [sys.executable, "-m", "torchpjrt", "bench", "compare", str(out / "machine-a.json"), str(out / "machine-b.json"),
         "--samples", "1e8", "--json", str(paths["json"]), "--csv", str(paths["csv"]), "--report", str(paths["html"])],
        capture_output=True, text=True, timeout=300, cwd=out)
    return proc, paths, out


@pytest.mark.slow
def test_compare_of_two_real_runs(two_machines):
    proc, paths, out = two_machines
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 runs compared" in proc.stdout and "ranked by cost for 1e+08 samples" in proc.stdout
    merged = json.loads(paths["json"].read_text())
    assert merged["schema"] == compare.SCHEMA and merged["reference"] == "cpu [machine-a]"
    rows = {r["name"]: r for r in merged["targets"]}
    assert {"cpu [machine-a]", "cpu [machine-b]", "pjrt@cpu [machine-b]"} <= set(rows)
    for row in rows.values():
        assert row["status"] == "ok" and row["threads"]["torch_intra_op"] == 1 and row["threads"]["cores_pinned"] == 1
        assert row["time_to_train_s"] > 0 and row["cost_to_train"] > 0 and row["agrees"] is True
    # the cpu workers started without torchpjrt and JAX, the pjrt worker with them
    assert rows["cpu [machine-a]"]["imported_jax"] is False and rows["pjrt@cpu [machine-b]"]["imported_jax"] is True
    with open(paths["csv"], newline="") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == report.CSV_COLUMNS and {r["machine"] for r in table} == {"machine-a", "machine-b"}
    # a run of another workload is refused, naming the difference
    other = json.loads((out / "machine-b.json").read_text())
    other["config"]["seed"] = 7
    (out / "other.json").write_text(json.dumps(other))
    refused = subprocess.run([sys.executable, "-m", "torchpjrt", "bench", "compare", str(out / "machine-a.json"),
                              str(out / "other.json")], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "seed 7 vs 0" in refused.stderr


@pytest.mark.slow
def test_compare_report_renders_in_chromium(two_machines, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (torchpjrt[bench])")
    _, paths, _ = two_machines
    dom = _rendered(paths["html"], tmp_path)
    assert dom.count('src="data:image/png;base64,') == 3  # step time, cost of the job, loss curves
    assert "Machine machine-a" in dom and "Machine machine-b" in dom and "Ranking" in dom


@pytest.mark.slow  # fresh processes
def test_accelerator_check_runs_its_parts_and_skips_after_a_failed_env(tmp_path):
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "accelerator_check.py")

    def check(out, extra_env):
        r = subprocess.run([sys.executable, script, "--out", str(out), "--parts", "env,overhead,ddp", "--budget", "200",
                            "--quick"],
                           capture_output=True, text=True, timeout=400, env={**os.environ, **extra_env})
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads((out / "accelerator_check.json").read_text())
        assert (out / "accelerator_check.txt").read_text().startswith("accelerator check:")
        return {p["part"]: p for p in summary["parts"]}

    parts = check(tmp_path / "ok", {})
    assert parts["env"]["status"] == "ok" and parts["env"]["info"]["matmul_matches_cpu"] is True
    assert parts["overhead"]["status"] == "ok" and "host cost per op" in parts["overhead"]["output"]
    assert parts["ddp"]["status"].startswith("skipped")  # fewer than 2 chips
    parts = check(tmp_path / "broken", {"TORCHPJRT_PLATFORM": "nosuch"})
    assert parts["env"]["status"].startswith("failed") and "nosuch" in parts["env"]["output"]
    assert parts["overhead"]["status"] == "skipped: env failed"
