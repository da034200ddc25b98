"""The benchmarks' argument parser: a usage error is one line on stderr and exit code 2
(docs/diagnose.md's codes), not argparse's usage block."""

from __future__ import annotations

import argparse

from tpguard.errors import EXIT_BAD_INPUT


class BenchParser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (--help lists the options)\n")
