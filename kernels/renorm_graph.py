"""Eager small-batch renorm calls replayed from CUDA graphs that their call plan owns (host time;
kernels/NOTES.md "Plan graphs"; docs/kernels.md "Call plans").

An eager call of a few rows is host-bound: its 3-5 direct launches cost more host time than the
GPU spends on them (run 27: top-k(40) at 1 row 55 us of host time for 23 us of GPU work,
flashinfer's one launch 46 us). A plan (kernels/renorm_plan.py) whose direct launches are
validated and whose rows are <= ``TPGUARD_RENORM_GRAPH_ROWS`` (default 0: off until a GPU run
times it) captures those launches once into a CUDA graph over buffers it owns: probs in, the
output, tensor parameters and the fingerprint slot. A call then copies probs (and any parameter
tensor) in, replays the graph on the current stream and clones the output (and copies the
fingerprint out): 3-5 torch operations and one graph launch instead of the launches and their
arguments. The GPU does two extra copies of the batch (~2 us at 1 row), so this pays only where
host time dominates.

* Same kernels with the same arguments but for the buffers' addresses (at the recorded 16-byte
  alignments): the same bits, checked once per graph against the direct launches (one sync).
* A scalar parameter is baked into a graph: one graph per scalar value, at most
  GRAPHS_PER_PLAN per plan (least recently used dropped); tensor parameters are copied in.
* Captured on a side stream in thread-local capture mode, with no allocation inside (the
  workspace is the plan's); replayed on the caller's current stream, the plan's stream.
* Any failure (capture refused, bits differ): the plan keeps its direct launches
  (`direct_launch.FAILURES` says why).
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from tpguard.kernels import direct_launch as dl

GRAPH_ROWS = int(os.environ.get("TPGUARD_RENORM_GRAPH_ROWS", "0"))
GRAPHS_PER_PLAN = 4
PROBS, OUT, K, P, FP = range(5)  # the roles of renorm_plan's values


def aligned_like(t: torch.Tensor | None) -> torch.Tensor | None:
    """An uninitialised tensor like `t` (shape, dtype, device) at the same address mod 16: Triton
    specialises pointers on 16-byte alignment, and a recorded launch accepts only its own."""
    if t is None:
        return None
    per = max(1, 16 // t.element_size())
    buf = torch.empty(t.numel() + per, dtype=t.dtype, device=t.device)
    for i in range(per):
        if buf[i:].data_ptr() % 16 == t.data_ptr() % 16:
            return buf[i:i + t.numel()].view(t.shape)
    return buf[:t.numel()].view(t.shape)


class PlanGraphs:
    """The graphs of one plan: its buffers, and one captured graph per scalar-parameter value."""

    def __init__(self, op: str, direct: dl.LaunchSet, probs, k, p, fp):
        self.op, self.direct = op, direct
        self.bufs = [aligned_like(probs), aligned_like(probs),
                     aligned_like(k) if isinstance(k, torch.Tensor) else None,
                     aligned_like(p) if isinstance(p, torch.Tensor) else None, aligned_like(fp)]
        self.nbytes = sum(b.untyped_storage().nbytes() for b in self.bufs if b is not None)
        self.graphs: OrderedDict = OrderedDict()
        self.state, self.refusal = "on", ""
        self.captures = 0

    def __call__(self, probs, k, p, fp):
        """The call's output from a graph replay, or None (the caller launches directly)."""
        if self.state != "on" or not dl.hooks_idle(*self.direct.hooks):
            return None
        bufs = self.bufs
        key = (None if bufs[K] is not None else k, None if bufs[P] is not None else p)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, k, p)
            if graph is None:
                return None
        else:
            self.graphs.move_to_end(key)
        bufs[PROBS].copy_(probs)
        if bufs[K] is not None:
            bufs[K].copy_(k)
        if bufs[P] is not None:
            bufs[P].copy_(p)
        graph.replay()
        if fp is not None:
            fp.view(1).copy_(bufs[FP].view(1))  # a 0-d slot or a [1] view: one element either way
        return bufs[OUT].clone()

    def _values(self, k, p, out=None, fp=None) -> list:
        b = self.bufs
        return [b[PROBS], b[OUT] if out is None else out, b[K] if b[K] is not None else k,
                b[P] if b[P] is not None else p, b[FP] if fp is None else fp]

    def _capture(self, key, k, p):
        """Capture the direct launches over the buffers for this scalar key, then check one
        replay against a direct run, bit for bit (one sync). None (and state off) on failure."""
        try:
            values = self._values(k, p)
            if not self.direct.accepts(values):
                raise RuntimeError("the graph's buffers are refused by the recorded launches (alignment)")
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(device=self.bufs[PROBS].device)
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.direct(values)
                finally:
                    graph.capture_end()
            self.captures += 1
            # the check: the same probs through the direct launches and through a replay
            self.bufs[PROBS].normal_()
            if self.bufs[K] is not None:
                self.bufs[K].copy_(k)
            if self.bufs[P] is not None:
                self.bufs[P].copy_(p)
            self.bufs[PROBS].abs_().div_(self.bufs[PROBS].sum(-1, keepdim=True))
            want_out = aligned_like(self.bufs[OUT])
            want_fp = aligned_like(self.bufs[FP])
            self.direct(self._values(k, p, want_out, want_fp))
            self.bufs[OUT].fill_(float("nan"))
            if want_fp is not None:
                self.bufs[FP].copy_(want_fp).bitwise_not_()  # a replay that wrote no fingerprint shows
            graph.replay()
            same = torch.equal(self.bufs[OUT].view(torch.int32), want_out.view(torch.int32)) and \
                (want_fp is None or torch.equal(self.bufs[FP], want_fp))
            if not same:
                raise RuntimeError("a graph replay differs from the direct launches")
        except Exception as e:  # noqa: BLE001 - any failure: the direct launches, as before
            self.state, self.refusal = "off", f"{type(e).__name__}: {e}"[:300]
            self.graphs.clear()
            dl.FAILURES[f"renorm graph {self.op}"] = self.refusal
            return None
        self.graphs[key] = graph
        while len(self.graphs) > GRAPHS_PER_PLAN:
            self.graphs.popitem(last=False)
        return graph


__all__ = ["GRAPHS_PER_PLAN", "GRAPH_ROWS", "PlanGraphs", "aligned_like"]
