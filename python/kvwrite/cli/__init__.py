"""`kvwrite` command line: each subcommand is one module of this package, listed in COMMANDS.

A command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = (
    "kvwrite.cli.demo",
    "kvwrite.cli.plan",
    "kvwrite.cli.presets",
    "kvwrite.cli.bench",
    "kvwrite.cli.build",
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
