"""The `torchpjrt` command. Subcommands:

    torchpjrt bench [WORKLOAD] [options]   the cross-hardware benchmark (docs/bench.md)
"""

import argparse
import importlib.util
import os
import sys


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchpjrt", description="torchpjrt: PyTorch on any XLA device through PJRT.")
    commands = parser.add_subparsers(title="commands")
    _add_bench(commands)
    return parser


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
    p.add_argument("workload", nargs="?", choices=BUILTIN, help="built-in workload (default: mlp)")
    p.add_argument("--size", choices=SIZES, default="small", help="preset size of the built-in workload (default: small)")
    p.add_argument("--task", choices=("train", "infer"), default="train",
                   help="train: forward + loss + backward + AdamW step; infer: forward + loss under no_grad")
    p.add_argument("--model", metavar="MODULE:FACTORY",
                   help="your own model: factory() returns (model, batch_fn, loss_fn); see docs/bench.md")
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
                   help="largest relative difference of the final loss to the cpu target that counts as agreeing (default: 1e-3)")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds a target may take to start or to run one round before it is stopped (default: 900)")
    p.add_argument("--prices", metavar="TOML", help="price table (default: the example table shipped in torchpjrt/bench/prices.toml)")
    p.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    p.add_argument("--csv", metavar="PATH", help="write one row per target as CSV")
    p.add_argument("--report", metavar="PATH", help="write an HTML report with plots")
    p.set_defaults(run=run_bench)


def run_bench(args) -> int:
    from rich.console import Console

    from .bench import display, prices, report
    from .bench.runner import BenchConfig, run_bench as bench
    from .bench.targets import parse_target_list

    problem = _check_model_path(args.model)
    if problem:
        print(f"torchpjrt bench: {problem}", file=sys.stderr)
        return 2
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
        prices=args.prices,
    )
    progress_console = Console(stderr=True)
    # Not a terminal (a log, a pipe): wide enough that the table keeps one line per field.
    table_console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        result = bench(config, progress_console, price_table)
    except KeyboardInterrupt:  # the workers are stopped on the way out (runner's finally blocks)
        print("torchpjrt bench: interrupted", file=sys.stderr)
        return 130
    display.print_table(table_console, result)
    for path, write in ((args.json, report.write_json), (args.csv, report.write_csv), (args.report, report.write_html)):
        if path:
            write(result, path)
            print(f"wrote {path}", file=sys.stderr)
    ran = any(t["status"] == "ok" for t in result["targets"])
    if not ran:
        print("torchpjrt bench: no target could run", file=sys.stderr)
    return 0 if ran else 1


def _check_model_path(path: str | None) -> str | None:
    """Catch a malformed or missing --model module before starting any worker."""
    if not path:
        return None
    from .bench.workloads import FactoryError, parse_model_path

    try:
        module, _ = parse_model_path(path)
    except FactoryError as e:
        return str(e)
    sys.path.insert(0, os.getcwd())  # workers find the module from the current directory too
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as e:
        return f"--model {path}: cannot look up {module!r} ({e})"
    finally:
        sys.path.remove(os.getcwd())
    return None if found else f"--model {path}: no module named {module!r} (looked in the current directory and sys.path)"
