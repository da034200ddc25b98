"""Naming a rank that stopped reaching the guard.

Every rank posts the last step it reached at each site to the process group's key-value store
(the TCPStore torchrun already runs), out of band of the collectives. When a rank's wait for the
guard's all-gather times out, it reads those keys and names the ranks that are behind, instead of
hanging until NCCL's own timeout fires hours later with no hint.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist


def default_store():
    """The store torch.distributed was initialised with, or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


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
                try:
                    key = self._key(g)
                    if self.store.check([key]):
                        value = int(self.store.get(key))
                except Exception:
                    value = None
            out[group_rank] = value
        return out

    def missing(self, step: int) -> tuple[list[int], dict[int, int | None]]:
        """(ranks that have not reached `step`, last step by rank)."""
        last = self.last_steps()
        return [r for r, s in last.items() if s is None or s < step], last

    def close(self) -> None:
        self._stop.set()


def wait_with_deadline(work, timeout_s: float, cuda_event=None) -> bool:
    """Wait for a collective; False if it did not finish in time.

    gloo: `Work.wait(timeout)` ends the wait (the collective stays pending). NCCL: `wait()` only
    orders streams, so completion is read from a CUDA event recorded after it, by polling.
    """
    if cuda_event is None:
        try:
            import datetime

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
