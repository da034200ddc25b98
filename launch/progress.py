"""Rank 0's progress bar (rich), shown only once a run has lasted a couple of seconds."""

from __future__ import annotations

import sys
import time

SHOW_AFTER_S = 2.0


class StepProgress:
    def __init__(self, total: int, enabled: bool | None, description: str = "verify steps"):
        # None: on when stderr is a terminal (a log file gets no bar).
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total, self.description = total, description
        self.t0 = time.monotonic()
        self.done = 0
        self._bar = None
        self._task = None
        self.divergences = 0

    def _start(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[note]}"), TimeRemainingColumn(),
                             console=Console(stderr=True), transient=True)
        self._bar.start()
        self._task = self._bar.add_task(self.description, total=self.total, completed=self.done, note="")

    def advance(self, divergences: int = 0) -> None:
        self.done += 1
        self.divergences = divergences
        if not self.enabled:
            return
        if self._bar is None:
            if time.monotonic() - self.t0 < SHOW_AFTER_S:
                return
            self._start()
        note = f"{divergences} divergent" if divergences else ""
        self._bar.update(self._task, completed=self.done, note=note)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
