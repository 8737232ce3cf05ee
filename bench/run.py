#!/usr/bin/env python3
"""`bench/run.py [ARGS]` = `kvwrite bench [ARGS]` (see bench/README.md)."""
import sys

from kvwrite.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
