"""The terminal: a live progress display while running and the final table (rich)."""

import io

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from .results import AGREEMENT_STEPS

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


def fmt_duration(seconds) -> str:
    if seconds is None:
        return "n/a"
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def fmt_money(value, currency) -> str:
    return "n/a" if value is None else f"{value:,.4g} {currency}"


def tags(result: dict, row: dict) -> list[str]:
    return [t for t in ("fastest", "cheapest") if result.get(t) == row["name"]]


def title(result: dict) -> str:
    w, cfg = result["workload"], result["config"]
    what = "user model" if cfg.get("model") else cfg["size"]
    batch = f", batch {w['batch_size']}" if w.get("batch_size") else ""
    text = f"torchpjrt bench: {w['name']} ({what}, {cfg['task']}{batch})"
    if "runs" in result:
        text += f", {len(result['runs'])} runs compared"
    if not any(r["status"] == "ok" for r in result["targets"]):
        text += ": no target ran"
    return text


def columns(result: dict) -> list[tuple[str, callable]]:
    """(header, cell text) of every column with something to show: a column that is n/a on every
    row is left out, so that the table keeps its values whole on a narrow terminal."""
    ok = [r for r in result["targets"] if r["status"] == "ok"]
    currency = result["currency"]
    cols = [("target", lambda r: r["name"] if "runs" not in result else r["target"])]
    if "runs" in result:
        cols.append(("machine", lambda r: r["machine"]))
    cols += [
        ("device", lambda r: r["device_name"]),
        ("step time median (p10–p90)", lambda r: fmt_step(r["step_time_s"]) + (" busy*" if r.get("busy_machine") else "")),
        ("throughput", fmt_rate),
        ("first step", lambda r: f"{r['time_to_first_step_s']:.1f} s"),
        ("peak memory", fmt_memory),
        ("energy/step", fmt_energy),
        ("cost / 1M samples", lambda r: fmt_cost(r, r.get("currency") or currency)),
    ]
    if result.get("budget"):
        cols += [(f"time for {result['budget']}", lambda r: fmt_duration(r["time_to_train_s"])),
                 (f"cost for {result['budget']}", lambda r: fmt_money(r["cost_to_train"], r.get("currency") or currency))]
    cols += [("final loss", lambda r: fmt_loss(r["final_loss"])),
             ("loss vs reference" if "runs" in result else f"loss vs {result['reference'] or 'cpu'}",
              lambda r: fmt_agreement(r, result["reference"]))]
    return [(h, f) for h, f in cols if h in ("target", "final loss") or any(f(r) != "n/a" for r in ok)]


# ---- live progress --------------------------------------------------------------------------


class ProgressView:
    """One line per target: a bar over start-up + rounds, and what it is doing now. Not on a
    terminal (a log, a pipe), a plain line per target as it finishes instead."""

    def __init__(self, console: Console, names: list[str], rounds: int):
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), console=console,
        )
        self.tasks = {n: self.progress.add_task(n, total=rounds + 1, status="waiting") for n in names}
        self.last = {}

    def __enter__(self):
        if self.live:
            self.progress.start()
        else:
            self.console.print(f"running {len(self.tasks)} target(s): {', '.join(self.tasks)}", highlight=False, markup=False)
        return self

    def __exit__(self, *exc):
        if self.live:
            self.progress.stop()

    def update(self, name: str, status: str, advance: int = 0, done: bool = False):
        if not self.live:
            if done:
                self.console.print(f"{name}: {Text.from_markup(status).plain}", highlight=False, markup=False)
            self.last[name] = status
            return
        task = self.tasks[name]
        self.progress.update(task, status=status, advance=advance)
        if done:  # a failed target stops here: its bar ends where it got to
            self.progress.update(task, total=self.progress.tasks[task].completed or 1, completed=self.progress.tasks[task].completed or 1)


# ---- final table ----------------------------------------------------------------------------


def print_table(console: Console, result: dict):
    if any(r["status"] == "ok" for r in result["targets"]):
        console.print(_results_table(result, console.width))
        if result.get("rank_by_cost") or result.get("rank_by_time"):
            for line in ranking_lines(result):
                console.print(line, highlight=False, markup=False)
    else:
        console.print(title(result), style="bold", highlight=False, markup=False)
    for line in notes(result):
        console.print(line, highlight=False, markup=False)
    problems = [r for r in result["targets"] if r["status"] != "ok"]
    if problems:
        console.print(_problems_table(problems))


