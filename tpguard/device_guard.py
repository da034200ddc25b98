"""DeviceStepGuard: the always-on production guard. No host synchronisation on the hot path.

Per checked step, everything is enqueued on the device stream: fingerprints of the recorded
tensors (`fingerprint_many`: a fixed handful of launches whatever their number), the gathered
vector, one all-gather, the comparison (`kernels/guard_compare.py`) and one asynchronous copy of
the result into pinned host memory with an event behind it. The host reads that result at the
next check (lag = 1 step), when the stream has long passed it in a serving engine, so detection
lags by at most one step and never blocks the stream; every rank reads the same step's result
at the same call, so `abort` still stops all ranks at the same point.

Fused heal (policy ``heal`` with ``heal_capacity``): rank 0's decision tensors travel inside the
same all-gather, and every rank copies rank 0's values into its own on the device, every step
(one launch packs all decision tensors into the vector, one unpacks rank 0's row back:
kernels/heal_copy.py). One collective per verify step replaces SGLang's per-site broadcasts, and
the fingerprints still record every disagreement that the broadcast hid.

CUDA graphs: `device_check()` is the capturable half (fixed buffers, a device step counter, no
host reads); after each replay, `collect()` reads the result. See docs/production.md.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from tpguard.errors import RankTimeoutError
from tpguard.fingerprint import attached_fingerprint, fingerprint_bytes, fingerprint_many, to_signed
from tpguard.guard import _HDR, FAILED_BIT, StepGuard, all_gather_flat
from tpguard.quantities import DECISION_QUANTITIES
from tpguard.records import DivergenceRecord



class DeviceStepGuard(StepGuard):
    """StepGuard whose check() only enqueues device work and reports the previous step."""

    def __init__(self, group=None, site: str = "synthetic.verify", quantities=None, policy: str = "record",
                 trace=None, *, heal_capacity: dict[str, int] | None = None, lag: int = 1,
                 watchdog: bool = True, device: torch.device | str | None = None, **kw):
        from tpguard.quantities import CANONICAL_ORDER

        if kw.get("dump_dir"):
            raise ValueError("DeviceStepGuard does not dump tensors (the step is gone when its "
                             "result is read); use StepGuard with dump_dir to debug")
        super().__init__(group, site, quantities or CANONICAL_ORDER, policy, trace,
                         background_heartbeat=True, **kw)
        if policy == "heal" and not heal_capacity:
            raise ValueError("DeviceStepGuard: policy 'heal' needs heal_capacity (elements per decision "
                             "quantity) so rank 0's decisions can travel in the fixed-size all-gather")
        self.lag = max(1, int(lag))
        self.heal_layout: list[tuple[str, int, int]] = []  # (quantity, offset in vector, capacity)
        q = len(self.quantities)
        offset = _HDR + 2 * q
        for name in DECISION_QUANTITIES:
            if heal_capacity and name in heal_capacity and name in self.index:
                self.heal_layout.append((name, offset, int(heal_capacity[name])))
                offset += int(heal_capacity[name])
        self.length = offset
        # Where the vector lives: the group's collective device; a lone process (world 1) with a
        # GPU keeps it there too, so that nothing ever waits on a device-to-host copy.
        if device is not None:
            self.dev = torch.device(device)
        elif self.info.world_size == 1 and torch.cuda.is_available():
            self.dev = torch.device("cuda", torch.cuda.current_device())
        else:
            self.dev = self.info.device
        self._pending: deque = deque()  # (step, host result, event or None, enqueue time)
        # Preallocated slots, reused round-robin (a slot is free again once its step was read:
        # at most lag + 1 steps are in flight): header staging (pinned), vector, result, result copy.
        pin = self.dev.type == "cuda"
        w = self.info.world_size
        self._slots = [{
            "header": torch.zeros(_HDR + 2 * q, dtype=torch.int64, pin_memory=pin),
            "result": torch.zeros(w * self.length + q + 1, dtype=torch.int64, device=self.dev),
            "host": torch.zeros(w * self.length + q + 1, dtype=torch.int64, pin_memory=pin),
        } for _ in range(self.lag + 3)]
        for slot in self._slots:
            # one rank: the vector IS the "gathered" result (no copy); else its own buffer
            slot["vec"] = (slot["result"][: self.length] if w == 1
                           else torch.zeros(self.length, dtype=torch.int64, device=self.dev))
        self._slot_i = 0
        self._idx_cache: dict[tuple, torch.Tensor] = {}
        self._graph = None  # buffers of the capturable path, built by prepare_graph()
        self._watchdog = None
        if watchdog and self.info.world_size > 1:
            self._watchdog = threading.Thread(target=self._watch, daemon=True, name="tpguard-watchdog")
            self._stop_watch = threading.Event()
            self._watchdog.start()

    # --- record: keep references; fingerprint all device tensors in one batch at check() --------

    def record(self, name: str, tensor: torch.Tensor | None) -> None:
        if self._forget_if_none(name, tensor):
            return
        pre = attached_fingerprint(tensor)
        if pre is not None:  # computed by the kernel that wrote the tensor: copied at check()
            self._fps[name] = pre if pre.device == self.dev else pre.to(self.dev)
        elif tensor.device.type == "cpu" and self.dev.type == "cuda":
            # Host-side state (a CUDA generator's seed/offset is a CPU tensor): hash it on the host.
            self._fps[name] = to_signed(fingerprint_bytes(tensor.contiguous().numpy().tobytes()
                                                          + f"{tensor.dtype}{tuple(tensor.shape)}".encode()))
        else:
            self._fps[name] = None  # fingerprinted in the batch at check()
        self._numels[name] = tensor.numel()
        self._tensors[name] = tensor

    # --- the device half ------------------------------------------------------------------------

    def _next_slot(self) -> dict:
        slot = self._slots[self._slot_i]
        self._slot_i = (self._slot_i + 1) % len(self._slots)
        return slot

    def _device_vector(self, step: int, slot: dict) -> torch.Tensor:
        """[step, site, mask, fingerprints, numels, heal payload] on the comm device, no host sync."""
        q = len(self.quantities)
        header = [0] * (_HDR + 2 * q)
        mask = 0
        batch_names, batch = [], []
        ready = []  # (slot, fingerprint already on the vector's device)
        for name, fp in self._fps.items():
            i = self.index[name]
            mask |= 1 << i
            header[_HDR + q + i] = self._numels.get(name, 0)
            if fp is None:
                batch_names.append(name)
                batch.append(self._tensors[name])
            elif isinstance(fp, torch.Tensor):  # on the vector's device (record)
                ready.append((_HDR + i, fp))
            else:
                header[_HDR + i] = fp
        header[0], header[1], header[2] = step, self.site_id, mask | (int(self.local_failure) << FAILED_BIT)
        staged = slot["header"]
        staged.numpy()[:] = header  # one host write into pinned memory, then one async copy
        vec = slot["vec"]
        vec[: _HDR + 2 * q].copy_(staged, non_blocking=True)
        if batch_names:
            slots = [_HDR + self.index[n] for n in batch_names]
            if all(t.device == self.dev for t in batch):
                # the usual case: one batch, values written straight into the vector's slots
                fingerprint_many(batch, out=vec, out_index=slots)
            else:
                vec.index_copy_(0, self._index_tensor(slots), self._fingerprints(batch_names, batch))
        for slot_i, fp in ready:  # one 8-byte device copy each, behind the header's
            vec[slot_i:slot_i + 1].copy_(fp.reshape(1))
        if self.heal_layout:  # this rank's decisions into the vector: rank 0's travel to everyone
            from tpguard.kernels.heal_copy import heal_pack

            heal_pack(vec, self.heal_layout, self._tensors)
        return vec

    def _fingerprints(self, names: list[str], tensors: list) -> torch.Tensor:
        """int64 [len(names)] on the comm device: one `fingerprint_many` batch per device (the
        mixed case; `_device_vector` writes a single same-device batch straight into the vector)."""
        out = torch.empty(len(names), dtype=torch.int64, device=self.dev)
        by_device: dict[torch.device, list[int]] = {}
        for k, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(k)
        for ks in by_device.values():
            # to the CPU (gloo) a non-blocking copy lands in pinned memory that the CPU ops
            # below could read before the copy is done: blocking there; GPU to GPU stays async
            fps = fingerprint_many([tensors[k] for k in ks]).to(self.dev, non_blocking=self.dev.type == "cuda")
            if len(ks) == len(names):
                out.copy_(fps)
            else:
                out.index_copy_(0, self._index_tensor(ks), fps)
        return out

    def _index_tensor(self, positions) -> torch.Tensor:
        """A cached int64 index tensor on the comm device (no host-to-device copy per step)."""
        key = tuple(positions)
        idx = self._idx_cache.get(key)
        if idx is None:
            idx = self._idx_cache[key] = torch.tensor(key, dtype=torch.long, device=self.dev)
        return idx

    def _enqueue(self, vec: torch.Tensor, step: int, slot: dict) -> None:
        """All-gather, fused heal, compare, and the asynchronous copy to pinned host memory."""
        from tpguard.kernels.guard_compare import compare_gathered

        w, n = self.info.world_size, self.length
        q = len(self.quantities)
        result = slot["result"]
        gathered = result[: w * n]
        if w == 1:
            if gathered.data_ptr() != vec.data_ptr():
                gathered.copy_(vec)
        else:
            work = all_gather_flat(gathered, vec, group=self.info.group, async_op=True)
            if self.dev.type == "cuda":
                work.wait()  # orders the stream only; the host does not wait
            else:
                # gloo on CPU: there is no stream to order the work below behind the collective,
                # so wait here, bounded by the timeout.
                from tpguard.watchdog import wait_with_deadline

                if not wait_with_deadline(work, self.timeout_s):
                    self._on_timeout(step)
        if self.heal_layout:  # rank 0's decisions (row 0) into this rank's tensors
            from tpguard.kernels.heal_copy import heal_unpack

            heal_unpack(gathered.view(w, n), self.heal_layout, self._tensors)
        compare_gathered(gathered.view(w, n), q, out=result[w * n:])
        if self.dev.type == "cuda":
            host = slot["host"]
            host.copy_(result, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((step, host, event, time.monotonic()))
        else:
            self._pending.append((step, result.clone(), None, time.monotonic()))

    # --- the host half -------------------------------------------------------------------------

    def check(self, step: int | None = None, *, heal: bool = True) -> DivergenceRecord | None:
        """Enqueue this step; return the divergence found in an earlier step (lag steps ago).
        `failed_ranks` then names the ranks whose guard work failed at that earlier step."""
        step = self.step if step is None else int(step)
        self.step = step + 1
        self.failed_ranks = []
        t0 = time.perf_counter()
        if self.wants(step):
            self.heartbeat.beat(step)
            slot = self._next_slot()
            self._enqueue(self._device_vector(step, slot), step, slot)
            self.stats["checked"] += 1
            self.last_checked = step
        self._reset_step()
        div = self._collect_ready(keep=self.lag)
        elapsed = time.perf_counter() - t0
        self.guard_seconds += elapsed
        if self.metrics is not None:
            self.metrics.checked(elapsed)
        return div

    def drain(self) -> DivergenceRecord | None:
        """Wait for and process every pending step (shutdown, tests)."""
        return self._collect_ready(keep=0)

    def _collect_ready(self, keep: int) -> DivergenceRecord | None:
        first = None
        while len(self._pending) > keep:
            step, result, done, t_enq = self._pending.popleft()
            self._wait(step, done, t_enq)
            div = self._process(step, result)
            first = first or div
        return first

    def _wait(self, step: int, done, t_enq: float) -> None:
        """The previous step's work is normally long finished: this returns at once. If it is
        not (a rank is missing), wait up to the timeout, then name the missing ranks."""
        if done is None:  # CPU: already complete
            return
        deadline = t_enq + self.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                self._on_timeout(step)
            time.sleep(1e-4)

    def _process(self, step: int, result: torch.Tensor) -> DivergenceRecord | None:
        w, n = self.info.world_size, self.length
        q = len(self.quantities)
        flags = result[w * n:]
        gathered = result[: w * n].view(w, n)[:, : _HDR + 2 * q]
        self.failed_ranks += [r for r, m in enumerate(gathered[:, 2].tolist()) if (m >> FAILED_BIT) & 1]
        if not bool(flags[q]) and (step % self.clean_every or (self.trace is None and self.merged_trace is None)):
            return None  # clean, and no step record to write: nothing to parse
        div = self._compare(gathered.cpu(), step)
        if div is not None:
            self._act(div, gathered)
        return div

    def _diverging_rows(self, name: str) -> list[int] | None:
        return None  # no extra collectives on the asynchronous path (docs/production.md)

    def heal(self, gathered=None) -> list[str]:
        """Nothing to send: rank 0's decisions already travelled in the step's all-gather and were
        copied on the device (`heal_unpack` in `_enqueue`)."""
        return [name for name, _, _ in self.heal_layout]

    # --- CUDA graphs ---------------------------------------------------------------------------

    def prepare_graph(self, tensors: dict[str, torch.Tensor],
                      precomputed: tuple[str, ...] | list[str] = (), zero_copy: bool = True) -> None:
        """Fix the recorded tensors (static buffers of a captured graph) and build the buffers
        of the capturable path. Call outside capture, then `device_check()` inside it.

        Capture soon after: the fingerprint plan lives in `fingerprint_many`'s cache (64 plans,
        least recently used first out) until the capture pins it.

        `precomputed`: quantities whose fingerprint a producer writes itself, inside the same
        graph and before `device_check()`, into `fingerprint_slot(name)` (e.g. the renorm's
        ``fingerprint_out=``: target_probs without a second read of the probabilities).

        `zero_copy` (CUDA; the default): the comparison kernel writes the result straight into the
        pinned host buffer, one graph node fewer (no copy after it: ~10 us less per check inside a
        graph on H200s, docs/benchmarks.md); used only where a one-time check on this device
        gave the copy path's bytes (`guard_compare.zero_copy_works`), else the copy stays.

        The vector's header and numels are written once here; per replay only the fingerprints
        (written in place into the vector's slots) and the step counter change, and the step
        counter lives in the vector itself (bumped by the fingerprint launch)."""
        q = len(self.quantities)
        unknown = [n for n in precomputed if n not in self.index]
        if unknown:
            raise ValueError(f"prepare_graph: precomputed quantities {unknown} are not guarded here")
        healed = [n for n in precomputed if any(n == h for h, _, _ in self.heal_layout)]
        if healed:  # heal copies rank 0's values of these into the tensors: they must be recorded
            raise ValueError(f"prepare_graph: {healed} travel with heal and cannot be precomputed")
        names = [n for n in self.quantities if n in tensors and n not in precomputed]
        w = self.info.world_size
        result = torch.zeros(w * self.length + q + 1, dtype=torch.int64, device=self.dev)
        vec = result[: self.length] if w == 1 else torch.zeros(self.length, dtype=torch.int64,
                                                               device=self.dev)
        host = torch.zeros(_HDR + 2 * q, dtype=torch.int64)
        mask = 0
        for n in names:
            mask |= 1 << self.index[n]
            host[_HDR + q + self.index[n]] = tensors[n].numel()
        for n in precomputed:  # present; numel from the tensor when given, else 0
            mask |= 1 << self.index[n]
            host[_HDR + q + self.index[n]] = tensors[n].numel() if n in tensors else 0
        host[0], host[1], host[2] = -1, self.site_id, mask  # step -1: the warm-up below makes it 0
        vec[: _HDR + 2 * q].copy_(host.to(self.dev))
        g = {
            "tensors": [tensors[n] for n in names],  # in the order of "slots" (fingerprint_many)
            "by_name": {n: tensors[n] for n in names},  # the heal copies
            "slots": [_HDR + self.index[n] for n in names],
            "vec": vec,
            "result": result,
            "precomputed": tuple(precomputed),
            "host": torch.zeros(w * self.length + q + 1, dtype=torch.int64,
                                pin_memory=self.dev.type == "cuda"),
            "zero_copy": False,
        }
        if zero_copy:
            from tpguard.kernels.guard_compare import zero_copy_works

            g["zero_copy"] = zero_copy_works(self.dev)
        self._graph = g
        self._graph_fingerprints()  # compiles kernels and caches the plan before capture
        if self.heal_layout:
            # compile the heal copy kernels before capture too: pack this rank's decisions, then
            # unpack them from the same vector (each tensor gets back the values it holds)
            from tpguard.kernels.heal_copy import heal_pack, heal_unpack

            heal_pack(vec, self.heal_layout, g["by_name"])
            heal_unpack(vec.view(1, -1), self.heal_layout, g["by_name"])

    def fingerprint_slot(self, name: str) -> torch.Tensor:
        """The 1-element int64 slot of `name`'s fingerprint in the captured vector (after
        `prepare_graph`): pass it as a producer's ``fingerprint_out=`` inside the graph."""
        if self._graph is None:
            raise RuntimeError("fingerprint_slot: call prepare_graph first")
        if name not in self._graph["precomputed"]:  # the guard's own launch writes the others
            raise ValueError(f"fingerprint_slot: {name!r} was not given as precomputed to prepare_graph")
        i = _HDR + self.index[name]
        return self._graph["vec"][i:i + 1]

    def _graph_fingerprints(self) -> None:
        g = self._graph
        if g["tensors"]:
            fingerprint_many(g["tensors"], out=g["vec"], out_index=g["slots"], bump_index=0)
        else:
            g["vec"][0:1].add_(1)

    def device_check(self) -> None:
        """Capturable: fingerprints (+ step counter), all-gather, compare into the pinned slot
        (zero-copy; else compare, then a copy). One rank, decisions set: 2 graph nodes (3 with the
        copy); fused heal adds 2 (the payload pack before the all-gather, rank 0's unpack after)."""
        from tpguard.kernels.guard_compare import compare_gathered

        g = self._graph
        w, n, q = self.info.world_size, self.length, len(self.quantities)
        vec = g["vec"]
        self._graph_fingerprints()
        if self.heal_layout:
            from tpguard.kernels.heal_copy import heal_pack, heal_unpack

            heal_pack(vec, self.heal_layout, g["by_name"])
        gathered = g["result"][: w * n]
        if w > 1:
            all_gather_flat(gathered, vec, group=self.info.group)
        if self.heal_layout:
            heal_unpack(gathered.view(w, n), self.heal_layout, g["by_name"])
        if g["zero_copy"]:  # the header, fingerprints, numels and flags: all _process reads
            from tpguard.kernels.guard_compare import compare_gathered_to_host

            compare_gathered_to_host(gathered.view(w, n), q, g["host"], _HDR + 2 * q)
        else:
            compare_gathered(gathered.view(w, n), q, out=g["result"][w * n:])
            g["host"].copy_(g["result"], non_blocking=True)

    def collect(self) -> DivergenceRecord | None:
        """After a replay: read the pinned result (waits for the stream to reach it)."""
        if self.dev.type == "cuda":
            torch.cuda.current_stream().synchronize()
        result = self._graph["host"].clone()
        step = int(result[0])  # the device step counter, as gathered
        self.stats["checked"] += 1
        return self._process(step, result)

    # --- watchdog ------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Name a rank that stopped reaching the guard, in the trace and the log, within the
        timeout, even when the main thread is itself stuck behind the wedged collective."""
        import logging

        log = logging.getLogger("tpguard")
        reported: set[int] = set()
        while not self._stop_watch.wait(min(1.0, self.timeout_s / 4)):
            if not self._pending:
                continue
            try:
                step, _, done, t_enq = self._pending[0]
            except IndexError:
                continue
            finished = done is None or done.query()
            if finished or step in reported or time.monotonic() - t_enq < self.timeout_s:
                continue
            reported.add(step)
            missing, last = self.heartbeat.missing(step)
            err = RankTimeoutError(self.site, step, missing, last, self.timeout_s)
            log.error("%s", err)
            from tpguard.records import EventRecord

            self._write(EventRecord(run_id=self.run_id, kind="timeout", step=step, site=self.site,
                                    rank=self.info.rank, message=str(err),
                                    extra={"missing_ranks": missing, "by": "watchdog",
                                           "last_step_by_rank": {str(r): s for r, s in last.items()}}),
                        both=True)
            self.flush()
            if self.metrics is not None:
                self.metrics.timeout()

    def close(self) -> None:
        if self._watchdog is not None:
            self._stop_watch.set()
        super().close()


def decisions_capacity(bs: int, draft_tokens: int) -> dict[str, int]:
    """heal_capacity for a verify step of `bs` requests x `draft_tokens` positions."""
    return {"accept_index": bs * draft_tokens, "accept_len": bs, "bonus": bs,
            "commit_lens": bs, "out_tokens": bs * draft_tokens}


__all__: Sequence[str] = ("DeviceStepGuard", "decisions_capacity")
