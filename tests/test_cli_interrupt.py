"""Ctrl-C in a tpguard command that reads or writes traces: one line, exit 130, no traceback
(typer turns the KeyboardInterrupt into a silent exit 130 unless tpguard's entry point says so)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.slow
def test_sigint_during_a_command_is_one_line(tmp_path):
    # `bench diagnose` writes a long trace, then reads it back: SIGINT once its first file exists,
    # i.e. inside the command (not during Python's start-up)
    out = tmp_path / "traces"
    p = subprocess.Popen([sys.executable, "-m", "tpguard", "bench", "diagnose", "--steps", "3000000", "--dir", str(out),
                          "--keep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TPGUARD_DEBUG": "", "PYTHONFAULTHANDLER": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and any(out.rglob("*.jsonl"))):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # still running: its threads' stacks (faulthandler, on SIGABRT) say where
            p.send_signal(signal.SIGABRT)
            pytest.fail("no exit within 120 s of SIGINT; its stacks:\n" + p.communicate(timeout=30)[1][-4000:])
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (p.returncode, stderr[-2000:])
    assert stderr == "tpguard: interrupted\n", stderr[-2000:]
    assert "Traceback" not in stdout
