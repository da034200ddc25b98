"""Renorm call plans with processes sharing one GPU: time per step, warm-up apart.

The harness at 256 x 163840 (2 ranks on one H200, softmax + top_p_renorm per step) once measured
tpguard's renorm 3-4x slower per step with the call plans than without. This check separates the
one-time cost (Triton's compilation, a plan's recording and its bit check) from the steady state:
N processes on cuda:0 each run `steps` calls of softmax -> top_p_renorm on their own logits, with
TPGUARD_RENORM_PLANS unset (plans on) and =0 (off), and print per mode the first steps and the
steady-state median (ms per step, one process's view, synchronised after each step).

    python gpu/plans_shared_gpu.py [--procs 2] [--steps 100] [--rows 256] [--vocab 163840]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp


def _worker(rank: int, args, plans: str, queue) -> None:
    if plans == "off":
        os.environ["TPGUARD_RENORM_PLANS"] = "0"
    else:
        os.environ.pop("TPGUARD_RENORM_PLANS", None)
    from tpguard.kernels import top_p_renorm

    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    logits = torch.randn(args.rows, args.vocab, device="cuda", generator=gen)
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        probs = torch.softmax(logits, dim=-1)
        top_p_renorm(probs, 0.9)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    queue.put((rank, times))


def run(args, plans: str) -> list[list[float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, plans, queue)) for r in range(args.procs)]
    for p in procs:
        p.start()
    out = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return [out[r] for r in range(args.procs)]


def main() -> int:
    ap = argparse.ArgumentParser(prog="gpu/plans_shared_gpu.py")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    print(f"{args.procs} process(es) on one GPU ({torch.cuda.get_device_name(0)}), softmax + top_p_renorm(0.9), "
          f"{args.rows} x {args.vocab} float32, {args.steps} steps")
    print("| plans | rank | first steps, ms | warm-up ms (sum) | steady median ms | steady p90 ms | mean over all ms |")
    print("|---|---|---|---|---|---|---|")
    for plans in ("on", "off"):
        for rank, t in enumerate(run(args, plans)):
            steady = sorted(t[args.warmup:])
            print(f"| {plans} | {rank} | {' / '.join(f'{x:.1f}' for x in t[:4])} | {sum(t[:args.warmup]):.0f} | "
                  f"{statistics.median(steady):.2f} | {steady[int(0.9 * (len(steady) - 1))]:.2f} | "
                  f"{statistics.fmean(t):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
