"""Faults in the harness, with real processes and real signals (CPU, gloo).

A rank killed (SIGKILL, SIGTERM) or frozen (SIGSTOP) is named by the survivors within --timeout,
in their message, their trace event and `tpguard diagnose`; `tpguard launch` exits 6 (died) or 4
(frozen) with one line naming it; a full trace file (RLIMIT_FSIZE) is one line and the trace stays
readable; Ctrl-C / SIGTERM end every rank with 130 / 143 and one line; a rank that never starts is
named within --timeout; warm-up steps are timed apart from the steady state.

Runs are started as a user would: `tpguard launch` (the launcher and its rank processes) or
`python -m tpguard.launch` per rank with torchrun's variables set by hand (rank 0 hosts the store).
Each rank is set to 100000 steps; a fault is planted once rank 1's trace shows a few steps.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multiproc import free_port
from tpguard.diagnose import diagnose, render_text
from tpguard.trace import read_trace

pytestmark = pytest.mark.slow  # ranks killed, frozen and timed out, through the launcher

LONG = ["--steps", "100000", "--renorm", "torch", "--no-progress"]
_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _end_what_was_started():
    """A failing test must not leave ranks behind (a frozen one above all): kill what it started."""
    yield
    while _started:
        p = _started.pop()
        if p.poll() is None:
            for pid in _children(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.kill()
            p.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _launch(*args, preexec_fn=None) -> subprocess.Popen:
    """`tpguard launch --nproc-per-node 2 ...` in a session of its own (Ctrl-C goes to its group)."""
    p = subprocess.Popen([sys.executable, "-m", "tpguard.cli", "launch", "--nproc-per-node", "2", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=preexec_fn)
    _started.append(p)
    return p


def _manual(world: int, ranks: list[int], *args) -> dict[int, subprocess.Popen]:
    """`python -m tpguard.launch` for the given ranks of a world, variables set by hand."""
    port = str(free_port())
    procs = {}
    for r in ranks:
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs[r] = subprocess.Popen([sys.executable, "-m", "tpguard.launch", *args], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
        _started.append(procs[r])
    return procs


def _rank_pids(launcher: int) -> dict[int, int]:
    """The launcher's rank processes, by the RANK in their environment."""
    out = {}
    for pid in _children(launcher):
        with open(f"/proc/{pid}/environ", "rb") as f:
            for var in f.read().split(b"\0"):
                if var.startswith(b"RANK="):
                    out[int(var[5:])] = pid
    return out


def _steps_in(trace_dir: Path, rank: int) -> int:
    for path in trace_dir.glob(f"*.rank{rank}.jsonl"):
        return path.read_bytes().count(b'"type":"step"')
    return 0


def _wait_for_steps(trace_dir: Path, procs, n: int = 3, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while _steps_in(trace_dir, 1) < n:
        assert all(p.poll() is None for p in procs), "a rank ended before the fault was planted"
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.05)


def _finish(p: subprocess.Popen, limit: float = 60.0) -> tuple[str, str, float]:
    t = time.monotonic()
    try:
        out, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"still running after {limit} s:\n{out}\n{err}")
    return out, err, time.monotonic() - t


def _events(trace_dir: Path, rank: int) -> list:
    recs = []
    for path in trace_dir.glob(f"*.rank{rank}.jsonl"):
        recs += [r for r in read_trace(path) if r.type == "event"]
    return recs


def _readable_whole(trace_dir: Path) -> None:
    """Every trace reads without a warning (no torn line) and ends with a complete line."""
    for path in trace_dir.glob("*.jsonl"):
        warnings = []
        records = list(read_trace(path, warnings.append))
        assert records and not warnings, (path, warnings)
        assert path.read_bytes().endswith(b"\n"), path


def _no_noise(text: str) -> None:
    for needle in ("Traceback", "frame #", "TCPStore", "KeyboardInterrupt", "Exception raised"):
        assert needle not in text, text


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_rank_is_named_by_the_survivor_and_launch_exits_6(tmp_path, sig):
    timeout = 4
    p = _launch(*LONG, "--timeout", str(timeout), "--trace", str(tmp_path))
    _wait_for_steps(tmp_path, [p])
    os.kill(_rank_pids(p.pid)[1], sig)
    out, err, took = _finish(p)
    assert p.returncode == 6, (out, err)
    assert took < timeout + 3, took  # the survivor named it within --timeout (plus the launcher's look)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tpguard launch: rank 1 died ({sig.name}) at step "), err
    assert "rank 0 named it and exited 4" in lines[0], err
    _no_noise(out + err)
    said = "rank 1 stopped answering" if sig == signal.SIGKILL else "rank 1 was terminated (SIGTERM)"
    assert said in out  # rank 0's summary carries its message
    (event,) = [e for e in _events(tmp_path, 0) if e.kind == "timeout"]
    assert event.extra["missing_ranks"] == [1] and event.extra["dead_ranks"] == [1] and said in event.message
    assert said in render_text(diagnose([tmp_path]))
    _readable_whole(tmp_path)


