"""Device time of top-k alone at small batches, beside flashinfer's default, in one process: where the eager
cells that lose spend their time (docs/benchmarks.md, "Top-k at small batches: device time and launch rules").

    python gpu/top_k_device.py

Per cell (top_k 40, flat and peaky rows, bf16 and fp32), us per call of 20 calls captured in one CUDA graph,
the median of 5 batches of 10 replays back to back (no launch gaps, no host time): tpguard with its defaults
(one launch up to 8 rows, 64 on rows of <= 32768 entries), the same at k = vocab (no search: the row stats, the
row's wait and the write), three launches (`fused_rows=0`), flashinfer's `top_k_renorm_probs`, and a copy of
probs (`clone`: a floor of one read and one write).
"""

from __future__ import annotations

import sys
import time

import torch
import triton

from tpguard.bench.kernels import flashinfer_sampling, make_probs
from tpguard.bench.timing import time_batched, time_graph
from tpguard.config import env_set
from tpguard.kernels import renorm as tk
from tpguard.kernels import renorm_plan

CELLS = ((32000, 1), (32000, 8), (32000, 64), (128256, 1), (128256, 8), (128256, 64))
DTYPES = (("bf16", torch.bfloat16), ("fp32", torch.float32))


def device_us(fn) -> float | None:
    """us per call of 20 calls replayed from one CUDA graph (None where the call cannot be captured)."""
    return time_graph(fn, 10, per_replay=20, timer=lambda f, n: time_batched(f, n, rounds=5, warmup=2), strict=False)


def with_config(config: str, fn) -> float | None:
    """device_us of fn under TPGUARD_RENORM_CONFIG=config (plans made again under it)."""
    with env_set("TPGUARD_RENORM_CONFIG", config):
        renorm_plan.clear_plans()
        try:
            return device_us(fn)
        finally:
            renorm_plan.clear_plans()


def main() -> int:
    fs = flashinfer_sampling()
    print(f"# {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, Triton {triton.__version__}, flashinfer "
          f"{getattr(sys.modules.get('flashinfer'), '__version__', '-')}; device us per call")
    print("| dtype | vocab | rows | logits | tpguard k 40 | tpguard k = vocab | three launches k 40 | flashinfer k 40 "
          "| clone |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dname, dtype in DTYPES:
        for vocab, rows in CELLS:
            for logits in ("flat", "peaky"):
                x = make_probs(rows, vocab, logits, "cuda", 0, dtype)
                cells = [with_config("", lambda: tk.top_k_renorm(x, 40, validate=False)),
                         with_config("", lambda: tk.top_k_renorm(x, vocab, validate=False)),
                         with_config("fused_rows=0", lambda: tk.top_k_renorm(x, 40, validate=False)),
                         None if fs is None else device_us(lambda: fs.top_k_renorm_probs(x, 40)),
                         device_us(lambda: x.clone())]
                print(f"| {dname} | {vocab} | {rows} | {logits} | "
                      + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
