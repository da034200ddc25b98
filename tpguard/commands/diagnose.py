"""`tpguard diagnose PATH... [--json] [--run RUN_ID] [--html FILE]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tpguard.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK, TPGuardError


def run_diagnose(paths: list[str], as_json: bool = False, run: str | None = None,
                 html_path: str | None = None) -> int:
    from tpguard.diagnose import diagnose, render_text

    try:
        diag = diagnose(paths, run=run)
    except TPGuardError as e:
        print(f"tpguard diagnose: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if html_path:
        from tpguard.diagnose.html import render_html

        Path(html_path).write_text(render_html(diag), encoding="utf-8")
    if as_json:
        print(json.dumps(diag.to_json(), indent=None))
    else:
        print(render_text(diag))
        if html_path:
            print(f"html report: {html_path}")
    return EXIT_DIVERGED if diag.diverged else EXIT_OK
