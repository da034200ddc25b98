"""probe: where the fused logits -> target probs call's time goes at 1-8 rows."""
import sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from tpguard.kernels import renorm as tk
from tpguard.kernels.target_probs import target_probs, temperature_scale
from tpguard.bench.kernels import make_logits
from tpguard.bench.timing import time_batched, time_graph, time_host

def kernels_per_call(fn, n=20):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [(e.key[:60], e.count / n, e.device_time_total / n) for e in evs if e.device_time_total > 0]

for rows in (1, 8, 64):
    for kind in ("flat", "peaky"):
        logits = make_logits(rows, 163840, kind, "cuda", 0).float()
        t = torch.full((rows,), 0.8, device="cuda")
        fns = {
            "fused T tensor": lambda: target_probs(logits, t, 40, 0.9, validate=False),
            "fused T float": lambda: target_probs(logits, 0.8, 40, 0.9, validate=False),
            "fused T float no k": lambda: target_probs(logits, 0.8, None, 0.9, validate=False),
            "softmax+tpguard": lambda: tk.top_k_top_p_renorm(torch.softmax(logits.float() / t[:, None], -1), 40, 0.9, validate=False),
            "temperature_scale": lambda: temperature_scale(t, rows, logits.device),
        }
        for name, fn in fns.items():
            e, h, g = time_batched(fn, 30, 3, 3), time_host(fn, 100), time_graph(fn, 30, strict=False)
            print(f"rows {rows} {kind} {name}: eager {e:.1f} host {h:.1f} graph {g if g is None else round(g,1)}", flush=True)
        if kind == "flat":
            for name in ("fused T tensor", "fused T float no k"):
                print("  kernels of", name)
                for k, c, us in kernels_per_call(fns[name]):
                    print(f"    {us:8.1f} us x{c:.0f} {k}")
