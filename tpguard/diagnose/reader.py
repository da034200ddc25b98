"""Reader: open any number of trace files (per-rank, merged, mixed) and stream their records.

Headers are read up front (first line of each file) to check runs, world size and rank coverage;
step records are then streamed lazily, one file cursor each, so memory stays constant whatever
the trace length. Step records are kept as plain tuples on this hot path (no dataclass per line).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tpguard.errors import TraceError
from tpguard.records import (
    SCHEMA, DivergenceRecord, EventRecord, Header, expand_fp, from_json,
)
from tpguard.trace import iter_lines

# (step, site, ranks, fp) of one step record
StepTuple = tuple[int, str, list, dict]


@dataclass
class TraceFile:
    path: Path
    header: Header


@dataclass
class TraceSet:
    files: list[TraceFile]
    run_id: str
    world_size: int
    quantities: list[str]
    algo: str
    ranks: list[int]  # ranks that some file covers
    warnings: list[str] = field(default_factory=list)
    divergences: list[DivergenceRecord] = field(default_factory=list)  # filled while streaming
    events: list[EventRecord] = field(default_factory=list)

    def warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)

    def step_streams(self) -> list[Iterator[StepTuple]]:
        return [self._steps(f) for f in self.files]

    def _steps(self, f: TraceFile) -> Iterator[StepTuple]:
        """Step tuples of one file, for this run, in file order; keeps divergences and events."""
        in_run = True
        last_step = None
        for lineno, obj in iter_lines(f.path, self.warn):
            kind = obj.get("type")
            if kind == "step":
                if not in_run:
                    continue
                try:
                    step, site, ranks, fp = obj["step"], obj["site"], obj["ranks"], obj["fp"]
                except KeyError as e:
                    raise TraceError(f"{f.path}:{lineno}: step record without {e.args[0]}") from None
                if not isinstance(step, int) or not isinstance(fp, dict) or not isinstance(ranks, list):
                    raise TraceError(f"{f.path}:{lineno}: malformed step record")
                if obj.get("run_id", self.run_id) != self.run_id:
                    continue
                if last_step is not None and step < last_step:
                    self.warn(f"{f.path}:{lineno}: steps go backwards ({last_step} then {step}); "
                              "results for that file may be incomplete")
                last_step = step
                yield step, site, ranks, fp
            elif kind == "header":
                in_run = obj.get("run_id") == self.run_id
                if lineno > 1 and obj.get("schema") != SCHEMA:
                    raise TraceError(f"{f.path}:{lineno}: unknown schema {obj.get('schema')!r}")
            elif kind in ("divergence", "event"):
                if not in_run or obj.get("run_id", self.run_id) != self.run_id:
                    continue
                try:
                    rec = from_json(obj)
                except TraceError as e:
                    self.warn(f"{f.path}:{lineno}: {e}; record ignored")
                    continue
                (self.divergences if kind == "divergence" else self.events).append(rec)
            else:
                self.warn(f"{f.path}:{lineno}: unknown record type {kind!r} ignored")


def read_header(path: Path) -> Header:
    noop = lambda msg: None  # noqa: E731 - torn lines are reported when the body is streamed
    for lineno, obj in iter_lines(path, noop):
        if obj.get("type") != "header":
            raise TraceError(f"{path}: no header (line {lineno} is a {obj.get('type')!r} record)")
        rec = from_json(obj)
        assert isinstance(rec, Header)
        return rec
    raise TraceError(f"{path}: empty trace (no header)")


def open_traces(paths: list[str | Path], run: str | None = None) -> TraceSet:
    """Check the files belong together and return the set to stream. TraceError if unusable."""
    if not paths:
        raise TraceError("no trace files given")
    files = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise TraceError(f"{p}: directory holds no *.jsonl trace")
            files.extend(TraceFile(q, read_header(q)) for q in found)
        else:
            files.append(TraceFile(p, read_header(p)))
    runs = sorted({f.header.run_id for f in files})
    if run is not None:
        if run not in runs:
            raise TraceError(f"run {run!r} not in these traces (runs: {', '.join(runs)})")
        files = [f for f in files if f.header.run_id == run]
    elif len(runs) > 1:
        raise TraceError(f"traces from {len(runs)} runs ({', '.join(runs)}): choose one with --run")
    run_id = run or runs[0]
    sizes = {f.header.world_size for f in files}
    if len(sizes) > 1:
        raise TraceError(f"run {run_id}: files disagree on world_size ({sorted(sizes)})")
    world_size = sizes.pop()
    ranks = sorted({r for f in files for r in f.header.ranks})
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise TraceError(f"run {run_id}: ranks {bad} outside world size {world_size}")
    orders = {tuple(f.header.quantities) for f in files}
    quantities = list(max(orders, key=len))
    ts = TraceSet(files=files, run_id=run_id, world_size=world_size, quantities=quantities,
                  algo=files[0].header.algo, ranks=ranks)
    if len(orders) > 1:
        ts.warn(f"files list different quantity orders; using {quantities}")
    missing = [r for r in range(world_size) if r not in ranks]
    if len(ranks) < 2:
        raise TraceError(f"run {run_id}: only rank {ranks} has a trace here; need two ranks to compare "
                         f"(world size {world_size}, missing ranks {missing})")
    if missing:
        ts.warn(f"no trace for rank(s) {missing} of {world_size}: they are not compared")
    return ts


def values_by_rank(ranks: list, value) -> dict[int, str | None]:
    return expand_fp(value, ranks)
