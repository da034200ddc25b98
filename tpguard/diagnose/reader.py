"""Reader: open any number of trace files (per-rank, merged, mixed) and stream their records.

Headers are read up front (first line of each file) to check runs, world size and rank coverage.
Bodies are read through one `FileCursor` per file: a small buffer of raw lines that the matcher
either consumes in blocks (clean stretches compared as bytes, never parsed) or one step at a time
(parsed). Memory stays constant whatever the trace length.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from tpguard.errors import TraceError
from tpguard.records import SCHEMA, DivergenceRecord, EventRecord, Header, from_json
from tpguard.trace import iter_lines

BLOCK_LINES = 4096
# The parts of a line in tpguard's own step layout that the block comparison uses.
STEP_PREFIX = b'{"type":"step","run_id":"'
RANKS_FIELD = re.compile(rb',"ranks":\[[0-9, ]*\]')
STEP_NUMBER = re.compile(rb',"step":([0-9]+),"site":"')
# Files a directory argument stands for: traces and their rotated segments (NAME.jsonl.1, ...).
SEGMENT = re.compile(r"\.jsonl(\.[0-9]+)?$")


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

    def cursors(self) -> list["FileCursor"]:
        return [FileCursor(f, self) for f in self.files]


class FileCursor:
    """Buffered raw lines of one file, consumed as clean blocks or as one parsed step at a time.

    Step records come out as (step, site, ranks, fp). Divergence and event records met on the way
    are kept in the TraceSet; records of other runs are skipped.
    """

    def __init__(self, f: TraceFile, ts: TraceSet):
        self.file = f
        self.ts = ts
        self._fh = open(f.path, "rb")
        self.buf: list[bytes] = []
        self.pos = 0  # next unread line in buf
        self.lineno = 0  # lines consumed before buf[pos]
        self.eof = False
        self.in_run = True
        self.last_step = -1
        self._head: tuple | None = None  # parsed step record at buf[pos], if any

    # -- raw buffer --------------------------------------------------------------------------

    def fill(self, n: int) -> int:
        """Make at least n unread lines available (fewer at end of file); returns how many are."""
        if len(self.buf) - self.pos < n and not self.eof:
            rest = self.buf[self.pos:]
            more = self._fh.readlines(max(1 << 20, 400 * n))
            if not more:
                self.eof = True
                self._fh.close()
            self.buf = rest + more
            self.pos = 0
        return len(self.buf) - self.pos

    def block(self, n: int) -> bytes:
        return b"".join(self.buf[self.pos:self.pos + n])

    def skip(self, n: int) -> None:
        self.pos += n
        self.lineno += n
        self._head = None

    # -- parsed records ----------------------------------------------------------------------

    def head(self) -> tuple | None:
        """The next step record of this run (consuming other records before it), or None at end."""
        while self._head is None:
            if self.fill(1) == 0:
                return None
            raw = self.buf[self.pos]
            obj = self._parse(raw, self.lineno + 1)
            if obj is None:  # torn last line
                self.skip(1)
                continue
            kind = obj.get("type")
            if kind == "step" and self.in_run:
                rec = self._step_fields(obj)
                if rec[0] < self.last_step:
                    self.ts.warn(f"{self.file.path}:{self.lineno + 1}: steps go backwards "
                                 f"({self.last_step} then {rec[0]}); results for that file may be incomplete")
                self._head = rec
                return rec
            self.skip(1)
            self._other(kind, obj)
        return self._head

    def pop(self) -> tuple:
        rec = self._head
        assert rec is not None
        self.last_step = rec[0]
        self.skip(1)
        return rec

    def _other(self, kind, obj) -> None:
        where = f"{self.file.path}:{self.lineno}"
        if kind == "header":
            self.in_run = obj.get("run_id") == self.ts.run_id
            if obj.get("schema") != SCHEMA:
                raise TraceError(f"{where}: unknown schema {obj.get('schema')!r}")
        elif kind in ("divergence", "event"):
            if self.in_run and obj.get("run_id", self.ts.run_id) == self.ts.run_id:
                try:
                    rec = from_json(obj)
                except TraceError as e:
                    self.ts.warn(f"{where}: {e}; record ignored")
                    return
                (self.ts.divergences if kind == "divergence" else self.ts.events).append(rec)
        elif kind != "step":
            self.ts.warn(f"{where}: unknown record type {kind!r} ignored")

    def _parse(self, raw: bytes, lineno: int) -> dict | None:
        path = self.file.path
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            if lineno == 1:
                raise TraceError(f"{path}: not a tpguard trace (line 1 is not JSON)") from None
            # A line the writer did not finish has no newline: it can only be the last one.
            if not raw.endswith(b"\n") or self._is_last_line():
                self.ts.warn(f"{path}:{lineno}: torn last line skipped (the writer was killed mid-write?)")
                return None
            raise TraceError(f"{path}:{lineno}: line is not JSON (corrupt trace)") from None
        if type(obj) is not dict:
            raise TraceError(f"{path}:{lineno}: line is not a JSON object")
        return obj

    def _is_last_line(self) -> bool:
        self.fill(2)
        return self.eof and self.pos + 1 == len(self.buf)

    def _step_fields(self, obj: dict) -> tuple:
        where = f"{self.file.path}:{self.lineno + 1}"
        try:
            step, site, ranks, fp = obj["step"], obj["site"], obj["ranks"], obj["fp"]
        except KeyError as e:
            raise TraceError(f"{where}: step record without {e.args[0]}") from None
        if type(step) is not int or type(fp) is not dict or type(ranks) is not list:
            raise TraceError(f"{where}: malformed step record")
        if type(site) is not str:
            raise TraceError(f"{where}: step record whose site is not a string ({site!r})")
        if any(type(r) is not int or not 0 <= r < self.ts.world_size for r in ranks):
            raise TraceError(f"{where}: step record with bad ranks {ranks!r} "
                             f"(integers in [0, {self.ts.world_size}))")
        for q, v in fp.items():
            if v is None or type(v) is str:
                continue
            if type(v) is not list:
                raise TraceError(f"{where}: fp[{q!r}] is neither a fingerprint string, a list nor null")
            if len(v) != len(ranks):
                raise TraceError(f"{where}: fp list length differs from ranks")
            if any(x is not None and type(x) is not str for x in v):
                raise TraceError(f"{where}: fp[{q!r}] holds a value that is not a fingerprint string")
        return step, site, ranks, fp


class EmptyTrace(TraceError):
    """A file with no complete header line: its writer was killed before writing one."""


def read_header(path: Path) -> Header:
    if _torn_header_only(path):
        raise EmptyTrace(f"{path}: empty trace (its only line, the header, is torn)")
    noop = lambda msg: None  # noqa: E731 - torn lines are reported when the body is streamed
    for lineno, obj in iter_lines(path, noop):
        if obj.get("type") != "header":
            raise TraceError(f"{path}: no header (line {lineno} is a {obj.get('type')!r} record)")
        try:
            rec = from_json(obj)
        except TraceError as e:
            raise TraceError(f"{path}: {e}") from None
        assert isinstance(rec, Header)
        return rec
    raise EmptyTrace(f"{path}: empty trace (no header)")


def _torn_header_only(path: Path) -> bool:
    """The file is one unfinished line that starts a header: killed while writing line 1."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False  # iter_lines reports it
    return (0 < len(head) < 1 << 16 and b"\n" not in head
            and head.startswith(b'{"type":"header"'[:len(head)]))


