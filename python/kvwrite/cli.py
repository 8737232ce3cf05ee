"""`kvwrite` command line: each subcommand lives in its own module, listed in COMMANDS.

A command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = (
    "kvwrite.demo",
    "kvwrite.plan_cli",
    "kvwrite.presets_cli",
    "kvwrite.bench.cli",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvwrite", description="Fast, bounds-checked paged KV-cache stores")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for path in COMMANDS:
        module = importlib.import_module(path)
        modules[module.NAME] = module
        module.add_arguments(sub.add_parser(module.NAME, help=module.HELP, description=module.HELP))
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
