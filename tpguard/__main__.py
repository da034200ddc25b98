"""`python -m tpguard ...`: the `tpguard` command (same commands, output and exit codes)."""

import sys

from tpguard.cli import main

if __name__ == "__main__":
    sys.exit(main())