def _expand(p: Path) -> list[Path]:
    """A file, the traces (and rotated segments) of a directory, or a quoted glob pattern."""
    if p.is_dir():
        found = sorted(q for q in p.iterdir() if SEGMENT.search(q.name) and q.is_file())
        if not found:
            raise TraceError(f"{p}: directory holds no *.jsonl trace")
        return found
    if not p.exists() and glob.has_magic(str(p)):
        found = sorted(Path(q) for q in glob.glob(str(p)) if Path(q).is_file())
        if not found:
            raise TraceError(f"{p}: no file matches this pattern")
        return found
    if p.exists() and not p.is_file():  # a FIFO or a device (/dev/zero) could be read forever
        raise TraceError(f"{p}: not a regular file")
    return [p]


def _read_headers(paths: list[str | Path], warn) -> list[TraceFile]:
    files, seen, empty = [], set(), []
    for arg in paths:
        for q in _expand(Path(arg)):
            key = q.resolve()
            if key in seen:  # the same file named twice (a file and its directory): read it once
                continue
            seen.add(key)
            try:
                files.append(TraceFile(q, read_header(q)))
            except EmptyTrace:
                empty.append(q)
    if empty and files:  # a rank killed before its first line: the other files still count
        for q in empty:
            warn(f"{q}: empty trace (no header line: its writer was killed before writing?); skipped")
    elif empty:
        raise TraceError(f"{empty[0]}: empty trace (no header)" if len(empty) == 1
                         else f"all {len(empty)} trace files are empty (no header)")
    return files


def open_traces(paths: list[str | Path], run: str | None = None) -> TraceSet:
    """Check the files belong together and return the set to stream. TraceError if unusable."""
    if not paths:
        raise TraceError("no trace files given")
    early_warnings: list[str] = []
    files = _read_headers(list(paths), early_warnings.append)
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
    for w in early_warnings:
        ts.warn(w)
    if len(orders) > 1:
        ts.warn(f"files list different quantity orders; using {quantities}")
    # e.g. ranks on different tpguard releases: their values are not comparable. Headers before
    # tpguard.fp/2 did not record it (and other writers need not): "unrecorded" counts as one more.
    fp_versions = sorted({str(f.header.versions.get("fingerprint", "unrecorded")) if isinstance(f.header.versions, dict)
                          else "unrecorded" for f in files})
    if len(fp_versions) > 1:
        ts.warn(f"files hash with different fingerprint definitions ({', '.join(fp_versions)}): "
                "their values differ even for equal tensors")
    missing = [r for r in range(world_size) if r not in ranks]
    if len(ranks) < 2:
        skipped = "".join(f"; {w}" for w in early_warnings)
        raise TraceError(f"run {run_id}: only rank {ranks} has a trace here; need two ranks to compare "
                         f"(world size {world_size}, missing ranks {missing}){skipped}")
    if missing:
        ts.warn(f"no trace for rank(s) {missing} of {world_size}: they are not compared")
    return ts
