"""The repository describes the present: no "session 7", "run 28", "runs 35-37", "call2", "issue 3"
(how the work happened) in code, comments or docs. Figures carry their hardware and date
(docs/benchmarks.md) instead of the run that measured them.

Not chronology, so not matched: run ids (`run 20261203-195450-33b982`), CLI flags (`--calls 100`),
measured figures (`the whole call 45.7 us`). Replay's report names repeat calls by number ("rank 1's
bytes by call 12"): the doc lines that quote it are allowed one by one (ALLOWED)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tpguard", "kernels", "hooks", "launch", "tests", "docs", "gpu", "scripts", "README.md")
# a word of chronology, then a number: "run 28", "Runs 19-20", "session-4", "run4_options", "issue #3";
# not inside a word or after "-" (`--calls 2000`), not a decimal figure (`call 45.7 us`), not a run id
CHRONOLOGY = re.compile(r"(?<![A-Za-z0-9-])(?:sessions?|runs?|calls?|issues?)[ _-]?#?\d+"
                        r"(?![\d.]*\d)(?!-\d{6}-[0-9a-f])", re.IGNORECASE)
# (path, the line stripped): replay's own output quoted in its doc
ALLOWED = {
    ("docs/replay.md", "emulated-atomic (the run's backend): 99 of 100 calls differ from the first; reproduced: "
                       "rank 0's differing rows each by some call (rows 1: call 2, 8: call 1, ...); rank 1's "
                       "differing rows each by some call (rows 1: call 1, 8: call 3, ...)"),
    ("docs/replay.md", "accept step (dflash): 0 of 100 calls differ from the first; reproduced: rank 0's bytes by "
                       "call 1; rank 1's bytes by no call"),
    ("docs/replay.md", "bytes by call 12\") and, where the ranks' rows differ, row by row (\"rank 1's differing "
                       "rows each"),
}
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()  # quotes the allowed lines: not scanned


def chronology_hits(path: str, text: str) -> list[str]:
    """`path:line: match | line` for each line of `text` that states chronology."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        found = [m.group(0) for m in CHRONOLOGY.finditer(line)]
        if found and (path, line.strip()) not in ALLOWED:
            hits.append(f"{path}:{number}: {', '.join(found)} | {line.strip()}")
    return hits


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", *SCANNED], cwd=ROOT, capture_output=True, text=True, check=True)
    return [p for p in out.stdout.splitlines() if p != SELF]


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
                                               ("call", "", "2"), ("issue", " #", "3"), ("issues", " ", "3"),
                                               ("run", " ", "22."), ("(run", " ", "37)"))]
    passed = ["run " + "20261203-195450-33b982", "--calls " + "100", "the whole call " + "45.7 us",
              "rerun " + "3" + "x", "step " + "4", "RUN" + "_ID", "calls " + "differ"]
    for line in caught:
        assert chronology_hits("x.md", line), line
    for line in passed:
        assert not chronology_hits("x.md", line), line
    allowed = sorted(ALLOWED)[0]
    assert not chronology_hits(allowed[0], "  " + allowed[1]) and chronology_hits("other.md", allowed[1])
