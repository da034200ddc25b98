"""Eager renorm calls replayed from CUDA graphs that their call plan owns, the call's tensors set as
the graph's pointer arguments (host time; docs/design-renorm.md, "Host time"; docs/kernels.md "Call plans").

An eager call's 3-6 direct launches cost 35-230 us of host time (H100, top-p on flat rows of 32000:
41 us at 8 rows for ~40 us of GPU work, where the GPU waits for the host; 226 us at 1024 rows, host time
a serving process spends on nothing else). A plan (kernels/renorm_plan.py) whose direct launches are
validated, whose rows are <= ``TPGUARD_RENORM_GRAPH_ROWS`` (default 1024) and whose call makes at
least GRAPH_MIN_LAUNCHES launches (`worth_graph`: top-p, min-p, the fused logits -> target probs op,
and top-k and top-k + top-p where they take three launches) captures those launches once into a
CUDA graph. A call then sets the graph's pointer arguments to its own tensors (probs or logits, a new
output, tensor parameters, the fingerprint slot: `DriverGraph.pointer_args`, one driver call per
kernel node) and launches the graph on the current stream: no copy, one graph launch instead of
the launches and their arguments.

* Same kernels with the same arguments: the same bits, checked against the direct launches on the
  call's own tensors (one sync) the first time a process captures a plan's launches (`CHECKED`).
* Captured over placeholders: one distinct address per tensor role, at its recorded 16-byte alignment
  (Triton specialises pointers on it), so each pointer argument is found by its value and belongs
  to one role (a call may pass one tensor in two roles); nothing runs during a capture, and every
  launch sets every role's arguments first. No buffer of the batch's size: graphs at any batch size.
* A scalar parameter is baked into a graph: one graph per scalar value, at most
  GRAPHS_PER_PLAN per plan (least recently used dropped; after GRAPHS_PER_PLAN drops the plan's
  graphs go off: values that keep changing would cost a capture each).
* Captured on a side stream in thread-local capture mode through the driver API
  (kernels/driver_graph.py: torch's CUDAGraph would tie the process's CUDA generator to each
  graph and refill its state before every replay), with no allocation inside (the workspace is
  the plan's); launched on the caller's current stream, the plan's stream.
* A call whose tensors sit at other 16-byte alignments than the recorded ones takes the plan's
  path without the graph (Triton's launches). Any failure (capture refused, a driver without
  cuFuncGetParamInfo, bits differ, an argument update refused): the plan keeps its direct launches
  (`direct_launch.FAILURES` says why).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tpguard.config import renorm_graph_rows
from tpguard.kernels import direct_launch as dl
from tpguard.kernels.driver_graph import DriverGraph
from tpguard.kernels.reference import bits

# H100 (docs/benchmarks.md, "Plan graphs"): eager us per call, direct launches vs the plan's graph, one
# process: top-p at 1 / 8 / 64 / 256 / 1024 x 32000 fp32 flat 67.6 / 51.7 / 52.1 / 105.6 / 387.7 -> 44.8 /
# 40.7 / 48.7 / 104.1 / 386.5 (host time 58 / 41 / 35 / 61 / 226 -> 40 / 21 / 24 / 51 / 37); top-k + top-p
# (three launches) at 64 x 32000 31.3 -> 29.0; min-p at 8 x 32000 39.1 -> 25.5; within noise elsewhere.
# One launch (top-k at <= 8 rows, <= 64 on short rows: renorm_top_k_fused.py) stays a direct launch. Up to
# TPGUARD_RENORM_GRAPH_ROWS rows (tpguard.config.renorm_graph_rows, read when a plan decides; measured to 1024).
GRAPH_MIN_LAUNCHES = 3
GRAPHS_PER_PLAN = 4
# the roles of a plan call's values (renorm_plan.py); MP (min-p) and T (the temperature) only in
# the fused logits -> target probs op's calls (kernels/target_probs.py)
PROBS, OUT, K, P, FP, MP, T = ROLES = tuple(range(7))
PARAMS = (K, P, MP, T)  # a tensor parameter is a pointer argument; a scalar one is baked into a graph
SLOT = 32  # bytes between two placeholders
REFUSED = "the driver refused a kernel node's new arguments"
# (launch variants, tensor roles) of the graphs checked in this process: the binding of the pointer
# arguments depends on the compiled kernels and the roles, not on the grid or the data, so later
# graphs of the same launches skip the check and its sync (a plan is made again whenever the batch
# size comes back after an eviction)
CHECKED: set = set()


def worth_graph(rows: int, launches: int) -> bool:
    """A plan of `rows` rows whose call makes `launches` direct launches replays a graph of its own."""
    return rows <= renorm_graph_rows() and launches >= GRAPH_MIN_LAUNCHES


def aligned_like(t: torch.Tensor | None) -> torch.Tensor | None:
    """An uninitialised tensor like `t` (shape, dtype, device) at t's own address mod 16, or None:
    Triton specialises pointers on 16-byte alignment, and a recorded launch accepts only its own."""
    if t is None:
        return None
    n, per, residue = t.numel(), max(1, 16 // t.element_size()), t.data_ptr() % 16
    buf = torch.empty(n + per, dtype=t.dtype, device=t.device)
    for i in range(per):
        if buf[i:].data_ptr() % 16 == residue:
            return buf[i:i + n].view(t.shape)
    return buf[:n].view(t.shape)


class PlanGraphs:
    """The graphs of one plan: one captured graph per scalar-parameter value, and its placeholders."""

    def __init__(self, op: str, direct: dl.LaunchSet, device: torch.device):
        """`direct`: the plan's validated launches."""
        self.op, self.direct = op, direct
        with torch.inference_mode(False):  # (made under inference mode, used outside it)
            self._scratch = torch.empty(SLOT * (len(ROLES) + 1), dtype=torch.uint8, device=device)
        base = self._scratch.data_ptr()
        self.placeholders = [None] * len(ROLES)  # tensor role -> a uint8 view at its recorded alignment
        for r, residue in direct.tensor_roles:
            at = SLOT * r + (residue - base) % 16
            self.placeholders[r] = self._scratch[at:at + 1]
        self.graphs: OrderedDict = OrderedDict()
        self.state, self.refusal = "on", ""
        self.captures = self.evictions = 0

    def release(self) -> None:
        """Off for good (a failed capture, scalar values that keep changing)."""
        self.state = "off"
        self.graphs.clear()

    def __call__(self, values: list) -> bool:
        """Replay the call `values` (its output allocated, the whole call accepted by the direct
        launches); False where no graph ran (the caller launches directly, into the same output)."""
        if self.state != "on":
            return False
        key = tuple([None if values[r] is None or isinstance(values[r], torch.Tensor) else values[r] for r in PARAMS])
        entry = self.graphs.get(key)
        if entry is None:
            return self._capture(key, values)  # the check's replay is this call's
        self.graphs.move_to_end(key)
        if self._launch(*entry, values):
            return True
        self._give_up(REFUSED)
        return False

    @staticmethod
    def _launch(graph: DriverGraph, args, values: list) -> bool:
        """`graph` on the call's tensors; False (nothing launched) where the driver refused them."""
        if not args.set(values):
            return False
        graph.launch(dl.current_stream())
        return True

    def _give_up(self, why: str) -> None:
        self.refusal = why
        dl.FAILURES[f"renorm graph {self.op}"] = why
        self.release()

    def _capture(self, key, values: list) -> bool:
        """Capture the direct launches over the placeholders for this scalar key, bind their pointer
        arguments (`DriverGraph.pointer_args`) and replay the call; the first time a process captures
        these launches (CHECKED), the replay is checked against a direct run on the same tensors bit
        for bit (one sync). False (and the graphs released) on failure; also when scalar values keep
        changing."""
        if self.evictions >= GRAPHS_PER_PLAN:
            self._give_up(f"{self.evictions} graphs dropped for new scalar values: graphs off")
            return False
        try:
            held = [self.placeholders[r] if self.placeholders[r] is not None else values[r] for r in ROLES]
            if not self.direct.accepts(held):
                raise RuntimeError("the placeholders are refused by the recorded launches (alignment)")
            side = torch.cuda.Stream(device=values[PROBS].device)
            with torch.cuda.stream(side):  # the direct launches go to the current stream: the side one
                graph = DriverGraph.capture(lambda: self.direct(held), side.cuda_stream)
            self.captures += 1
            args = graph.pointer_args({held[r].data_ptr(): r for r in ROLES if self.placeholders[r] is not None})
            launches = (tuple(launch.variant for launch in self.direct.launches), self.direct.tensor_roles)
            check = launches not in CHECKED
            out, fp = values[OUT], values[FP]
            if check:  # (no random data: a draw would move the process's CUDA generator)
                want = list(values)
                want[OUT], want[FP] = aligned_like(out), aligned_like(fp)
                self.direct(want)
                out.fill_(float("nan"))  # a replay that wrote nothing shows
                if fp is not None:
                    fp.copy_(want[FP]).bitwise_not_()
            if not self._launch(graph, args, values):
                raise RuntimeError(REFUSED)
            if check:
                if not (torch.equal(bits(out), bits(want[OUT])) and (fp is None or torch.equal(fp, want[FP]))):
                    raise RuntimeError("a graph replay differs from the direct launches")
                CHECKED.add(launches)
        except Exception as e:  # noqa: BLE001 - any failure: the direct launches, as before
            self._give_up(f"{type(e).__name__}: {e}"[:300])
            return False
        self.graphs[key] = (graph, args)
        while len(self.graphs) > GRAPHS_PER_PLAN:
            self.graphs.popitem(last=False)
            self.evictions += 1
        return True


__all__ = ["GRAPHS_PER_PLAN", "GRAPH_MIN_LAUNCHES", "PARAMS", "ROLES", "PlanGraphs", "aligned_like",
           "worth_graph"]
