"""Reader: open any number of trace files (per-rank, merged, mixed, compressed) and stream their records.

Headers are read up front (first line of each file) to check that the files are of one run:
world size, algo, config (the seed, ...), creation time and rank coverage. Bodies are read
through one `FileCursor` per file: a small buffer of raw lines that the matcher either consumes
in blocks (clean stretches compared as bytes, see matcher.py) or one step at a time (parsed and
checked: hex fingerprints, non-negative steps in order, the header's run id). Memory stays
constant whatever the trace length.
"""

from __future__ import annotations

import datetime as _dt
import functools
import glob
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from tpguard.diagnose.source import open_trace_bytes, truncated
from tpguard.errors import TraceError
from tpguard.paths import describe
from tpguard.records import MAX_STEP, MAX_WORLD_SIZE, SCHEMA, DivergenceRecord, EventRecord, Header, from_json

BLOCK_LINES = 4096
# Files a directory argument stands for: traces and their rotated segments (NAME.jsonl.1, ...),
# plain or compressed.
SEGMENT = re.compile(r"\.jsonl(\.[0-9]+)?(\.gz|\.zst)?$")
FIRST_LINE_LIMIT = 8 << 20  # a header is a few hundred bytes; more without a newline is not a trace
# Every rank writes its header right after a collective (the run id's broadcast, a process
# group's set-up, the first verify step): within a second or two, stamped to the second. Further
# apart, the files are of two runs that reuse one run id (a rerun takes longer than this to start).
CREATED_TOLERANCE_S = 10.0
FINGERPRINT = re.compile(r"[0-9a-f]{16}")
HEX_RUN = re.compile(r"[0-9a-f]*")
RANKS_SHOWN = 8
_INT, _STR, _STR_OR_NONE, _SIXTEEN = {int}, {str}, {str, type(None)}, {16}
_CAPTURED = functools.partial(operator.is_not, None)


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


def show(text: str, limit: int = 60) -> str:
    """A name from a trace, fit for a one-line message (garbage shown escaped)."""
    return text if text.isprintable() and len(text) <= limit else ascii(text[:limit])


def show_ranks(ranks, shown: int = RANKS_SHOWN) -> str:
    """A list of ranks for a message, cut short: a long list would make one line megabytes."""
    ranks = list(ranks)
    if len(ranks) <= shown + 2:
        return repr(ranks)
    head = ", ".join(map(repr, ranks[:shown]))
    return f"[{head}, ... {ranks[-1]!r}] ({len(ranks)} ranks)"


def _header_checked(h: Header, where: str) -> Header:
    if h.world_size > MAX_WORLD_SIZE:
        raise TraceError(f"{where}: header with world_size {h.world_size} (at most {MAX_WORLD_SIZE} ranks)")
    bad = [r for r in h.ranks if not 0 <= r < h.world_size]
    if bad:
        raise TraceError(f"{where}: header with ranks {show_ranks(bad)} outside its world size {h.world_size}")
    return h


