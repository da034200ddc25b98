"""The argparse parser left to scripts outside the `tpguard` command (`python -m tpguard.determinism`'s
own options, gpu/renorm_host.py): a usage error is one line on stderr and exit code 2
(docs/exit-codes.md), not argparse's usage block. The `tpguard` commands are typer's (tpguard/cli.py)."""

from __future__ import annotations

import argparse

from tpguard.errors import EXIT_BAD_INPUT


class BenchParser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (--help lists the options)\n")
