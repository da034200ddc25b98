"""Trace writer and reader (format v1: docs/trace-format.md).

Writer: one JSON object per line, each line handed to the OS in one write(2) as it is made, so a
killed run keeps every completed record; fsynced at exit and on SIGTERM. A write that fails (a
full disk, a file size limit) is cut back to the last complete line and raises `TraceWriteError`:
the file stays readable up to the last record written. Optional size rotation keeps a
long-running server's trace bounded.

Reader: streams records with constant memory; a torn last line is skipped with a warning;
anything else that is not a v1 trace is a `TraceError` (one line, exit code 2 in the CLI).
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson

from tpguard.errors import TraceError, TraceWriteError
from tpguard.records import Header, Record, from_json, to_json

logger = logging.getLogger("tpguard.trace")

# --- writer ----------------------------------------------------------------------------------

_open_writers: "weakref.WeakSet[TraceWriter]" = weakref.WeakSet()
_exit_hooks_installed = False


def _flush_all(lock_timeout: float = -1) -> None:
    for w in list(_open_writers):
        w.flush(lock_timeout)


def _install_exit_hooks() -> None:
    """Flush every open trace at interpreter exit and on SIGTERM (then die as SIGTERM would)."""
    global _exit_hooks_installed
    if _exit_hooks_installed:
        return
    _exit_hooks_installed = True
    atexit.register(_flush_all)
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        # The handler runs on the main thread, maybe inside a write() that holds a writer's lock:
        # waiting for it would deadlock the dying process. Completed lines are already with the
        # OS (line buffering), so a writer whose lock is busy can be skipped.
        _flush_all(lock_timeout=0.2)
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main interpreter
        pass


def rank_trace_path(trace_dir: str | os.PathLike, run_id: str, rank: int) -> Path:
    return Path(trace_dir) / f"{run_id}.rank{rank}.jsonl"


def merged_trace_path(trace_dir: str | os.PathLike, run_id: str) -> Path:
    return Path(trace_dir) / f"{run_id}.merged.jsonl"


def _keep_aside(path: Path) -> None:
    """Move a non-empty file at `path` to `path.prev<N>` (first free N): opening for writing
    would truncate it. Diagnose ignores `.prev<N>` files unless they are named explicitly."""
    try:
        if path.stat().st_size == 0:
            return
    except OSError:
        return
    n = 1
    while path.with_name(f"{path.name}.prev{n}").exists():
        n += 1
    aside = path.with_name(f"{path.name}.prev{n}")
    os.replace(path, aside)
    logger.warning("tpguard: %s already held a trace (run id reused?); kept it as %s", path, aside)


class TraceWriter:
    """Writes one trace file: the header first, then records as they come."""

    def __init__(self, path: str | os.PathLike, header: Header, max_bytes: int = 0):
        self.path = Path(path)
        self.header = header
        self.max_bytes = max_bytes
        self.last_step: int | None = None  # the step of the last step record written whole
        self._lock = threading.Lock()
        self._segment = 0
        self._fd = -1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open(self.path)
        _open_writers.add(self)
        _install_exit_hooks()

    def _open(self, path: Path) -> None:
        _keep_aside(path)  # never truncate a trace already there (a reused run id, a restart)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._bytes = 0
        self._write_line(to_json(self.header))

    def _write_line(self, obj: dict) -> None:
        data = orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)
        done = 0
        try:
            while done < len(data):  # a regular file takes it in one write unless it is full
                done += os.write(self._fd, data[done:])
        except OSError as e:
            self._fail(e)
        self._bytes += len(data)

    def _fail(self, e: OSError) -> None:
        """Cut a partly written line off (readers then see whole records only) and raise."""
        try:
            os.ftruncate(self._fd, self._bytes)
        except OSError:
            pass
        upto = (f"it holds every record up to step {self.last_step}" if self.last_step is not None
                else "it holds no step record")
        name = errno.errorcode.get(e.errno, "")
        raise TraceWriteError(f"tpguard: cannot write the trace {self.path}: {e.strerror or e}"
                              + (f" ({name})" if name else "") + f"; {upto}") from None

    def write(self, rec: Record) -> None:
        with self._lock:
            if self._fd < 0:
                return
            if self.max_bytes and self._bytes >= self.max_bytes:
                self._rotate()
            self._write_line(to_json(rec))
            if rec.type == "step":
                self.last_step = rec.step

    def _rotate(self) -> None:
        """Move the full file aside (path.1, path.2, ...) and start a new one with the header."""
        os.close(self._fd)
        self._fd = -1
        self._segment += 1
        while self.path.with_name(f"{self.path.name}.{self._segment}").exists():
            self._segment += 1  # a segment of an earlier writer of this path: keep it
        os.replace(self.path, self.path.with_name(f"{self.path.name}.{self._segment}"))
        self._open(self.path)

    def flush(self, lock_timeout: float = -1) -> None:
        """fsync (every line is with the OS already). `lock_timeout` >= 0 gives up if the lock
        stays busy that long: the signal paths, where the holder may be the interrupted frame."""
        if not self._lock.acquire(timeout=lock_timeout):
            return
        try:
            if self._fd >= 0:
                try:
                    os.fsync(self._fd)
                except OSError:
                    pass
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        _open_writers.discard(self)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_trace_writers(trace_dir: str | os.PathLike, header: Header, rank: int, merged: bool,
                       max_bytes: int = 0) -> tuple[TraceWriter, TraceWriter | None]:
    """This rank's trace file (`header` with `ranks: [rank]`), and on rank 0 the merged file
    (every rank) if asked for. OSError if the directory cannot be written."""
    own = TraceWriter(rank_trace_path(trace_dir, header.run_id, rank),
                      dataclasses.replace(header, ranks=[rank]), max_bytes=max_bytes)
    if not (merged and rank == 0):
        return own, None
    try:
        both = TraceWriter(merged_trace_path(trace_dir, header.run_id),
                           dataclasses.replace(header, ranks=list(range(header.world_size))), max_bytes=max_bytes)
    except BaseException:
        own.close()
        raise
    return own, both


# --- reader ----------------------------------------------------------------------------------

Warn = Callable[[str], None]


def iter_lines(path: str | os.PathLike, warn: Warn) -> Iterator[tuple[int, dict]]:
    """(line number, parsed object) for every line; a torn last line is skipped with a warning."""
    p = Path(path)
    try:
        f = open(p, "rb")
    except OSError as e:
        raise TraceError(f"{p}: cannot open ({e.strerror})") from None
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                obj = loads(raw)
            except decode_error:
                if lineno == 1:
                    raise TraceError(f"{p}: not a tpguard trace (line 1 is not JSON)") from None
                # A line the writer did not finish has no newline; it can only be the last one.
                if not raw.endswith(b"\n") or not f.peek(1):
                    warn(f"{p}:{lineno}: torn last line skipped (the writer was killed mid-write?)")
                    return
                raise TraceError(f"{p}:{lineno}: line is not JSON (corrupt trace)") from None
            if type(obj) is not dict:
                if lineno == 1:
                    raise TraceError(f"{p}: not a tpguard trace (line 1 is not a JSON object)")
                raise TraceError(f"{p}:{lineno}: line is not a JSON object")
            yield lineno, obj


def read_trace(path: str | os.PathLike, warn: Warn | None = None) -> Iterator[Record]:
    """Typed records of one file. The first record must be a header."""
    warn = warn or (lambda msg: None)
    first = True
    for lineno, obj in iter_lines(path, warn):
        if first:
            if obj.get("type") != "header":
                raise TraceError(f"{path}: no header (line {lineno} is a {obj.get('type')!r} record)")
            first = False
        try:
            rec = from_json(obj)
        except TraceError as e:
            raise TraceError(f"{path}:{lineno}: {e}") from None
        yield rec
    if first:
        raise TraceError(f"{path}: empty trace (no header)")
