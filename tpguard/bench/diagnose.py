"""`tpguard bench diagnose`: diagnose throughput on a generated long trace, per JSON layout.

Writes a 2-rank per-rank trace of N steps (default 1,000,000) with one divergence near the end,
in tpguard's compact layout and in the spacing of a standard `json.dumps` (", " and ": "), then
times, for each, a bare `json.loads` of every line (the yardstick: any layout should read within
3x of it) and `tpguard.diagnose.diagnose`, and prints steps/s, the ratio and peak memory.
Usage: tpguard bench diagnose [--steps N] [--ranks R] [--layout compact|spaced|both]
       [--dir DIR] [--keep]
"""

from __future__ import annotations

import json  # the yardstick (a bare json.loads per line) and the spaced layout (json.dumps's)
import resource
import shutil
import tempfile
import time
from pathlib import Path

import orjson

from tpguard.quantities import CANONICAL_ORDER
from tpguard.records import Header, to_json

LAYOUTS = ("compact", "spaced")


def write_synthetic_trace(directory: Path, steps: int, ranks: int = 2, diverge_at: int | None = None,
                          quantity: str = "target_probs", culprit: int = 1, run_id: str = "bench",
                          layout: str = "compact") -> list[Path]:
    """Per-rank files as the guard writes them (`layout` "compact"), or as `json.dumps` with its
    default separators writes the same records ("spaced"); `quantity` and every later one differ
    on `culprit` from `diverge_at` on."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    colon, comma = (b":", b",") if layout == "compact" else (b": ", b", ")
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    qi = CANONICAL_ORDER.index(quantity)
    keys = [b'"%s"%s' % (q.encode(), colon) for q in CANONICAL_ORDER]
    for r in range(ranks):
        path = directory / f"{run_id}.rank{r}.jsonl"
        header = to_json(Header(run_id=run_id, world_size=ranks, ranks=[r], algo="synthetic"))
        with open(path, "wb") as f:
            f.write((orjson.dumps(header) if layout == "compact" else json.dumps(header).encode()) + b"\n")
            prefix = (b'{"type"%s"step"%s"run_id"%s%s%s"step"%s'
                      % (colon, comma, colon, orjson.dumps(run_id), comma, colon))
            middle = (b'%s"site"%s"synthetic.verify"%s"ranks"%s[%d]%s"fp"%s{'
                      % (comma, colon, comma, colon, r, comma, colon))
            for s in range(steps):
                vals = []
                for i in range(len(CANONICAL_ORDER)):
                    v = (s * 0x9E3779B97F4A7C15 + i * 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
                    if diverge_at is not None and s >= diverge_at and r == culprit and i >= qi:
                        v ^= 1
                    vals.append(b'%s"%016x"' % (keys[i], v))
                f.write(prefix + str(s).encode() + middle + comma.join(vals) + b"}}\n")
        paths.append(path)
    return paths


def time_json_loads(paths: list[Path]) -> float:
    """Seconds for a bare `json.loads` of every line of the files (nothing else done)."""
    loads = json.loads
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb") as f:
            for line in f:
                loads(line)
    return time.perf_counter() - t0


def time_diagnose(paths: list[Path]) -> tuple[float, dict]:
    from tpguard.diagnose import diagnose

    t0 = time.perf_counter()
    j = diagnose(paths).to_json()
    return time.perf_counter() - t0, j


def main(*, steps: int, ranks: int, layout: str, directory: str | None, keep: bool) -> int:
    """`tpguard bench diagnose` (its options, checked: tpguard/cli.py); returns an exit code."""
    layouts = LAYOUTS if layout == "both" else (layout,)
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="tpguard-bench-"))
    try:
        for layout in layouts:
            t0 = time.perf_counter()
            paths = write_synthetic_trace(root / layout, steps, ranks, diverge_at=steps - 10, layout=layout)
            t_write = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in paths)
            t_json = time_json_loads(paths)
            t_diag, j = time_diagnose(paths)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            f = j["first_divergence"]
            print(f"{layout}: {ranks} ranks x {steps} steps, {size / 1e6:.1f} MB (written in {t_write:.1f} s)")
            print(f"  json.loads of every line: {t_json:.2f} s")
            print(f"  diagnose: {t_diag:.2f} s ({steps / t_diag:,.0f} steps/s, {size / 1e6 / t_diag:.0f} MB/s), "
                  f"{t_diag / t_json:.2f}x json.loads; peak RSS {rss:.0f} MB")
            print(f"  verdict: {j['verdict']} at step {f['step'] if f else '-'} ({f['quantity'] if f else '-'})")
    finally:
        if not keep and not directory:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    import sys

    from tpguard.cli import main as cli_main

    raise SystemExit(cli_main(["bench", "diagnose", *sys.argv[1:]]))
