"""Eager renorm calls at 1 and 8 rows with plan graphs on and off, interleaved in one process (an A/B of
TPGUARD_RENORM_GRAPH_ROWS without the process-to-process host noise of two bench runs; session 10).

    python3 gpu/graph_ab.py   (CUDA; prints eager median us per (op, rows, mode) over 5 alternating rounds)
"""
import statistics

import torch

from tpguard.bench.timing import time_events
from tpguard.kernels import renorm, renorm_graph

calls = {"top_p": lambda x: renorm.top_p_renorm(x, 0.9), "top_k": lambda x: renorm.top_k_renorm(x, 40),
         "top_k_top_p": lambda x: renorm.top_k_top_p_renorm(x, 40, 0.9), "min_p": lambda x: renorm.min_p_renorm(x, 0.1)}
res = {}
for rows in (1, 8):
    x = torch.softmax(torch.randn(rows, 163840, device="cuda"), -1)
    for _ in range(5):
        for mode, (g, m) in (("direct", (0, 5)), ("graph", (rows, 0))):
            renorm_graph.GRAPH_ROWS, renorm_graph.GRAPH_MIN_LAUNCHES = g, m
            renorm.clear_plans()
            for op, fn in calls.items():
                for _ in range(5):
                    fn(x)
                res.setdefault((op, rows, mode), []).append(time_events(lambda: fn(x), 50))
for (op, rows, mode), v in sorted(res.items()):
    print(f"{op:12s} {rows} rows {mode:6s}: eager median {statistics.median(v):6.1f} us  (rounds {' '.join(f'{t:.0f}' for t in v)})")
