"""Naming a rank that stopped reaching the guard: behind, dead or frozen.

Two signals travel through the process group's key-value store (the TCPStore torchrun or
`tpguard launch` hosts), out of band of the collectives:

* `Heartbeat` (the guard's): the last step each rank reached at a site. A rank that waits past
  its deadline names the ranks behind it.
* `Liveness` (one per process, the harness's): a pulse, a counter each rank's own thread bumps a
  few times a second, and an exit note a rank leaves when it ends on purpose (its own timeout, a
  signal it handled, an error it caught). A rank that posted the same step as everyone and then
  stopped pulsing without a note was killed or crashed hard or is frozen (SIGSTOP): it is named
  even though its last step looks fine. A rank still pulsing is only behind.

Store operations on a store whose host is frozen never return, so every read made while naming
ranks is bounded (`bounded`); on a store whose host is gone they fail, and c10d logs each failure
with a C++ stack trace (20 lines), so tpguard's own store operations run with c10d's logs off
(`quiet_store`): tpguard reports the failure itself, in one line.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from dataclasses import dataclass

import orjson
import torch.distributed as dist

PULSE_S = 0.2  # how often a rank's pulse moves


def default_store():
    """The store torch.distributed was initialised with, or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def base_store():
    """The default store without torch's key prefixes: the store a launcher hosts, so that it
    can read what the ranks post there (their steps, their exit notes)."""
    store = default_store()
    while store is not None and isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def peer_lost(e: BaseException) -> bool:
    """gloo's error when the other side of a pending collective exited (died, or gave up)."""
    text = str(e).lower()
    return "connection closed by peer" in text or "connection reset" in text or "broken pipe" in text


_C10_FATAL = 3  # c10's log levels: 0 info, 1 warning, 2 error, 3 fatal
_quiet_lock = threading.Lock()
_quiet = {"depth": 0, "saved": None, "flag": None}


def _c10_log_level():
    """c10's FLAGS_caffe2_log_level (what TORCH_CPP_LOG_LEVEL sets at start), or None."""
    if _quiet["flag"] is None:
        try:
            import ctypes

            import torch

            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
            _quiet["flag"] = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
        except (OSError, ValueError, ImportError):
            _quiet["flag"] = False
    return _quiet["flag"] or None


@contextlib.contextmanager
def quiet_store():
    """c10d's logs off (below fatal) while tpguard touches the store; nestable, thread-safe."""
    flag = _c10_log_level()
    if flag is not None:
        with _quiet_lock:
            if _quiet["depth"] == 0:
                _quiet["saved"] = flag.value
                flag.value = max(flag.value, _C10_FATAL)
            _quiet["depth"] += 1
    try:
        yield
    finally:
        if flag is not None:
            with _quiet_lock:
                _quiet["depth"] -= 1
                if _quiet["depth"] == 0 and _quiet["saved"] is not None:
                    flag.value = _quiet["saved"]


def silence_c10d() -> None:
    """c10d's logs off for good: this rank is ending after a failure it has reported itself, and a
    thread still blocked on the store would log its own failure on the way out."""
    flag = _c10_log_level()
    if flag is not None:
        with _quiet_lock:
            _quiet["saved"] = _C10_FATAL
            flag.value = _C10_FATAL


_store_hung = threading.Event()  # a store operation never returned: its host is frozen


def bounded(fn, timeout_s: float, default=None):
    """A store operation fn() on a daemon thread, c10d's logs off; `default` if it raises or has
    not returned within timeout_s. After one that never returned, the others return `default` at
    once (they would queue behind it on the client's lock)."""
    if _store_hung.is_set():
        return default
    box: list = []

    def run() -> None:
        try:
            with quiet_store():
                box.append(fn())
        except Exception:  # the store going away must never break the caller
            pass

    t = threading.Thread(target=run, daemon=True, name="tpguard-store-op")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        _store_hung.set()
    return box[0] if box else default


def stale_after(timeout_s: float) -> float:
    """Seconds without a pulse after which a rank counts as gone: half the deadline, 1-2 s."""
    return min(2.0, max(1.0, timeout_s / 2))


def dead_wait_s(timeout_s: float) -> float:
    """How long a rank whose peer closed its connection waits for the peer's silence to show."""
    return stale_after(timeout_s) + 2 * PULSE_S