class FileCursor:
    """Buffered raw lines of one file, consumed as clean blocks or as one parsed step at a time.

    Step records come out as (step, site, ranks, fp). Divergence and event records met on the way
    are kept in the TraceSet. Every parsed record is checked: a malformed one, a record of another
    run, or a header of another run or rank (files concatenated) is a TraceError naming the file
    and line.
    """

    def __init__(self, f: TraceFile, ts: TraceSet):
        self.file = f
        self.ts = ts
        self._fh = open_trace_bytes(f.path)
        self.buf: list[bytes] = []
        self.pos = 0  # next unread line in buf
        self.lineno = 0  # lines consumed before buf[pos]
        self.eof = False
        self.header_run = f.header.run_id  # the run of the header above the current line
        self.header_ranks = frozenset(f.header.ranks)
        self.last_step = -1
        self.last_sites: set[str] = set()  # sites recorded at last_step (a repeat is a duplicated line)
        self._head: tuple | None = None  # parsed step record at buf[pos], if any

    # -- raw buffer --------------------------------------------------------------------------

    def fill(self, n: int) -> int:
        """Make at least n unread lines available (fewer at end of file); returns how many are."""
        if len(self.buf) - self.pos < n and not self.eof:
            rest = self.buf[self.pos:]
            more = self._fh.readlines(max(1 << 20, 400 * n))
            if not more:
                self.eof = True
                if truncated(self._fh):
                    self.ts.warn(f"{self.file.path}: compressed data ends early (the file was cut?); "
                                 "read up to its last complete line")
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
            if kind == "step":
                self._head = self._checked_step(obj)
                return self._head
            self.skip(1)
            if kind != "step":
                self._other(kind, obj)
        return self._head

    def pop(self) -> tuple:
        rec = self._head
        assert rec is not None
        self.passed(rec[0], rec[1])
        self.skip(1)
        return rec

    def passed(self, step: int, site: str) -> None:
        """A record of (step, site) was consumed: the next one of this file must come after it."""
        if step != self.last_step:
            self.last_step = step
            self.last_sites = set()
        self.last_sites.add(site)

    def where(self, offset: int = 1) -> str:
        return f"{self.file.path}:{self.lineno + offset}"

    def _checked_step(self, obj: dict) -> tuple:
        """The step record at the cursor, checked."""
        rid = obj.get("run_id")
        if rid != self.header_run:
            raise TraceError(f"{self.where()}: step record of run {show(str(rid))!r} under a header of run "
                             f"{show(self.header_run)!r}")
        rec = self.step_fields(obj)
        step, site = rec[0], rec[1]
        if step < self.last_step:
            raise TraceError(f"{self.where()}: step {step} after step {self.last_step}: lines out of order "
                             "(a trace lists its steps in increasing order)")
        if step == self.last_step and site in self.last_sites:
            raise TraceError(f"{self.where()}: a second record of step {step}, site {show(site)!r} "
                             "(a duplicated line?)")
        return rec

    def _other(self, kind, obj) -> None:
        where = f"{self.file.path}:{self.lineno}"
        if kind == "header":
            self._second_header(obj, where)
        elif kind in ("divergence", "event"):
            rid = obj.get("run_id")
            if rid is not None and rid != self.header_run:  # another run's record: files concatenated
                raise TraceError(f"{where}: {kind} record of run {show(str(rid))!r} under a header of run "
                                 f"{show(self.header_run)!r} (files concatenated?); give each run's files "
                                 "separately")
            try:
                rec = from_json(obj)
            except TraceError as e:
                self.ts.warn(f"{where}: {e}; record ignored")
                return
            (self.ts.divergences if kind == "divergence" else self.ts.events).append(rec)
        else:
            self.ts.warn(f"{where}: unknown record type {show(str(kind))!r} ignored")

    def scan_headers(self) -> None:
        """Check every header after line 1 (a byte search, then a parse of the few lines found)."""
        while self.fill(1):
            raw = self.buf[self.pos]
            if self.lineno > 0 and b'"header"' in raw:
                obj = self._parse(raw, self.lineno + 1)
                if obj is not None and obj.get("type") == "header":
                    self._second_header(obj, self.where())
            self.skip(1)

    def _second_header(self, obj: dict, where: str) -> None:
        """A header inside the file. Rotated segments of one rank joined with `cat` repeat the
        file's header and read on; anything else is other files concatenated into this one, whose
        records would be read as this rank's (or dropped): refused."""
        if obj.get("schema") != SCHEMA:
            raise TraceError(f"{where}: unknown schema {show(str(obj.get('schema')))!r}")
        try:
            header = from_json(obj)
        except TraceError as e:
            raise TraceError(f"{where}: {e}") from None
        _header_checked(header, where)
        mine = self.file.header
        if header.run_id != mine.run_id:
            raise TraceError(f"{where}: a header of run {show(header.run_id)!r} inside the trace of run "
                             f"{show(mine.run_id)!r} (files concatenated?); give each run's files separately")
        if sorted(header.ranks) != sorted(mine.ranks):
            raise TraceError(f"{where}: a second header, of rank(s) {show_ranks(sorted(header.ranks))}, inside "
                             f"the trace of rank(s) {show_ranks(sorted(mine.ranks))} (files concatenated?); "
                             "give each rank's file separately")
        differ = header_differences(self.ts.files[0].header, header)
        if differ:  # one file holding two runs that share a run id
            raise TraceError(f"{where}: a header of run {self.ts.run_id} that differs from the run's "
                             f"first header in {_describe(differ)}: two runs that reuse one run id?")

    def _parse(self, raw: bytes, lineno: int) -> dict | None:
        path = self.file.path
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            if "number is infinity" in str(e):  # a whole line (not torn) holding a huge number
                raise TraceError(f"{path}:{lineno}: a number out of range (steps and ranks are integers "
                                 f"from 0 to {MAX_STEP})") from None
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

    def step_fields(self, obj: dict, offset: int = 1) -> tuple:
        """(step, site, ranks, fp) of a step record, every field checked (this runs once per
        record on the parsed path: the common shapes are checked with C-level set operations)."""
        try:
            step, site, ranks, fp = obj["step"], obj["site"], obj["ranks"], obj["fp"]
        except KeyError as e:
            raise TraceError(f"{self.where(offset)}: step record without {e.args[0]}") from None
        if type(step) is float and abs(step) > MAX_STEP:  # orjson reads integers beyond 64 bits as floats
            raise TraceError(f"{self.where(offset)}: step {step:g} out of range (0 to {MAX_STEP})")
        if type(step) is not int or type(fp) is not dict or type(ranks) is not list:
            raise TraceError(f"{self.where(offset)}: malformed step record")
        if step < 0:
            raise TraceError(f"{self.where(offset)}: negative step {step}")
        if step > MAX_STEP:
            raise TraceError(f"{self.where(offset)}: step {step} out of range (0 to {MAX_STEP})")
        if type(site) is not str:
            raise TraceError(f"{self.where(offset)}: step record whose site is not a string ({site!r})")
        if not (set(map(type, ranks)) <= _INT and self.header_ranks.issuperset(ranks)
                and len(set(ranks)) == len(ranks)):
            self._bad_ranks(ranks, offset)
        values = fp.values()
        kinds = set(map(type, values))
        if kinds <= _STR:
            pass
        elif kinds <= _STR_OR_NONE:
            values = list(filter(_CAPTURED, values))
        else:
            values = self._listed_values(fp, ranks, offset)
        # One regex over all values: a call per value would cost as much as the JSON parse.
        if values and (set(map(len, values)) != _SIXTEEN or not HEX_RUN.fullmatch("".join(values))):
            q, bad = next((q, x) for q, v in fp.items() for x in (v if type(v) is list else [v])
                          if x is not None and not FINGERPRINT.fullmatch(x))
            raise TraceError(f"{self.where(offset)}: fp[{show(q)!r}] = {show(bad, 40)!r} is not a fingerprint "
                             "(16 lower-case hex digits)")
        return step, site, ranks, fp

    def _bad_ranks(self, ranks: list, offset: int) -> None:
        if any(type(r) is not int or not 0 <= r < self.ts.world_size for r in ranks):
            raise TraceError(f"{self.where(offset)}: step record with bad ranks {show(repr(ranks), 120)} "
                             f"(integers in [0, {self.ts.world_size}))")
        raise TraceError(f"{self.where(offset)}: step record of ranks {show_ranks(ranks)} in a file whose header "
                         f"covers ranks {show_ranks(sorted(self.header_ranks))}")

    def _listed_values(self, fp: dict, ranks: list, offset: int) -> list[str]:
        """The captured values of an fp holding per-rank lists, each entry checked."""
        values = []
        for q, v in fp.items():
            if v is None:
                continue
            if type(v) is str:
                values.append(v)
                continue
            if type(v) is not list:
                raise TraceError(f"{self.where(offset)}: fp[{q!r}] is neither a fingerprint string, a list nor null")
            if len(v) != len(ranks):
                raise TraceError(f"{self.where(offset)}: fp list length differs from ranks")
            for x in v:
                if x is not None:
                    if type(x) is not str:
                        raise TraceError(f"{self.where(offset)}: fp[{q!r}] holds a value that is not a "
                                         "fingerprint string")
                    values.append(x)
        return values


