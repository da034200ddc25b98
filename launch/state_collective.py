"""The harness's one collective whose count depends on each rank's state, and its deadline.

SGLang's TP ranks each run their own scheduler and prefix cache; what they match and insert
decides how many and which collectives they issue next (prefix-matched extend lengths size the
forward pass, request metadata is broadcast per request). When the ranks' states drift apart they
issue different collectives and wedge. The harness reproduces that shape: at the start of each
step, one broadcast (from rank 0) per prefix-cache block this rank matched or inserted since the
last step, then one all-reduce standing in for the forward pass's. A rank that issues one
broadcast fewer pairs its all-reduce with the other rank's broadcast, and both wait forever.

It runs on its OWN process group (`dist.new_group`), so its sequence numbers never mix with the
guard's, and every wait is bounded by `--timeout` (`tpguard.watchdog.wait_with_deadline`). Before
each step every rank posts "step:count" to the store; a rank whose wait expires reads everyone's
and names the ranks that disagree with rank 0, or that did not reach the step (exit code 4).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from tpguard.divergence import split_majority
from tpguard.errors import EXIT_TIMEOUT, TPGuardError
from tpguard.guard import all_gather_flat
from tpguard.watchdog import default_store, wait_with_deadline

FORWARD_ELEMS = 64  # the stand-in forward all-reduce (fp32)


class HarnessTimeoutError(TPGuardError):
    """A harness collective did not complete within --timeout; names the ranks."""

    exit_code = EXIT_TIMEOUT

    def __init__(self, what: str, step: int, timeout_s: float, positions: dict[int, tuple[int, int] | None],
                 culprits: list[int], peer_left: bool = False):
        self.what, self.step, self.timeout_s = what, step, timeout_s
        self.positions, self.culprits = positions, culprits
        where = "; ".join(
            f"rank {r}: " + ("no report" if p is None else
                             f"step {p[0]}, " + ("final comparison" if p[1] < 0 else f"{p[1]} block broadcast(s)"))
            for r, p in sorted(positions.items()))
        how = ("ended early: a peer gave up (or died) and closed its connection" if peer_left
               else f"did not complete within {timeout_s:g} s")
        super().__init__(
            f"tpguard: {what} at step {step} {how}; ranks {culprits} disagree with rank 0 or did not arrive "
            f"({where})")


class StartupTimeoutError(TPGuardError):
    """Not every rank reached the start of the run within --timeout."""

    exit_code = EXIT_TIMEOUT


def peer_lost(e: BaseException) -> bool:
    """gloo's error when the other side of a pending collective exited (e.g. after its own timeout)."""
    text = str(e).lower()
    return "connection closed by peer" in text or "connection reset" in text or "broken pipe" in text


def comm_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


class StateCollective:
    def __init__(self, group, rank: int, world_size: int, run_id: str, timeout_s: float, backend: str):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.timeout_s = timeout_s
        self.device = comm_device(backend)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.store = default_store()
        self.prefix = f"tpguard/{run_id}/state"
        self.collectives = 0

    def _post(self, step: int, count: int) -> None:
        if self.store is not None:
            try:
                self.store.set(f"{self.prefix}/{self.rank}", f"{step}:{count}")
            except Exception:  # the store going away must not break the run
                pass

    def positions(self) -> dict[int, tuple[int, int] | None]:
        out: dict[int, tuple[int, int] | None] = {}
        for r in range(self.world_size):
            value = None
            if self.store is not None:
                try:
                    key = f"{self.prefix}/{r}"
                    if self.store.check([key]):
                        s, c = self.store.get(key).decode().split(":")
                        value = (int(s), int(c))
                except Exception:
                    value = None
            out[r] = value
        return out

    def timeout_error(self, what: str, step: int, peer_left: bool = False) -> HarnessTimeoutError:
        """Name the ranks from what they posted: those outside the majority (ties: rank 0's side)."""
        pos = self.positions()
        groups: dict[str, list[int]] = {}
        for r, p in pos.items():
            groups.setdefault(repr(p), []).append(r)
        _, culprits = split_majority(groups)
        return HarnessTimeoutError(what, step, self.timeout_s, pos, culprits, peer_left)

    def _wait(self, work, step: int, what: str) -> None:
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
        try:
            done = wait_with_deadline(work, self.timeout_s, event)
        except RuntimeError as e:
            if not peer_lost(e):
                raise
            raise self.timeout_error(what, step, peer_left=True) from None
        if not done:
            raise self.timeout_error(what, step)

    def run(self, step: int, blocks: list[np.ndarray]) -> None:
        """One broadcast per block (count depends on this rank's state), then the forward's all-reduce."""
        self._post(step, len(blocks))
        for block in blocks:
            buf = torch.from_numpy(np.ascontiguousarray(block)).to(self.device)
            work = dist.broadcast(buf, src=self.src, group=self.group, async_op=True)
            self._wait(work, step, "the prefix-cache collective")
            self.collectives += 1
        hidden = torch.ones(FORWARD_ELEMS, dtype=torch.float32, device=self.device)
        work = dist.all_reduce(hidden, group=self.group, async_op=True)
        self._wait(work, step, "the prefix-cache collective")
        self.collectives += 1

    def leave(self, grace_s: float = 5.0) -> None:
        """After a timeout: say so; rank 0 (which may host the store) then waits, briefly, for the
        others to say so too, so that they can still read everyone's position when they give up."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}/left/{self.rank}", "1")
            if self.rank != 0:
                return
            keys = [f"{self.prefix}/left/{r}" for r in range(1, self.world_size)]
            deadline = time.monotonic() + min(grace_s, self.timeout_s + 1.0)
            while time.monotonic() < deadline and not self.store.check(keys):
                time.sleep(0.05)
        except Exception:
            pass

    def all_gather_final(self, values: list[int], step: int) -> torch.Tensor:
        """[world, len(values)] int64 of every rank's values (end of run), deadline-bounded."""
        self._post(step, -1)
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        work = all_gather_flat(out, mine, group=self.group, async_op=True)
        self._wait(work, step, "the end-of-run output comparison")
        return out.view(self.world_size, -1).cpu()
