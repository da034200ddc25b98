"""A harness rank's SIGINT and SIGTERM: note for the other ranks, traces flushed, exit 130 / 143.

The main thread may sit for up to --timeout inside a collective's wait (C++), where a Python
signal handler would not run until the wait ends, and a KeyboardInterrupt would end in a
traceback. So the handlers only wake a watcher thread (`signal.set_wakeup_fd`), which leaves
the rank's exit note in the store (the other ranks then name it at once), fsyncs every open trace
(each completed line is already with the OS) and ends the process with 128 + the signal number,
printing at most one line.
"""

from __future__ import annotations

import os
import signal
import threading

HANDLED = (signal.SIGINT, signal.SIGTERM)
VERBS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


def _ignore(signum, frame) -> None:  # the watcher thread acts; the main thread carries on meanwhile
    return None


def install(rank: int, announce: bool) -> bool:
    """Route SIGINT and SIGTERM to the watcher; `announce`: print one line when one comes (off
    under `tpguard launch`, which prints the run's one line itself). False where it cannot (not
    the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in HANDLED:
            signal.signal(sig, _ignore)
    except ValueError:
        return False
    threading.Thread(target=_watch, args=(read_fd, rank, announce), daemon=True, name="tpguard-signals").start()
    return True


def _watch(read_fd: int, rank: int, announce: bool) -> None:
    while True:
        got = os.read(read_fd, 1)
        if got and got[0] in HANDLED:
            break
    exit_on_signal(signal.Signals(got[0]), rank, announce)


def exit_on_signal(sig: signal.Signals, rank: int, announce: bool) -> None:
    from tpguard.trace import _flush_all
    from tpguard.watchdog import current_liveness

    code = 128 + int(sig)
    live = current_liveness()
    step = live.step if live is not None else None
    if live is not None:
        live.leave("signal", code, signal_name=sig.name)
    _flush_all(lock_timeout=0.5)
    if os.isatty(2):  # rank 0's progress bar hides the cursor while it runs: show it again
        os.write(2, b"\x1b[?25h")
    if announce:
        at = f" at step {step}" if step is not None else ""
        line = f"[rank {rank}] tpguard: {VERBS.get(sig, 'stopped')} ({sig.name}){at}; traces flushed\n"
        try:
            os.write(2, line.encode())
        except OSError:
            pass
    os._exit(code)
