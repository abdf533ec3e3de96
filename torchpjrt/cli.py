"""The `torchpjrt` command. Subcommands:

    torchpjrt bench [WORKLOAD] [options]   the cross-hardware benchmark (docs/bench.md)
    torchpjrt bench compare RUN.json ...   runs made on different machines, in one comparison
"""

import argparse
import importlib.util
import os
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `compare` is not a workload: it has a parser of its own
    parser = build_compare_parser() if argv[:2] == ["bench", "compare"] else build_parser()
    args = parser.parse_args(argv[2:] if argv[:2] == ["bench", "compare"] else argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchpjrt", description="torchpjrt: PyTorch on any XLA device through PJRT.")
    commands = parser.add_subparsers(title="commands")
    _add_bench(commands)
    return parser


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 2e9, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _add_budget(p):
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=_positive_number, metavar="N",
                        help="the whole job in tokens (e.g. 2e9): adds time and cost to train per target")
    budget.add_argument("--samples", type=_positive_number, metavar="N",
                        help="the whole job in samples: adds time and cost to train per target")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_bench(commands):
    from .bench.targets import KINDS
    from .bench.workloads import BUILTIN, SIZES

    p = commands.add_parser(
        "bench", help="run one workload on every available target and compare speed, memory, energy, cost",
        description="Run the same PyTorch workload on every available target (each in its own process) and "
        "compare step time, throughput, time to first step, peak memory, energy and cost, and check the "
        "losses agree. Default: the mlp workload, small, training, on every available target.",
    )
    p.add_argument("workload", nargs="?", choices=BUILTIN,
                   help="built-in workload (default: mlp); `torchpjrt bench compare RUN.json ...` merges runs instead")
    p.add_argument("--size", choices=SIZES, default="small", help="preset size of the built-in workload (default: small)")
    p.add_argument("--task", choices=("train", "infer"), default="train",
                   help="train: forward + loss + backward + AdamW step; infer: forward + loss under no_grad")
    p.add_argument("--model", metavar="MODULE:FACTORY",
                   help="your own model, as package.module:factory or path/to/file.py:factory; factory() returns "
                   "(model, batch_fn, loss_fn); see docs/bench.md")
    p.add_argument("--targets", metavar="A,B,...",
                   help=f"targets to run (default: all available). Kinds: {', '.join(KINDS)}; pjrt kinds run on every "
                   "JAX platform found, or one with @cpu, @gpu, @tpu")
    p.add_argument("--steps", type=_positive_int, default=10, help="measured steps per round (default: 10)")
    p.add_argument("--rounds", type=_positive_int, default=5, help="rounds, interleaved across targets (default: 5)")
    p.add_argument("--warmup", type=_positive_int, default=3, help="warm-up steps, the first included (default: 3)")
    p.add_argument("--batch-size", type=_positive_int, help="override the workload's batch size")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batch stream (default: 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate for --task train (default: 1e-3)")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest relative difference of the loss to the cpu target's over the first 10 steps that counts as agreeing (default: 1e-3)")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds a target may take to start or to run one round before it is stopped (default: 900)")
    p.add_argument("--prices", metavar="TOML", help="price table (default: the example table shipped in torchpjrt/bench/prices.toml)")
    p.add_argument("--label", metavar="NAME",
                   help="this machine's name in reports, such as a provider's instance (default: its CPU and accelerators); "
                   "a label listed in the price table's [instance] section prices the run by that instance")
    p.add_argument("--threads", type=_positive_int,
                   help="CPU threads of every target (torch's and XLA's; default: the cores the load average leaves free)")
    _add_budget(p)
    p.add_argument("--json", metavar="PATH", help="write the full results as JSON (input of `torchpjrt bench compare`)")
    p.add_argument("--csv", metavar="PATH", help="write one row per target as CSV")
    p.add_argument("--report", metavar="PATH", help="write an HTML report with plots")
    p.set_defaults(run=run_bench)


def run_bench(args) -> int:
    from rich.console import Console

    from .bench import prices
    from .bench.runner import BenchConfig, run_bench as bench
    from .bench.targets import parse_target_list

    problem = _check_model_path(args.model)
    if problem:
        print(f"torchpjrt bench: {problem}", file=sys.stderr)
        return 2
    if args.model:
        from .bench.workloads import is_file_path, parse_model_path

        module, factory = parse_model_path(args.model)
        if is_file_path(module):  # workers may start elsewhere: give them the whole path
            args.model = f"{os.path.abspath(module)}:{factory}"
    try:
        price_table = prices.load(args.prices)
    except prices.PriceTableError as e:
        print(f"torchpjrt bench: {e}", file=sys.stderr)
        if args.prices:
            return 2
        price_table = None  # the shipped table is missing: run anyway, costs say n/a
    config = BenchConfig(
        workload=None if args.model else args.workload or "mlp", size=args.size, task=args.task, model=args.model,
        targets=parse_target_list(args.targets), steps=args.steps, rounds=args.rounds, warmup=args.warmup,
        batch_size=args.batch_size, seed=args.seed, lr=args.lr, tolerance=args.tolerance, timeout=args.timeout,
        prices=args.prices, label=args.label, threads=args.threads, tokens=args.tokens, samples=args.samples,
    )
    progress_console = Console(stderr=True)
    try:
        result = bench(config, progress_console, price_table)
    except KeyboardInterrupt:  # the workers are stopped on the way out (runner's finally blocks)
        print("torchpjrt bench: interrupted", file=sys.stderr)
        return 130
    _show_and_write(result, args)
    ran = any(t["status"] == "ok" for t in result["targets"])
    if not ran:
        print("torchpjrt bench: no target could run", file=sys.stderr)
    return 0 if ran else 1


