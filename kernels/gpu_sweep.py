"""Block-shape sweep and per-pass timing of the renorm kernels on one GPU (run by gpu_check.sh).

For each RenormConfig variant: median us of top-p (flat, peaky), top-k(40), top-k + top-p and
min-p on 256 x 163840 float32, and whether the output equals the default config's bit for bit
(the results may only differ where a float64 sum ties at the cutoff). Then, for the default
config, the time of each pass (CUDA events around each launch). Prints a table; --json writes all.

Usage: python -P kernels/gpu_sweep.py [--rows 256] [--vocab 163840] [--iters 30] [--budget S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from tpguard.kernels import renorm_min_p, renorm_passes, renorm_top_k, renorm_top_p
from tpguard.kernels import reference as ref
from tpguard.kernels.renorm_passes import DEFAULT_CONFIG

VARIANTS = {
    "default": {},
    "chunk4096_w4": {"chunk": 4096, "pass_warps": 4},
    "select_w8": {"select_warps": 8, "reg": 2048},
    "bracket_w16": {"bracket_warps": 16, "bracket_reg": 8192},
    "tau512": {"tau_groups": 512},
    "z6": {"z": 6.0},
    "pass_w16": {"pass_warps": 16},
}


def probs(rows, vocab, scale, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g, device="cuda").double() * scale
    return torch.softmax(z, dim=-1).float().contiguous()


def time_us(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    evs = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        evs.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1000 for a, b in evs)


def ops_for(cfg, flat, peaky):
    return {
        "top_p_flat": (lambda: renorm_top_p.top_p_renorm_triton(flat, 0.9, config=cfg),
                       lambda: ref.top_p_renorm_reference(flat, 0.9)),
        "top_p_peaky": (lambda: renorm_top_p.top_p_renorm_triton(peaky, 0.9, config=cfg),
                        lambda: ref.top_p_renorm_reference(peaky, 0.9)),
        "top_k40_flat": (lambda: renorm_top_k.top_k_renorm_triton(flat, 40, config=cfg),
                         lambda: ref.top_k_renorm_reference(flat, 40)),
        "top_k1024_flat": (lambda: renorm_top_k.top_k_renorm_triton(flat, 1024, config=cfg),
                           lambda: ref.top_k_renorm_reference(flat, 1024)),
        "top_k_top_p_flat": (lambda: renorm_top_k.top_k_top_p_renorm_triton(flat, 40, 0.9, config=cfg),
                             lambda: ref.top_k_top_p_renorm_reference(flat, 40, 0.9)),
        "min_p_flat": (lambda: renorm_min_p.min_p_renorm_triton(flat, 0.1, config=cfg),
                       lambda: ref.min_p_renorm_reference(flat, 0.1)),
        "min_p_peaky": (lambda: renorm_min_p.min_p_renorm_triton(peaky, 0.1, config=cfg),
                        lambda: ref.min_p_renorm_reference(peaky, 0.1)),
    }


def check(out, expect):
    """(kept sets equal, max ulp gap) against the reference."""
    same = bool(torch.equal(out > 0, expect > 0))
    gap = int((out.view(torch.int32).long() - expect.view(torch.int32).long()).abs().max())
    return same, gap


@contextmanager
def pass_timer(log):
    """Record CUDA events around every kernel launch of the renorm modules."""
    patched = []

    def wrap(mod, name):
        kernel = getattr(mod, name)

        class Timed:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def run(*args, **kwargs):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    res = launch(*args, **kwargs)
                    b.record()
                    log.append((name, a, b))
                    return res

                return run

        setattr(mod, name, Timed())
        patched.append((mod, name, kernel))

    for mod, name in [(renorm_passes, "_row_stats_kernel"), (renorm_passes, "_bracket_kernel"),
                      (renorm_passes, "_bracket_select_kernel"), (renorm_passes, "_renorm_write_kernel"),
                      (renorm_top_p, "_top_p_select_kernel"), (renorm_top_k, "_top_k_select_kernel"),
                      (renorm_min_p, "_min_p_select_kernel")]:
        wrap(mod, name)
    try:
        yield
    finally:
        for mod, name, kernel in patched:
            setattr(mod, name, kernel)


def breakdown(fn, iters):
    """Median us per pass over iters calls."""
    per = {}
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for _ in range(iters):
        log = []
        with pass_timer(log):
            fn()
        torch.cuda.synchronize()
        for name, a, b in log:
            per.setdefault(name, []).append(a.elapsed_time(b) * 1000)
    return {k: statistics.median(v) for k, v in per.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; no new variant starts after it")
    a = ap.parse_args(argv)
    start = time.time()
    flat = probs(a.rows, a.vocab, 1.0)
    peaky = probs(a.rows, a.vocab, 5.0, seed=1)
    out = torch.empty_like(flat)
    floor = time_us(lambda: out.copy_(flat), a.iters)
    print(f"# {torch.cuda.get_device_name()} {a.rows}x{a.vocab} fp32; copy floor {floor:.1f} us", flush=True)
    expected = {name: r() for name, (_, r) in ops_for(DEFAULT_CONFIG, flat, peaky).items()}
    results = {"floor_us": floor, "variants": {}, "breakdown": {}, "configs": VARIANTS}
    baseline = {}
    for name, (fn, _) in ops_for(DEFAULT_CONFIG, flat, peaky).items():
        try:
            results["breakdown"][name] = bd = breakdown(fn, a.iters)
            print(f"passes {name:18s} " + " ".join(f"{k.strip('_').replace('_kernel', '')}={v:.1f}"
                                                   for k, v in bd.items()), flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"passes {name}: {type(e).__name__}: {e}", flush=True)
    for vname in a.variants.split(","):
        if time.time() - start > a.budget:
            print(f"{vname:16s} skipped (time budget)", flush=True)
            continue
        cfg = DEFAULT_CONFIG.replace(**VARIANTS[vname])
        row = {}
        t0 = time.time()
        for name, (fn, _) in ops_for(cfg, flat, peaky).items():
            try:
                res = fn()
                same_kept, gap = check(res, expected[name])
                if vname == "default":
                    baseline[name] = res
                same_bits = bool(torch.equal(res.view(torch.int32), baseline[name].view(torch.int32))) \
                    if name in baseline else None
                if not torch.equal(torch.isnan(res), torch.isnan(expected[name])):
                    same_kept = False
                us = time_us(fn, a.iters)
                row[name] = {"us": us, "same_kept_as_reference": same_kept, "max_ulp_vs_reference": gap,
                             "bits_equal_default": same_bits}
            except Exception as e:  # noqa: BLE001 - report and continue with the others
                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        results["variants"][vname] = row
        cells = " ".join(f"{k}={v['us']:.0f}" + ("" if v["same_kept_as_reference"] else "!KEPT")
                         + ("" if v["bits_equal_default"] in (True, None) else "~")
                         if "us" in v else f"{k}=ERR" for k, v in row.items())
        print(f"{vname:16s} ({time.time() - t0:4.0f}s) {cells}", flush=True)
        for k, v in row.items():
            if "error" in v:
                print(f"    {k}: {v['error']}", flush=True)
        if a.json:  # after every variant: a run cut short still leaves its results
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
