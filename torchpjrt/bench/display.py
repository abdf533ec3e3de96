"""The terminal: a live progress display while running and the final table (rich)."""

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table

# ---- formatting (shared with the HTML report) -----------------------------------------------


def fmt_ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def fmt_step(step: dict | None) -> str:
    if not step:
        return "n/a"
    return f"{fmt_ms(step['median'])} ({fmt_ms(step['p10'])}–{fmt_ms(step['p90'])})"


def fmt_rate(row: dict) -> str:
    if row["samples_per_s"] is None:
        return "n/a"
    text = f"{row['samples_per_s']:,.0f} samples/s"
    return text + (f"\n{row['tokens_per_s']:,.0f} tokens/s" if row["tokens_per_s"] else "")


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


MEMORY_SOURCE_SHORT = {
    "process peak RSS (getrusage)": "RSS",
    "torch.pjrt.max_memory_allocated": "device",
    "torch.cuda.max_memory_allocated": "device",
}


def fmt_memory(row: dict) -> str:
    if row["peak_memory_bytes"] is None:
        return "n/a"
    return f"{fmt_bytes(row['peak_memory_bytes'])} ({MEMORY_SOURCE_SHORT.get(row['peak_memory_source'], '?')})"


def fmt_energy(row: dict) -> str:
    j = row["energy_j_per_step"]
    return "n/a" if j is None else f"{j:.3g} J"


def fmt_cost(row: dict, currency: str | None) -> str:
    c = row["cost_per_million_samples"]
    return "n/a" if c is None else f"{c:.3g} {currency}"


def fmt_agreement(row: dict, reference: str | None) -> str:
    if row["loss_rel_diff"] is None:
        return "n/a" if reference is None or row["status"] != "ok" else "n/a (step counts differ)"
    mark = "ok" if row["agrees"] else "DIFFERS"
    return f"{row['loss_rel_diff']:.1e} {mark}"


def fmt_status(row: dict) -> str:
    return row["status"] + (f" ({row['error_kind']})" if row["error_kind"] else "")


def fmt_loss(value) -> str:
    return "n/a" if value is None else f"{value:.6g}"


# ---- live progress --------------------------------------------------------------------------


class ProgressView:
    """One line per target: a bar over start-up + rounds, and what it is doing now."""

    def __init__(self, console: Console, names: list[str], rounds: int):
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), console=console,
        )
        self.tasks = {n: self.progress.add_task(n, total=rounds + 1, status="waiting") for n in names}

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def update(self, name: str, status: str, advance: int = 0, done: bool = False):
        task = self.tasks[name]
        self.progress.update(task, status=status, advance=advance)
        if done:  # a failed target stops here: its bar ends where it got to
            self.progress.update(task, total=self.progress.tasks[task].completed or 1, completed=self.progress.tasks[task].completed or 1)


# ---- final table ----------------------------------------------------------------------------


def print_table(console: Console, result: dict):
    console.print(_results_table(result))
    for line in notes(result):
        console.print(line, highlight=False, markup=False)
    problems = [r for r in result["targets"] if r["status"] != "ok"]
    if problems:
        console.print(_problems_table(problems))


def _results_table(result: dict) -> Table:
    w = result["workload"]
    cfg = result["config"]
    title = f"torchpjrt bench: {w['name']} ({cfg['size'] if not cfg['model'] else 'user model'}, {cfg['task']}, batch {w['batch_size']})"
    table = Table(title=title, header_style="bold")
    for column in ("target", "device", "step time median (p10–p90)", "throughput", "first step", "peak memory",
                   "energy/step", "cost / 1M samples", "final loss", f"loss vs {result['reference'] or 'cpu'}"):
        table.add_column(column, justify="left" if column in ("target", "device") else "right")
    for row in result["targets"]:
        if row["status"] != "ok":
            continue
        tags = [t for t, key in (("fastest", "fastest"), ("cheapest", "cheapest")) if result[key] == row["name"]]
        name = escape(row["name"]) + (f"\n[bold green]{', '.join(tags)}[/]" if tags else "")
        agreement = fmt_agreement(row, result["reference"])
        table.add_row(
            name, escape(row["device_name"]), fmt_step(row["step_time_s"]), fmt_rate(row), f"{row['time_to_first_step_s']:.1f} s",
            fmt_memory(row), fmt_energy(row), fmt_cost(row, result["currency"]), fmt_loss(row["final_loss"]),
            f"[red]{escape(agreement)}[/]" if row["agrees"] is False else escape(agreement),
            style="bold" if tags else None,
        )
    return table


def notes(result: dict) -> list[str]:
    """The sources behind the memory, energy and cost columns, each said once."""
    ok = [r for r in result["targets"] if r["status"] == "ok"]
    lines = ["first step: from process launch to the end of the first step (imports, model build, compilation)"]
    memory = sorted({f"{MEMORY_SOURCE_SHORT.get(r['peak_memory_source'], '?')} = {r['peak_memory_source']}" for r in ok})
    if memory:
        lines.append("peak memory: " + "; ".join(memory))
    for label, key in (("energy", "energy_source"), ("cost basis", "price_basis")):
        seen = {}
        for r in ok:
            seen.setdefault(r[key], []).append(r["name"])
        lines += [f"{label} ({', '.join(names)}): {text}" for text, names in seen.items()]
    load, cores = result["machine"].get("load_average"), result["machine"]["usable_cores"]
    if load and max(load.values()) > cores:
        lines.append(f"warning: the machine was busy (1-minute load average {load['start']:.1f} at the start, "
                     f"{load['end']:.1f} at the end, on {cores} cores): timings are noisy")
    if result["reference"]:
        lines.append(f"loss agreement: relative difference of the final loss to {result['reference']}, tolerance {result['tolerance']:g}")
    else:
        lines.append("loss agreement: n/a (the cpu target did not run)")
    return lines


def _problems_table(rows: list[dict]) -> Table:
    table = Table(title="not run / failed", header_style="bold", show_lines=False)
    table.add_column("target")
    table.add_column("status")
    table.add_column("reason", overflow="fold")
    for row in rows:
        status = escape(fmt_status(row))
        table.add_row(escape(row["name"]), f"[red]{status}[/]" if row["status"] == "failed" else status, escape(row["reason"] or ""))
    return table
