"""Probe (GPU, session 7): the launch gaps of a renorm call and of a one-tensor fingerprint.

A graph replay of top-p at 256 x 163840 was 295 us and an eager call 305 us (run 22): the eager
call pays a gap between each of its 5 launches. Options that keep the output bits:
  pdl      RenormConfig.pdl=1: programmatic dependent launches (kernels/pdl.py),
           every kernel signalling its dependents at its start
  pdl2     RenormConfig.pdl=2: the per-row kernels (select, bracket_select) signal at their end
Run 24 (session 7) also measured an eager row split (2 parts on 2 streams, each through its own call
plan): top-p flat 304.4 -> 301.9 us, top-k(40) 169 -> 330 (host-bound: each part's launches): dropped.
For each config: eager (median of CUDA events around each call, through the call plans, as
`tpguard bench kernels` times them) and graph-replay us, and whether the output bits equal the
default config's. Then the fingerprint of one 256 x 163840 fp32 tensor: each of its two launches apart
(the lane launch, the one-program finalize) and the whole call. (Run 24 also timed the finalize as a
dependent launch: 49.5 -> 49.2 us, not adopted, removed.)

("base" = pdl 0; "default" = today's RenormConfig: pdl=1 from pdl_min_rows=128 rows.)

Usage: python -P gpu/launch_gap_probe.py [--iters 50] [--json PATH] [--configs base,pdl,pdl2,default]
"""

from __future__ import annotations

import argparse
import json

import torch

from tpguard.bench.timing import time_events, time_graph
from tpguard.kernels import fingerprint as fpk
from tpguard.kernels import renorm_plan
from tpguard.kernels.gpu_sweep import probs as probs_for, recording
from tpguard.kernels.renorm_passes import DEFAULT_CONFIG

CONFIGS = {"base": {"pdl": 0}, "pdl": {"pdl": 1, "pdl_min_rows": 1}, "pdl2": {"pdl": 2, "pdl_min_rows": 1},
           "default": {}}


def cases(vocab):
    flat = probs_for(256, vocab, 1.0)
    peaky = probs_for(256, vocab, 5.0, 1)
    mid = probs_for(256, vocab, 4.0, 2)
    out = [("top_p", "flat", 256, flat, "top_p", None, 0.9), ("top_p", "peaky", 256, peaky, "top_p", None, 0.9),
           ("top_p", "mid", 256, mid, "top_p", None, 0.9), ("top_k40", "flat", 256, flat, "top_k", 40, None),
           ("top_k1024", "flat", 256, flat, "top_k", 1024, None),
           ("top_k_top_p", "flat", 256, flat, "top_k_top_p", 40, 0.9), ("min_p", "flat", 256, flat, "min_p", None, 0.1)]
    for rows in (1, 8, 64):
        x = flat[:rows].clone()
        out += [("top_p", "flat", rows, x, "top_p", None, 0.9), ("top_k40", "flat", rows, x, "top_k", 40, None),
                ("top_k_top_p", "flat", rows, x, "top_k_top_p", 40, 0.9)]
    return out


def fingerprint_passes(x, iters):
    """GPU us of each launch of one fingerprint(x) call (the lane launch, the finalize), each
    re-launched 10 times per graph replay (both are idempotent)."""
    fpk.fingerprint_triton(x, config=fpk.SINGLE_TENSOR_CONFIG)
    log = []
    with recording(log, [(fpk, "_rows_kernel"), (fpk, "_finalize_kernel")]):
        fpk.fingerprint_triton(x, config=fpk.SINGLE_TENSOR_CONFIG)
    torch.cuda.synchronize()
    return {name.strip("_"): time_graph(relaunch, iters, per_replay=10, strict=False) for name, relaunch in log}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    results = {"renorm": {}, "fingerprint": {}}
    names = [c for c in a.configs.split(",") if c in CONFIGS]
    for name, kind, rows, x, op, k, p in cases(a.vocab):
        base = None
        line = []
        for cname in names:
            cfg = DEFAULT_CONFIG.replace(**CONFIGS[cname])
            fn = lambda: renorm_plan.run(op, x, k, p, cfg)  # noqa: E731
            try:
                for _ in range(3):  # the plan records its launches at its second call
                    y = fn()
                torch.cuda.synchronize()
                if base is None:
                    base = y.clone()
                same = bool(torch.equal(y.view(torch.int32), base.view(torch.int32)))
                e = time_events(fn, a.iters)
                g = time_graph(fn, a.iters, strict=False)
                y = fn()
                torch.cuda.synchronize()
                same = same and bool(torch.equal(y.view(torch.int32), base.view(torch.int32)))
                results["renorm"][f"{name}/{kind}/{rows}/{cname}"] = {"eager_us": e, "graph_us": g, "bits_equal_base": same}
                line.append(f"{cname} {e:.1f}/{g if g is None else round(g, 1)}{'' if same else ' BITS!'}")
            except Exception as ex:  # noqa: BLE001 - report and go on
                results["renorm"][f"{name}/{kind}/{rows}/{cname}"] = {"error": f"{type(ex).__name__}: {ex}"[:300]}
                line.append(f"{cname} ERR {type(ex).__name__}: {str(ex)[:120]}")
        print(f"{name:12s} {kind:5s} {rows:4d} eager/graph us: " + " | ".join(line), flush=True)
        renorm_plan.clear_plans()
    x = probs_for(256, a.vocab, 1.0)
    for name, us in fingerprint_passes(x, a.iters).items():
        results["fingerprint"][f"pass/{name}"] = us
        print(f"fingerprint 256x{a.vocab} pass {name}: {us if us is None else round(us, 1)} us "
              "(graph, 10 per replay)", flush=True)
    fn = lambda: fpk.fingerprint_triton(x, config=fpk.SINGLE_TENSOR_CONFIG)  # noqa: E731
    e = time_events(fn, a.iters)
    g = time_graph(fn, a.iters, strict=False)
    results["fingerprint"]["call"] = {"eager_us": e, "graph_us": g}
    print(f"fingerprint 256x{a.vocab}: eager {e:.1f} graph {g if g is None else round(g, 1)} us (events around each)",
          flush=True)
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
