"""Files: the results as JSON and CSV, and a self-contained HTML report with plots."""

import base64
import csv
import html
import io
import json
import math

from . import display
from .measure import relative_difference

CSV_COLUMNS = (
    "target", "machine", "status", "reason", "device_name", "step_median_ms", "step_p10_ms", "step_p90_ms",
    "samples_per_s", "tokens_per_s", "time_to_first_step_s", "peak_memory_bytes", "peak_memory_source",
    "energy_j_per_step", "energy_source", "threads", "busy_machine", "price_per_hour", "cost_per_million_samples",
    "currency", "price_basis", "time_to_train_s", "cost_to_train", "final_loss", "loss_rel_diff", "agrees",
)


def _finite(value):
    """JSON has no NaN or infinity: a non-finite loss is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(result: dict, path: str):
    with open(path, "w") as f:
        json.dump(_finite(result), f, indent=2)
        f.write("\n")


def write_csv(result: dict, path: str):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in result["targets"]:
            writer.writerow(_csv_row(row, result["currency"]))


def _csv_row(row: dict, currency: str | None) -> dict:
    step = row["step_time_s"] or {}
    ms = {f"step_{k}_ms": step[k] * 1e3 for k in ("median", "p10", "p90") if k in step}
    threads = (row.get("threads") or {}).get("torch_intra_op")
    return {
        **{k: row[k] for k in CSV_COLUMNS if k in row},
        "target": row.get("target") or row["name"], "machine": row.get("machine"),
        "currency": row.get("currency") or currency, "threads": threads, **ms,
    }


# ---- HTML -----------------------------------------------------------------------------------


def write_html(result: dict, path: str):
    with open(path, "w") as f:
        f.write(render_html(result))


def render_html(result: dict) -> str:
    esc = html.escape
    w = result["workload"]
    title = display.title(result).replace("torchpjrt bench:", "torchpjrt bench —", 1)
    created = result.get("created") or ", ".join(r["created"] or "?" for r in result["runs"])
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>{STYLE}</head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p>{esc(w['description'] or '')}; batch {w['batch_size']}; {_count(w['parameters'])} parameters; "
        f"created {esc(created)}.</p>",
        "<h2>Results</h2>", _results_html(result),
        _ranking_html(result),
        "<h2>Plots</h2>", _plots_html(result),
        _problems_html(result),
    ]
    if "runs" in result:  # a comparison: each machine with its own versions
        for run in result["runs"]:
            parts += [f"<h2>Machine {esc(run['label'])}</h2>", f"<p>From {esc(run['path'])}.</p>",
                      _definition_list(_machine_items(run["machine"])),
                      "<h3>Versions</h3>", _definition_list(list(run["versions"].items()))]
    else:
        parts += ["<h2>Machine</h2>", _definition_list(_machine_items(result["machine"])),
                  "<h2>Versions</h2>", _definition_list(list(result["versions"].items()))]
    parts += ["<h2>Method</h2>", f"<p>{esc(result['method'] or '')}</p>",
              f"<p>Configuration: <code>{esc(json.dumps(result['config']))}</code></p>", "</body></html>"]
    return "\n".join(parts)


STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; } th, td { border: 1px solid #ccc; padding: 4px 8px; }
td.num { text-align: right; white-space: nowrap; } tr.best { background: #e8f6e8; }
.differs { color: #b00; font-weight: bold; } img { max-width: 100%; } dt { font-weight: bold; }
</style>"""


def _count(n) -> str:
    return "n/a" if n is None else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def _results_html(result: dict) -> str:
    esc = html.escape
    cols = display.columns(result)
    rows = []
    for row in (r for r in result["targets"] if r["status"] == "ok"):
        best = display.tags(result, row)
        cells = []
        for header, cell in cols:
            text = esc(cell(row)).replace("\n", "<br>")
            if header == "target":
                text += "".join(f" <b>({t})</b>" for t in best)
            elif header.startswith("loss vs") and row["agrees"] is False:
                text = f"<span class='differs'>{text}</span>"
            cells.append(f"<td>{text}</td>" if header in ("target", "machine", "device") else f"<td class='num'>{text}</td>")
        rows.append(f"<tr{' class=best' if best else ''}>{''.join(cells)}</tr>")
    table = "<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h, _ in cols) + "</tr>" + "".join(rows) + "</table>"
    notes = "".join(f"<li>{esc(n)}</li>" for n in display.notes(result))
    return table + f"<ul>{notes}</ul>"


def _ranking_html(result: dict) -> str:
    lines = display.ranking_lines(result)
    if not lines:
        return ""
    return "<h2>Ranking</h2><ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>"


