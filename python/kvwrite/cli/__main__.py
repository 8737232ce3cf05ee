"""`python -m kvwrite.cli ...` is the `kvwrite` command."""
import sys

from kvwrite.cli import main

sys.exit(main())
