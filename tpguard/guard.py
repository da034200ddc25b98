"""StepGuard: per step, fingerprint the named quantities on every rank, compare, act.

One guard per verify site. Per step: `record(name, tensor)` for each quantity (or None), then
`check()`: one all-gather of a fixed-size int64 vector over the TP group, a comparison in causal
order (`tpguard.divergence.first_divergence`), a trace record, and the policy:

* ``record``: write the divergence and go on;
* ``abort``: raise `RankDivergenceError` on every rank at the same step (they all saw the same
  gathered vector), so nothing hangs afterwards;
* ``heal``: broadcast rank 0's decision tensors (accept_index, accept_len, bonus, commit_lens,
  out_tokens) in place, so the ranks continue in agreement.

The gathered vector is ``[step, site id, present mask, fingerprint x Q, numel x Q]``: its size
depends only on the number of quantities, never on a rank's state, so the guard's collective can
never be the one that hangs. A rank that never arrives is named after `timeout_s` (see watchdog).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from tpguard.config import POLICIES
from tpguard.divergence import first_divergence
from tpguard.errors import RankDivergenceError, RankTimeoutError, TraceWriteError
from tpguard.fingerprint import attached_fingerprint, fingerprint_device, fingerprint_rows_i64, format_fp, to_signed
from tpguard.quantities import CANONICAL_ORDER, DECISION_QUANTITIES, validate_order
from tpguard.metrics import MetricsListener
from tpguard.records import DivergenceRecord, EventRecord, Header, StepRecord, compact_fp
from tpguard.sampling import should_check
from tpguard.trace import TraceWriter, open_trace_writers
from tpguard.watchdog import Heartbeat, dead_wait_s, default_store, peer_lost, wait_with_deadline

_HDR = 3  # step, site id, present mask
# A bit of the present mask above every quantity's (at most 62): "this rank's own guard work failed
# this step". Every rank reads it in the gathered vector, so the ranks stop guarding a site together
# and their collectives stay paired (hooks/sglang_runtime.py).
FAILED_BIT = 62


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """All-gather into one flat tensor (`all_gather_single` where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def site_id(site: str) -> int:
    return xxhash.xxh64_intdigest(site.encode()) & ((1 << 62) - 1)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + os.urandom(3).hex()


class GroupInfo:
    """Who we are in the compared group, and where its collectives' tensors must live."""

    def __init__(self, group=None):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            self.rank, self.world_size, self.global_ranks = 0, 1, [0]
            self.backend, self.device = "none", torch.device("cpu")
            return
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) if group is not None else r
                             for r in range(self.world_size)]
        self.backend = str(dist.get_backend(group)).lower()
        uses_cuda = "nccl" in self.backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if uses_cuda else torch.device("cpu")

    def src0(self) -> int:
        return self.global_ranks[0]


RUN_ID_BYTES = 128


def agree_on_run_id(info: GroupInfo, run_id: str | None, timeout_s: float = 60.0) -> str:
    """Every rank of the group uses group rank 0's run id: one fixed-size broadcast, bounded by
    the timeout like every wait of the guard. A given run id (the same on every rank) needs none."""
    if run_id is not None or info.world_size == 1:
        return run_id or new_run_id()
    buf = torch.zeros(RUN_ID_BYTES, dtype=torch.uint8)
    if info.rank == 0:
        raw = new_run_id().encode()[:RUN_ID_BYTES]
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buf = buf.to(info.device)
    work = dist.broadcast(buf, src=info.src0(), group=info.group, async_op=True)
    if not wait_with_deadline(work, timeout_s, torch.cuda.Event() if buf.is_cuda else None):
        raise RankTimeoutError("run start", 0, [], {}, timeout_s)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()


