"""`python -m bench [ARGS]` (from the repository root) = `kvwrite bench [ARGS]`."""
import sys

from kvwrite.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
