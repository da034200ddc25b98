"""The repository describes the present: code, comments and docs never say in which session, run or
issue something happened, nor number a call of the work ("call" glued to a number). Figures carry
their hardware and date (docs/benchmarks.md) instead. The examples the pattern catches are built at
run time in test_the_pattern, so that this file holds none.

Not chronology, so not matched: run ids, CLI flags, measured figures, and a call counted by its
number in prose (replay's report names repeat calls that way)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tpguard", "kernels", "hooks", "launch", "tests", "docs", "gpu", "scripts", "README.md")
# session / run / issue, then a number (space, "-", "_" or "#" between); "call" only glued to its
# number; not inside a word or after "-" (CLI flags), not a decimal figure, not a run id
CHRONOLOGY = re.compile(r"(?<![A-Za-z0-9-])(?:(?:sessions?|runs?|issues?)[ _-]?#?|calls?_?)\d+"
                        r"(?![\d.]*\d)(?!-\d{6}-[0-9a-f])", re.IGNORECASE)


def chronology_hits(path: str, text: str) -> list[str]:
    """`path:line: match | line` for each line of `text` that states chronology."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        found = [m.group(0) for m in CHRONOLOGY.finditer(line)]
        if found:
            hits.append(f"{path}:{number}: {', '.join(found)} | {line.strip()}")
    return hits


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", *SCANNED], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_no_chronology_in_tracked_files():
    hits = []
    for path in tracked_files():
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):  # binary, or deleted in the working tree
            continue
        hits += chronology_hits(path, text)
    assert not hits, "chronology (state the fact, not when it happened):\n" + "\n".join(hits)


def test_the_pattern():
    # built at run time, so that this file holds none of them
    caught = [f"{w}{sep}{n}" for w, sep, n in (("run", " ", "28"), ("Runs", " ", "19-20"), ("session", " ", "7"),
                                               ("Session", "-", "4"), ("test_run", "", "4_options"),
                                               ("call", "", "2"), ("call", "_", "3"), ("issue", " #", "3"), ("issues", " ", "3"),
                                               ("run", " ", "22."), ("(run", " ", "37)"))]
    passed = ["run " + "20261203-195450-33b982", "--calls " + "100", "the whole call " + "45.7 us",
              "rerun " + "3" + "x", "bytes by call " + "12", "rows 1: call " + "2", "step " + "4", "RUN" + "_ID", "calls " + "differ"]
    for line in caught:
        assert chronology_hits("x.md", line), line
    for line in passed:
        assert not chronology_hits("x.md", line), line
