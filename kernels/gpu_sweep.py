"""Block-shape sweep and per-pass timing of the renorm kernels on one GPU (run by gpu_check.sh).

For each RenormConfig variant: the GPU time of top-p (flat, peaky), top-k(40), top-k(1024),
top-k + top-p and min-p on 256 x 163840 float32, as the median replay of one call captured in a
CUDA graph (``us``: no host overhead, so variants compare on the GPU alone; the eager median is
kept as ``eager_us``), whether the kept set equals the torch reference's and whether the output
equals the default config's bit for bit. First, for the --breakdown variants (default),
each pass's GPU time: every launch of one call re-launched 10 times inside a CUDA graph (the
passes are idempotent), so the breakdown carries no launch gaps. Prints a table; --json writes all (after every variant). All variants with their
compiles take ~4 minutes: --budget 240 under a 300 s timeout (kernels/NOTES.md, run 4).

Usage: python -P kernels/gpu_sweep.py [--rows 256] [--vocab 163840] [--iters 30] [--budget S] [--json PATH]
       [--variants a,b] [--breakdown a,b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager

import torch

from tpguard.bench.timing import time_events, time_graph
import triton

from tpguard.kernels import renorm_min_p, renorm_passes, renorm_top_k, renorm_top_p
from tpguard.kernels import reference as ref
from tpguard.kernels.renorm_passes import DEFAULT_CONFIG

VARIANTS = {  # in order of interest: the time budget cuts the list short (kernels/NOTES.md, run 4)
    "default": {},  # bracket_copy=2 since run 9, bracket_bins=8 since run 10, tps_shared=1 since run 11, tps_split=1 since run 19
    # session 7 (kernels/pdl.py): programmatic dependent launches between a call's passes (pdl=1 the default
    # since run 24, from 128 rows); 0 = run 23's plain launches, 2 = the per-row kernels signal at their end
    "pdl0": {"pdl": 0},
    "pdl2": {"pdl": 2},
    # session 5 (kernels/NOTES.md, "Top-p select: padded rounds split (session 5)"): run 18's default, the
    # sample bracket's 5120 samples as one padded 8192 block (run 19: select 46.6 vs 37.7 us split)
    "tps_split0": {"tps_split": 0},
    # session 6 (kernels/NOTES.md, "Bracket misses near tau (session 6)"): hi = tau when fewer than this many
    # samples lie in [hi, tau); 0 = run 19's rule (top_p_mid: logits N(0, 1) x 4, where ~3% of the rows missed)
    "hi0": {"bracket_hi_samples": 0},
    "hi32": {"bracket_hi_samples": 32},
    # session 6: the bracket pass's register cap apart from bracket_select's (more CTAs per SM)
    # (80 the default since run 20: top-p flat 330 -> 316 us; 96: 320, 64: 320)
    "bpass0": {"bracket_pass_maxnreg": 0},  # run 19's: the pass at bracket_maxnreg (128)
    "bpass_r72": {"bracket_pass_maxnreg": 72},
    "bpass_r88": {"bracket_pass_maxnreg": 88},
    "bsel_w16": {"bracket_warps": 16},  # run 20's bracket_select: 1 CTA per SM (two waves of 256 rows); 8 since run 21
    "bchunk8k_w8": {"bracket_chunk": 8192, "bracket_pass_warps": 8},
    # session 4 (kernels/NOTES.md, "Top-p select rounds (session 4)"): while the bracket's lo and hi
    # searches agree, one 6-sum reduction per round instead of 12
    "tps0": {"tps_shared": 0},  # run 11's default (the two bracket searches apart)
    # session 4 (kernels/NOTES.md, "Sub-bracket bins (session 4)"): the bracket pass sums its entries'
    # mass per 1/B of [lo, hi); bracket_select searches only the sub-bracket holding the cutoff
    "bins0": {"bracket_bins": 0},  # run 10's default (before the bins)
    "bins16": {"bracket_bins": 16},
    "bins4": {"bracket_bins": 4},
    "bcopy_scan": {"bracket_copy": 0},  # run 9's default (the copy-out through shared memory)
    # run 3's kernels' resource shape: no register caps (Triton 3.6 gave the top-p select 181 and the
    # bracket pass 129 registers: 1 CTA per SM), tau list compacted before M(>= tau) is known
    "run3_regs": {"select_maxnreg": 0, "bracket_maxnreg": 0, "tau_mass_first": 0, "bracket_reg": 8192},
    "bchunk4k_w4": {"bracket_chunk": 4096, "bracket_pass_warps": 4},  # 4 CTAs per SM in the bracket pass
    "bracket_reg8k": {"bracket_reg": 8192},  # run 3's: flat rows' 10-14k bracket entries stream
    "bprefetch": {"bracket_prefetch": 1},  # bracket chunk load not behind the plan load
    "bsel_w8": {"bracket_warps": 8, "bracket_reg": 8192},  # bracket_select 2 CTAs/SM (1 wave), >8k entries stream
    "bchunk4k_bsel_w8": {"bracket_chunk": 4096, "bracket_pass_warps": 4, "bracket_warps": 8, "bracket_reg": 8192},
    "bracket_w32": {"bracket_warps": 32, "bracket_reg": 16384},
    "tau256": {"tau_groups": 256},
    "no_caps": {"select_maxnreg": 0, "bracket_maxnreg": 0},
    "chunk4k_w4": {"chunk": 4096, "pass_warps": 4},  # every streaming pass at 4 warps x 4096 entries
}


def probs(rows, vocab, scale, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g, device="cuda").double() * scale
    return torch.softmax(z, dim=-1).float().contiguous()


def graph_us(fn, iters, per_replay=1):
    """Median GPU us of fn replayed from a CUDA graph; None when capture fails."""
    return time_graph(fn, iters, per_replay=per_replay, strict=False)


def ops_for(cfg, flat, peaky, mid):
    return {
        "top_p_flat": (lambda: renorm_top_p.top_p_renorm_triton(flat, 0.9, config=cfg),
                       lambda: ref.top_p_renorm_reference(flat, 0.9)),
        "top_p_peaky": (lambda: renorm_top_p.top_p_renorm_triton(peaky, 0.9, config=cfg),
                        lambda: ref.top_p_renorm_reference(peaky, 0.9)),
        "top_p_mid": (lambda: renorm_top_p.top_p_renorm_triton(mid, 0.9, config=cfg),
                      lambda: ref.top_p_renorm_reference(mid, 0.9)),
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


RENORM_KERNELS = [(renorm_passes, "_row_stats_kernel"), (renorm_passes, "_bracket_kernel"),
                  (renorm_passes, "_bracket_select_kernel"), (renorm_passes, "_renorm_write_kernel"),
                  (renorm_top_p, "_top_p_select_kernel"), (renorm_top_k, "_top_k_select_kernel"),
                  (renorm_min_p, "_min_p_select_kernel")]


@contextmanager
def recording(log, kernels=None):
    """Record every launch of the given (module, kernel name) pairs (default: the renorm passes) as
    (name, relaunch closure)."""
    patched = []

    def wrap(mod, name):
        kernel = getattr(mod, name)

        class Recorded:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def run(*args, **kwargs):
                    log.append((name, lambda: launch(*args, **kwargs)))
                    return launch(*args, **kwargs)

                return run

        setattr(mod, name, Recorded())
        patched.append((mod, name, kernel))

    for mod, name in kernels or RENORM_KERNELS:
        wrap(mod, name)
    try:
        yield
    finally:
        for mod, name, kernel in patched:
            setattr(mod, name, kernel)


def breakdown(fn, iters):
    """GPU us per pass: each launch of one call replayed 10 times from a CUDA graph."""
    fn()
    log = []
    with recording(log):
        fn()
    torch.cuda.synchronize()
    per = {}
    for name, relaunch in log:
        us = graph_us(relaunch, iters, per_replay=10)
        per[name.strip("_").replace("_kernel", "")] = us
    return per


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; no new variant starts after it")
    ap.add_argument("--breakdown", default="default", help="variants whose per-pass times are measured")
    a = ap.parse_args(argv)
    start = time.time()
    flat = probs(a.rows, a.vocab, 1.0)
    peaky = probs(a.rows, a.vocab, 5.0, seed=1)
    mid = probs(a.rows, a.vocab, 4.0, seed=2)  # kept sets of a few hundred, cutoffs near tau
    out = torch.empty_like(flat)
    floor = time_events(lambda: out.copy_(flat), a.iters)
    print(f"# {torch.cuda.get_device_name()} {a.rows}x{a.vocab} fp32; copy floor {floor:.1f} us; "
          f"torch {torch.__version__}, triton {triton.__version__}; {DEFAULT_CONFIG}", flush=True)
    print("# variants: graph-replay us / eager us per op", flush=True)
    expected = {name: r() for name, (_, r) in ops_for(DEFAULT_CONFIG, flat, peaky, mid).items()}
    results = {"floor_us": floor, "variants": {}, "breakdown": {}, "configs": VARIANTS}
    baseline = {}
    unknown = [v for v in a.variants.split(",") + a.breakdown.split(",") if v and v not in VARIANTS]
    if unknown:  # (e.g. an old run's variant, renamed or made the default since)
        print(f"# unknown variants skipped: {', '.join(unknown)}", flush=True)
    for bname in (b for b in a.breakdown.split(",") if b in VARIANTS):
        bcfg = DEFAULT_CONFIG.replace(**VARIANTS[bname])
        for name, (fn, _) in ops_for(bcfg, flat, peaky, mid).items():
            key = name if bname == "default" else f"{bname}/{name}"
            try:
                results["breakdown"][key] = bd = breakdown(fn, a.iters)
                print(f"passes {key:28s} " + " ".join(f"{k}={v:.1f}" if v is not None else f"{k}=?"
                                                      for k, v in bd.items())
                      + f" sum={sum(v for v in bd.values() if v is not None):.1f}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"passes {key}: {type(e).__name__}: {e}", flush=True)
    for vname in (v for v in a.variants.split(",") if v in VARIANTS):
        if time.time() - start > a.budget:
            print(f"{vname:16s} skipped (time budget)", flush=True)
            continue
        cfg = DEFAULT_CONFIG.replace(**VARIANTS[vname])
        row = {}
        t0 = time.time()
        for name, (fn, _) in ops_for(cfg, flat, peaky, mid).items():
            try:
                res = fn()
                same_kept, gap = check(res, expected[name])
                if vname == "default":
                    baseline[name] = res
                same_bits = bool(torch.equal(res.view(torch.int32), baseline[name].view(torch.int32))) \
                    if name in baseline else None
                if not torch.equal(torch.isnan(res), torch.isnan(expected[name])):
                    same_kept = False
                eager = time_events(fn, a.iters)
                gpu = graph_us(fn, a.iters)
                row[name] = {"us": gpu if gpu is not None else eager, "eager_us": eager,
                             "graph": gpu is not None, "same_kept_as_reference": same_kept,
                             "max_ulp_vs_reference": gap, "bits_equal_default": same_bits}
            except Exception as e:  # noqa: BLE001 - report and continue with the others
                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        results["variants"][vname] = row
        cells = " ".join(f"{k}={v['us']:.0f}/{v['eager_us']:.0f}" + ("" if v["same_kept_as_reference"] else "!KEPT")
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