class StepGuard:
    """Fingerprint, all-gather, compare and act, once per verify step at one site."""

    def __init__(
        self,
        group=None,
        site: str = "synthetic.verify",
        quantities: Sequence[str] = CANONICAL_ORDER,
        policy: str = "record",
        trace: TraceWriter | str | os.PathLike | None = None,
        *,
        merged_trace: TraceWriter | None = None,
        merged: bool = False,
        timeout_s: float = 60.0,
        dump_dir: str | os.PathLike | None = None,
        algo: str = "synthetic",
        run_id: str | None = None,
        every: int = 1,
        clean_every: int = 1,
        config: dict | None = None,
        versions: dict | None = None,
        background_heartbeat: bool = False,
        sample_one_in: int = 0,
        sample_seed: int | None = None,
        metrics: bool = False,
        max_trace_bytes: int = 0,
        trace_optional: bool = False,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {'|'.join(POLICIES)}, got {policy!r}")
        self.info = GroupInfo(group)
        self.site = site
        self.quantities = validate_order(quantities)
        if len(self.quantities) > 62:
            raise ValueError("at most 62 quantities per guard")
        self.index = {q: i for i, q in enumerate(self.quantities)}
        self.policy = policy
        self.timeout_s = float(timeout_s)
        self.every = max(1, int(every))
        self.clean_every = max(1, int(clean_every))
        self.dump_dir = Path(dump_dir) if dump_dir else None
        # Set by the caller: step -> tpguard.dump.DumpContext (what `tpguard replay` re-runs with)
        self.dump_context: Callable[[int], object] | None = None
        self.run_id = agree_on_run_id(self.info, run_id, self.timeout_s)
        self.site_id = site_id(site)
        self.sample_one_in = int(sample_one_in)
        # The seed must be the same on every rank: derive it from the agreed run id by default.
        self.sample_seed = site_id(self.run_id) if sample_seed is None else int(sample_seed)
        self.metrics = MetricsListener(site) if metrics else None
        self.step = 0  # next step number when check() is not told
        self.last_checked: int | None = None
        self.stats = {"checked": 0, "divergences": 0, "healed": 0, "aborted": 0, "timeouts": 0,
                      "heal_broadcasts": 0}
        self.local_failure = False  # set by the caller before check(): sent as FAILED_BIT
        self.failed_ranks: list[int] = []  # ranks that sent FAILED_BIT at the last check
        self.listeners: list[Callable[[DivergenceRecord], None]] = []
        # Policy fix: who applies a switch (tpguard.fix.Switch) from the next step on, and the
        # kinds already switched at this site (each switches once).
        self.switchers: list[Callable[[object], None]] = []
        self.switched: set[str] = set()
        self.always_broadcast = False  # after a broadcast switch: rank 0's decisions every check
        self.last_healed: list[str] = []  # decisions broadcast at the last check
        self.guard_seconds = 0.0  # time spent in record()+check(), for the harness summary
        # A trace that can no longer be written: raise TraceWriteError (the harness: its trace is
        # the point), or, trace_optional (a server), drop it with one log line and go on checking.
        self.trace_optional = trace_optional
        self._reset_step()

        self._own_trace: TraceWriter | None = None
        self.merged_trace = merged_trace
        if isinstance(trace, (str, os.PathLike)):
            header = Header(run_id=self.run_id, world_size=self.info.world_size, ranks=[self.info.rank],
                            quantities=list(self.quantities), algo=algo, config=config or {},
                            versions=versions or default_versions())
            trace, own_merged = open_trace_writers(trace, header, self.info.rank, merged, max_trace_bytes)
            self._own_trace = trace
            self.merged_trace = self.merged_trace or own_merged
        self.trace = trace
        self.heartbeat = Heartbeat(default_store() if self.info.distributed else None, self.run_id, site,
                                   self.info.global_ranks, self.info.global_ranks[self.info.rank],
                                   background=background_heartbeat)

    # --- per step --------------------------------------------------------------------------

    def _reset_step(self) -> None:
        self._fps: dict[str, torch.Tensor | int] = {}
        self._numels: dict[str, int] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._dump_copies: dict[str, torch.Tensor] = {}

    def wants(self, step: int | None = None) -> bool:
        """Whether check() at this step will compare (every N steps; the same on all ranks)."""
        step = self.step if step is None else step
        return should_check(step, self.every, self.sample_one_in, self.sample_seed)

    def _forget_if_none(self, name: str, value) -> bool:
        """Check the name; a None value means "not captured this step" (forget any earlier one)."""
        if name not in self.index:
            raise ValueError(f"unknown quantity {name!r} for site {self.site} (known: {list(self.quantities)})")
        if value is None:
            self._fps.pop(name, None)
            self._tensors.pop(name, None)
            return True
        return False

    def record(self, name: str, tensor: torch.Tensor | None) -> None:
        """Fingerprint `tensor` now (it may be overwritten later); None means not captured."""
        t0 = time.perf_counter()
        if self._forget_if_none(name, tensor):
            return
        pre = attached_fingerprint(tensor)
        self._fps[name] = pre if pre is not None else fingerprint_device(tensor)
        self._numels[name] = tensor.numel()
        # Kept for heal (decisions are overwritten in place) and row naming; dumps need a copy
        # of the value as recorded.
        self._tensors[name] = tensor
        if self.dump_dir:
            self._dump_copies[name] = tensor.detach().clone()
        self.guard_seconds += time.perf_counter() - t0

    def record_fingerprint(self, name: str, value: int | torch.Tensor, numel: int = 0) -> None:
        """An already computed fingerprint (e.g. emitted by a kernel's write pass)."""
        if self._forget_if_none(name, value):
            return
        self._fps[name] = value if isinstance(value, torch.Tensor) else to_signed(int(value))
        self._numels[name] = numel

    def skip(self) -> None:
        """Drop what was recorded for this step without checking (unchecked steps)."""
        self._reset_step()
        self.step += 1

    def discard(self) -> None:
        """Drop what was recorded; no step happened (the step number stays)."""
        self._reset_step()

    def check(self, step: int | None = None, *, heal: bool = True) -> DivergenceRecord | None:
        """Compare this step's fingerprints across ranks; act on a divergence per the policy.
        `heal=False`: this step cannot be healed (the caller says why): policy heal records."""
        step = self.step if step is None else int(step)
        self.step = step + 1
        self.failed_ranks = []
        self.last_healed = []
        if not self.wants(step):
            self._reset_step()
            return None
        t0 = time.perf_counter()
        gathered = self._all_gather(self._vector(step), step)
        self.failed_ranks = [r for r, row in enumerate(gathered.tolist()) if (row[2] >> FAILED_BIT) & 1]
        self._heal_allowed = heal
        div = self._compare(gathered, step)
        if div is None and self.always_broadcast and heal:
            self.last_healed = self.heal(gathered)
        elapsed = time.perf_counter() - t0
        self.guard_seconds += elapsed
        self.stats["checked"] += 1
        self.last_checked = step
        if self.metrics is not None:
            self.metrics.checked(elapsed)
        if div is not None:
            self._act(div, gathered)
        self._reset_step()
        return div

    # --- the collective ---------------------------------------------------------------------

    def _vector(self, step: int) -> torch.Tensor:
        q = len(self.quantities)
        host = [step, self.site_id, 0] + [0] * (2 * q)
        device_fps: list[tuple[int, torch.Tensor]] = []
        mask = 0
        for name, fp in self._fps.items():
            i = self.index[name]
            mask |= 1 << i
            host[_HDR + q + i] = self._numels.get(name, 0)
            if isinstance(fp, torch.Tensor):
                device_fps.append((i, fp))
            else:
                host[_HDR + i] = fp
        host[2] = mask | (int(self.local_failure) << FAILED_BIT)
        dev = self.info.device
        vec = torch.tensor(host, dtype=torch.int64, device=dev)
        if device_fps:  # fingerprints computed on their tensors' devices, moved to the comm device
            idx = torch.tensor([_HDR + i for i, _ in device_fps], dtype=torch.long, device=dev)
            vec[idx] = torch.stack([fp.to(dev) for _, fp in device_fps])
        return vec

    def _all_gather(self, vec: torch.Tensor, step: int) -> torch.Tensor:
        if self.info.world_size == 1:
            return vec.view(1, -1).cpu()
        self.heartbeat.beat(step)
        out = torch.empty(self.info.world_size * vec.numel(), dtype=vec.dtype, device=vec.device)
        work = all_gather_flat(out, vec, group=self.info.group, async_op=True)
        event = torch.cuda.Event() if vec.is_cuda else None
        try:
            done = wait_with_deadline(work, self.timeout_s, event)
        except RuntimeError as e:  # a peer's connection closed: it died, or gave up first
            if not peer_lost(e):
                raise
            self._on_timeout(step, peer_left=True)
        if not done:
            self._on_timeout(step)
        return out.view(self.info.world_size, -1).cpu()

    def _on_timeout(self, step: int, peer_left: bool = False):
        missing, last = self.heartbeat.missing(step)
        # a rank that reached this step and then died or froze is named too (its pulse stopped)
        dead = self.heartbeat.dead(wait_s=dead_wait_s(self.timeout_s) if peer_left else 0.0)
        missing = sorted(set(missing) | set(dead))
        err = RankTimeoutError(self.site, step, missing, last, self.timeout_s, dead, peer_left)
        self.stats["timeouts"] += 1
        if self.metrics is not None:
            self.metrics.timeout()
        self._write(EventRecord(run_id=self.run_id, kind="timeout", step=step, site=self.site,
                                rank=self.info.rank, message=str(err),
                                extra={"missing_ranks": missing, "dead_ranks": sorted(dead),
                                       "last_step_by_rank": {str(r): s for r, s in last.items()}}),
                    both=True)
        self.flush()
        raise err

    # --- comparison and report ----------------------------------------------------------------

    def _compare(self, gathered: torch.Tensor, step: int) -> DivergenceRecord | None:
        rows = gathered.tolist()
        by_quantity: dict[str, dict[int, str | None]] = {}
        for i, name in enumerate(self.quantities):
            by_quantity[name] = {
                r: (format_fp(row[_HDR + i]) if (row[2] >> i) & 1 else None) for r, row in enumerate(rows)
            }
        self._last_by_quantity = by_quantity
        steps = {row[0] for row in rows}
        sites = {row[1] for row in rows}
        if len(steps) > 1 or len(sites) > 1:
            self._write(EventRecord(run_id=self.run_id, kind="misaligned", step=step, site=self.site,
                                    rank=self.info.rank,
                                    message="ranks checked different steps or sites in one collective",
                                    extra={"step_by_rank": [row[0] for row in rows]}), both=True)
        first, differing = first_divergence(self.quantities, by_quantity)
        self._write_step(step, by_quantity, force=first is not None)
        if first is None:
            return None
        div = DivergenceRecord(run_id=self.run_id, step=step, site=self.site, quantity=first.quantity,
                               values=first.values, culprit_ranks=first.culprit_ranks,
                               majority_ranks=first.majority_ranks, differing=differing)
        div.rows = self._diverging_rows(first.quantity)
        return div

    def _write_step(self, step: int, by_quantity: dict[str, dict[int, str | None]], force: bool) -> None:
        if not force and step % self.clean_every:
            return
        me = self.info.rank
        if self.trace is not None:
            self.trace = self._write_or_drop(self.trace, StepRecord(
                run_id=self.run_id, step=step, site=self.site, ranks=[me],
                fp={q: v[me] for q, v in by_quantity.items()}))
        if self.merged_trace is not None:
            ranks = list(range(self.info.world_size))
            self.merged_trace = self._write_or_drop(self.merged_trace, StepRecord(
                run_id=self.run_id, step=step, site=self.site, ranks=ranks,
                fp={q: compact_fp([v[r] for r in ranks]) for q, v in by_quantity.items()}))

    def _diverging_rows(self, name: str) -> list[int] | None:
        """Which rows of the first differing tensor differ (two small fixed-size collectives)."""
        tensor = self._tensors.get(name)
        local = (fingerprint_rows_i64(tensor) if tensor is not None and tensor.dim() >= 1
                 else torch.empty(0, dtype=torch.int64))
        if self.info.world_size == 1:
            return None
        dev = self.info.device
        count = torch.tensor([local.numel()], dtype=torch.int64, device=dev)
        counts = torch.empty(self.info.world_size, dtype=torch.int64, device=dev)
        all_gather_flat(counts, count, group=self.info.group)
        n = int(counts.max().item())
        if n == 0:
            return None
        padded = torch.zeros(n, dtype=torch.int64, device=dev)
        padded[: local.numel()] = local.to(dev)
        every = torch.empty(self.info.world_size * n, dtype=torch.int64, device=dev)
        all_gather_flat(every, padded, group=self.info.group)
        every = every.view(self.info.world_size, n).cpu()
        have = counts.cpu()
        present = [r for r in range(self.info.world_size) if have[r] > 0]
        if len(present) < 2:
            return None
        ref = every[present[0]]
        differs = torch.zeros(n, dtype=torch.bool)
        for r in present[1:]:
            differs |= every[r] != ref
        return torch.nonzero(differs).flatten().tolist()[:64]

    # --- policy -----------------------------------------------------------------------------

    def _act(self, div: DivergenceRecord, gathered: torch.Tensor) -> None:
        self.stats["divergences"] += 1
        if self.dump_dir is not None:
            div.dump = self._dump(div.step)
        if self.policy in ("heal", "fix") and getattr(self, "_heal_allowed", True):
            div.healed = self.last_healed = self.heal(gathered)
            div.action = "healed"
            self.stats["healed"] += 1
            self.stats["heal_broadcasts"] += len(div.healed)
        elif self.policy in ("heal", "fix"):
            div.note = "heal refused at this step (see the log); recorded"
        elif self.policy == "abort":
            div.action = "aborted"
            self.stats["aborted"] += 1
        self._write(div, both=True)
        self.flush()
        if self.metrics is not None:
            self.metrics.divergence(div)
        for listener in self.listeners:
            listener(div)
        if self.policy == "fix":
            self._switch(div)
        if self.policy == "abort":
            raise RankDivergenceError(div)

    def _switch(self, div: DivergenceRecord) -> None:
        """Policy fix: the cause's switch, once per kind; every rank decides alike (same vector)."""
        import logging

        from tpguard import fix

        sw = fix.choose(div.quantity, self.site, div.step, self._last_by_quantity)
        log = logging.getLogger("tpguard")
        if sw is None:
            key = f"none:{div.quantity}"
            if key not in self.switched:
                self.switched.add(key)
                log.warning("tpguard: site %s, step %d: %s", self.site, div.step, fix.no_switch_reason(div.quantity))
                self.event("no_switch", fix.no_switch_reason(div.quantity), quantity=div.quantity)
            return
        if sw.kind in self.switched:
            return
        self.switched.add(sw.kind)
        div.switch = sw.kind
        applied = []
        for apply in self.switchers:
            note = apply(sw)
            if note:
                applied.append(str(note))
        message = f"switched {sw.what} from step {sw.step + 1} on: {sw.why}"
        if applied:
            message += "; " + "; ".join(applied)
        log.warning("tpguard: site %s, step %d: %s", self.site, div.step, message)
        self.event("switch", message, what=sw.kind, why=sw.why, from_step=sw.step + 1,
                   applied=applied)
        if self.metrics is not None:
            self.metrics.switch(sw.kind)

    def heal(self, gathered: torch.Tensor | None = None) -> list[str]:
        """Broadcast rank 0's recorded decision tensors in place; returns the healed names.

        Only decisions whose fingerprints differ are sent (equal fingerprints: the ranks already
        hold the same bytes, e.g. after sglang's own rank-0 broadcast), and only those that every
        rank recorded with the same number of elements (known from the gathered vector), so the
        broadcasts themselves always match up. Without `gathered`, every recorded decision.
        """
        if self.info.world_size == 1:
            return []
        q = len(self.quantities)
        rows = gathered.tolist() if gathered is not None else None
        healed = []
        for name in DECISION_QUANTITIES:
            if name not in self.index:
                continue
            i = self.index[name]
            if rows is not None:
                if not all((row[2] >> i) & 1 for row in rows):
                    continue
                if len({row[_HDR + q + i] for row in rows}) != 1:
                    continue
                if len({row[_HDR + i] for row in rows}) == 1 and not self.always_broadcast:
                    continue  # the same bytes on every rank: nothing to heal
            tensor = self._tensors.get(name)
            if tensor is None:
                continue
            buf = tensor if tensor.device == self.info.device else tensor.to(self.info.device)
            dist.broadcast(buf, src=self.info.src0(), group=self.info.group)
            if buf is not tensor:
                tensor.copy_(buf)
            healed.append(name)
        return healed

    def _dump(self, step: int) -> str | None:
        """Each rank saves this step's tensors (tpguard/dump.py); returns this rank's file."""
        from tpguard.dump import write_dump

        return write_dump(self.dump_dir, run_id=self.run_id, step=step, site=self.site, rank=self.info.rank,
                          world_size=self.info.world_size, quantities=self.quantities,
                          tensors=self._dump_copies,
                          context=self.dump_context(step) if self.dump_context is not None else None)

    # --- trace plumbing -----------------------------------------------------------------------

    def _write(self, rec, both: bool = False) -> None:
        if self.trace is not None:
            self.trace = self._write_or_drop(self.trace, rec)
        if both and self.merged_trace is not None:
            self.merged_trace = self._write_or_drop(self.merged_trace, rec)

    def _write_or_drop(self, writer: TraceWriter, rec) -> TraceWriter | None:
        """Write `rec`. A trace that can no longer be written (disk full, file gone) raises
        TraceWriteError, or with `trace_optional` is dropped with one log line while the guard goes
        on checking (its collectives must stay paired with the other ranks')."""
        try:
            writer.write(rec)
            return writer
        except (TraceWriteError, OSError, ValueError) as e:
            if not self.trace_optional:
                if isinstance(e, TraceWriteError):
                    raise
                raise TraceWriteError(f"tpguard: cannot write the trace {writer.path}: "
                                      f"{getattr(e, 'strerror', None) or e}") from None
            import logging

            logging.getLogger("tpguard").error(
                "tpguard: site %s, rank %d: trace %s cannot be written (%s); this rank writes no more "
                "trace records (checks go on)", self.site, self.info.rank, writer.path,
                getattr(e, "strerror", None) or e)
            try:
                writer.close()
            except Exception:
                pass
            return None

    def event(self, kind: str, message: str = "", **extra) -> None:
        """Write an event (a fix switched on, a policy change...) to this rank's trace."""
        self._write(EventRecord(run_id=self.run_id, kind=kind, step=self.last_checked, site=self.site,
                                rank=self.info.rank, message=message, extra=extra), both=True)

    def flush(self) -> None:
        for w in (self.trace, self.merged_trace):
            if w is not None:
                try:
                    w.flush()
                except (OSError, ValueError):
                    pass  # reported by the next write

    def close(self) -> None:
        self.heartbeat.close()
        self.flush()
        if self._own_trace is not None:
            self._own_trace.close()
            if self.merged_trace is not None:
                self.merged_trace.close()


def default_versions() -> dict:
    import tpguard

    from tpguard.fingerprint import FORMAT_VERSION

    # the fingerprint definition too: traces hashed with different definitions are not comparable
    versions = {"tpguard": tpguard.__version__, "torch": torch.__version__, "fingerprint": FORMAT_VERSION}
    for name in ("triton", "flashinfer", "sglang"):
        mod = __import__("sys").modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    return versions
