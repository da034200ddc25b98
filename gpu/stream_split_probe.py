"""Probe (GPU): does running a renorm on row parts on several streams at once hide the latency-bound
per-row kernels (the select kernels, bracket_select) of one part behind the streaming passes of another?

Rows are independent (batch-invariant kernels), so a part is the same op on a row slice with its own
call plan and workspace (plans are per stream). Schedules, timed by CUDA-graph replay (parallel
branches) and by back-to-back eager batches, output bits compared with the one-call baseline:
  base   one call over all rows, RenormConfig.graph_row_split = 1 (no split)
  parN   N row parts on N streams through kernels/row_split.run_split, eagerly too (graph_row_split = 1 inside)
  split  one call with the default config: kernels/row_split.py splits it under capture (graph only)
Run 19 (session 6, top-p flat 256 x 163840): base 337.9, par2 320.3 us (graph); staggered starts (part i
after part i-1's row_stats) 330-341 us: dropped.

(Runs 19-22 ran an earlier copy of this script with its own fork/join class; it now calls run_split, which
does the same fork/join with aligned part boundaries: not re-run since.)

Usage: python -P gpu/stream_split_probe.py [--rows 256] [--vocab 163840] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

from tpguard.bench.timing import time_batched, time_graph
from tpguard.kernels import renorm_plan, row_split
from tpguard.kernels.gpu_sweep import probs as probs_for
from tpguard.kernels.renorm_passes import DEFAULT_CONFIG

NO_SPLIT = DEFAULT_CONFIG.replace(graph_row_split=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    results = {}
    inputs = {"flat": probs_for(a.rows, a.vocab, 1.0), "mid": probs_for(a.rows, a.vocab, 4.0, 2)}
    ops = [("top_p", "flat", "top_p", None, 0.9), ("top_p", "mid", "top_p", None, 0.9),
           ("top_k40", "flat", "top_k", 40, None), ("top_k_top_p", "flat", "top_k_top_p", 40, 0.9)]
    streams = row_split.side_streams(torch.device("cuda", torch.cuda.current_device()), 4)

    def part(op, x, k, p, out):  # one part, unsplit inside
        return renorm_plan._run_op(op, x, k, p, NO_SPLIT, None, None, out)

    for name, kind, op, k, p in ops:
        x = inputs[kind]
        base = renorm_plan.run(op, x, k, p, NO_SPLIT)
        torch.cuda.synchronize()
        for parts in (1, 2, 4, "split"):
            if parts == "split":
                fn = lambda: renorm_plan.run(op, x, k, p, DEFAULT_CONFIG)  # noqa: E731
            elif parts == 1:
                fn = lambda: renorm_plan.run(op, x, k, p, NO_SPLIT)  # noqa: E731
            else:
                fn = lambda n=parts: row_split.run_split(  # noqa: E731
                    lambda y, kk, pp, out: part(op, y, kk, pp, out), x, (k, p), n, streams)
            out = fn()
            torch.cuda.synchronize()
            same = bool(torch.equal(out.view(torch.int32), base.view(torch.int32)))
            g = time_graph(fn, a.iters, strict=False)
            e = time_batched(fn, 20)
            label = {1: "base", "split": "split"}.get(parts, f"par{parts}")
            results[f"{name}/{kind}/{label}"] = {"graph_us": g, "eager_us": e, "bits_equal_base": same}
            print(f"{name:12s} {kind:5s} {label:5s} graph {g if g is None else round(g, 1)} us  "
                  f"eager(batched) {e:.1f} us  bits_equal {same}", flush=True)
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
