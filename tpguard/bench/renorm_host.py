"""tpguard's own Python per eager renorm call, without the kernels (CPU; kernels/NOTES.md, "Eager
host time"): the Triton interpreter's launches are replaced by no-ops, so what is timed is the API
checks, the block shapes, the workspace and the argument handling around the 5-6 launches.

    TRITON_INTERPRET=1 python -m tpguard.bench.renorm_host [--vocab 163840] [--calls 2000]
"""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from tpguard.bench.args import BenchParser

    ap = BenchParser(prog="python -m tpguard.bench.renorm_host")
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("renorm_host: run with TRITON_INTERPRET=1 (the launches it stubs are the interpreter's)")
        return 2
    import cProfile
    import pstats

    import torch
    import triton.runtime.interpreter as interp

    interp.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)  # no kernel runs
    from tpguard.kernels import renorm

    x = torch.softmax(torch.randn(1, args.vocab), -1)
    calls = {"top_p": lambda: renorm.top_p_renorm(x, 0.9, backend="triton"),
             "top_k": lambda: renorm.top_k_renorm(x, 40, backend="triton"),
             "top_k_top_p": lambda: renorm.top_k_top_p_renorm(x, 40, 0.9, backend="triton"),
             "min_p": lambda: renorm.min_p_renorm(x, 0.1, backend="triton")}
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        print(f"{name}: {(time.perf_counter() - t0) / args.calls * 1e6:.1f} us of Python per call (launches stubbed)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        calls["top_p"]()
    prof.disable()
    stats = pstats.Stats(prof)
    print(f"top_p: {stats.total_calls / 200:.0f} Python function calls per call")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
