"""Probe (GPU): does running a renorm on row parts on several streams at once hide the latency-bound
per-row kernels (the select kernels, bracket_select) of one part behind the streaming passes of another?

Rows are independent (batch-invariant kernels), so a part is the same op on a row slice with its own
call plan and workspace (plans are per stream). Schedules, timed by CUDA-graph replay (parallel
branches) and by back-to-back eager batches, output bits compared with the one-call baseline:
  base   one call over all rows, RenormConfig.graph_row_split = 1 (no split)
  parN   N row parts, each on its own stream, forked from and joined to the caller's stream
  split  one call with the default config: kernels/row_split.py splits it under capture (graph only)
Run 19 (session 6, top-p flat 256 x 163840): base 337.9, par2 320.3 us (graph); staggered starts (part i
after part i-1's row_stats) 330-341 us: dropped.

Usage: python -P gpu/stream_split_probe.py [--rows 256] [--vocab 163840] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

from tpguard.bench.timing import time_batched, time_graph
from tpguard.kernels import renorm_plan
from tpguard.kernels.renorm_passes import DEFAULT_CONFIG

NO_SPLIT = DEFAULT_CONFIG.replace(graph_row_split=1)


def probs_for(rows, vocab, scale, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g, device="cuda").double() * scale
    return torch.softmax(z, dim=-1).float().contiguous()


class RowSplit:
    """op over `parts` row slices on as many side streams; returns the parts' outputs."""

    def __init__(self, op, probs, parts):
        rows = probs.shape[0]
        bounds = [rows * i // parts for i in range(parts + 1)]
        self.slices = [probs[a:b] for a, b in zip(bounds, bounds[1:])]
        self.op = op
        self.streams = [torch.cuda.Stream() for _ in range(parts)]

    def __call__(self):
        main = torch.cuda.current_stream()
        outs = []
        for s, x in zip(self.streams, self.slices):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                outs.append(self.op(x))
        for s, o in zip(self.streams, outs):
            main.wait_stream(s)
            o.record_stream(main)
        return outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    results = {}
    inputs = {"flat": probs_for(a.rows, a.vocab, 1.0), "mid": probs_for(a.rows, a.vocab, 4.0, 2)}
    ops = [("top_p", "flat", lambda x, c: renorm_plan.run("top_p", x, None, 0.9, c)),
           ("top_p", "mid", lambda x, c: renorm_plan.run("top_p", x, None, 0.9, c)),
           ("top_k40", "flat", lambda x, c: renorm_plan.run("top_k", x, 40, None, c)),
           ("top_k_top_p", "flat", lambda x, c: renorm_plan.run("top_k_top_p", x, 40, 0.9, c))]
    for name, kind, op in ops:
        x = inputs[kind]
        base = op(x, NO_SPLIT)
        torch.cuda.synchronize()
        for parts in (1, 2, 4, "split"):
            if parts == "split":
                fn = lambda: op(x, DEFAULT_CONFIG)  # noqa: E731
            else:
                fn = (lambda: op(x, NO_SPLIT)) if parts == 1 else RowSplit(lambda y: op(y, NO_SPLIT), x, parts)
            out = fn()
            torch.cuda.synchronize()
            out = out if not isinstance(out, list) else torch.cat(out)
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
