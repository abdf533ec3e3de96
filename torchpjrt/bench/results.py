"""From what the workers reported to the results: statistics, throughput, cost, agreement.

The result is one JSON-ready dict (the `--json` file); every other output reads it.
"""

import datetime
import math

from . import prices
from .measure import relative_difference, spread

SCHEMA = "torchpjrt-bench/1"
REFERENCE = "cpu"

METHOD = (
    "Each target runs in its own worker process; the workers start one after another, so no "
    "other target runs during a start-up; time to first step counts from process launch to the end of the first step (interpreter "
    "start, imports, model build, transfer, compilation; inductor's cache starts empty). Every target builds the model on the CPU from "
    "the same seed, moves it to its device, and trains on the same stream of batches (the CPU generator "
    "is reseeded before each batch; the batch copy is made before the timer starts). A step is "
    "forward + loss (+ backward + AdamW for train); the device is synchronised before each timer read, "
    "so consecutive steps do not overlap. After {warmup} warm-up step(s), {rounds} rounds of {steps} "
    "steps are run; within a round the targets take turns (the order rotates each round) so that drift "
    "of the machine reaches all of them alike. Step time statistics are over all measured steps. "
    "Energy per step is a counter difference over each round divided by its steps (it includes batch "
    "preparation, and RAPL counts the whole CPU package, other processes included). Cost is the hourly "
    "price from the price table times the median step time. Agreement: the largest relative difference "
    "of each target's loss to the cpu target's over the first {agreement_steps} steps, flagged above the tolerance."
)

TARGET_KEYS = (
    "name", "kind", "platform", "hardware", "status", "reason", "error_kind", "device_name",
    "step_time_s", "samples_per_s", "tokens_per_s", "time_to_first_step_s", "startup_s",
    "peak_memory_bytes", "peak_memory_source", "energy_j_per_step", "energy_source",
    "cores", "threads", "imported_jax", "busy_machine", "price_per_hour",
    "cost_per_million_samples", "price_basis", "time_to_train_s", "cost_to_train", "losses", "final_loss",
    "loss_rel_diff", "final_loss_rel_diff", "max_loss_rel_diff", "agrees", "round_median_step_s", "error_detail",
)


def summarize(config, records, not_run, probed, table) -> dict:
    machine = dict(probed["machine"], label=config.label or default_label(probed["machine"]))
    rows = [_measured(r, table, machine["label"]) for r in records] + [_not_run(entry) for entry in not_run]
    reference = _add_agreement(rows, config.tolerance)
    budget = config.budget()
    for row in rows:
        row.update(prices.job_figures(row, budget))
    _mark_busy(rows, machine)
    ok = [r for r in rows if r["status"] == "ok"]
    ready = next((r.ready for r in records if r.ready), {})
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": dict(vars(config)),
        "workload": {
            "name": config.model or config.workload,
            "description": ready.get("description"),
            "batch_size": ready.get("batch_size"),
            "tokens_per_sample": ready.get("tokens_per_sample"),
            "parameters": ready.get("parameters"),
        },
        "machine": machine,
        "versions": probed["versions"],
        "method": METHOD.format(warmup=config.warmup, rounds=config.rounds, steps=config.steps,
                                agreement_steps=AGREEMENT_STEPS),
        "reference": reference,
        "tolerance": config.tolerance,
        "currency": table.currency if table else None,
        "prices": table.path if table else None,
        "price_source": table.provenance() if table else None,
        "budget": budget.describe() if budget else None,
        "budget_note": budget_note(budget, {"name": config.model or config.workload,
                                            "tokens_per_sample": ready.get("tokens_per_sample")}),
        **rankings(ok),
        "targets": rows,
    }


def rankings(ok: list[dict]) -> dict:
    """fastest/cheapest, and the targets that ran ordered by time and by cost: of the whole job
    when a budget gave those figures, else per sample (throughput, cost per million samples)."""
    job = any(r["time_to_train_s"] is not None for r in ok)
    by_time = _ranked(ok, (lambda r: r["time_to_train_s"]) if job else (lambda r: 1 / r["samples_per_s"]))
    by_cost = _ranked(ok, (lambda r: r["cost_to_train"]) if job else (lambda r: r["cost_per_million_samples"]))
    return {"fastest": by_time[0] if by_time else None, "cheapest": by_cost[0] if by_cost else None,
            "rank_by_time": by_time, "rank_by_cost": by_cost, "ranked_by_job": job}


def budget_note(budget, workload: dict) -> str | None:
    """Why a budget gave no job figures, when it did not."""
    if budget is not None and budget.unit == "tokens" and not workload.get("tokens_per_sample"):
        return f"--tokens: the workload {workload.get('name')!r} has no tokens per sample; give the job with --samples"
    return None


def default_label(machine: dict) -> str:
    """A machine's name when the run was given no --label: its host CPU and accelerators."""
    accelerators = ", ".join(machine.get("accelerators") or []) or "no accelerator"
    return f"{machine.get('cpu_model') or 'unknown CPU'} / {accelerators}"


BUSY_LOAD = 1.0  # load average above the cores a run left free marks its CPU timings