def _problems_html(result: dict) -> str:
    rows = [r for r in result["targets"] if r["status"] != "ok"]
    if not rows:
        return ""
    esc = html.escape
    body = "".join(
        f"<tr><td>{esc(r['name'])}</td><td>{esc(display.fmt_status(r))}</td><td>{esc(r['reason'] or '')}{_traceback_html(r)}</td></tr>"
        for r in rows
    )
    return f"<h2>Not run / failed</h2><table><tr><th>target</th><th>status</th><th>reason</th></tr>{body}</table>"


def _traceback_html(row: dict) -> str:
    if not row["error_detail"]:
        return ""
    return f"<details><summary>traceback</summary><pre>{html.escape(row['error_detail'])}</pre></details>"


def _machine_items(m: dict) -> list:
    return [
        ("CPU", f"{m['cpu_model']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable)"),
        ("memory", f"{m['memory_gib']} GiB" if m["memory_gib"] else "n/a"),
        ("accelerators", ", ".join(m["accelerators"]) or "none"),
        ("OS", m["os"]),
        ("load average (1 min)", _load_text(m.get("load_average"))),
    ]


def _load_text(load) -> str:
    return "n/a" if not load else f"{load['start']:.2f} at the start, {load['end']:.2f} at the end of the run"


def _definition_list(items) -> str:
    esc = html.escape
    return "<dl>" + "".join(f"<dt>{esc(str(k))}</dt><dd>{esc(str(v))}</dd>" for k, v in items) + "</dl>"


# ---- plots ----------------------------------------------------------------------------------


def _plots_html(result: dict) -> str:
    try:
        import matplotlib
    except ImportError:
        return "<p>Plots need matplotlib: <code>pip install 'torchpjrt[bench]'</code>.</p>"
    matplotlib.use("Agg")
    ok = [r for r in result["targets"] if r["status"] == "ok"]
    if not ok:
        return "<p>No target ran: nothing to plot.</p>"
    figures = [("step time per target", _step_time_plot(ok))]
    if result.get("budget"):
        priced = [r for r in ok if r["cost_to_train"] is not None]
        cost = _cost_plot(priced, result["currency"], "cost_to_train", f"Cost of {result['budget']}",
                          f"{result['currency']} for {result['budget']}") if priced else None
    else:
        priced = [r for r in ok if r["cost_per_million_samples"] is not None]
        cost = _cost_plot(priced, result["currency"], "cost_per_million_samples", "Cost per million samples",
                          f"{result['currency']} per 1M samples") if priced else None
    figures.append(("cost per target", cost))
    figures.append(("loss curves per target", _loss_plot(ok, result["config"]["warmup"], result["reference"])))
    return "\n".join(
        f"<figure><img alt='{html.escape(alt)}' src='data:image/png;base64,{png}'></figure>" if png
        else f"<p>No {html.escape(alt)} plot: no target has a price.</p>"
        for alt, png in figures
    )


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _bar_chart(names, values, title, xlabel, errors=None):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * len(names)))
    ax.barh(names, values, xerr=errors, color="#4C72B0", capsize=4)
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _step_time_plot(rows) -> str:
    medians = [r["step_time_s"]["median"] * 1e3 for r in rows]
    errors = [[m - r["step_time_s"]["p10"] * 1e3 for m, r in zip(medians, rows)],
              [r["step_time_s"]["p90"] * 1e3 - m for m, r in zip(medians, rows)]]
    return _png(_bar_chart([r["name"] for r in rows], medians, "Step time (median; bars: p10–p90)", "ms per step", errors))


def _cost_plot(rows, currency, key, title, xlabel) -> str:
    return _png(_bar_chart([r["name"] for r in rows], [r[key] for r in rows], title, xlabel))


def _loss_plot(rows, warmup: int, reference: str | None) -> str:
    """Left: the loss after each step. Right: its relative difference to the reference target."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (curves, diffs) = plt.subplots(1, 2, figsize=(12, 4))
    ref = next((r["losses"] for r in rows if r["name"] == reference), None)
    for i, r in enumerate(rows):
        steps, style = range(1, len(r["losses"]) + 1), {"label": r["name"], "color": f"C{i}", "alpha": 0.8}
        curves.plot(steps, r["losses"], **style)
        if ref is not None and r["name"] != reference:  # runs may differ in steps: the common prefix
            n = min(len(r["losses"]), len(ref))
            diffs.plot(steps[:n], [relative_difference(a, b) for a, b in zip(r["losses"][:n], ref[:n])], **style)
    for ax in (curves, diffs):
        ax.axvline(warmup + 0.5, color="gray", linestyle="--", linewidth=1, label="end of warm-up")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    curves.set_title("Loss after each step")
    curves.set_ylabel("loss")
    diffs.set_title(f"Relative difference to {reference}" if ref is not None else "No reference target (cpu) ran")
    diffs.set_yscale("symlog", linthresh=1e-9)  # exact agreement (0) stays on the plot
    return _png(fig)