@dataclass
class RankStatus:
    """What the store says about one rank, as seen by another."""

    rank: int
    pulse: int | None  # its pulse counter as last read
    silent_s: float | None  # seconds its pulse has not moved (None: not watched)
    note: dict | None  # its exit note: {"how": "signal"|"crashed"|"ended", "signal", "code", "message"}
    stale_s: float
    hosts_store: bool = False  # the store it hosts does not answer (so nothing else could be read)

    @property
    def dead(self) -> bool:
        """Killed, crashed or frozen: not merely behind, and not a rank that gave up waiting."""
        if self.hosts_store:
            return True
        if self.note is not None:
            return self.note.get("how") in ("signal", "crashed")
        return self.silent_s is not None and self.silent_s >= self.stale_s

    def describe(self) -> str:
        note = self.note or {}
        if self.hosts_store:
            return f"rank {self.rank} is gone or frozen (the store it hosts does not answer)"
        if note.get("how") == "signal":
            verb = {"SIGINT": "interrupted", "SIGTERM": "terminated"}.get(note.get("signal"), "killed")
            return f"rank {self.rank} was {verb} ({note.get('signal')})"
        if note.get("how") == "crashed":
            return f"rank {self.rank} crashed ({note.get('message') or 'exit code ' + str(note.get('code'))})"
        if note.get("how") == "ended":
            return f"rank {self.rank} ended (exit code {note.get('code')})"
        if self.dead:
            return (f"rank {self.rank} stopped answering (no heartbeat for {self.silent_s:.1f} s: "
                    "killed, crashed or frozen)")
        return f"rank {self.rank} is alive"


class Liveness:
    """This process's pulse and exit note in the store, and the other ranks' as seen from here.

    `start()` runs a daemon thread that bumps this rank's pulse every `interval_s` and reads the
    others' (an `add(key, 0)` never blocks on a missing key), remembering when each last moved.
    `leave()` writes the exit note and stops the pulse; `statuses()` says who is dead.
    """

    def __init__(self, store, run_id: str, rank: int, world_size: int, stale_s: float = 2.0,
                 interval_s: float = PULSE_S, store_host: int | None = None):
        self.store = _own_connection(store)
        self.store_host = store_host  # the rank whose process hosts the store (None: a launcher does)
        self.prefix = f"tpguard/{run_id}/live"
        self.rank, self.world_size = rank, world_size
        self.stale_s, self.interval_s = stale_s, interval_s
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (pulse, monotonic time it last moved)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.left = False
        self.step: int | None = None  # the step this rank is at (set by the harness, read on a signal)

    def key(self, rank: int, what: str) -> str:
        return f"{self.prefix}/{rank}/{what}"

    def start(self) -> "Liveness":
        _store_hung.clear()  # a new run (a test may run several in one process group)
        if self.store is not None and self._thread is None:
            self._beat()
            self._thread = threading.Thread(target=self._run, daemon=True, name="tpguard-pulse")
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def _beat(self) -> None:
        try:
            with quiet_store():
                self.store.add(self.key(self.rank, "pulse"), 1)
                self._look()
        except Exception:  # the store going away must never break the run
            pass

    def _look(self) -> None:
        now = time.monotonic()
        for r in range(self.world_size):
            if r == self.rank:
                continue
            pulse = int(self.store.add(self.key(r, "pulse"), 0))
            with self._lock:
                old = self._seen.get(r)
                if old is None or old[0] != pulse:
                    self._seen[r] = (pulse, now)

    def leave(self, how: str, code: int, message: str = "", signal_name: str | None = None) -> bool:
        """Say why this rank ends (before it closes its connections) and stop the pulse; whether
        the note reached the store (False also when this rank has left already)."""
        if self.left:
            return False
        self.left = True
        self._stop.set()
        if self.store is None:
            return False
        note = {"how": how, "code": int(code), "message": message}
        if signal_name:
            note["signal"] = signal_name
        return bounded(lambda: self.store.set(self.key(self.rank, "exit"), orjson.dumps(note)) or True, 1.0, False)

    def note(self, rank: int) -> dict | None:
        def read():
            key = self.key(rank, "exit")
            return orjson.loads(self.store.get(key)) if self.store.check([key]) else None

        return bounded(read, 1.0) if self.store is not None else None

    def statuses(self) -> dict[int, RankStatus]:
        """Every other rank's status, after a fresh look at the pulses."""
        if self.store is None:
            return {}
        if not bounded(lambda: self._look() or True, 1.0, False):
            host = self.store_host
            if host is None or host == self.rank:
                return {}
            return {host: RankStatus(host, None, None, None, self.stale_s, hosts_store=True)}
        now = time.monotonic()
        out = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            with self._lock:
                seen = self._seen.get(r)
            pulse, silent = (None, None) if seen is None else (seen[0], now - seen[1])
            out[r] = RankStatus(r, pulse, silent, self.note(r), self.stale_s)
        return out

    def find_dead(self, wait_s: float = 0.0) -> dict[int, RankStatus]:
        """Ranks killed, crashed or frozen. With `wait_s` (a peer just closed its connection, so
        a pulse that stopped a moment ago still looks fresh) it waits until every rank has left
        a note, pulsed again or gone silent for `stale_s`, at most `wait_s` seconds."""
        deadline = time.monotonic() + wait_s
        first: dict[int, int | None] | None = None
        while True:
            statuses = self.statuses()
            dead = {r: s for r, s in statuses.items() if s.dead}
            if first is None:
                first = {r: s.pulse for r, s in statuses.items()}
            undecided = [r for r, s in statuses.items()
                         if not s.dead and s.note is None and s.pulse == first.get(r)]
            if dead or not undecided or time.monotonic() >= deadline:
                return dead
            time.sleep(self.interval_s)

    def stop(self) -> None:
        self._stop.set()


