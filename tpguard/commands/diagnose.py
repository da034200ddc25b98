"""`tpguard diagnose PATH... [--json] [--run RUN_ID] [--html FILE]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tpguard.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK, TPGuardError


def run_diagnose(paths: list[str], as_json: bool = False, run: str | None = None,
                 html_path: str | None = None) -> int:
    from tpguard.diagnose import diagnose, render_text

    from tpguard.config import output_file_problem

    problem = output_file_problem(html_path) if html_path else None
    if problem:  # checked before the traces are read
        print(f"tpguard diagnose: --html {html_path}: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        diag = diagnose(paths, run=run)
    except TPGuardError as e:
        print(f"tpguard diagnose: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # The report is printed first: a failing --html write must not cost the diagnosis itself.
    if as_json:
        print(json.dumps(diag.to_json(), indent=None), flush=True)
    else:
        print(render_text(diag), flush=True)
    if html_path:
        from tpguard.diagnose.html import render_html

        try:
            Path(html_path).write_text(render_html(diag), encoding="utf-8")
        except OSError as e:
            print(f"tpguard diagnose: --html {html_path}: cannot write ({e.strerror})", file=sys.stderr)
            return EXIT_BAD_INPUT
        if not as_json:
            print(f"html report: {html_path}")
    return EXIT_DIVERGED if diag.diverged else EXIT_OK