def _show_and_write(result, args) -> None:
    from rich.console import Console

    from .bench import display, report

    # Not a terminal (a log, a pipe): wide enough that the table keeps one line per field.
    display.print_table(Console() if sys.stdout.isatty() else Console(width=200), result)
    for path, write in ((args.json, report.write_json), (args.csv, report.write_csv), (args.report, report.write_html)):
        if path:
            write(result, path)
            print(f"wrote {path}", file=sys.stderr)


def build_compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchpjrt bench compare",
        description="Merge `torchpjrt bench --json` runs made on different machines (a GPU at one provider, a TPU at "
        "another) into one table and report: every target labelled with its machine, loss curves against one "
        "reference, and with --tokens/--samples the time and cost of the whole job. Runs of different workloads, "
        "sizes, tasks, batch sizes, seeds or learning rates are refused.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN.json", help="`torchpjrt bench --json` files")
    p.add_argument("--reference", metavar="TARGET",
                   help="the target whose losses the others are compared with: a name from the merged table, or a "
                   "target name (taken from the first run that has it); default: the first run's cpu")
    p.add_argument("--tolerance", type=float, help="largest relative difference of the loss over the first 10 steps that counts as "
                   "agreeing (default: the first run's)")
    p.add_argument("--prices", metavar="TOML", help="price every run with this table (default: each run keeps its own costs)")
    _add_budget(p)
    p.add_argument("--json", metavar="PATH", help="write the merged results as JSON")
    p.add_argument("--csv", metavar="PATH", help="write one row per target and machine as CSV")
    p.add_argument("--report", metavar="PATH", help="write an HTML report with plots")
    p.set_defaults(run=run_compare)
    return p


def run_compare(args) -> int:
    from .bench import compare, prices

    try:
        table = prices.load(args.prices) if args.prices else None
        runs = [compare.load_run(path) for path in args.runs]
        budget = prices.Budget(args.tokens, "tokens") if args.tokens else prices.Budget(args.samples, "samples") if args.samples else None
        result = compare.merge(runs, reference=args.reference, budget=budget, table=table, tolerance=args.tolerance)
    except (compare.CompareError, prices.PriceTableError) as e:
        print(f"torchpjrt bench compare: {e}", file=sys.stderr)
        return 2
    _show_and_write(result, args)
    return 0


def _check_model_path(path: str | None) -> str | None:
    """Catch a malformed --model, a missing module or file, or a module without the factory,
    before starting any worker (the module is read, not run)."""
    if not path:
        return None
    from .bench.workloads import FactoryError, is_file_path, parse_model_path

    try:
        module, factory = parse_model_path(path)
    except FactoryError as e:
        return str(e)
    if is_file_path(module):
        if not os.path.isfile(module):
            return f"--model {path}: no file {module!r} (relative paths start from {os.getcwd()})"
        source = module
    else:
        sys.path.insert(0, os.getcwd())  # workers find the module from the current directory too
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as e:
            return f"--model {path}: cannot look up {module!r} ({e})"
        finally:
            sys.path.remove(os.getcwd())
        if spec is None:
            return f"--model {path}: no module named {module!r} (looked in the current directory and sys.path)"
        source = spec.origin
    defined = _top_level_names(source)
    if defined is not None and factory not in defined:
        return f"--model {path}: {module!r} defines no {factory!r} at its top level ({source})"
    return None


def _top_level_names(source: str | None) -> set | None:
    """Names a Python source file binds at module level, or None when it cannot be read as such
    (a compiled module, a package whose names come from elsewhere, `from x import *`)."""
    import ast

    if not source or not source.endswith(".py"):
        return None
    try:
        with open(source, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None  # the worker's import reports it with the module's own error
    names = set()

    def collect(body) -> bool:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if any(a.name == "*" for a in node.names):
                    return False
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # names bound on one branch count too
                branches = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
                branches += [h.body for h in getattr(node, "handlers", [])]
                if not all(collect(b) for b in branches):
                    return False
        return True

    return names if collect(tree.body) else None