# columns left out first when the terminal is too narrow for the table's values to stay whole
DROP_FIRST = ("energy/step", "peak memory", "first step", "device", "final loss", "throughput", "cost / 1M samples",
              "machine")


def _results_table(result: dict, width: int | None = None) -> Table:
    """The table of targets that ran. Given the terminal's width, columns are left out (the
    least telling first) until every column fits its longest word, then the room left is shared
    out: values wrap between words and are never cut."""
    ok = [r for r in result["targets"] if r["status"] == "ok"]
    cols, dropped = columns(result), []
    widths = None
    while width is not None:
        widths = _widths(cols, ok, width)
        name = next((n for n in DROP_FIRST if any(h == n for h, _ in cols)), None)
        if widths is not False or name is None:
            break
        cols = [(h, c) for h, c in cols if h != name]
        dropped.append(name)
    table = Table(title=title(result), header_style="bold", show_lines=True)
    for i, (header, cell) in enumerate(cols):
        left = header in ("target", "machine", "device")
        table.add_column(header, justify="left" if left else "right", overflow="fold",
                         width=widths[i] if widths else None)
    for row in ok:
        best = tags(result, row)
        cells = []
        for header, cell in cols:
            text = escape(cell(row))
            if header == "target" and best:
                text += f" [bold green]({', '.join(best)})[/]"
            elif header.startswith("loss vs") and row["agrees"] is False:
                text = f"[red]{text}[/]"
            cells.append(text)
        table.add_row(*cells, style="bold" if best else None)
    if dropped:
        table.caption = f"left out for the width of the terminal: {', '.join(dropped)} (--json, --csv and --report have every column)"
    return table


def _widths(cols: list, rows: list[dict], width: int):
    """Column widths for `width` characters: None when every value fits on one line, False when
    even the longest words do not fit."""
    def texts(header, cell):
        return [header] + [cell(r) + (" (fastest, cheapest)" if header == "target" else "") for r in rows]

    natural = [max(len(line) for t in texts(h, c) for line in t.splitlines()) for h, c in cols]
    least = [max(len(w) for t in texts(h, c) for w in t.split()) for h, c in cols]
    room = width - 3 * len(cols) - 1  # each column's padding and border, and the last border
    if sum(natural) <= room:
        return None
    if sum(least) > room:
        return False
    spare, want = room - sum(least), [n - m for n, m in zip(natural, least)]
    return [m + spare * w // max(1, sum(want)) for m, w in zip(least, want)]


def ranking_lines(result: dict) -> list[str]:
    """The targets that ran, ordered by cost and by time (of the whole job when a budget was given)."""
    job = f" for {result['budget']}" if result.get("ranked_by_job") else " per sample"
    lines = [result["budget_note"]] if result.get("budget_note") else []
    for what, key in (("cost", "rank_by_cost"), ("time", "rank_by_time")):
        names = result.get(key) or []
        if names:
            lines.append(f"ranked by {what}{job}: " + " < ".join(names))
    return lines


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
    for run in result.get("runs") or [{"label": None, "machine": result["machine"]}]:
        load, cores = run["machine"].get("load_average"), run["machine"]["usable_cores"]
        where = f" {run['label']}" if run["label"] else ""
        if load and max(load.values()) > cores:
            lines.append(f"warning: the machine{where} was busy (1-minute load average {load['start']:.1f} at the start, "
                         f"{load['end']:.1f} at the end, on {cores} cores): timings are noisy")
    if any(r.get("busy_machine") for r in ok):
        lines.append("busy*: a target computing on the CPU while other work was running (the load average above "
                     "the threads it used): its step time is pessimistic")
    threads = sorted({(r["threads"] or {}).get("torch_intra_op") for r in ok if r.get("threads")} - {None})
    if threads:
        lines.append(f"CPU threads per target: {', '.join(map(str, threads))} "
                     f"({result['machine'].get('threads_chosen') or 'as chosen by each run'})")
    if result.get("price_source"):
        lines.append(f"prices: {result['price_source']}")
    lines += result.get("version_notes") or []
    if result["reference"]:
        lines.append(f"loss agreement: largest relative difference of the loss to {result['reference']} over the first "
                     f"{AGREEMENT_STEPS} steps, tolerance {result['tolerance']:g} (later steps amplify float rounding "
                     "in any two implementations; final-loss differences are in the JSON)")
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