def test_the_store_host_killed_is_named_without_a_launcher(tmp_path):
    procs = _manual(2, [0, 1], *LONG, "--quiet", "--timeout", "3", "--trace", str(tmp_path))
    _wait_for_steps(tmp_path, procs.values())
    procs[0].kill()
    out, err, took = _finish(procs[1])
    procs[0].wait()
    assert procs[1].returncode == 4 and took < 3 + 2, (took, err)
    assert err.startswith("[rank 1] tpguard: rank 0 is gone or frozen (the store it hosts does not answer)"), err
    assert len(err.splitlines()) == 1
    _no_noise(err)
    (event,) = [e for e in _events(tmp_path, 1) if e.kind == "timeout"]
    assert event.extra["dead_ranks"] == [0]


def _guard_after_a_death(rank, world, queue_path):
    """Rank 1 dies right after step 0's check; rank 0's guard waits at step 1 (the guard's own path)."""
    import torch

    from tpguard.errors import RankTimeoutError
    from tpguard.guard import StepGuard
    from tpguard.launch.harness import start_liveness

    guard = StepGuard(site="kill.verify", quantities=["rng_state", "bonus"], timeout_s=3.0, run_id="kill")
    start_liveness("kill", rank, world, 3.0)
    guard.record("bonus", torch.arange(4))
    guard.check(0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    guard.record("bonus", torch.arange(4))
    t = time.monotonic()
    try:
        guard.check(1)
    except RankTimeoutError as e:
        return {"missing": e.missing, "dead": sorted(e.dead), "message": str(e), "took": time.monotonic() - t}
    return {"missing": None}


def test_the_guard_names_a_rank_that_died_after_reaching_the_same_step(tmp_path):
    from multiproc import _ctx, _entry

    queue, port = _ctx.Queue(), free_port()
    procs = [_ctx.Process(target=_entry, args=(_guard_after_a_death, r, 2, port, (str(tmp_path),), queue, {}))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, status, got = queue.get(timeout=40)  # rank 1 never reports: it was killed
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert (rank, status) == (0, "ok"), got
    assert procs[1].exitcode == -signal.SIGKILL
    assert got["missing"] == [1] and got["dead"] == [1], got
    assert "rank 1 stopped answering" in got["message"] and got["took"] < 3.0 + 1, got


def test_a_full_trace_file_is_one_line_and_the_trace_stays_readable(tmp_path):
    limit = 24_000  # bytes per file (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a write gets EFBIG)

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    p = _launch("--steps", "400", "--renorm", "torch", "--no-progress", "--timeout", "4", "--trace", str(tmp_path),
                preexec_fn=small_files)
    out, err, _ = _finish(p)
    assert p.returncode == 6, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and "crashed at step" in lines[0] and "File too large (EFBIG)" in lines[0], err
    assert "it holds every record up to step" in lines[0]
    _no_noise(out + err)
    _readable_whole(tmp_path)
    for path in tmp_path.glob("*.jsonl"):
        steps = [r.step for r in read_trace(path) if r.type == "step"]
        assert steps == list(range(len(steps))) and len(steps) > 5 and path.stat().st_size <= limit
    assert render_text(diagnose([tmp_path])).splitlines()[1].startswith("CLEAN")


@pytest.mark.parametrize("how,code", [("sigint-group", 130), ("sigterm-launcher", 143)])
def test_ctrl_c_or_sigterm_end_every_rank_with_one_line(tmp_path, how, code):
    p = _launch(*LONG, "--timeout", "5", "--trace", str(tmp_path))
    _wait_for_steps(tmp_path, [p])
    pids = _rank_pids(p.pid)
    if how == "sigint-group":  # what a terminal's Ctrl-C does: every process of the group gets it
        os.killpg(p.pid, signal.SIGINT)
    else:
        os.kill(p.pid, signal.SIGTERM)
    out, err, took = _finish(p)
    assert p.returncode == code and took < 5, (took, out, err)
    name = "SIGINT" if code == 130 else "SIGTERM"
    verb = "interrupted" if code == 130 else "terminated"
    assert err.splitlines() == [f"tpguard launch: {verb} ({name}); every rank stopped, traces flushed"], err
    _no_noise(out + err)
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
    _readable_whole(tmp_path)
    assert _steps_in(tmp_path, 0) >= 3 and _steps_in(tmp_path, 1) >= 3


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_python_m_tpguard_launch_ranks_on_a_signal(tmp_path, sig, code):
    procs = _manual(2, [0, 1], *LONG, "--quiet", "--timeout", "5", "--trace", str(tmp_path))
    _wait_for_steps(tmp_path, procs.values())
    for p in procs.values():
        os.killpg(p.pid, sig)
    verb = "interrupted" if sig == signal.SIGINT else "terminated"
    for r, p in procs.items():
        out, err, took = _finish(p, 20)
        assert p.returncode == code and took < 5, (r, took, err)
        assert len(err.splitlines()) == 1 and err.startswith(f"[rank {r}] tpguard: {verb} ({sig.name}) at step "), err
        assert err.rstrip().endswith("; traces flushed")
        _no_noise(err)
    _readable_whole(tmp_path)


def test_a_frozen_rank_ends_within_the_timeout_under_launch(tmp_path):
    timeout = 3
    p = _launch(*LONG, "--timeout", str(timeout), "--trace", str(tmp_path))
    _wait_for_steps(tmp_path, [p])
    frozen = _rank_pids(p.pid)[1]
    t = time.monotonic()
    os.kill(frozen, signal.SIGSTOP)
    out, err, _ = _finish(p)
    took = time.monotonic() - t
    assert p.returncode == 4, (out, err)
    assert took < timeout + 2, took
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpguard launch: rank 1 was frozen"), err
    assert "rank 0 named it" in lines[0] and lines[0].endswith("rank 1 was killed")
    assert "rank 1 stopped answering" in out
    _no_noise(out + err)
    assert not Path(f"/proc/{frozen}").exists() or b"zombie" in Path(f"/proc/{frozen}/status").read_bytes().lower()


@pytest.mark.parametrize("victim", [1, 0])
def test_a_frozen_rank_without_a_launcher_survivor_and_resumed_rank_end_quietly(tmp_path, victim):
    """victim 0 hosts the store: the survivor cannot read anything there and says so."""
    timeout = 3
    procs = _manual(2, [0, 1], *LONG, "--quiet", "--timeout", str(timeout), "--trace", str(tmp_path))
    _wait_for_steps(tmp_path, procs.values())
    t = time.monotonic()
    os.kill(procs[victim].pid, signal.SIGSTOP)
    survivor = procs[1 - victim]
    out, err, _ = _finish(survivor)
    took = time.monotonic() - t
    assert survivor.returncode == 4 and took < timeout + 2, (took, err)
    named = ("rank 1 stopped answering" if victim == 1
             else "rank 0 is gone or frozen (the store it hosts does not answer)")
    assert len(err.splitlines()) == 1 and named in err, err
    os.kill(procs[victim].pid, signal.SIGCONT)
    out, err, took = _finish(procs[victim], 20)
    assert procs[victim].returncode == 4 and took < 2 + timeout, (took, err)
    assert len(err.splitlines()) <= 1, err
    _no_noise(out + err)


@pytest.mark.parametrize("world,started,missing", [(2, [0], [1]), (2, [1], [0]), (3, [0, 1], [2])])
def test_a_rank_that_never_starts_is_named_within_the_timeout(world, started, missing):
    t = time.monotonic()
    procs = _manual(world, started, "--steps", "3", "--timeout", "3")
    for r, p in procs.items():
        out, err, _ = _finish(p, 40)
        assert p.returncode == 4, (r, out, err)
        assert len(err.splitlines()) == 1 and f"rank(s) {missing} never arrived within 3 s" in err, err
        _no_noise(err)
    assert time.monotonic() - t < 3 + 15  # start-up (torch's import) included; torch's own wait is 60 s+


def test_warmup_steps_are_timed_apart_from_the_steady_state(tmp_path):
    from tpguard.launch.spawn import spawn_ranks

    path = tmp_path / "summary.json"
    res = spawn_ranks(["--steps", "8", "--renorm", "torch", "--no-progress", "--warmup-steps", "3",
                       "--summary-json", str(path)], 2, timeout=120, capture=True)
    assert res.exit_codes == [0, 0], res.outputs
    s = json.loads(path.read_text())
    assert (s["warmup_steps"], len(s["warmup_step_ms"]), s["steps_timed"]) == (3, 3, 5)
    assert s["ms_per_step"] == pytest.approx(1e3 * s["seconds"] / 5, abs=1e-3)
    assert s["warmup_ms_per_step"] == pytest.approx(sum(s["warmup_step_ms"]) / 3, abs=1e-2)
    text = res.outputs[0]
    assert "steady state over 5 step(s)" in text and "warm-up:          3 step(s)" in text

    res = spawn_ranks(["--steps", "4", "--renorm", "emulated-atomic", "--logits", "flat", "--no-progress",
                       "--on-divergence", "abort", "--summary-json", str(path)], 2, timeout=120, capture=True)
    s = json.loads(path.read_text())  # aborted at step 0, inside its warm-up (half of 4 steps: 2)
    assert res.exit_codes == [3, 3] and s["ms_per_step"] is None and s["warmup_steps"] == 1
    assert "time per step:    n/a (the run ended within its warm-up)" in res.outputs[0]
