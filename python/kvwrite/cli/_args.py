"""What every `kvwrite` command shares: a parser whose errors are one line, argument types that
refuse bad values at parse time, and `UsageError` for values only a command can judge."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Iterable

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad argument or environment value: `main` prints it as one line and exits 2."""


class Parser(argparse.ArgumentParser):
    """argparse, with every error one line on stderr (no usage block) and exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def default_device() -> str:
    """"cuda" when torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device(text: str):
    """A torch device this process can use: cpu, or cuda[:N] when that GPU exists."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu or cuda[:N]") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: kvwrite runs on cpu or cuda[:N], not {dev.type}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here (torch.cuda.is_available() is "
                                         f"False); use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s)")
    return dev


def names(known: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """A type for a comma-separated list whose every entry is one of `known`."""
    known = tuple(known)

    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"no {what} given")
        bad = [x for x in items if x not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad))}; "
                                             f"choose from {', '.join(known)}")
        return items

    return parse


def positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of ints >= 1."""
    try:
        items = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be an integer >= 1")
    return items


def _number(parse: Callable, kind: str, ok: Callable, want: str) -> Callable:
    """An argparse type: `parse(text)` (else "is not <kind>"), then `ok(value)` (else "must be <want>")."""
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {want}")
        return value
    return convert


positive_int = _number(int, "an integer", lambda v: v >= 1, ">= 1")
non_negative_int = _number(int, "an integer", lambda v: v >= 0, ">= 0")
positive_float = _number(float, "a number", lambda v: 0 < v < float("inf"), "a finite number > 0")


def writable_dir(path: Path) -> Path:
    """Create `path` (and parents) and check a file can be written there, before any work."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".kvwrite-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--out {path}: cannot write there ({err.strerror or err})") from None
    return path


def quiet_broken_pipe() -> None:
    """The reader of stdout went away (`kvwrite plan --json | head`): point stdout at /dev/null
    so the interpreter's final flush does not complain either."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
