"""`tpguard bench kernels`: renorm speed and repeat-call determinism, side by side.

For top-p, top-k, top-k + top-p and min-p, on float32 ``[rows, vocab]`` probabilities from flat
or peaky logits, it times (CUDA events, median) tpguard's Triton kernels, flashinfer's default
and ``is_deterministic=True`` kernels (where flashinfer imports) and the torch reference, and
prints median us, GB/s (one read + one write of the tensor), the ratio to a one-pass copy of the
same tensor (the floor), and how many of N repeated calls on the same input differ from the
first one (bit for bit). Then batch sizes (1, 8, 64 rows) and top_k up to 1024.

Logits: ``flat`` = N(0, 1), ``peaky`` = N(0, 1) * 5 (kept sets of a few hundred entries at
top_p 0.9), softmax in float64, cast to float32. Seeded: every implementation sees the same bytes.

Usage: tpguard bench kernels [--rows 256] [--vocabs 128256,163840] [--logits flat,peaky]
       [--iters 50] [--repeats 200] [--top-p 0.9] [--top-k 40] [--min-p 0.1]
       [--batch-sizes 1,8,64] [--top-ks 40,256,1024] [--impls tpguard,flashinfer,flashinfer-det,torch]
       [--ops top_p,top_k,top_k_top_p,min_p] [--graphs] [--json PATH] [--quick]

``--grid`` prints the full grid instead, side by side in one process: rows {1, 8, 64, 256, 1024} x
vocab {32000, 128256, 163840, 262144} x logits {flat, peaky} x dtype {float32, bfloat16} (``--grid-rows``,
``--vocabs``, ``--logits``, ``--dtypes`` narrow it), for top-p, top-k and top-k + top-p, tpguard vs
flashinfer's default: us per call over ``--iters`` back-to-back calls (the median of 3 such
batches: device time unless the host is slower), the ratio, and the calls of ``--repeats`` that
differ from the first; then logits -> target probs: tpguard's fused kernel (kernels/target_probs.py)
vs softmax + tpguard's top-k + top-p renorms vs softmax + flashinfer's (SGLang's default path).

``--configs "A|B|..."`` prints a config comparison instead: tpguard's ops (``--ops``, default top-p) under
each ``RenormConfig`` override (``TPGUARD_RENORM_CONFIG``'s ``field=value,...``; ``''``: the defaults),
per rows x vocab x logits x dtype, us of one call replayed from a CUDA graph (device time), and every
output checked bit for bit against the first config's ("!" marks a difference).
Without CUDA it prints a note and exits 0 (the Triton interpreter is far too slow to time).
"""

from __future__ import annotations

import json  # a result file, not a trace: the stdlib's encoder takes any float a timer gives (NaN too)
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch

from tpguard.bench.timing import time_batched, time_events, time_graph
from tpguard.kernels.reference import bits

OPS = ("top_p", "top_k", "top_k_top_p", "min_p")
IMPLS = ("tpguard", "flashinfer", "flashinfer-det", "torch")
# The baseline TARGETS_US is stated against: flashinfer's and torch's times (H200, flashinfer 0.7.2.post1,
# 256 rows, top_k 40), printed in the note of the matching measured cell
BASELINE_TABLE_US = {
    ("top_p", "flashinfer", 128256, "flat"): 787, ("top_p", "flashinfer", 163840, "flat"): 971,
    ("top_p", "flashinfer", 163840, "peaky"): 472, ("top_p", "flashinfer-det", 128256, "flat"): 1097,
    ("top_p", "flashinfer-det", 163840, "flat"): 1370, ("top_p", "flashinfer-det", 163840, "peaky"): 657,
    ("top_k", "flashinfer", 128256, "flat"): 278, ("top_k", "flashinfer", 163840, "flat"): 350,
    ("top_k", "flashinfer", 163840, "peaky"): 341, ("top_p", "torch", 128256, "flat"): 3685,
    ("top_p", "torch", 163840, "flat"): 4672, ("top_p", "torch", 163840, "peaky"): 4752,
}
TARGETS_US = {"top_p": 300, "top_k": 175, "top_k_top_p": 350}  # 256 x 163840 flat


