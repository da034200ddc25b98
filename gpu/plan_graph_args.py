"""Plan graphs (kernels/renorm_graph.py: the call's tensors as the graph's pointer arguments) against the
plans' direct launches, eager, beside flashinfer's default, in one process (docs/benchmarks.md, "Plan
graphs").

    python gpu/plan_graph_args.py [VOCABS] [ROWS] [OPS]   # default 32000,163840 1,8,64,256,1024 every op

Per cell (flat rows, top_p 0.9, top_k 40, min_p 0.1, fp32 and bf16): us per call, the median of 3
batches of 30 back-to-back calls (the grid's timer), and host us per call (500 calls, no sync in the
loop). "direct": no plan graph (TPGUARD_RENORM_GRAPH_ROWS=0); "graph": a plan graph wherever the call
makes >= 3 launches (TPGUARD_RENORM_GRAPH_ROWS=4096). Every output is compared with the direct
launches' bit for bit.
"""

from __future__ import annotations

import os
import sys

import torch
from tpguard.kernels import renorm as tk
from tpguard.kernels import renorm_plan
from tpguard.kernels.reference import bits

from tpguard.bench.kernels import flashinfer_sampling, make_probs
from tpguard.bench.timing import time_batched, time_host

ITERS = 30
OPS = ("top_p", "min_p", "top_k", "top_k_top_p")


def ours(op: str):
    return {"top_p": lambda x: tk.top_p_renorm(x, 0.9, validate=False),
            "min_p": lambda x: tk.min_p_renorm(x, 0.1, validate=False),
            "top_k": lambda x: tk.top_k_renorm(x, 40, validate=False),
            "top_k_top_p": lambda x: tk.top_k_top_p_renorm(x, 40, 0.9, validate=False)}[op]


def graph_state() -> str:
    """The most recent plan's launches and graph state (gpu/top_k_rules.py prints it too)."""
    plans = renorm_plan.plans()
    if not plans:
        return "no plan"
    plan = plans[-1][1]
    launches = len(plan.direct.launches) if plan.direct else "?"
    g = plan.graphs
    return f"{launches} launches, " + ("no graph" if g is None else f"graph {g.state} {g.refusal}".strip())


def run_mode(mode: str, fn, x):
    renorm_plan.clear_plans()
    os.environ["TPGUARD_RENORM_GRAPH_ROWS"] = "0" if mode == "direct" else "4096"
    for _ in range(5):
        fn(x)
    dev = time_batched(lambda: fn(x), ITERS, rounds=3, warmup=2)
    host = time_host(lambda: fn(x), 500)
    return dev, host, fn(x), graph_state()


def main() -> int:
    vocabs = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "32000,163840").split(",")]
    rows_list = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,8,64,256,1024").split(",")]
    ops = (sys.argv[3] if len(sys.argv) > 3 else ",".join(OPS)).split(",")
    fs = flashinfer_sampling()
    theirs = {} if fs is None else {
        "top_p": lambda x: fs.top_p_renorm_probs(x, 0.9),
        "top_k": lambda x: fs.top_k_renorm_probs(x, 40),
        "top_k_top_p": lambda x: fs.top_p_renorm_probs(fs.top_k_renorm_probs(x, 40), 0.9)}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| op | dtype | rows | vocab | direct us | graph us | flashinfer us | host: direct | host: graph | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for vocab in vocabs:
            for rows in rows_list:
                x = make_probs(rows, vocab, "flat", "cuda", 0, dtype)
                for op in ops:
                    fn = ours(op)
                    res = {mode: run_mode(mode, fn, x) for mode in ("direct", "graph")}
                    same = torch.equal(bits(res["direct"][2]), bits(res["graph"][2]))
                    f = theirs.get(op)
                    c = time_batched(lambda: f(x), ITERS, rounds=3, warmup=2) if f is not None else None
                    cells = [f"{res['direct'][0]:.1f}", f"{res['graph'][0]:.1f}", "-" if c is None else f"{c:.1f}",
                             f"{res['direct'][1]:.1f}", f"{res['graph'][1]:.1f}"]
                    print(f"| {op} | {dname} | {rows} | {vocab} | " + " | ".join(cells) +
                          f" | {res['graph'][3]}{'' if same else ' BITS DIFFER'} |", flush=True)
                del x
    os.environ.pop("TPGUARD_RENORM_GRAPH_ROWS", None)
    renorm_plan.clear_plans()
    return 0


if __name__ == "__main__":
    sys.exit(main())