def _mark_busy(rows: list[dict], machine: dict) -> None:
    """Rows whose step time other load on the CPU can change (targets computing on the CPU)
    are marked when the load average says other work was running."""
    load = machine.get("load_average")
    cores = machine.get("usable_cores") or 1
    for row in rows:
        if row["status"] != "ok" or row["hardware"] != "cpu" or not load:
            row["busy_machine"] = False if row["status"] == "ok" else None
            continue
        threads = (row["threads"] or {}).get("torch_intra_op") or cores
        # one process of ours runs at a time, with `threads` threads; load beyond them is others'
        row["busy_machine"] = bool(max(load.values()) > threads + BUSY_LOAD and max(load.values()) > cores - 0.5)


def _empty_row(name: str, status: str, reason: str | None) -> dict:
    row = dict.fromkeys(TARGET_KEYS)
    row.update(name=name, status=status, reason=reason, losses=[])
    return row


def _not_run(entry: dict) -> dict:
    kind, _, platform = entry["name"].partition("@")
    row = _empty_row(entry["name"], entry["status"], entry["reason"])
    row.update(kind=kind, platform=platform or None)
    return row


def _measured(record, table, label) -> dict:
    target = record.target
    row = _empty_row(target.name, record.status, record.reason)
    row.update(kind=target.kind, platform=target.platform, hardware=target.hardware, error_kind=record.error_kind,
               error_detail=record.error_detail, losses=record.losses)
    ready = record.ready
    if ready:
        row.update(
            device_name=ready["device_name"],
            time_to_first_step_s=ready["time_to_first_step_s"],
            startup_s={k: ready[k] for k in ("import_s", "build_s", "first_step_s")},
            cores=ready["cores"], threads=ready["threads"], imported_jax=ready["imported_jax"],
        )
    if record.status != "ok":
        return row
    step = spread(record.step_times)
    samples_per_s = ready["batch_size"] / step["median"]
    row.update(
        step_time_s=step,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * ready["tokens_per_sample"] if ready["tokens_per_sample"] else None,
        round_median_step_s=[spread(times)["median"] for times in record.round_times],
        peak_memory_bytes=record.final["peak_memory_bytes"],
        peak_memory_source=record.final["peak_memory_source"],
        final_loss=record.losses[-1] if record.losses else None,
    )
    row.update(_energy(record))
    row.update(price_row(row, table, label))
    return row


def _energy(record) -> dict:
    ready = record.ready
    if ready["energy_source"] is None or any(j is None for j in record.energy_j):
        return {"energy_j_per_step": None, "energy_source": f"n/a: {ready['energy_unavailable']}"}
    return {"energy_j_per_step": sum(record.energy_j) / len(record.step_times), "energy_source": ready["energy_source"]}


def price_row(row: dict, table, label: str | None) -> dict:
    """The price columns of a row that ran: hourly price, its basis, cost per million samples."""
    none = {"price_per_hour": None, "cost_per_million_samples": None}
    if table is None:
        return {**none, "price_basis": "n/a: no price table (see --prices)"}
    hourly, basis = table.hourly(row["hardware"], row["device_name"], row["cores"], label)
    if hourly is None:
        return {**none, "price_basis": f"n/a: {basis}"}
    batch_size = row["samples_per_s"] * row["step_time_s"]["median"]
    cost = prices.cost_per_million_samples(hourly, row["step_time_s"]["median"], batch_size)
    return {"price_per_hour": hourly, "cost_per_million_samples": cost, "price_basis": basis}


# Agreement is judged on the first steps: there two correct implementations of the same program
# differ by float rounding alone, while later steps of a training run amplify that rounding (on
# GPT-2 small, torch.compile's losses were 3% off torch CPU eager's by step 50, pjrt's 1%).
AGREEMENT_STEPS = 10


def loss_agreement(losses: list[float], reference: list[float], tolerance: float) -> dict:
    """How a target's loss curve compares with the reference's over their common steps:
    loss_rel_diff (the judged figure: the largest relative difference over the first
    AGREEMENT_STEPS steps), final_loss_rel_diff, max_loss_rel_diff and agrees. A NaN loss
    anywhere never agrees."""
    n = min(len(losses), len(reference))  # runs may differ in steps: the common prefix
    if n == 0:
        return {"loss_rel_diff": None, "final_loss_rel_diff": None, "max_loss_rel_diff": None, "agrees": None}
    diffs = [relative_difference(a, b) for a, b in zip(losses[:n], reference[:n])]
    nan = any(math.isnan(d) for d in diffs)
    judged = max(diffs[:AGREEMENT_STEPS])
    return {"loss_rel_diff": math.nan if nan else judged, "final_loss_rel_diff": diffs[-1],
            "max_loss_rel_diff": math.nan if nan else max(diffs), "agrees": not nan and judged <= tolerance}


def _add_agreement(rows: list[dict], tolerance: float) -> str | None:
    """Compare every target's losses with the cpu target's; returns the reference's name."""
    reference = next((r for r in rows if r["name"] == REFERENCE and r["status"] == "ok"), None)
    if reference is None:
        return None
    for row in rows:
        if row["status"] == "ok":
            row.update(loss_agreement(row["losses"], reference["losses"], tolerance))
    return REFERENCE


def _ranked(rows: list[dict], key) -> list[str]:
    candidates = [r for r in rows if key(r) is not None and math.isfinite(key(r))]
    return [r["name"] for r in sorted(candidates, key=key)]
