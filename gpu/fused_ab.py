"""Top-k(40) (scalar k, a k per row, and top-k + top-p) at 1-8 rows: the one-launch kernel (kernels/renorm_top_k_fused.py) against
the three launches it replaces and flashinfer's default, interleaved in one process (session 11; eager cells
are host-bound and differ process to process, docs/benchmarks.md run 32).

    python3 gpu/fused_ab.py [--vocab 163840] [--rounds 5]

Per (op, rows, way): eager median us (events around each call, 50 calls) over alternating rounds, the
replay of one call from a CUDA graph (GPU work), and the host time per call. Checks the two tpguard ways
give the same bits first.
"""
import argparse
import statistics

import torch

from tpguard.bench.timing import capture, time_events, time_host
from tpguard.kernels import renorm, renorm_plan
from tpguard.kernels.renorm_passes import DEFAULT_CONFIG

ap = argparse.ArgumentParser()
ap.add_argument("--vocab", type=int, default=163840)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--rows", default="1,2,4,8")
ap.add_argument("--repeats", type=int, default=300)
args = ap.parse_args()
THREE = DEFAULT_CONFIG.replace(fused_rows=0)
try:
    import flashinfer.sampling as fs
except Exception as e:  # noqa: BLE001
    fs = None
    print("flashinfer unavailable:", e)


def ways(x):
    kt = torch.full((x.shape[0],), 40, dtype=torch.int32, device=x.device)  # SGLang passes a k per row
    w = {
        ("top_k_tensor", "one"): lambda: renorm_plan.run("top_k", x, kt),
        ("top_k_tensor", "three"): lambda: renorm_plan.run("top_k", x, kt, config=THREE),
        ("top_k", "api"): lambda: renorm.top_k_renorm(x, 40),  # the public call, one launch
        ("top_k", "one"): lambda: renorm_plan.run("top_k", x, 40),
        ("top_k", "three"): lambda: renorm_plan.run("top_k", x, 40, config=THREE),
        ("top_k_top_p", "one"): lambda: renorm_plan.run("top_k_top_p", x, 40, 0.9),
        ("top_k_top_p", "three"): lambda: renorm_plan.run("top_k_top_p", x, 40, 0.9, config=THREE),
    }
    if fs is not None:
        w[("top_k", "flashinfer")] = lambda: fs.top_k_renorm_probs(x, 40)
        w[("top_k_tensor", "flashinfer")] = lambda: fs.top_k_renorm_probs(x, kt)
    return w


eager, graph, host = {}, {}, {}
for rows in (int(r) for r in args.rows.split(",")):
    x = torch.softmax(torch.randn(rows, args.vocab, device="cuda"), -1)
    renorm.clear_plans()
    w = ways(x)
    for op in ("top_k", "top_k_tensor", "top_k_top_p"):
        a, b = w[(op, "one")](), w[(op, "three")]()
        same = torch.equal(a.view(torch.int32), b.view(torch.int32))
        repeats = sum(not torch.equal(w[(op, "one")]().view(torch.int32), a.view(torch.int32))
                      for _ in range(args.repeats))
        print(f"{op} {rows} rows: one launch and three launches {'same bits' if same else 'DIFFER'};"
              f" {repeats} of {args.repeats} repeated one-launch calls differ", flush=True)
    for _ in range(args.rounds):
        for key, fn in w.items():
            for _ in range(5):
                fn()
            eager.setdefault((rows,) + key, []).append(time_events(fn, 50))
    for key, fn in w.items():
        g = capture(fn)
        graph[(rows,) + key] = time_events(g.replay, 50)
        host[(rows,) + key] = time_host(fn, 200)
plan_launches = {f"{key[0]} rows={key[1]} fused_rows={key[3].fused_rows} k={key[6]}":
                 len(p.direct.launches) if p.direct else p.state for key, p in renorm_plan.plans()}
print("launches per plan:", plan_launches)
for (rows, op, way), v in sorted(eager.items()):
    print(f"{op:12s} {rows} rows {way:10s}: eager {statistics.median(v):6.1f} us  graph {graph[(rows, op, way)]:6.1f}"
          f"  host {host[(rows, op, way)]:6.1f}  (rounds {' '.join(f'{t:.0f}' for t in v)})")