class EmptyTrace(TraceError):
    """A file with no complete header line: its writer was killed before writing one."""


def _looks_like_torn_header(line: bytes) -> bool:
    """An unfinished first line that starts a header (compact or spaced layout)."""
    text = line.lstrip()
    return any(p.startswith(text[:len(p)]) for p in (b'{"type":"header"', b'{"type": "header"'))


def read_header(path: Path) -> Header:
    with open_trace_bytes(path) as f:
        first = f.readline(FIRST_LINE_LIMIT)
        finished = first.endswith(b"\n")
        at_end = not finished and not f.read(1)
    if not first:
        raise EmptyTrace(f"{path}: empty trace (no header)")
    try:
        obj = orjson.loads(first)
    except orjson.JSONDecodeError:
        if at_end and _looks_like_torn_header(first):
            raise EmptyTrace(f"{path}: empty trace (its only line, the header, is torn)") from None
        raise TraceError(f"{path}: not a tpguard trace (line 1 is not JSON)") from None
    if type(obj) is not dict:
        raise TraceError(f"{path}: not a tpguard trace (line 1 is not a JSON object)")
    if obj.get("type") != "header":
        raise TraceError(f"{path}: no header (line 1 is a {show(str(obj.get('type')))!r} record)")
    try:
        rec = from_json(obj)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None
    assert isinstance(rec, Header)
    return _header_checked(rec, str(path))


