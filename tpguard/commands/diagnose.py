"""`tpguard diagnose PATH... [--json] [--run RUN_ID] [--html FILE]`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import orjson

from tpguard.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_NOTHING_COMPARED, EXIT_OK, TPGuardError

EXIT_BY_VERDICT = {"clean": EXIT_OK, "diverged": EXIT_DIVERGED, "nothing_compared": EXIT_NOTHING_COMPARED}


def html_target_problem(html_path: str, inputs: list[str]) -> str | None:
    """Why the report must not be written at `html_path`, or None. A report never replaces an
    input, nor an existing file other than an earlier tpguard report (an empty file holds nothing
    to lose)."""
    from tpguard.config import output_file_problem
    from tpguard.diagnose.html import is_report
    from tpguard.diagnose.reader import trace_paths

    problem = output_file_problem(html_path)
    if problem:
        return problem
    target = Path(html_path)
    if not target.exists():
        return None
    if not target.is_file():
        return "not a regular file"
    try:
        named = trace_paths(inputs)
    except TPGuardError:
        named = [Path(p) for p in inputs if Path(p).exists()]
    for p in named:
        try:
            if os.path.samefile(p, target):
                return "is one of the traces to read: not overwritten"
        except OSError:
            continue
    try:
        with open(target, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        return f"cannot read it to check it ({e.strerror})"
    if b'"schema":"tpguard.trace/' in head.replace(b" ", b""):
        return "is a tpguard trace: not overwritten"
    if head and not is_report(head):
        return "exists and is not a tpguard report: not overwritten (remove it or name another file)"
    return None


def _write_report(path: Path, text: str) -> None:
    """Write next to the target, then rename: a reader never sees half a page."""
    tmp = path.with_name(f".{path.name}.tpguard-{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run_diagnose(paths: list[str], as_json: bool = False, run: str | None = None,
                 html_path: str | None = None) -> int:
    from tpguard.diagnose import diagnose, render_text

    problem = html_target_problem(html_path, paths) if html_path else None
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
        print(orjson.dumps(diag.to_json(), option=orjson.OPT_NON_STR_KEYS).decode(), flush=True)
    else:
        print(render_text(diag), flush=True)
    if html_path:
        from tpguard.diagnose.html import render_html

        problem = html_target_problem(html_path, paths)  # again: a file may have appeared meanwhile
        if problem:
            print(f"tpguard diagnose: --html {html_path}: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
        try:
            _write_report(Path(html_path), render_html(diag))
        except OSError as e:
            print(f"tpguard diagnose: --html {html_path}: cannot write ({e.strerror})", file=sys.stderr)
            return EXIT_BAD_INPUT
        if not as_json:
            print(f"html report: {html_path}")
    return EXIT_BY_VERDICT[diag.verdict]
