"""`kvwrite bench`: the sweep, a progress bar, a terminal table and the files under
bench/results/<machine-kind>/ (results.json, report.md, plot.png)."""
from __future__ import annotations

import argparse
import shlex
import signal
import threading
from pathlib import Path

import torch

NAME = "bench"
HELP = "latency and bandwidth of every store vs the same-run copy bandwidth and the usual alternatives"


def default_out(kind: str) -> Path:
    """bench/results/<kind> of the source checkout when run from one, else ./bench-results/<kind>."""
    root = Path(__file__).resolve().parents[3]
    if (root / "bench" / "gpu_check.sh").exists():
        return root / "bench" / "results" / kind
    return Path("bench-results") / kind


def case_names() -> tuple[str, ...]:
    """Every case and op name `--cases` accepts."""
    from kvwrite.bench.cases import REGISTRY

    return tuple(sorted({c.name for g in REGISTRY.values() for c in g} | set(REGISTRY)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvwrite.backend import BACKENDS
    from kvwrite.bench.cases import VALUES
    from kvwrite.bench.run import CHECKS, FULL_SIZES, QUICK_SIZES
    from kvwrite.cli._args import device, names, non_negative_int, positive_float, positive_ints

    p.add_argument("--device", type=device, default=None,
                   help="cpu or cuda[:N] (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--quick", action="store_true",
                   help=f"N in {','.join(map(str, QUICK_SIZES))} and short measurements (< 2 min on 2 CPU cores)")
    p.add_argument("--sizes", type=positive_ints, default=None,
                   help=f"comma-separated token counts N >= 1 (default {FULL_SIZES[0]}..{FULL_SIZES[-1]}, "
                        "powers of 2)")
    p.add_argument("--cases", type=names(case_names(), "case"), default=None,
                   help="comma-separated case or op names (default: every case); e.g. mha-bf16,store_mla")
    p.add_argument("--backends", type=names(BACKENDS, "backend"), default=None,
                   help=f"comma-separated kvwrite backends from {','.join(BACKENDS)} (default: every "
                        "backend that runs on the device); one that cannot run there is refused")
    p.add_argument("--checks", type=names(CHECKS, "check mode"), default=list(CHECKS),
                   help=f"comma-separated check modes from {','.join(CHECKS)} (default: all)")
    p.add_argument("--min-time", type=positive_float, default=None,
                   help="seconds per measurement (CPU; on CUDA the do_bench rep in s)")
    p.add_argument("--threads", type=non_negative_int, default=1,
                   help="torch CPU threads (default 1: on a shared or oversubscribed machine OpenMP "
                        "stalls of a scheduler tick swamp the medians; 0 = torch's default)")
    p.add_argument("--values", choices=VALUES, default="normal",
                   help="the input rows: normal (default), or outliers (every 64th value x1000, one large "
                        "channel a tile as in real K / V: most codes of a tile small, many fp8 subnormals)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay rows")
    p.add_argument("--interpreter", action="store_true",
                   help="also time triton under TRITON_INTERPRET on CPU (not a performance backend)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default bench/results/<machine-kind>)")
    p.add_argument("--no-plot", action="store_true", help="write results.json and report.md only, no plot.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (options that differ from the defaults)."""
    from kvwrite.bench.run import CHECKS

    parts = ["kvwrite", NAME] + (["--quick"] if args.quick else [])
    if args.device is not None and args.device.type != ("cuda" if torch.cuda.is_available() else "cpu"):
        parts += ["--device", str(args.device)]
    for flag, value in (("--sizes", args.sizes), ("--cases", args.cases), ("--backends", args.backends)):
        if value:
            parts += [flag, ",".join(map(str, value))]
    if tuple(args.checks) != CHECKS:
        parts += ["--checks", ",".join(args.checks)]
    if args.min_time is not None:
        parts += ["--min-time", str(args.min_time)]
    if args.threads != 1:
        parts += ["--threads", str(args.threads)]
    if args.values != "normal":
        parts += ["--values", args.values]
    parts += [f for f, on in (("--no-graph", args.no_graph), ("--interpreter", args.interpreter)) if on]
    if args.out is not None:
        parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(p) for p in parts)


def check_backends(args: argparse.Namespace, device: torch.device) -> None:
    """Refuse a listed backend that cannot be timed on `device` (instead of dropping its rows)."""
    from kvwrite.bench.run import select_backends
    from kvwrite.cli._args import UsageError

    if args.backends is None:
        return
    _, notes = select_backends(device, args.backends, args.interpreter)
    for name in args.backends:
        if name in notes:
            raise UsageError(f"--backends {name} cannot be timed on {device}: {notes[name]}")


def run(args: argparse.Namespace) -> int:
    from kvwrite.cli._args import default_device

    device = args.device or torch.device(default_device())
    check_backends(args, device)
    threads = torch.get_num_threads()
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # `timeout` stops the sweep, the report is kept
    try:
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        return _run(args, device)
    finally:
        torch.set_num_threads(threads)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _run(args: argparse.Namespace, device: torch.device) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvwrite.bench import report
    from kvwrite.bench.run import FULL_SIZES, QUICK_SIZES, Config, machine_kind, sweep
    from kvwrite.cli._args import writable_dir

    out = writable_dir(args.out or default_out(machine_kind(device)))  # before the sweep, not after
    quick = args.quick
    cfg = Config(
        device=str(device),
        sizes=args.sizes or (QUICK_SIZES if quick else FULL_SIZES),
        cases=args.cases, backends=args.backends, checks=tuple(args.checks),
        min_time=args.min_time if args.min_time is not None else (0.02 if quick else 0.1),
        graph=not args.no_graph, interpreter=args.interpreter, quick=quick, values=args.values,
        command=_command(args),
    )
    console = Console(stderr=False, quiet=args.quiet)
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True, disable=args.quiet) as bar:
        result = sweep(cfg, bar)
    paths = report.write(result, out, with_plot=not args.no_plot)
    if not args.quiet:
        report.print_table(result, console)
        console.print(f"wall {result['wall_s']} s; wrote " + ", ".join(str(p) for p in paths.values()))
    return 2 if result["interrupted"] else 0
