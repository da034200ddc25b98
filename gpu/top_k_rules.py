"""Top-k alone at small batches under each launch rule, eager beside flashinfer's default, in one process: the
cells that still lose (docs/benchmarks.md, "The grid": every one is top-k alone at <= 64 rows).

    python gpu/top_k_rules.py [RULES] [DTYPES]   # default: every rule below; bf16,fp32

Rules (the same bits by construction; each output is compared with the default's):
  default   RenormConfig's defaults: one launch at <= 8 rows, <= 64 on rows of <= 32768 entries; plan graphs
            for calls of >= 3 launches
  three     fused_rows=0: three launches at every batch size, so a plan graph from 1 row
  nopdl     top_k_pdl_min_rows=0: no PDL below pdl_min_rows on long rows
  graph1    the defaults with a plan graph for one launch too (renorm_graph.GRAPH_MIN_LAUNCHES = 1)
Per cell, top_k 40, flat and peaky rows: eager us (the median of 3 batches of 20 back-to-back calls, the
grid's timer) / host us (300 calls, no sync) / graph-replay us (one call captured in a torch CUDA graph, each
replay between events: the rule's launches on the device and the replay's launch gap; plans stand aside under
capture, so `graph1` equals `default` there), the plan's launches and graph state after the eager calls.
gpu/top_k_device.py gives the device time alone.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton

from tpguard.bench.kernels import flashinfer_sampling, make_probs
from tpguard.bench.timing import time_batched, time_graph, time_host
from tpguard.kernels import renorm as tk
from tpguard.kernels import renorm_graph, renorm_plan
from tpguard.kernels.reference import bits

from plan_graph_args import graph_state  # gpu/, this script's folder

RULES = {"default": ("", 3), "three": ("fused_rows=0", 3), "nopdl": ("top_k_pdl_min_rows=0", 3),
         "graph1": ("", 1)}  # name: (TPGUARD_RENORM_CONFIG, GRAPH_MIN_LAUNCHES)
CELLS = ((32000, 1), (32000, 64), (128256, 64), (32000, 8), (128256, 8), (32000, 16), (128256, 1), (163840, 64))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def run_rule(rule: str, x: torch.Tensor):
    config, min_launches = RULES[rule]
    os.environ["TPGUARD_RENORM_CONFIG"] = config
    renorm_graph.GRAPH_MIN_LAUNCHES = min_launches
    renorm_plan.clear_plans()
    fn = lambda: tk.top_k_renorm(x, 40, validate=False)  # noqa: E731
    for _ in range(5):
        out = fn()
    eager = time_batched(fn, 20, rounds=3, warmup=2)
    host = time_host(fn, 300)
    state = graph_state()  # before time_graph: its warm-up calls on a side stream make a plan of their own
    graph = time_graph(fn, 20, strict=False)
    return out, f"{eager:.1f} / {host:.1f} / {'-' if graph is None else f'{graph:.1f}'} ({state})"


def main() -> int:
    rules = (sys.argv[1] if len(sys.argv) > 1 else ",".join(RULES)).split(",")
    dtypes = (sys.argv[2] if len(sys.argv) > 2 else "bf16,fp32").split(",")
    fs = flashinfer_sampling()
    min_launches0, config0 = renorm_graph.GRAPH_MIN_LAUNCHES, os.environ.get("TPGUARD_RENORM_CONFIG")
    print(f"# {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, Triton {triton.__version__}, flashinfer "
          f"{getattr(sys.modules.get('flashinfer'), '__version__', '-')}; eager / host / graph us")
    print("| dtype | vocab | rows | logits | flashinfer eager | " + " | ".join(rules) + " |")
    print("|---|---|---|---|---|" + "---|" * len(rules))
    try:
        for dname in dtypes:
            for vocab, rows in CELLS:
                for logits in ("flat", "peaky"):
                    x = make_probs(rows, vocab, logits, "cuda", 0, DTYPES[dname])
                    theirs = "-" if fs is None else \
                        f"{time_batched(lambda: fs.top_k_renorm_probs(x, 40), 20, rounds=3, warmup=3):.1f}"
                    cells, first = [], None
                    for rule in rules:
                        out, cell = run_rule(rule, x)
                        first = out if first is None else first
                        cells.append(cell + ("" if torch.equal(bits(out), bits(first)) else " BITS DIFFER"))
                    print(f"| {dname} | {vocab} | {rows} | {logits} | {theirs} | " + " | ".join(cells) + " |",
                          flush=True)
    finally:
        if config0 is None:
            os.environ.pop("TPGUARD_RENORM_CONFIG", None)
        else:
            os.environ["TPGUARD_RENORM_CONFIG"] = config0
        renorm_graph.GRAPH_MIN_LAUNCHES = min_launches0
        renorm_plan.clear_plans()
    return 0


if __name__ == "__main__":
    sys.exit(main())
