"""`torchpjrt bench compare`: runs made on different machines, merged into one comparison.

The chips a hardware choice is between are never in one machine, so each machine runs
`torchpjrt bench --json` and this merges the files. Runs must measure the same thing (the
workload, its size, task, batch size, seed and learning rate): a mismatch is refused with the
difference named. Every run computes the same losses from the same seed, so each target's loss
curve is compared with one reference target (by default the first run's `cpu`).
"""

import json

from . import prices, results

SCHEMA = "torchpjrt-bench-compare/1"

# what must be equal across runs for their figures to be comparable: (what, how to read it)
MUST_MATCH = (
    ("workload", lambda r: r["workload"]["name"]),
    ("size", lambda r: None if r["config"].get("model") else r["config"].get("size")),
    ("task", lambda r: r["config"].get("task")),
    ("batch size", lambda r: r["workload"].get("batch_size")),
    ("seed", lambda r: r["config"].get("seed")),
    ("learning rate", lambda r: r["config"].get("lr") if r["config"].get("task") == "train" else None),
)


class CompareError(Exception):
    pass


def load_run(path: str) -> dict:
    try:
        with open(path) as f:
            run = json.load(f)
    except OSError as e:
        raise CompareError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise CompareError(f"{path} is not JSON ({e})") from None
    if not isinstance(run, dict) or run.get("schema") != results.SCHEMA:
        found = run.get("schema") if isinstance(run, dict) else type(run).__name__
        raise CompareError(f"{path} is not a `torchpjrt bench --json` file (schema {found!r}, expected {results.SCHEMA!r})")
    run["_path"] = path
    return run


def check_comparable(runs: list[dict]) -> None:
    first = runs[0]
    for what, read in MUST_MATCH:
        for run in runs[1:]:
            if read(run) != read(first):
                raise CompareError(
                    f"{run['_path']} and {first['_path']} measured different things: {what} "
                    f"{read(run)!r} vs {read(first)!r}; compare runs of one workload configuration")


def version_differences(runs: list[dict]) -> list[str]:
    notes = []
    names = sorted({k for r in runs for k in r.get("versions", {})})
    for name in names:
        seen = {}
        for r in runs:
            seen.setdefault(r.get("versions", {}).get(name), []).append(machine_label(r))
        if len(seen) > 1:
            notes.append(f"{name} differs: " + "; ".join(f"{v} on {', '.join(m)}" for v, m in seen.items()))
    return notes


def machine_label(run: dict) -> str:
    return run["machine"].get("label") or results.default_label(run["machine"])


def merge(runs: list[dict], reference: str | None = None, budget: prices.Budget | None = None,
          table: prices.PriceTable | None = None, tolerance: float | None = None) -> dict:
    """One result in the layout of a bench result, every target row labelled with its machine."""
    if not runs:
        raise CompareError("give at least one run (a `torchpjrt bench --json` file)")
    check_comparable(runs)
    labels = _unique_labels(runs)
    rows = []
    for run, label in zip(runs, labels):
        for original in run["targets"]:
            row = _filled({**dict.fromkeys(results.TARGET_KEYS), **original})
            row.update(target=original["name"], name=f"{original['name']} [{label}]", machine=label,
                       run=run["_path"], currency=run.get("currency"))
            if table is not None and row["status"] == "ok":
                row.update(results.price_row(row, table, run["machine"].get("label")))
                row["currency"] = table.currency
            rows.append(row)
    tolerance = runs[0].get("tolerance", 1e-3) if tolerance is None else tolerance
    reference_name = _reference(rows, reference, labels[0])
    _agreement(rows, reference_name, tolerance)
    for row in rows:
        row.update(prices.job_figures(row, budget))
    ok = [r for r in rows if r["status"] == "ok"]
    currencies = {r["currency"] for r in ok if r["cost_per_million_samples"] is not None}
    if len(currencies) > 1:
        raise CompareError(f"the runs priced in different currencies ({', '.join(sorted(map(str, currencies)))}); "
                           "give one price table with --prices")
    first = runs[0]
    return {
        "schema": SCHEMA,
        "runs": [{"path": r["_path"], "label": label, "created": r.get("created"), "machine": r["machine"],
                  "versions": r.get("versions", {}), "prices": r.get("prices"), "price_source": r.get("price_source")}
                 for r, label in zip(runs, labels)],
        "config": first["config"],
        "workload": first["workload"],
        "machine": first["machine"],
        "versions": first.get("versions", {}),
        "version_notes": version_differences(runs),
        "method": first.get("method"),
        "reference": reference_name,
        "tolerance": tolerance,
        "currency": next(iter(currencies), first.get("currency")),
        "prices": table.path if table else None,
        "price_source": table.provenance() if table else _price_sources(runs),
        "budget": budget.describe() if budget else None,
        "budget_note": results.budget_note(budget, first["workload"]),
        **results.rankings(ok),
        "targets": rows,
    }


def _filled(row: dict) -> dict:
    """Columns a run written before they existed lacks, where the rest of the row gives them."""
    if row["hardware"] is None and row.get("kind"):
        device_type = row["kind"].split("-")[0]
        row["hardware"] = row["platform"] if device_type == "pjrt" else "gpu" if device_type == "cuda" else "cpu"
    if row["price_per_hour"] is None and row["cost_per_million_samples"] is not None and row["samples_per_s"]:
        row["price_per_hour"] = row["cost_per_million_samples"] / 1e6 * row["samples_per_s"] * 3600
    return row


def _unique_labels(runs: list[dict]) -> list[str]:
    labels, seen = [], {}
    for run in runs:
        label = machine_label(run)
        seen[label] = seen.get(label, 0) + 1
        labels.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return labels


def _price_sources(runs: list[dict]) -> str | None:
    sources = sorted({r.get("price_source") or r.get("prices") for r in runs} - {None})
    return "; ".join(sources) or None


def _reference(rows: list[dict], wanted: str | None, first_label: str) -> str | None:
    """The merged name of the reference target: --reference as a merged name or a bare target
    name (its first run), else the first run's cpu."""
    ok = [r for r in rows if r["status"] == "ok"]
    if wanted is None:
        return next((r["name"] for r in ok if r["target"] == results.REFERENCE and r["machine"] == first_label), None)
    for r in ok:
        if wanted in (r["name"], r["target"]):
            return r["name"]
    names = ", ".join(r["name"] for r in ok) or "none"
    raise CompareError(f"--reference {wanted!r} is not a target that ran (targets that ran: {names})")


def _agreement(rows: list[dict], reference: str | None, tolerance: float) -> None:
    ref = next((r for r in rows if r["name"] == reference), None)
    for row in rows:
        if ref is None or row["status"] != "ok":
            row.update(results.loss_agreement([], [], tolerance))
        else:
            row.update(results.loss_agreement(row["losses"], ref["losses"], tolerance))
