"""`python -m grpoflow` runs the command line, as the `grpoflow` command does."""

import sys

from grpoflow.cli import main

if __name__ == "__main__":
    sys.exit(main())