@dataclass
class Cell:
    op: str
    impl: str
    rows: int
    vocab: int
    logits: str
    top_k: int
    median_us: Optional[float] = None
    graph_us: Optional[float] = None
    gbps: Optional[float] = None
    x_floor: Optional[float] = None
    calls: int = 0
    calls_differing: Optional[int] = None
    rows_differing: Optional[int] = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def make_logits(rows: int, vocab: int, logits: str, device, seed: int = 0) -> torch.Tensor:
    """float64 logits: N(0, 1) (flat) or N(0, 1) * 5 (peaky), seeded."""
    scale = {"flat": 1.0, "peaky": 5.0}[logits]
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, device=device, dtype=torch.float32).double() * scale


def make_probs(rows: int, vocab: int, logits: str, device, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    z = make_logits(rows, vocab, logits, device, seed)
    return torch.softmax(z, dim=-1).to(dtype).contiguous()


def graph_or_none(fn: Callable[[], object], iters: int) -> Optional[float]:
    return time_graph(fn, iters, strict=False)


def repeat_differences(fn: Callable[[], torch.Tensor], calls: int) -> tuple[int, int]:
    """(calls whose output differs from the first call's bits, rows differing in any call)."""
    first = fn().clone()
    calls_diff = 0
    rows_diff = torch.zeros(first.shape[0], dtype=torch.bool, device=first.device)
    for _ in range(calls - 1):
        out = fn()
        differs = (bits(out) != bits(first)).any(dim=1)
        rows_diff |= differs
        calls_diff += int(differs.any())
    return calls_diff, int(rows_diff.sum())


def flashinfer_sampling():
    try:
        import flashinfer.sampling as fs  # noqa: F401

        return fs
    except Exception:  # noqa: BLE001 - missing, or built for another GPU
        return None


def implementation(op: str, impl: str, top_k, top_p: float, min_p: float, fs) -> Optional[Callable]:
    """fn(probs) -> renormed probs, or None where the implementation has no such op."""
    if impl == "tpguard":
        from tpguard.kernels import renorm as tk

        return {
            "top_p": lambda x: tk.top_p_renorm(x, top_p, validate=False),
            "top_k": lambda x: tk.top_k_renorm(x, top_k, validate=False),
            "top_k_top_p": lambda x: tk.top_k_top_p_renorm(x, top_k, top_p, validate=False),
            "min_p": lambda x: tk.min_p_renorm(x, min_p, validate=False),
        }[op]
    if impl == "torch":
        from tpguard.kernels import reference as ref

        return {
            "top_p": lambda x: ref.top_p_renorm_reference(x, top_p),
            "top_k": lambda x: ref.top_k_renorm_reference(x, top_k),
            "top_k_top_p": lambda x: ref.top_k_top_p_renorm_reference(x, top_k, top_p),
            "min_p": lambda x: ref.min_p_renorm_reference(x, min_p),
        }[op]
    if fs is None or op == "min_p":  # flashinfer has no min-p renorm (only min-p sampling)
        return None
    det = impl == "flashinfer-det"
    return {
        "top_p": lambda x: fs.top_p_renorm_probs(x, top_p, is_deterministic=det),
        "top_k": lambda x: fs.top_k_renorm_probs(x, top_k, is_deterministic=det),
        "top_k_top_p": lambda x: fs.top_p_renorm_probs(
            fs.top_k_renorm_probs(x, top_k, is_deterministic=det), top_p, is_deterministic=det),
    }[op]


def measure(op, impl, x, top_k, top_p, min_p, fs, iters, repeats, floor_us, graphs, logits) -> Cell:
    rows, vocab = x.shape
    cell = Cell(op=op, impl=impl, rows=rows, vocab=vocab, logits=logits, top_k=int(top_k))
    fn = implementation(op, impl, top_k, top_p, min_p, fs)
    if fn is None:
        cell.note = "n/a" if fs is not None or impl == "torch" else "flashinfer not installed"
        return cell
    try:
        it = max(3, iters // 5) if impl == "torch" else iters
        cell.median_us = time_events(lambda: fn(x), it)
        if graphs and impl != "torch":
            cell.graph_us = graph_or_none(lambda: fn(x), iters)
        n = max(2, repeats // 5) if impl == "torch" else repeats
        cell.calls = n
        cell.calls_differing, cell.rows_differing = repeat_differences(lambda: fn(x), n)
    except Exception as e:  # noqa: BLE001 - report and go on with the other cells
        cell.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        torch.cuda.synchronize()
        return cell
    moved = 2 * x.numel() * x.element_size()
    cell.gbps = moved / (cell.median_us * 1e-6) / 1e9
    cell.x_floor = cell.median_us / floor_us
    return cell


def copy_floor_us(x: torch.Tensor, iters: int) -> float:
    out = torch.empty_like(x)
    return time_events(lambda: out.copy_(x), iters)


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_cells(title: str, cells: list[Cell], key_cols: Sequence[str]) -> None:
    print(f"\n### {title}\n")
    head = list(key_cols) + ["impl", "median us", "graph us", "GB/s", "x floor", "calls differing", "note"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for c in cells:
        keys = [str(getattr(c, k)) for k in key_cols]
        diff = "-" if c.calls_differing is None else f"{c.calls_differing}/{c.calls - 1}"
        baseline = BASELINE_TABLE_US.get((c.op, c.impl, c.vocab, c.logits)) if c.rows == 256 and c.top_k == 40 else None
        note = c.note + (f" (baseline: {baseline} us)" if baseline else "")
        print("| " + " | ".join(keys + [c.impl, fmt(c.median_us, ".0f"), fmt(c.graph_us, ".0f"), fmt(c.gbps, ".0f"),
                                        fmt(c.x_floor, ".2f"), diff, note]) + " |")


def run(rows=256, vocabs=(128256, 163840), logits=("flat", "peaky"), iters=50, repeats=200, top_p=0.9,
        top_k=40, min_p=0.1, batch_sizes=(1, 8, 64), top_ks=(40, 256, 1024), impls=IMPLS, ops=OPS,
        graphs=False, json_path=None, seed=0, device="cuda") -> list[Cell]:
    """Measure and print every table; returns the cells (also written to json_path)."""
    fs = flashinfer_sampling() if any(i.startswith("flashinfer") for i in impls) else None
    print(f"# tpguard bench kernels: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"flashinfer {getattr(sys.modules.get('flashinfer'), '__version__', 'not installed')}")
    print(f"# top_p={top_p} top_k={top_k} min_p={min_p}, median of {iters} calls (CUDA events), "
          f"determinism over {repeats} calls on one input")
    if "tpguard" in impls:
        from tpguard.config import renorm_graph_rows
        from tpguard.kernels import renorm_graph
        from tpguard.kernels.renorm_config import default_config

        print(f"# tpguard block shapes: {default_config()}")
        print(f"# tpguard eager calls of <= {renorm_graph_rows()} rows and >= {renorm_graph.GRAPH_MIN_LAUNCHES} "
              "launches replay their plan's graph (TPGUARD_RENORM_GRAPH_ROWS; 0: none)")
    cells: list[Cell] = []
    floors = {}
    main_cells = []
    for vocab in vocabs:
        for kind in logits:
            x = make_probs(rows, vocab, kind, device, seed)
            floors[(rows, vocab)] = floor = copy_floor_us(x, iters)
            for op in ops:
                for impl in impls:
                    c = measure(op, impl, x, top_k, top_p, min_p, fs, iters, repeats, floor, graphs, kind)
                    main_cells.append(c)
            del x
    print("\ncopy floor (read + write, us): " + ", ".join(f"{r}x{v}: {f:.0f}" for (r, v), f in floors.items()))
    print_cells(f"{rows} rows", main_cells, ("op", "vocab", "logits"))
    cells += main_cells

    vocab = max(vocabs)
    bs_cells = []
    for b in batch_sizes:
        x = make_probs(b, vocab, "flat", device, seed)
        floor = copy_floor_us(x, iters)
        for op in ops:
            for impl in impls:
                if impl == "torch":
                    continue
                bs_cells.append(measure(op, impl, x, top_k, top_p, min_p, fs, iters, min(repeats, 50), floor,
                                        True, "flat"))
    print_cells(f"batch sizes, vocab {vocab}, flat logits (graph us: one call replayed from a CUDA graph)",
                bs_cells, ("op", "rows"))
    cells += bs_cells

    k_cells = []
    x = make_probs(rows, vocab, "flat", device, seed)
    floor = floors.get((rows, vocab)) or copy_floor_us(x, iters)
    for k in top_ks:
        for op in ("top_k", "top_k_top_p"):
            if op not in ops:
                continue
            for impl in impls:
                if impl == "torch":
                    continue
                k_cells.append(measure(op, impl, x, k, top_p, min_p, fs, iters, min(repeats, 50), floor, graphs,
                                       "flat"))
    print_cells(f"top_k sweep, {rows} x {vocab}, flat logits", k_cells, ("op", "top_k"))
    cells += k_cells

    summary = []
    for op, target in TARGETS_US.items():
        ours = [c for c in main_cells if c.op == op and c.impl == "tpguard" and c.vocab == 163840 and c.logits == "flat"]
        if ours and ours[0].median_us is not None:
            c = ours[0]  # GPU time from a graph replay when measured; an eager call can be host-bound
            got = f"{c.graph_us:.0f} us graph, {c.median_us:.0f} us eager" if c.graph_us is not None \
                else f"{c.median_us:.0f} us eager"
            summary.append(f"{op}: {got} (target <= {target} us)")
    if summary:
        print("\ntargets at 256 x 163840 flat: " + "; ".join(summary))
    if "tpguard" in impls:
        from tpguard.kernels import direct_launch

        # what the eager tpguard cells ran through (a refused direct launch or plan graph shows here)
        print(f"direct launches by launcher: {direct_launch.LAUNCHERS}; refused: {direct_launch.FAILURES or 'none'}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"floors_us": {f"{r}x{v}": t for (r, v), t in floors.items()},
                       "cells": [asdict(c) for c in cells]}, f, indent=1)
    return cells


GRID_ROWS = (1, 8, 64, 256, 1024)
GRID_VOCABS = (32000, 128256, 163840, 262144)
GRID_DTYPES = ("fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GRID_OPS = ("top_p", "top_k", "top_k_top_p")
TOP_P_TARGET_US = 200  # top-p, 256 x 163840 flat float32


def _batched_us(fn: Callable[[], object], iters: int) -> Optional[float]:
    try:
        return time_batched(fn, iters, rounds=3, warmup=2)
    except Exception as e:  # noqa: BLE001 - one failing cell must not end the grid
        print(f"  (error: {type(e).__name__}: {str(e).splitlines()[0][:100]})")
        torch.cuda.synchronize()
        return None


def _differing(fn: Callable[[], torch.Tensor], repeats: int) -> Optional[int]:
    if repeats < 2:
        return None
    try:
        return repeat_differences(fn, repeats)[0]
    except Exception:  # noqa: BLE001
        return None


def _ratio(ours: Optional[float], theirs: Optional[float]) -> str:
    if ours is None or theirs is None:
        return "-"
    return f"{theirs / ours:.2f}x" + ("" if ours < theirs else " SLOWER")


def grid(grid_rows=GRID_ROWS, vocabs=GRID_VOCABS, logits=("flat", "peaky"), dtypes=GRID_DTYPES, iters=50,
         repeats=10, top_p=0.9, top_k=40, temperature=0.8, fused=True, json_path=None, seed=0,
         device="cuda") -> list[dict]:
    """The full grid, tpguard vs flashinfer's default side by side (module doc); returns the rows."""
    from tpguard.kernels import renorm as tk
    from tpguard.kernels.target_probs import target_probs

    fs = flashinfer_sampling()
    print(f"# tpguard bench kernels --grid: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"flashinfer {getattr(sys.modules.get('flashinfer'), '__version__', 'not installed')}")
    print(f"# top_p={top_p} top_k={top_k}; us per call: median of 3 batches of {iters} back-to-back calls; "
          f"'differ': calls of {repeats} whose bits differ from the first call's")
    ours = {"top_p": lambda x: tk.top_p_renorm(x, top_p, validate=False),
            "top_k": lambda x: tk.top_k_renorm(x, top_k, validate=False),
            "top_k_top_p": lambda x: tk.top_k_top_p_renorm(x, top_k, top_p, validate=False)}
    theirs = {} if fs is None else {
        "top_p": lambda x: fs.top_p_renorm_probs(x, top_p),
        "top_k": lambda x: fs.top_k_renorm_probs(x, top_k),
        "top_k_top_p": lambda x: fs.top_p_renorm_probs(fs.top_k_renorm_probs(x, top_k), top_p)}
    results, fused_rows = [], []
    for dname in dtypes:
        dtype = DTYPES[dname]
        print(f"\n### renorms, {dname} probabilities (tpguard | flashinfer default | flashinfer / tpguard)\n")
        head = ["rows", "vocab", "logits"] + [f"{op} {c}" for op in GRID_OPS for c in ("tpguard", "flashinfer", "ratio")]
        head += ["differ (tpguard / flashinfer)"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for vocab in vocabs:
            for rows in grid_rows:
                for kind in logits:
                    x = make_probs(rows, vocab, kind, device, seed, dtype)
                    row = {"dtype": dname, "rows": rows, "vocab": vocab, "logits": kind}
                    cells, diffs = [], []
                    for op in GRID_OPS:
                        a = _batched_us(lambda: ours[op](x), iters)
                        b = _batched_us(lambda: theirs[op](x), iters) if op in theirs else None
                        row[f"{op}_tpguard_us"], row[f"{op}_flashinfer_us"] = a, b
                        cells += [fmt(a, ".0f"), fmt(b, ".0f"), _ratio(a, b)]
                        da = _differing(lambda: ours[op](x), repeats)
                        db = _differing(lambda: theirs[op](x), repeats) if op in theirs else None
                        row[f"{op}_differ"] = (da, db)
                        diffs.append(f"{fmt(da, 'd')}/{fmt(db, 'd')}")
                    print("| " + " | ".join([str(rows), str(vocab), kind] + cells + [" ".join(diffs)]) + " |",
                          flush=True)
                    results.append(row)
                    if fused:
                        fused_rows.append(_fused_cell(make_logits(rows, vocab, kind, device, seed).to(dtype), dname,
                                                      kind, temperature, top_k, top_p, iters, fs, target_probs, tk))
                    del x
    if fused_rows:
        print("\n### logits -> target probs (temperature, softmax, top-k, top-p): tpguard fused | softmax + tpguard "
              "renorms | softmax + flashinfer renorms (SGLang's default)\n")
        print("| dtype | rows | vocab | logits | fused us | softmax + tpguard us | softmax + flashinfer us | "
              "vs tpguard | vs flashinfer |")
        print("|---|---|---|---|---|---|---|---|---|")
        for f in fused_rows:
            print(f"| {f['dtype']} | {f['rows']} | {f['vocab']} | {f['logits']} | {fmt(f['fused_us'], '.0f')} | "
                  f"{fmt(f['tpguard_us'], '.0f')} | {fmt(f['flashinfer_us'], '.0f')} | "
                  f"{_ratio(f['fused_us'], f['tpguard_us'])} | {_ratio(f['fused_us'], f['flashinfer_us'])} |")
    slower = [r for r in results for op in GRID_OPS
              if r.get(f"{op}_tpguard_us") is not None and r.get(f"{op}_flashinfer_us") is not None
              and r[f"{op}_tpguard_us"] >= r[f"{op}_flashinfer_us"]]
    print(f"\ncells where tpguard is not faster than flashinfer's default: {len(slower)}")
    target = [r for r in results if r["rows"] == 256 and r["vocab"] == 163840 and r["logits"] == "flat"
              and r["dtype"] == "fp32" and r.get("top_p_tpguard_us") is not None]
    if target:
        print(f"top-p 256 x 163840 flat fp32: {target[0]['top_p_tpguard_us']:.0f} us (target <= {TOP_P_TARGET_US})")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"renorms": results, "target_probs": fused_rows}, f, indent=1)
    return results + fused_rows


def config_table(configs: Sequence[str], grid_rows=GRID_ROWS, vocabs=(32000,), logits=("flat", "peaky"),
                 dtypes=GRID_DTYPES, ops=("top_p",), iters=30, top_p=0.9, top_k=40, min_p=0.1, seed=0,
                 device="cuda") -> list[dict]:
    """us from a CUDA graph of tpguard's `ops` under each config override of `configs`, side by side,
    outputs compared bit for bit with the first config's (module doc, ``--configs``)."""
    from tpguard.config import replace_from_text
    from tpguard.kernels import renorm_plan
    from tpguard.kernels.renorm_config import RenormConfig

    cfgs = [replace_from_text(RenormConfig(), text, "--configs") for text in configs]
    params = {"top_p": (None, top_p), "top_k": (top_k, None), "top_k_top_p": (top_k, top_p), "min_p": (None, min_p)}
    names = [text or "defaults" for text in configs]
    print(f"# tpguard bench kernels --configs: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; "
          f"us of one call replayed from a CUDA graph (median of {iters}); '!': bits differ from the first config's\n")
    head = ["op", "dtype", "rows", "vocab", "logits"] + names
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    results = []
    for op in ops:
        k, p = params[op]
        for dname in dtypes:
            for vocab in vocabs:
                for rows in grid_rows:
                    for kind in logits:
                        x = make_probs(rows, vocab, kind, device, seed, DTYPES[dname])
                        first, cells, row = None, [], {"op": op, "dtype": dname, "rows": rows, "vocab": vocab,
                                                       "logits": kind, "us": {}}
                        for name, cfg in zip(names, cfgs):
                            def call(cfg=cfg):
                                return renorm_plan.run(op, x, k, p, cfg)

                            out = bits(call())
                            same = first is None or torch.equal(out, first)
                            first = out if first is None else first
                            us = graph_or_none(call, iters)
                            row["us"][name] = us
                            row.setdefault("differ", []).append(not same)
                            cells.append(fmt(us, ".1f") + ("" if same else " !"))
                        print("| " + " | ".join([op, dname, str(rows), str(vocab), kind] + cells) + " |", flush=True)
                        results.append(row)
                        del x
    return results


def _fused_cell(logits, dname, kind, temperature, top_k, top_p, iters, fs, target_probs, tk) -> dict:
    rows, vocab = logits.shape
    t = torch.full((rows,), temperature, device=logits.device)

    def softmax():
        return torch.softmax(logits.float() / t[:, None], dim=-1)

    cell = {"dtype": dname, "rows": rows, "vocab": vocab, "logits": kind}
    cell["fused_us"] = _batched_us(lambda: target_probs(logits, t, top_k, top_p, validate=False), iters)
    cell["tpguard_us"] = _batched_us(lambda: tk.top_k_top_p_renorm(softmax(), top_k, top_p, validate=False), iters)
    cell["flashinfer_us"] = None if fs is None else _batched_us(
        lambda: fs.top_p_renorm_probs(fs.top_k_renorm_probs(softmax(), top_k), top_p), iters)
    return cell


def run_options(*, quick: bool, grid: bool, grid_rows: tuple | None, dtypes: tuple | None, no_fused: bool,
                vocabs: tuple | None, repeats: int | None, impls: tuple | None, ops: tuple | None, **opts) -> dict:
    """What `main` runs, from `tpguard bench kernels`'s options (declared in tpguard/cli.py): --quick
    cuts iterations and repeats; --grid has its own defaults for vocabs and repeats not given (None)."""
    if opts.get("configs") is not None:
        return {"configs": opts["configs"], "grid_rows": grid_rows if grid_rows is not None else GRID_ROWS,
                "vocabs": vocabs if vocabs is not None else (32000,), "logits": opts["logits"],
                "dtypes": dtypes if dtypes is not None else GRID_DTYPES, "ops": ops if ops is not None else ("top_p",),
                "iters": 10 if quick else opts["iters"], "top_p": opts["top_p"], "top_k": opts["top_k"],
                "min_p": opts["min_p"]}
    opts.pop("configs", None)
    given_repeats = repeats is not None
    opts["repeats"] = 200 if repeats is None else repeats
    if quick:
        opts["iters"], opts["repeats"] = 10, 20
    if grid:
        if ops is not None:  # the grid's tables have one column set per op: all three, always
            return {"grid": True, "refused": "--ops does not apply to --grid (it times top_p, top_k and top_k_top_p)"}
        return {"grid": True, "grid_rows": grid_rows if grid_rows is not None else GRID_ROWS,
                "dtypes": dtypes if dtypes is not None else GRID_DTYPES,
                "logits": opts["logits"], "vocabs": vocabs if vocabs is not None else GRID_VOCABS,
                "iters": opts["iters"], "repeats": opts["repeats"] if given_repeats else 10,
                "top_p": opts["top_p"], "top_k": opts["top_k"], "fused": not no_fused, "json_path": opts["json_path"]}
    return {**opts, "vocabs": vocabs if vocabs is not None else (128256, 163840),
            "impls": impls if impls is not None else IMPLS, "ops": ops if ops is not None else OPS}


def bad_argument(opts: dict) -> str | None:
    """The first unknown implementation, op or dtype, count below 1, or bad ``--configs`` override (an
    unknown field or a value the kernels refuse), of `run_options`'s result, as one line; None if there
    is none."""
    from tpguard.config import replace_from_text
    from tpguard.kernels.renorm_config import RenormConfig
    from tpguard.kernels.renorm_workspace import shapes_for

    if opts.get("refused"):
        return opts["refused"]
    for name, known, given in (("implementation", IMPLS, opts.get("impls", ())), ("op", OPS, opts.get("ops", ())),
                               ("dtype", tuple(DTYPES), opts.get("dtypes", ()))):
        bad = [v for v in given if v not in known]
        if bad:
            return f"unknown {name} {bad[0]!r} (known: {', '.join(known)})"
    for name in ("rows", "iters", "vocabs", "grid_rows", "batch_sizes", "top_ks"):  # ints or tuples of ints
        given = opts.get(name)
        bad = [v for v in (given if isinstance(given, (tuple, list)) else [given]) if v is not None and v < 1]
        if bad:
            return f"--{name.replace('_', '-')} must be >= 1, got {bad[0]}"
    try:
        for text in opts.get("configs") or ():
            shapes_for(1, 4096, replace_from_text(RenormConfig(), text, "--configs"))
    except ValueError as e:
        return str(e)
    return None


def main(**opts) -> int:
    """Run what `run_options` gives (`tpguard bench kernels`); returns an exit code."""
    bad = bad_argument(opts)  # one line, with or without a GPU
    if bad:
        print(f"tpguard bench kernels: {bad}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("tpguard bench kernels: no CUDA device here; the kernels are timed on GPUs only "
              "(tests check them on CPU under TRITON_INTERPRET=1).")
        return 0
    if opts.pop("host_profile", False):
        host_profile(opts.get("vocabs", (163840,))[-1], opts.get("iters", 50))
        return 0
    if opts.get("configs") is not None:
        config_table(**opts)
        return 0
    if opts.pop("grid", False):
        grid(**opts)
        return 0
    run(**opts)
    return 0


def host_profile(vocab: int, iters: int) -> None:
    """Host time per eager call (no sync in the loop) of each tpguard op at 1 row, then a cProfile of
    the top-p calls: small batches run eagerly are host-bound (docs/benchmarks.md)."""
    import cProfile
    import pstats

    from tpguard.bench.timing import time_host
    from tpguard.kernels import renorm

    probs = torch.softmax(torch.randn(1, vocab, device="cuda"), -1)
    calls = {"top_p": lambda: renorm.top_p_renorm(probs, 0.9),
             "top_k": lambda: renorm.top_k_renorm(probs, 40),
             "top_k_top_p": lambda: renorm.top_k_top_p_renorm(probs, 40, 0.9),
             "min_p": lambda: renorm.min_p_renorm(probs, 0.1)}
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        print(f"host time per eager call, 1 x {vocab}: {name} {time_host(fn, iters):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        calls["top_p"]()
    prof.disable()
    torch.cuda.synchronize()
    print(f"cProfile of {iters} eager top_p calls:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    from tpguard.cli import main as cli_main

    sys.exit(cli_main(["bench", "kernels", *sys.argv[1:]]))