def _expand(p: Path, warn) -> list[Path]:
    """A file, the traces (and rotated segments) of a directory, or a quoted glob pattern. Of a
    directory's or a pattern's matches only regular files are read: the others (a FIFO or a device
    could be read forever) are skipped, each named to `warn`; sub-directories silently."""
    if p.is_dir():
        matches, none = sorted(q for q in p.iterdir() if SEGMENT.search(q.name)), \
            f"{p}: directory holds no *.jsonl trace (plain, .gz or .zst)"
    elif not p.exists() and glob.has_magic(str(p)):
        matches, none = sorted(Path(q) for q in glob.glob(str(p))), f"{p}: no file matches this pattern"
    elif p.exists() and not p.is_file():  # a FIFO or a device (/dev/zero) could be read forever
        raise TraceError(f"{p}: not a regular file ({describe(p)})")
    else:
        return [p]
    found = [q for q in matches if q.is_file()]
    skipped = [f"{q}: not a regular file ({describe(q)}); skipped" for q in matches
               if not q.is_file() and not q.is_dir()]
    for w in skipped:
        warn(w)
    if not found:
        raise TraceError(none + "".join(f"; {w}" for w in skipped))
    return found


def trace_paths(paths: list[str | Path], warn=None) -> list[Path]:
    """The files the arguments stand for (directories and patterns expanded), each once; `warn`
    hears of the files a directory or pattern holds that are skipped."""
    out, seen = [], set()
    for arg in paths:
        for q in _expand(Path(arg), warn or (lambda msg: None)):
            key = q.resolve()
            if key not in seen:  # the same file named twice (a file and its directory): read it once
                seen.add(key)
                out.append(q)
    return out


def _read_headers(paths: list[str | Path], warn) -> list[TraceFile]:
    files, empty = [], []
    for q in trace_paths(paths, warn):
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


def _created(h: Header) -> _dt.datetime | None:
    try:
        t = _dt.datetime.fromisoformat(h.created)
    except (TypeError, ValueError):
        return None  # free-form in other writers: not compared
    return t if t.tzinfo is not None else t.replace(tzinfo=_dt.timezone.utc)


def header_differences(a: Header, b: Header) -> list[tuple[str, object, object]]:
    """Header fields that differ between two files of one run id: (field, a's value, b's value).

    Files of one run share world size, algo and config (the seed, sampling parameters, ...), and
    were created within CREATED_TOLERANCE_S; anything else is two runs that reuse one run id."""
    out = []
    if a.world_size != b.world_size:
        out.append(("world_size", a.world_size, b.world_size))
    if a.algo != b.algo:
        out.append(("algo", a.algo, b.algo))
    if isinstance(a.config, dict) and isinstance(b.config, dict):
        keys = sorted(a.config.keys() & b.config.keys(), key=lambda k: (k != "seed", k))
        out += [(f"config.{k}", a.config[k], b.config[k]) for k in keys if a.config[k] != b.config[k]]
    ta, tb = _created(a), _created(b)
    if ta is not None and tb is not None and abs((ta - tb).total_seconds()) > CREATED_TOLERANCE_S:
        out.append(("created", a.created, b.created))
    return out


def _describe(differ: list[tuple[str, object, object]]) -> str:
    def value(v) -> str:
        text = repr(v)
        return text if len(text) <= 40 else text[:37] + "..."

    return ", ".join(f"{name} {value(x)} vs {value(y)}" for name, x, y in differ)


def _check_one_run(run_id: str, files: list[TraceFile]) -> None:
    """TraceError naming the header fields in which the files of `run_id` disagree."""
    ref = files[0]
    pairs, named = [], set()
    for f in files[1:]:
        differ = [d for d in header_differences(ref.header, f.header) if d[0] not in named]
        if differ:
            named.update(d[0] for d in differ)
            pairs.append(f"{ref.path} vs {f.path}: {_describe(differ)}")
    if pairs:
        raise TraceError(f"run {run_id}: the files' headers differ, two runs that reuse one run id? "
                         f"{'; '.join(pairs[:3])}; give the files of one run")


def open_trace_set(paths: list[str | Path], run: str | None = None) -> TraceSet:
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
    _check_one_run(run_id, files)
    world_size = files[0].header.world_size
    ranks = sorted({r for f in files for r in f.header.ranks})
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise TraceError(f"run {run_id}: ranks {show_ranks(bad)} outside world size {world_size}")
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
    covered = set(ranks)
    missing = [r for r in range(world_size) if r not in covered]
    if len(ranks) < 2:
        for c in ts.cursors():  # other ranks' files concatenated into this one: say that instead
            c.scan_headers()
        skipped = "".join(f"; {w}" for w in early_warnings)
        raise TraceError(f"run {run_id}: only rank {ranks} has a trace here; need two ranks to compare "
                         f"(world size {world_size}, missing ranks {show_ranks(missing)}){skipped}")
    if missing:
        ts.warn(f"no trace for rank(s) {show_ranks(missing)} of {world_size}: they are not compared")
    return ts
