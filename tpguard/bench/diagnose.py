"""`tpguard bench diagnose`: diagnose throughput on a generated long trace.

Writes a 2-rank per-rank trace of N steps (default 1,000,000) with one divergence near the end,
then times `tpguard.diagnose.diagnose` on it and prints steps/s and peak memory.
Usage: python -m tpguard.bench.diagnose [--steps N] [--ranks R] [--dir DIR] [--keep]
"""

from __future__ import annotations

import resource
import shutil
import tempfile
import time
from pathlib import Path

import orjson

from tpguard.bench.args import BenchParser
from tpguard.quantities import CANONICAL_ORDER
from tpguard.records import Header, to_json


def write_synthetic_trace(directory: Path, steps: int, ranks: int = 2, diverge_at: int | None = None,
                          quantity: str = "target_probs", culprit: int = 1, run_id: str = "bench") -> list[Path]:
    """Per-rank files as the guard writes them; `quantity` differs on `culprit` from `diverge_at` on."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    qi = CANONICAL_ORDER.index(quantity)
    for r in range(ranks):
        path = directory / f"{run_id}.rank{r}.jsonl"
        header = Header(run_id=run_id, world_size=ranks, ranks=[r], algo="synthetic")
        with open(path, "wb") as f:
            f.write(orjson.dumps(to_json(header)) + b"\n")
            prefix = b'{"type":"step","run_id":"%s","step":' % run_id.encode()
            middle = b',"site":"synthetic.verify","ranks":[%d],"fp":{' % r
            for s in range(steps):
                vals = []
                for i, q in enumerate(CANONICAL_ORDER):
                    v = (s * 0x9E3779B97F4A7C15 + i * 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
                    if diverge_at is not None and s >= diverge_at and r == culprit and i >= qi:
                        v ^= 1
                    vals.append(b'"%s":"%016x"' % (q.encode(), v))
                f.write(prefix + str(s).encode() + middle + b",".join(vals) + b"}}\n")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="tpguard bench diagnose")
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write the trace (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the generated trace")
    args = ap.parse_args(argv)
    if args.steps < 20 or args.ranks < 2:
        ap.error(f"--steps must be >= 20 and --ranks >= 2, got {args.steps} and {args.ranks}")
    from tpguard.diagnose import diagnose

    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tpguard-bench-"))
    try:
        t0 = time.perf_counter()
        paths = write_synthetic_trace(tmp, args.steps, args.ranks, diverge_at=args.steps - 10)
        t_write = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in paths)
        t0 = time.perf_counter()
        diag = diagnose(paths)
        t_diag = time.perf_counter() - t0
        j = diag.to_json()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"trace: {args.ranks} ranks x {args.steps} steps, {size / 1e6:.1f} MB (written in {t_write:.1f} s)")
        print(f"diagnose: {t_diag:.2f} s  ({args.steps / t_diag:,.0f} steps/s, "
              f"{size / 1e6 / t_diag:.0f} MB/s), peak RSS {rss:.0f} MB")
        f = j["first_divergence"]
        print(f"verdict: {j['verdict']} at step {f['step'] if f else '-'} ({f['quantity'] if f else '-'})")
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
