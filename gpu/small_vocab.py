"""Where an eager renorm call's time goes, tpguard beside flashinfer's default, in one process: per
cell the eager time (back-to-back calls), the host time alone (no sync in the loop) and the device time
(one call replayed from a CUDA graph), then tpguard's kernels per call from the profiler. An eager cell
is host-bound where host ~ eager > graph (docs/benchmarks.md, "Small vocabularies").

    python gpu/small_vocab.py [VOCABS=32000,128256] [ROWS=1,8,64,256,1024]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile
from tpguard.kernels import renorm as tk

from tpguard.bench.kernels import DTYPES, flashinfer_sampling, make_probs
from tpguard.bench.timing import time_batched, time_graph, time_host

OPS = ("top_k", "top_p")
PROFILED = (("fp32", 32000, 256, "top_k"), ("fp32", 32000, 64, "top_p"), ("bf16", 32000, 64, "top_k"),
            ("fp32", 32000, 1, "top_k"))


def calls(x: torch.Tensor, fs) -> dict:
    """(op, impl) -> a call on x: tpguard's public API, flashinfer's default (when it is there)."""
    out = {("top_p", "tpguard"): lambda: tk.top_p_renorm(x, 0.9, validate=False),
           ("top_k", "tpguard"): lambda: tk.top_k_renorm(x, 40, validate=False)}
    if fs is not None:
        out[("top_p", "flashinfer")] = lambda: fs.top_p_renorm_probs(x, 0.9)
        out[("top_k", "flashinfer")] = lambda: fs.top_k_renorm_probs(x, 40)
    return out


def timings(fn) -> list:
    return [time_batched(fn, 30, 3, 3), time_host(fn, 100), time_graph(fn, 30, strict=False)]


def fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def kernels_per_call(fn, n: int = 20) -> list[tuple[str, float]]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total / n) for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
            if e.device_time_total > 0]


def main(vocabs: list[int], rows_list: list[int]) -> int:
    fs = flashinfer_sampling()
    print("| dtype | vocab | rows | op | tpguard eager | tpguard host | tpguard graph | flashinfer eager | "
          "flashinfer host | flashinfer graph |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dname in ("fp32", "bf16"):
        for vocab in vocabs:
            for rows in rows_list:
                fns = calls(make_probs(rows, vocab, "flat", "cuda", 0, DTYPES[dname]), fs)
                for op in OPS:
                    cells = timings(fns[(op, "tpguard")])
                    cells += timings(fns[(op, "flashinfer")]) if fs is not None else [None] * 3
                    print(f"| {dname} | {vocab} | {rows} | {op} | " + " | ".join(fmt(c) for c in cells) + " |",
                          flush=True)
    for dname, vocab, rows, op in PROFILED:
        fn = calls(make_probs(rows, vocab, "flat", "cuda", 0, DTYPES[dname]), None)[(op, "tpguard")]
        print(f"\n{dname} {vocab} x {rows} {op}, tpguard's kernels, us per call:")
        for name, us in kernels_per_call(fn):
            print(f"  {name[:60]:60s} {us:8.1f}")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:] + [""] * 2
    sys.exit(main([int(v) for v in (args[0] or "32000,128256").split(",")],
                  [int(v) for v in (args[1] or "1,8,64,256,1024").split(",")]))
