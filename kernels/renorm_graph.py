"""Eager small-batch renorm calls replayed from CUDA graphs that their call plan owns (host time;
docs/design-renorm.md, "Host time"; docs/kernels.md "Call plans").

An eager call of a few rows is host-bound: its 3-6 direct launches cost more host time than the
GPU spends on them (H200: top-k(40) at 1 row 55 us of host time for 23 us of GPU work,
flashinfer's one launch 46 us). A plan (kernels/renorm_plan.py) whose direct launches are
validated, whose rows are <= ``TPGUARD_RENORM_GRAPH_ROWS`` (default 8) and whose call makes at
least GRAPH_MIN_LAUNCHES launches (`worth_graph`) captures those launches once into a CUDA graph
over buffers it owns: probs in (the fused op's logits), the output, tensor parameters and the
fingerprint slot. A call then copies probs (and any parameter tensor) in, replays the graph on the
current stream and clones the output (and copies the fingerprint out): 3-5 torch operations
and one graph launch instead of the launches and their arguments. The GPU does two extra copies
of the batch (~2 us at 1 row), so this pays only where host time dominates.

* Same kernels with the same arguments but for the buffers' addresses (at the recorded 16-byte
  alignments): the same bits, checked once per graph against the direct launches (one sync).
* A scalar parameter is baked into a graph: one graph per scalar value, at most
  GRAPHS_PER_PLAN per plan (least recently used dropped; after GRAPHS_PER_PLAN drops the plan's
  graphs go off: values that keep changing would cost a capture and a sync each); tensor
  parameters are copied in.
* Captured on a side stream in thread-local capture mode through the driver API
  (kernels/driver_graph.py: torch's CUDAGraph would tie the process's CUDA generator to each
  graph and refill its state before every replay), with no allocation inside (the workspace is
  the plan's); launched on the caller's current stream, the plan's stream.
* The buffers are ordinary tensors even when the plan is made under `torch.inference_mode()`
  (a later call outside it copies into them).
* Any failure (capture refused, bits differ): the plan keeps its direct launches and frees the
  buffers (`direct_launch.FAILURES` says why).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tpguard.config import renorm_graph_rows
from tpguard.kernels import direct_launch as dl
from tpguard.kernels.driver_graph import DriverGraph
from tpguard.kernels.reference import bits

# H200 (docs/benchmarks.md): the copy in, the graph launch and the clone cost about what 3-4 direct
# launches do. Eager us per call, direct launches vs graph, A/B in one process: top-p and min-p
# (5 launches) 88.5 -> 75.1 and 75.6 -> 60.4 at 1 row, 87.8 -> 72.8 and 70.4 -> 61.3 at 8; top-k and
# top-k + top-p with a scalar k (then 3 launches; one at <= 8 rows: renorm_top_k_fused.py) within
# +-1.6 us. At 64 rows the two copies of the batch cost more GPU time than the graph saves (top-p
# eager 166 vs 129 us). Hence up to TPGUARD_RENORM_GRAPH_ROWS rows (default 8; tpguard.config.
# renorm_graph_rows, read when a plan decides) and GRAPH_MIN_LAUNCHES launches.
GRAPH_MIN_LAUNCHES = 5
GRAPHS_PER_PLAN = 4
# the roles of a plan call's values (renorm_plan.py); MP (min-p) and T (the temperature) only in
# the fused logits -> target probs op's calls (kernels/target_probs.py)
PROBS, OUT, K, P, FP, MP, T = ROLES = tuple(range(7))
PARAMS = (K, P, MP, T)  # a tensor parameter is copied in per call; a scalar one is baked into a graph


def worth_graph(rows: int, launches: int) -> bool:
    """A plan of `rows` rows whose call makes `launches` direct launches replays a graph of its own."""
    return rows <= renorm_graph_rows() and launches >= GRAPH_MIN_LAUNCHES


def aligned_to(t: torch.Tensor, residue: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor like `t` (shape, device; `dtype`, default t's) at an address = residue
    mod 16: Triton specialises pointers on 16-byte alignment, and a recorded launch accepts only its own."""
    dtype = t.dtype if dtype is None else dtype
    n = t.numel()
    per = max(1, 16 // dtype.itemsize)
    buf = torch.empty(n + per, dtype=dtype, device=t.device)
    for i in range(per):
        if buf[i:].data_ptr() % 16 == residue:
            return buf[i:i + n].view(t.shape)
    return buf[:n].view(t.shape)


def aligned_like(t: torch.Tensor | None) -> torch.Tensor | None:
    """`aligned_to(t, t's own address mod 16)`, or None."""
    return None if t is None else aligned_to(t, t.data_ptr() % 16)


class PlanGraphs:
    """The graphs of one plan: its buffers, and one captured graph per scalar-parameter value."""

    def __init__(self, op: str, direct: dl.LaunchSet, values: list, out_dtype: torch.dtype | None = None):
        """`values`: a call's roles (ROLES; OUT unused); `out_dtype`: the output's (None: probs')."""
        self.op, self.direct = op, direct
        # each buffer at the alignment its role was recorded with (the recorded out: a fresh empty_like)
        residue = dict(direct.tensor_roles)
        probs = values[PROBS]
        with torch.inference_mode(False):  # copied into per call, maybe outside inference mode
            self.bufs = [aligned_to(v, residue[r]) if r in residue and r != OUT else None
                         for r, v in enumerate(values)]
            self.bufs[OUT] = (aligned_to(probs, residue[OUT], out_dtype) if OUT in residue
                              else torch.empty_like(probs, dtype=out_dtype))
        self.nbytes = sum(b.untyped_storage().nbytes() for b in self.bufs if b is not None)
        self.graphs: OrderedDict = OrderedDict()
        self.state, self.refusal = "on", ""
        self.captures = self.evictions = 0

    def release(self) -> None:
        """Off for good (a failed capture, scalar values that keep changing): the buffers go."""
        self.state = "off"
        self.graphs.clear()
        self.bufs, self.nbytes = [None] * len(ROLES), 0

    def __call__(self, values: list):
        """The call's output from a graph replay, or None (the caller launches directly)."""
        if self.state != "on" or not dl.hooks_idle(*self.direct.hooks):
            return None
        bufs = self.bufs
        key = tuple([None if bufs[r] is not None else values[r] for r in PARAMS])
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, values)
            if graph is None:
                return None
        else:
            self.graphs.move_to_end(key)
        self._copy_in(values)
        graph.launch(dl.current_stream())
        fp = values[FP]
        if fp is not None:
            fp.view(1).copy_(bufs[FP].view(1))  # a 0-d slot or a [1] view: one element either way
        return bufs[OUT].clone()

    def _copy_in(self, values: list) -> None:
        """The call's probs and tensor parameters into the graph's buffers."""
        b = self.bufs  # (detach only where needed: it costs host time on every call)
        for r in (PROBS,) + PARAMS:
            if b[r] is not None:
                v = values[r]
                b[r].copy_(v.detach() if v.requires_grad else v)

    def _values(self, values: list, out=None, fp=None) -> list:
        """The launches' roles over the buffers (scalar parameters: the call's)."""
        b = self.bufs
        mine = [b[r] if b[r] is not None else values[r] for r in ROLES]
        mine[OUT] = b[OUT] if out is None else out
        mine[FP] = b[FP] if fp is None else fp
        return mine

    def _capture(self, key, values: list):
        """Capture the direct launches over the buffers for this scalar key, then check one
        replay against a direct run on the call's own data, bit for bit (one sync). None (and
        the graphs released) on failure; also when scalar values keep changing (each new one
        would cost a capture and a sync)."""
        if self.evictions >= GRAPHS_PER_PLAN:
            self.refusal = f"{self.evictions} graphs dropped for new scalar values: graphs off"
            self.release()
            return None
        try:
            mine = self._values(values)
            if not self.direct.accepts(mine):
                raise RuntimeError("the graph's buffers are refused by the recorded launches (alignment)")
            side = torch.cuda.Stream(device=self.bufs[PROBS].device)
            with torch.cuda.stream(side):  # the direct launches go to the current stream: the side one
                graph = DriverGraph.capture(lambda: self.direct(mine), side.cuda_stream)
            self.captures += 1
            # the check: the call's probs through the direct launches and through a replay (no
            # random data: a draw here would move the process's CUDA generator)
            self._copy_in(values)
            want_out = aligned_like(self.bufs[OUT])
            want_fp = aligned_like(self.bufs[FP])
            self.direct(self._values(values, want_out, want_fp))
            self.bufs[OUT].fill_(float("nan"))
            if want_fp is not None:
                self.bufs[FP].copy_(want_fp).bitwise_not_()  # a replay that wrote no fingerprint shows
            graph.launch(dl.current_stream())
            same = torch.equal(bits(self.bufs[OUT]), bits(want_out)) and \
                (want_fp is None or torch.equal(self.bufs[FP], want_fp))
            if not same:
                raise RuntimeError("a graph replay differs from the direct launches")
        except Exception as e:  # noqa: BLE001 - any failure: the direct launches, as before
            self.refusal = f"{type(e).__name__}: {e}"[:300]
            dl.FAILURES[f"renorm graph {self.op}"] = self.refusal
            self.release()
            return None
        self.graphs[key] = graph
        while len(self.graphs) > GRAPHS_PER_PLAN:
            self.graphs.popitem(last=False)
            self.evictions += 1
        return graph


__all__ = ["GRAPHS_PER_PLAN", "GRAPH_MIN_LAUNCHES", "PARAMS", "ROLES", "PlanGraphs", "aligned_like", "aligned_to",
           "worth_graph"]
