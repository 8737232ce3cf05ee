"""`kvwrite` command line: each subcommand is one module of this package, listed in COMMANDS.

A command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`. Bad
arguments and environment values are one line on stderr and exit status 2 (`_args.UsageError`,
or an argument type that refuses the value); a closed stdout (`kvwrite plan --json | head`) ends
the command quietly.
"""
from __future__ import annotations

import importlib
import sys

from kvwrite.cli._args import EXIT_USAGE, Parser, UsageError, quiet_broken_pipe

COMMANDS = (
    "kvwrite.cli.demo",
    "kvwrite.cli.plan",
    "kvwrite.cli.presets",
    "kvwrite.cli.bench",
    "kvwrite.cli.build",
)

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe


def build_parser() -> Parser:
    """The `kvwrite` parser with every command's subparser (the docs and tests walk it)."""
    parser = Parser(prog="kvwrite", description="Fast, bounds-checked paged KV-cache stores")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for path in COMMANDS:
        module = importlib.import_module(path)
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        p.set_defaults(_module=module)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    prog = "kvwrite"
    try:
        from kvwrite import validate

        validate.default_check()  # a bad KVWRITE_CHECK is refused before any command runs
        args = build_parser().parse_args(argv)
        prog = f"kvwrite {args.command}"
        return args._module.run(args)
    except (UsageError, validate.CheckEnvError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        quiet_broken_pipe()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
