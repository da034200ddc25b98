"""`tpguard launch --nproc-per-node N [harness options]`: N harness ranks on this machine.

Each rank is `python -m tpguard.launch` in its own process with the environment torchrun sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, ...) and
the store hosted here, as `torchrun --standalone` hosts it: the same ranks as under torchrun. What
this launcher adds is the end of a run that fails:

* when a rank fails, the others are left to end by themselves (they name the failed rank within
  their --timeout); a rank frozen by SIGSTOP never will, so it is killed at once, and any rank
  still running `--timeout` + 3 s after the first failure is terminated (torchrun instead
  terminates the others at once, so nobody names the failed rank, and waits 30 s for a frozen one);
* SIGINT (Ctrl-C) or SIGTERM: every rank flushes its traces and stops; exit 130 / 143;
* the exit code says what happened first, in one line on stderr naming the rank: a rank killed by
  a signal or crashed 6, frozen 4; otherwise the ranks' own code (the earliest failure's).

Harness arguments are checked first (with the world size N), so bad ones are rejected before any
process starts (exit 2).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import orjson

from tpguard.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, EXIT_RANK_DIED, EXIT_TIMEOUT
from tpguard.launch.options import HarnessOptions, OptionsError, check_paths, to_argv, validate

POLL_S = 0.05
KILL_AFTER_S = 2.0  # a rank asked to stop (SIGTERM) that has not, is killed after this
VERDICTS = (0, 1, 2, 3, 4)  # a rank's own codes: ok, diverged, bad arguments, aborted, timeout


def signal_of(code: int | None) -> signal.Signals | None:
    """The signal that ended a process: a negative return code, or 128 + n from a rank's own
    signal handler (130 SIGINT, 143 SIGTERM)."""
    if code is None:
        return None
    n = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        return signal.Signals(n) if n else None
    except ValueError:
        return None


def rank_env(rank: int, world: int, port: int, run: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                "ROLE_NAME": "default", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "ROLE_WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run,
                "TPGUARD_LAUNCHER": "1"})
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks must not each take every core
    return env


def is_stopped(pid: int) -> bool:
    """Frozen by SIGSTOP (or a debugger): state T / t in /proc (Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


@dataclass
class Rank:
    rank: int
    proc: subprocess.Popen
    code: int | None = None
    ended_at: float | None = None
    frozen: bool = False
    ended_by_us: bool = False  # killed or terminated by this launcher (not a failure of its own)


@dataclass
class Launch:
    ranks: list[Rank]
    store: object
    timeout_s: float
    signal_got: signal.Signals | None = None
    first_failure: Rank | None = None
    stop_sent_at: float | None = None

    def alive(self) -> list[Rank]:
        return [r for r in self.ranks if r.code is None]

    def reap(self) -> None:
        for r in self.alive():
            code = r.proc.poll()
            if code is None:
                continue
            r.code, r.ended_at = code, time.monotonic()
            if code != 0 and self.first_failure is None and not r.ended_by_us:
                self.first_failure = r

    def stop(self, sig: signal.Signals) -> None:
        """Ask every rank still running to stop (a frozen one is woken to hear it); those still
        running KILL_AFTER_S later are killed."""
        for r in self.alive():
            r.ended_by_us = True
            _send(r, sig)
            _send(r, signal.SIGCONT)
        if self.stop_sent_at is None:
            self.stop_sent_at = time.monotonic()

    def look(self) -> None:
        """One look at the ranks: reap; after a signal, stop them all; after a failure, kill the
        frozen at once and stop the others if they have not ended `--timeout` + 3 s later."""
        self.reap()
        now = time.monotonic()
        if self.signal_got is not None and self.stop_sent_at is None:
            self.stop(self.signal_got)
        if self.first_failure is not None:
            for r in self.alive():
                if not r.frozen and is_stopped(r.proc.pid):  # it can never name anyone, nor end
                    r.frozen = r.ended_by_us = True
                    _send(r, signal.SIGKILL)
            if self.stop_sent_at is None and now > self.first_failure.ended_at + self.timeout_s + 3.0:
                self.stop(signal.SIGTERM)
        if self.stop_sent_at is not None and now > self.stop_sent_at + KILL_AFTER_S:
            for r in self.alive():
                r.ended_by_us = True
                _send(r, signal.SIGKILL)


def _send(r: Rank, sig: signal.Signals) -> None:
    if r.code is None:
        try:
            r.proc.send_signal(sig)
        except ProcessLookupError:
            pass


# --- what the store says about the run (the ranks post it: tpguard.watchdog, launch/state_collective.py) ---

def _read(store, key: str) -> str | None:
    from tpguard.watchdog import bounded

    def get():
        return store.get(key).decode() if store.check([key]) else None

    return bounded(get, 1.0)


def rank_step(store, run_id: str | None, rank: int) -> int | None:
    """The step a rank last posted (the state collective's "step:count")."""
    if run_id is None:
        return None
    value = _read(store, f"tpguard/{run_id}/state/{rank}")
    try:
        return int(value.split(":")[0]) if value else None
    except ValueError:
        return None


def rank_note(store, run_id: str | None, rank: int) -> dict:
    """The exit note a rank left (tpguard.watchdog.Liveness.leave), or {}."""
    if run_id is None:
        return {}
    value = _read(store, f"tpguard/{run_id}/live/{rank}/exit")
    try:
        return orjson.loads(value) if value else {}
    except ValueError:
        return {}


def verdict(launch: Launch) -> tuple[int, str | None]:
    """The launcher's exit code and its one line (None: the ranks' own output says it all)."""
    from tpguard.launch.harness import RUN_ID_KEY

    store = launch.store
    run_id = _read(store, RUN_ID_KEY)

    def at(r: Rank) -> str:
        step = rank_step(store, run_id, r.rank)
        return f" at step {step}" if step is not None else ""

    if launch.signal_got is not None:
        sig = launch.signal_got
        stuck = [r.rank for r in launch.ranks if signal_of(r.code) == signal.SIGKILL]
        how = ("every rank stopped, traces flushed" if not stuck
               else f"rank(s) {stuck} did not stop within {KILL_AFTER_S:g} s and were killed")
        verb = "interrupted" if sig == signal.SIGINT else "terminated"
        return 128 + int(sig), f"tpguard launch: {verb} ({sig.name}); {how}"
    failed = sorted((r for r in launch.ranks if r.code not in (None, 0) and not r.ended_by_us),
                    key=lambda r: r.ended_at)
    died = [r for r in failed if signal_of(r.code) is not None or r.code not in VERDICTS]
    if died:
        r = died[0]
        sig = signal_of(r.code)
        note = rank_note(store, run_id, r.rank)
        message = note.get("message", "").removeprefix("tpguard: ")
        if sig is not None:
            what, code = f"rank {r.rank} died ({sig.name}){at(r)}", EXIT_RANK_DIED
        elif r.code == EXIT_INTERNAL:
            what, code = (f"rank {r.rank} failed{at(r)} with an internal error (a tpguard bug): "
                          f"{message or 'see its output'}"), EXIT_INTERNAL
        else:
            what, code = f"rank {r.rank} crashed{at(r)}: {message or f'exit code {r.code}'}", EXIT_RANK_DIED
        return code, f"tpguard launch: {what}; {_others(launch, r, store, run_id)}"
    frozen = [r for r in launch.ranks if r.frozen]
    if frozen:
        r = frozen[0]
        return EXIT_TIMEOUT, (f"tpguard launch: rank {r.rank} was frozen (stopped, e.g. by SIGSTOP){at(r)}; "
                              f"{_others(launch, r, store, run_id)}; rank {r.rank} was killed")
    if failed:
        return failed[0].code, None
    return EXIT_OK, None


def _others(launch: Launch, culprit: Rank, store, run_id: str | None) -> str:
    """What the other ranks did about it: named it (their exit note mentions it) or not."""
    parts = []
    for r in launch.ranks:
        if r is culprit or r.frozen:
            continue
        if r.ended_by_us:
            parts.append(f"rank {r.rank} was stopped")
            continue
        named = f"rank {culprit.rank} " in rank_note(store, run_id, r.rank).get("message", "") + " "
        parts.append(f"rank {r.rank} {'named it and ' if named else ''}exited {r.code}")
    return ", ".join(parts) if parts else "no other rank"


def launch_ranks(nproc_per_node: int, opts: HarnessOptions) -> int:
    """Check the options (with the world size), start the ranks with them, return the run's code."""
    try:
        if nproc_per_node < 2:
            raise OptionsError(f"--nproc-per-node must be >= 2 (the harness compares ranks), got {nproc_per_node}")
        validate(opts, world_size=nproc_per_node)
        check_paths(opts)
    except OptionsError as e:
        print(f"tpguard launch: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args = to_argv(opts)

    got: list[signal.Signals] = []

    def on_signal(signum, frame) -> None:
        if not got:
            got.append(signal.Signals(signum))

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, nproc_per_node, is_master=True, wait_for_workers=False)
        run = f"tpguard-{os.getpid()}"
        procs = []
        for r in range(nproc_per_node):
            if got:
                break
            procs.append(Rank(r, subprocess.Popen([sys.executable, "-m", "tpguard.launch", *args],
                                                  env=rank_env(r, nproc_per_node, store.port, run))))
        launch = Launch(procs, store, opts.timeout)
        while launch.alive():
            if got and launch.signal_got is None:
                launch.signal_got = got[0]
            launch.look()
            time.sleep(POLL_S)
        launch.reap()
        if got and launch.signal_got is None:
            launch.signal_got = got[0]
        code, line = verdict(launch)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if line:
        print(line, file=sys.stderr, flush=True)
    return code
