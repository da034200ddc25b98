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
each step every rank posts "step:count" to the store. A rank whose wait expires, or whose peer
closed its connection, names the ranks that died or froze (their pulse stopped:
`tpguard.watchdog.Liveness`); if none did, it reads everyone's post and names the ranks that
disagree with rank 0, or that did not reach the step (exit code 4 either way).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from tpguard.divergence import split_majority
from tpguard.errors import EXIT_TIMEOUT, TPGuardError
from tpguard.guard import all_gather_flat
from tpguard.watchdog import (base_store, bounded, current_liveness, dead_wait_s, peer_lost, quiet_store,
                              wait_with_deadline)

FORWARD_ELEMS = 64  # the stand-in forward all-reduce (fp32)


class HarnessTimeoutError(TPGuardError):
    """A harness collective did not complete within --timeout; names the ranks."""

    exit_code = EXIT_TIMEOUT

    def __init__(self, what: str, step: int, timeout_s: float, positions: dict[int, tuple[int, int] | None],
                 culprits: list[int], peer_left: bool = False, dead: dict[int, str] | None = None):
        self.what, self.step, self.timeout_s = what, step, timeout_s
        self.positions, self.culprits = positions, culprits
        self.dead = dict(dead or {})  # rank -> why (killed, crashed or frozen), from the ranks' pulses
        where = "; ".join(
            f"rank {r}: " + ("no report" if p is None else
                             f"step {p[0]}, " + ("final comparison" if p[1] < 0 else f"{p[1]} block broadcast(s)"))
            for r, p in sorted(positions.items()))
        how = ("ended early: a peer closed its connection" if peer_left
               else f"did not complete within {timeout_s:g} s")
        if self.dead:
            why = "; ".join(self.dead[r] for r in sorted(self.dead))
            super().__init__(f"tpguard: {why}; {what} at step {step} {how} ({where})")
        else:
            super().__init__(
                f"tpguard: {what} at step {step} {how}; ranks {culprits} disagree with rank 0 or did not arrive "
                f"({where})")


class StartupTimeoutError(TPGuardError):
    """Not every rank reached the start of the run within --timeout."""

    exit_code = EXIT_TIMEOUT


def comm_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


class StateCollective:
    def __init__(self, group, rank: int, world_size: int, run_id: str, timeout_s: float, backend: str):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.timeout_s = timeout_s
        self.device = comm_device(backend)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.store = base_store()
        self.prefix = f"tpguard/{run_id}/state"
        self.collectives = 0

    def _post(self, step: int, count: int) -> None:
        if self.store is not None:
            try:  # a set is sent without waiting for an answer: it cannot hang on a frozen store host
                with quiet_store():
                    self.store.set(f"{self.prefix}/{self.rank}", f"{step}:{count}")
            except Exception:  # the store going away must not break the run
                pass

    def positions(self) -> dict[int, tuple[int, int] | None]:
        def read(key: str) -> tuple[int, int] | None:
            if not self.store.check([key]):
                return None
            s, c = self.store.get(key).decode().split(":")
            return int(s), int(c)

        out: dict[int, tuple[int, int] | None] = {}
        for r in range(self.world_size):
            key = f"{self.prefix}/{r}"
            out[r] = bounded(lambda: read(key), 1.0) if self.store is not None else None
        return out

    def timeout_error(self, what: str, step: int, peer_left: bool = False) -> HarnessTimeoutError:
        """Name the ranks: those killed, crashed or frozen (their pulse stopped; a closed
        connection waits a moment for that to show); else, from what they posted, those outside
        the majority (ties: rank 0's side), i.e. behind or on another collective."""
        live = current_liveness()
        found = live.find_dead(dead_wait_s(self.timeout_s) if peer_left else 0.0) if live is not None else {}
        dead = {r: st.describe() for r, st in found.items()}
        pos = self.positions()
        if dead:
            return HarnessTimeoutError(what, step, self.timeout_s, pos, sorted(dead), peer_left, dead)
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

    def leave(self, grace_s: float = 2.0) -> None:
        """After a timeout: say so; a rank 0 that hosts the store (no launcher does) then waits,
        briefly, for the ranks still alive to say so too, so that they can still read everyone's
        position when they give up."""
        if self.store is None:
            return
        bounded(lambda: self.store.set(f"{self.prefix}/left/{self.rank}", "1"), 1.0)
        live = current_liveness()
        if self.rank != 0 or live is None or live.store_host != 0:
            return
        dead = set(live.find_dead())
        keys = [f"{self.prefix}/left/{r}" for r in range(1, self.world_size) if r not in dead]
        deadline = time.monotonic() + min(grace_s, self.timeout_s)
        while keys and time.monotonic() < deadline and not bounded(lambda: self.store.check(keys), 1.0, False):
            time.sleep(0.05)

    def all_gather_final(self, values: list[int], step: int) -> torch.Tensor:
        """[world, len(values)] int64 of every rank's values (end of run), deadline-bounded."""
        self._post(step, -1)
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        work = all_gather_flat(out, mine, group=self.group, async_op=True)
        self._wait(work, step, "the end-of-run output comparison")
        return out.view(self.world_size, -1).cpu()
