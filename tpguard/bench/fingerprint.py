"""`tpguard bench fingerprint`: speed of the GPU fingerprint kernels (CUDA events, median).

Prints, per shape: fingerprint / fingerprint_rows time and effective TB/s (tensor bytes / time),
next to torch's read-only floor (``x.sum()``) and a copy (read + write); then the cost of
``fingerprint_many`` for the guard's "decisions" and "full" sets (eager GPU time, host time per
call, and CUDA-graph replay), against one ``fingerprint_device`` call per tensor. Every kernel
result is checked bit for bit against the numpy reference first (``--no-check`` skips it).

Usage: tpguard bench fingerprint [--iters N] [--shapes all|main] [--sweep [--sweep-budget S]] [--no-check]
``--sweep`` times KernelConfig variants (each checked against the reference) and names the best;
the table above it uses the defaults (one tensor: ``SINGLE_TENSOR_CONFIG``; sets: ``default_config()``).
Target: 256 x 163840 fp32 in <= 48 us (>= 3.5 TB/s) on one H200.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

from tpguard.bench.timing import time_batched, time_graph, time_host

MAIN_SHAPE = ((256, 163840), torch.float32)
SHAPES = [
    MAIN_SHAPE,
    ((256, 128256), torch.float32),
    ((64, 163840), torch.float32),
    ((1, 163840), torch.float32),
    ((256, 163840), torch.bfloat16),
    ((8192, 8192), torch.bfloat16),
    ((1 << 24,), torch.int32),  # 16M one-word rows: the many-rows path
    ((4096, 8, 128), torch.float64),
]


def _make(shape, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
    return torch.randint(-(1 << 30), 1 << 30, shape, generator=g, device=device, dtype=torch.int64).to(dtype)


def graph_batched(fn, iters: int) -> float:
    return time_graph(fn, iters, timer=time_batched)


def check(t: torch.Tensor) -> str:
    """Kernel rows and fingerprint vs the numpy reference, bit for bit."""
    from tpguard.kernels import fingerprint as k
    from tpguard.kernels import fingerprint_reference as ref

    rows_ref = ref.fingerprint_rows_reference(t)
    rows = k.fingerprint_rows_triton(t).cpu()
    top = ref.to_unsigned(int(k.fingerprint_triton(t).item()))
    top_ref = ref.combine_rows_reference(rows_ref, t.dtype, tuple(t.shape))
    return "ok" if torch.equal(rows, rows_ref) and top == top_ref else "MISMATCH"


def bench_shapes(shapes, iters: int, do_check: bool) -> list[dict]:
    from tpguard.kernels import fingerprint as k

    results = []
    print(f"{'shape':>20} {'dtype':>9} {'MB':>8} | {'fp us':>8} {'TB/s':>6} {'graph':>8} | "
          f"{'rows us':>8} {'TB/s':>6} | {'sum us':>8} {'TB/s':>6} | {'copy us':>8} | check")
    for shape, dtype in shapes:
        x = _make(shape, dtype, "cuda")
        nbytes = x.numel() * x.element_size()
        status = check(x) if do_check else "skipped"
        t_fp = time_batched(lambda: k.fingerprint_triton(x), iters)
        t_graph = graph_batched(lambda: k.fingerprint_triton(x), iters)
        t_rows = time_batched(lambda: k.fingerprint_rows_triton(x), iters)
        y = torch.empty_like(x)
        flat = x.view(-1)
        t_sum = time_batched(lambda: flat.sum(), iters)  # read-only floor (torch reduction)
        t_copy = time_batched(lambda: y.copy_(x), iters)  # read + write
        row = dict(shape=tuple(shape), dtype=str(dtype).replace("torch.", ""), mb=nbytes / 1e6,
                   fp_us=t_fp, graph_us=t_graph, rows_us=t_rows, sum_us=t_sum, copy_us=t_copy,
                   check=status)
        results.append(row)
        print(f"{str(tuple(shape)):>20} {row['dtype']:>9} {row['mb']:8.1f} | {t_fp:8.1f} "
              f"{nbytes / t_fp / 1e6:6.2f} {t_graph:8.1f} | {t_rows:8.1f} {nbytes / t_rows / 1e6:6.2f} | "
              f"{t_sum:8.1f} {nbytes / t_sum / 1e6:6.2f} | {t_copy:8.1f} | {status}")
        x = y = flat = None  # free the big tensors before the next shape allocates its own
    return results


def bench_lane_loads(iters: int, rounds: int = 5) -> None:
    """The one-tensor call on the main shape with its lane launch through TMA (the default on sm_90+,
    kernels/fingerprint_tma.py) and through ldg loads (lane_tma="off"), in alternating rounds of one
    process: graph replay, eager and host time per call (medians over rounds)."""
    import statistics

    from tpguard.kernels import fingerprint as k
    from tpguard.kernels import fingerprint_tma
    from tpguard.kernels.fingerprint_words import _tile, _words

    (shape, dtype) = MAIN_SHAPE
    x = _make(shape, dtype, "cuda")
    nbytes = x.numel() * x.element_size()
    variants = {"tma": k.SINGLE_TENSOR_CONFIG, "ldg": dataclasses.replace(k.SINGLE_TENSOR_CONFIG, lane_tma="off")}
    w = _words(x)
    br, bn = _tile(w.rows, w.n_words, k.SINGLE_TENSOR_CONFIG)[:2]
    uses_tma = fingerprint_tma.usable(w, br, bn, k.SINGLE_TENSOR_CONFIG)
    want = k.fingerprint_triton(x, config=variants["ldg"])
    same = torch.equal(k.fingerprint_triton(x, config=variants["tma"]), want)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, cfg in variants.items():
            fn = (lambda c: lambda: k.fingerprint_triton(x, config=c))(cfg)
            times.setdefault((name, "graph"), []).append(graph_batched(fn, iters))
            times.setdefault((name, "eager"), []).append(time_batched(fn, iters))
            times.setdefault((name, "host"), []).append(time_host(fn, iters))
    print(f"\nlane loads, {tuple(shape)} {str(dtype).replace('torch.', '')} fingerprint (medians of {rounds} "
          f"alternating rounds; default {'tma' if uses_tma else 'ldg (TMA not usable here)'}; "
          f"same value: {'yes' if same else 'NO'})")
    for name in variants:
        g, e, h = (statistics.median(times[(name, kind)]) for kind in ("graph", "eager", "host"))
        print(f"  {name}: graph {g:6.1f} us ({nbytes / g / 1e6:4.2f} TB/s)  eager {e:6.1f} us  host {h:5.1f} us"
              f"  (graph rounds {' '.join(f'{t:.1f}' for t in times[(name, 'graph')])})")


def guard_sets(device="cuda") -> dict[str, list[torch.Tensor]]:
    decisions = [
        _make((256,), torch.int32, device, 1),  # seq_lens
        _make((256,), torch.int64, device, 2),  # accept_len / bonus
        _make((32, 8), torch.int32, device, 3),  # draft_tokens / accept_index
        torch.randint(0, 256, (16,), dtype=torch.uint8, device=device),  # rng state (16 bytes)
    ]
    full = decisions + [_make((256, 163840), torch.float32, device, 4),  # target_logits
                        _make((256, 163840), torch.float32, device, 5)]  # target_probs
    return {"decisions": decisions, "full": full}


def _set_fast(k, on: bool) -> None:
    """Direct (recorded) launches on/off (TPGUARD_FAST_LAUNCH) for plans built from now on."""
    os.environ["TPGUARD_FAST_LAUNCH"] = "1" if on else "0"
    k.clear_plans()


def bench_many(iters: int, do_check: bool) -> list[str]:
    from tpguard.fingerprint import fingerprint_device
    from tpguard.kernels import fingerprint as k
    from tpguard.kernels.fingerprint_reference import fingerprint_many_reference

    print(f"\n{'set':>10} {'tensors':>7} {'launches':>8} | {'many us':>8} {'graph us':>8} | "
          f"{'host us':>8} {'triton':>8} {'fast':>5} | {'1-by-1 us':>9} {'host us':>8} | check")
    statuses = []
    for name, tensors in guard_sets().items():
        status = "skipped"
        if do_check:
            got = k.fingerprint_many_triton(tensors).cpu()
            status = "ok" if torch.equal(got, fingerprint_many_reference(tensors)) else "MISMATCH"
        plan = k.ManyPlan(tensors)
        plan.run()
        plan.run()  # the second run sets up direct launches
        torch.cuda.synchronize()
        launches, fast = plan.launches, plan.fast_launch
        if do_check and not torch.equal(plan.run().cpu(), fingerprint_many_reference(tensors)):
            status = "MISMATCH (direct launches)"
        t_many = time_batched(lambda: k.fingerprint_many_triton(tensors), iters)
        h_many = time_host(lambda: plan.run(), iters)  # direct launches when fast == "on"
        _set_fast(k, False)
        slow = k.ManyPlan(tensors)
        h_triton = time_host(lambda: slow.run(), iters)  # Triton's kernel[grid](...) launches
        _set_fast(k, True)
        t_graph = graph_batched(lambda: k.fingerprint_many_triton(tensors), iters)
        one_by_one = lambda: [fingerprint_device(t) for t in tensors]  # noqa: E731
        t_each = time_batched(one_by_one, iters)
        h_each = time_host(one_by_one, iters)
        print(f"{name:>10} {len(tensors):7d} {launches:8d} | {t_many:8.1f} {t_graph:8.1f} | "
              f"{h_many:8.1f} {h_triton:8.1f} {fast:>5} | {t_each:9.1f} {h_each:8.1f} | {status}")
        statuses.append(status)
    return statuses


# KernelConfig overrides ("name=value,..." on KernelConfig(), tpguard.config.replace_from_text);
# first: KernelConfig() (fingerprint_many's default; the one-tensor default is the next line). On
# fp/1 (docs/benchmarks.md) the shift masks and the load-pipelining knobs (since removed) were no
# faster than these.
SWEEP_CONFIGS = [
    "",  # 128 regs, 4 CTAs/SM (fp/1: 55.2 us; fp/2: 54.8)
    # fp/2: the single tensor at 54.8 us vs 45.9 per tensor in the full set: 640 programs of
    # [8 rows, 8192 words] on 528 CTA slots (1.2 waves); offline, 16 words/thread uncapped takes 64
    # registers (8 CTAs/SM, one wave)
    "block_words=2048,maxnreg=none", "block_words=2048,maxnreg=none,chunk_words=4096",
    "chunk_words=4096", "chunk_words=2048", "rows_per_tile=4,chunk_words=4096",
    "block_words=2048,maxnreg=none,rows_per_tile=4", "shifts=2", "maxnreg=none",
    "block_words=8192,num_warps=8", "block_words=2048,rows_per_tile=1,chunk_words=16384,num_warps=8",
    # around the best of that sweep (offline registers: 38 -> 12 CTAs/SM; 64 -> 8; 64 -> 8; 80 -> 3)
    "block_words=1024,maxnreg=none", "block_words=2048,maxnreg=none,rows_per_tile=16",
    "block_words=2048,maxnreg=none,chunk_words=16384", "block_words=4096,maxnreg=none,num_warps=8",
]
# fingerprint_many's long rows (the guard's full set: 2 x 168 MB): on top of each base config
MANY_VARIANTS = [dict(many_long="table"), dict(many_long="table", maxnreg=128),
                 dict(many_long="rows"), dict(many_long="rows", maxnreg=128)]
# and these whole configs on the full set (twice the programs of one tensor: the sweep's one-wave
# tile needs half as many chunks there)
FULL_SET_CONFIGS = ["", "block_words=2048,maxnreg=none,chunk_words=16384",
                    "block_words=1024,maxnreg=none,chunk_words=16384", "chunk_words=16384"]


def _checked_us(label: str, matches, run, iters: int) -> float | None:
    """Graph-replay us of `run` if `matches()` (bits against the reference) holds, else None
    after saying why: a variant that does not compile (resources) or does not match."""
    try:
        ok = matches()
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"{label}: ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        return None
    if not ok:
        print(f"{label}: MISMATCH")
        return None
    return graph_batched(run, iters)


def run_sweep(iters: int, budget_s: float = 30.0, configs: list[str] | None = None,
          full_configs: list[str] | None = None) -> None:
    """KernelConfig variants on the main shape (CUDA-graph replay), each checked bit for bit
    against the reference rows first; then the 3 fastest and FULL_SET_CONFIGS on the guard's full set
    (with `configs` given: `full_configs` alone, each as a whole config, if given)."""
    from tpguard.config import replace_from_text
    from tpguard.kernels import fingerprint as k
    from tpguard.kernels import fingerprint_reference as ref

    t0 = time.perf_counter()
    (shape, dtype) = MAIN_SHAPE
    x = _make(shape, dtype, "cuda")
    nbytes = x.numel() * x.element_size()
    rows_ref = ref.fingerprint_rows_reference(x)
    top_ref = ref.combine_rows_reference(rows_ref, x.dtype, tuple(x.shape))
    print(f"\nsweep {shape} {dtype} (graph replay): KernelConfig() overrides -> us TB/s")
    timed = []
    for text in SWEEP_CONFIGS if configs is None else configs:
        if time.perf_counter() - t0 > budget_s:
            print("  (time budget spent: remaining configs skipped)")
            break
        cfg = replace_from_text(k.KernelConfig(), text, "sweep config")
        label = f"  {text or '(default)':<60}"
        us = _checked_us(label, lambda: (
            torch.equal(k.fingerprint_rows_triton(x, config=cfg).cpu(), rows_ref)
            and ref.to_unsigned(int(k.fingerprint_triton(x, config=cfg).item())) == top_ref),
            lambda: k.fingerprint_triton(x, config=cfg), iters)
        if us is None:
            continue
        timed.append((us, cfg))
        print(f"{label}: {us:8.1f} us {nbytes / us / 1e6:5.2f} TB/s")
    if not timed:
        print("sweep: no config matched the reference")
        return
    timed.sort(key=lambda item: item[0])
    print(f"best (main shape): {timed[0][1]} at {timed[0][0]:.1f} us")
    if configs is not None and full_configs is None:
        print(f"(full set not swept with --sweep-configs alone; sweep took {time.perf_counter() - t0:.0f} s)")
        return
    full = guard_sets()["full"]
    want = ref.fingerprint_many_reference(full)
    print("full set (fingerprint_many, graph replay): " + ("the --full-set-configs" if full_configs is not None else
          "the 3 fastest configs and FULL_SET_CONFIGS x long-row variants (many_long, maxnreg)")
          + "; target: <= 88 us (2 x 168 MB at 3.8 TB/s)")
    seen, best_full = set(), None
    if full_configs is not None:
        pairs = [(float("nan"), replace_from_text(k.KernelConfig(), text, "full set config")) for text in full_configs]
    else:
        bases = timed[:3] + [(float("nan"), replace_from_text(k.KernelConfig(), text, "full set config"))
                             for text in FULL_SET_CONFIGS]
        pairs = [(us_main, dataclasses.replace(base, **variant)) for us_main, base in bases
                 for variant in MANY_VARIANTS]
    for us_main, cfg in pairs:
        if time.perf_counter() - t0 > budget_s + 10:
            print("  (time budget spent: remaining full-set configs skipped)")
            break
        if cfg in seen:
            continue
        seen.add(cfg)
        us = _checked_us(f"  {cfg}", lambda: torch.equal(k.fingerprint_many_triton(full, config=cfg).cpu(), want),
                         lambda: k.fingerprint_many_triton(full, config=cfg), iters)
        if us is None:
            continue
        print(f"  {cfg}: {us:8.1f} us (main shape {us_main:.1f} us)")
        if best_full is None or us < best_full[0]:
            best_full = (us, cfg)
    if best_full:
        print(f"best (full set): {best_full[1]} at {best_full[0]:.1f} us")
    print(f"sweep took {time.perf_counter() - t0:.0f} s")


def main(*, iters: int, shapes: str, sweep: bool, sweep_budget: float, sweep_configs: str | None,
         full_set_configs: str | None, check: bool) -> int:
    """`tpguard bench fingerprint` (its options: tpguard/cli.py); returns an exit code."""
    if not torch.cuda.is_available():
        print("tpguard bench fingerprint: CUDA is not available (this benchmark needs a GPU)",
              file=sys.stderr)
        return 2
    from tpguard.config import interpreting
    from tpguard.kernels import fingerprint as k

    if not k.available() or interpreting():
        print("tpguard bench fingerprint: Triton is missing or TRITON_INTERPRET=1 is set",
              file=sys.stderr)
        return 2
    import triton

    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}"
          f" | one tensor {k.SINGLE_TENSOR_CONFIG} | fingerprint_many {k.default_config()}")
    results = bench_shapes(SHAPES if shapes == "all" else [MAIN_SHAPE], iters, check)
    bench_lane_loads(iters)
    many_status = bench_many(iters, check)
    if sweep:
        run_sweep(iters, sweep_budget,
                  None if sweep_configs is None else sweep_configs.split("|"),
                  None if full_set_configs is None else full_set_configs.split("|"))
    main_row = results[0]
    nbytes = main_row["mb"] * 1e6
    best = min(main_row["fp_us"], main_row["graph_us"])
    print(f"\nmain: 256 x 163840 fp32 fingerprint {main_row['fp_us']:.1f} us eager, "
          f"{main_row['graph_us']:.1f} us graph = {nbytes / best / 1e6:.2f} TB/s "
          f"(target <= 48 us, >= 3.5 TB/s)")
    checks = [r["check"] for r in results] + many_status
    return 0 if all(c in ("ok", "skipped") for c in checks) else 1


if __name__ == "__main__":
    from tpguard.cli import main as cli_main

    raise SystemExit(cli_main(["bench", "fingerprint", *sys.argv[1:]]))