def _own_connection(store):
    """A second client of the same store (its own socket and lock), so that the pulse thread and
    the main thread never wait on each other's store operations; the store itself if it cannot."""
    if store is None:
        return None
    try:
        return store.clone()
    except Exception:
        return store


_current: Liveness | None = None


def set_liveness(liveness: Liveness | None) -> None:
    """The process's liveness (the harness starts one), consulted by the guard's timeouts."""
    global _current
    _current = liveness


def current_liveness() -> Liveness | None:
    return _current


class Heartbeat:
    """Last step reached per (site, rank), published to the store.

    `beat()` is a plain attribute write; with `background=True` a daemon thread publishes it every
    `interval_s` so that the hot path never waits on the store. Otherwise each beat is published at
    once (one small TCP round trip: fine for the harness and tests).
    """

    def __init__(self, store, run_id: str, site: str, global_ranks: list[int], my_global_rank: int,
                 background: bool = False, interval_s: float = 0.5):
        self.store = store
        self.prefix = f"tpguard/{run_id}/{site}/last_step"
        self.global_ranks = list(global_ranks)
        self.me = my_global_rank
        self.last_step: int | None = None
        self._published: int | None = None
        self._stop = threading.Event()
        self._thread = None
        if store is not None and background:
            self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True,
                                            name="tpguard-heartbeat")
            self._thread.start()

    def _key(self, global_rank: int) -> str:
        return f"{self.prefix}/{global_rank}"

    def beat(self, step: int) -> None:
        self.last_step = step
        if self._thread is None:
            self.publish()

    def publish(self) -> None:
        step = self.last_step
        if self.store is None or step is None or step == self._published:
            return
        try:
            with quiet_store():
                self.store.set(self._key(self.me), str(step))
            self._published = step
        except Exception:  # the store going away must never break the guarded program
            pass

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.publish()

    def last_steps(self) -> dict[int, int | None]:
        """group rank -> last step it published (None: never, or the store is unreachable)."""
        self.publish()
        out: dict[int, int | None] = {}
        for group_rank, g in enumerate(self.global_ranks):
            value = None
            if self.store is not None:
                key = self._key(g)
                value = bounded(lambda: int(self.store.get(key)) if self.store.check([key]) else None, 1.0)
            out[group_rank] = value
        return out

    def missing(self, step: int) -> tuple[list[int], dict[int, int | None]]:
        """(ranks that have not reached `step`, last step by rank)."""
        last = self.last_steps()
        return [r for r, s in last.items() if s is None or s < step], last

    def dead(self, wait_s: float = 0.0) -> dict[int, str]:
        """group rank -> why, for the ranks of this group the process's liveness finds killed,
        crashed or frozen (empty without one: the guard outside the harness)."""
        live = current_liveness()
        if live is None:
            return {}
        by_global = live.find_dead(wait_s)
        return {gr: by_global[g].describe() for gr, g in enumerate(self.global_ranks) if g in by_global}

    def close(self) -> None:
        self._stop.set()


def wait_with_deadline(work, timeout_s: float, cuda_event=None) -> bool:
    """Wait for a collective; False if it did not finish in time.

    gloo: `Work.wait(timeout)` ends the wait (the collective stays pending). NCCL: `wait()` only
    orders streams, so completion is read from a CUDA event recorded after it, by polling.
    """
    if cuda_event is None:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
            return True
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                return False
            raise
    work.wait()
    cuda_event.record()
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not cuda_event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True
