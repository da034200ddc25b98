"""The one-launch top-k's chunks per CTA (RenormConfig.fused_per_cta) against the three launches, at 1-8
rows of 163840, in one process: graph replay (GPU work) and eager medians over alternating rounds, bits
checked against the three launches first (session 11; run 36 also timed the wait by atomic reads, removed
since: `fused_poll=0` in docs/benchmarks.md).

    python3 gpu/fused_variants.py [--rows 1,2,4,8] [--per 0,1,2,4]
"""
import argparse
import statistics

import torch

from tpguard.bench.timing import capture, time_events
from tpguard.kernels import renorm_plan
from tpguard.kernels.renorm_passes import DEFAULT_CONFIG

ap = argparse.ArgumentParser()
ap.add_argument("--rows", default="1,2,4,8", help="batch sizes (the one launch is allowed up to the largest)")
ap.add_argument("--per", default="0,1,2,4", help="chunks per CTA (0: the default rule)")
args = ap.parse_args()
ROWS = [int(r) for r in args.rows.split(",")]
VARIANTS = {"three": DEFAULT_CONFIG.replace(fused_rows=0)}
for per in (int(p) for p in args.per.split(",")):  # 0: the default rule (renorm_top_k_fused.chunks_per_cta)
    VARIANTS[f"one per{per or '-auto'}"] = DEFAULT_CONFIG.replace(fused_per_cta=per, fused_rows=max(ROWS))
res = {}
for rows in ROWS:
    x = torch.softmax(torch.randn(rows, 163840, device="cuda"), -1)
    kt = torch.full((rows,), 40, dtype=torch.int32, device="cuda")
    base = renorm_plan.run("top_k", x, 40, config=VARIANTS["three"])
    fns = {}
    for name, cfg in VARIANTS.items():
        out = renorm_plan.run("top_k", x, 40, config=cfg)
        if not torch.equal(out.view(torch.int32), base.view(torch.int32)):
            print(f"{rows} rows {name}: BITS DIFFER")
        fns[name] = (lambda c: (lambda: renorm_plan.run("top_k", x, kt, config=c)))(cfg)
    graphs = {name: capture(fn) for name, fn in fns.items()}
    for _ in range(3):
        for name, fn in fns.items():
            res.setdefault((rows, name, "graph"), []).append(time_events(graphs[name].replay, 50))
            res.setdefault((rows, name, "eager"), []).append(time_events(fn, 50))
    renorm_plan.clear_plans()
for rows in ROWS:
    for name in VARIANTS:
        g, e = res[(rows, name, "graph")], res[(rows, name, "eager")]
        print(f"{rows} rows {name:16s}: graph {statistics.median(g):6.1f} us  eager {statistics.median(e):6.1f} us"
              f"  (graph rounds {' '.join(f'{t:.1f}' for t in g)})")
