"""Top-p renorm with one read of the batch before the write (Triton; ``RenormConfig.top_p_presample=1``,
off by default until measured). Reference: kernels/reference.py (``top_p_renorm_reference``); the
default pipeline it would replace: renorm_top_p.py; design and the argument for it: docs/kernels.md
("A faster top-p").

The default top-p reads a flat row three times (row stats, bracket pass, write) with two per-row
kernels between them (select: the tau gather and the sample bracket; bracket_select). Its bracket
for the cutoff is estimated from samples the row-stats pass takes; this variant takes the samples
first, from 1/32 of the row, so that the row stats and the bracket's copy-out share one read:

1. ``_presample_kernel`` (one program per row): SB consecutive entries out of every SG * SB (one
   32-byte sector per 1 KB: 1/32 of the bytes, the row-stats samples' rate), and the bracket
   [lo, hi) from them alone: `sample_bracket` with the sampled mass as the whole (a ratio estimate,
   so the unknown row mass cancels), tau = just above the largest sample (entries above it are
   summed exactly, not copied). A miss costs time only: the bracket is verified exactly.
2. ``_stats_bracket_kernel`` (rows x chunks, the one read): the row stats (chunk sums, non-finite
   counts, group maxima: renorm_passes.store_chunk_stats) and the bracket pass's work (mass >= hi,
   the [lo, hi) entries copied out in order, the sub-bracket masses: renorm_passes.bracket_chunk) on
   the same registers.
3. ``_resolve_kernel`` (one program per row): the total, the target p * total, NaN rows, then
   bracket_select's exact search (renorm_passes.bracket_resolve). A bracket below the cutoff (a
   peaky row: the sample misses the few entries that hold the mass) first tries the tau_groups
   groups with the largest maxima, as the default select does; above it, or overflowed: the
   whole row (slow, rare).
4. the write pass.

Same cutoff as the reference and the default pipeline (every search is exact; kept masses are
float64 sums, in practice the same bits); deterministic and batch-invariant: every launch is a
function of one row, with block shapes fixed by the vocabulary.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from tpguard.kernels.pdl import pdl_enter, pdl_exit, pdl_signal, pdl_wait
from tpguard.kernels.radix_select import reciprocal_f32
from tpguard.kernels.renorm_args import fill_fingerprint
from tpguard.kernels.renorm_config import RenormConfig, default_config, pdl_args, reg_cap
from tpguard.kernels.renorm_passes import (
    bins_args,
    bins_window,
    bracket_chunk,
    bracket_resolve,
    copy_mode,
    exact_span,
    store_chunk_stats,
)
from tpguard.kernels.renorm_top_p_select import sample_blocks, sample_bracket
from tpguard.kernels.renorm_workspace import shapes_for, workspace_for
from tpguard.kernels.renorm_write_fp import write_pass

TopP = Union[float, torch.Tensor]


@triton.jit
def _presample_kernel(probs_ptr, vocab, n_samples, gsamp_ptr, plan_ptr, p_ptr, p_val, Z,
                      HAS_P_ARR: tl.constexpr, SG: tl.constexpr, SB: tl.constexpr, NB_BLOCK: tl.constexpr,
                      NS_BLOCK: tl.constexpr, NS_REM: tl.constexpr, TPS_SHARED: tl.constexpr,
                      HI_SAMPLES: tl.constexpr, PDL: tl.constexpr = 0):
    """Pass 1: the row's sample into gsamp and its bracket [lo, hi) into the plan (status 2), or
    status 1 (p >= 1: every entry kept, no bracket)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    if HAS_P_ARR:
        p = tl.load(p_ptr + row)
    else:
        p = p_val
    status = tl.full((), 1, tl.int32)
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32)
    if p < 1.0:
        # block b: SB consecutive entries at a fixed pseudo-random SB-aligned offset of its SG * SB entries
        b = tl.arange(0, NB_BLOCK)[:, None]
        j = tl.arange(0, SB)[None, :]
        pos = b * (SG * SB) + (((b * 40503) ^ (b >> 3)) & (SG - 1)) * SB + j
        k = b * SB + j  # the sample's index
        s = tl.load(probs_ptr + row * vocab + pos, mask=(pos < vocab) & (k < n_samples), other=0.0).to(tl.float32)
        s = tl.where((s == s) & (s < float("inf")), tl.maximum(s, 0.0), 0.0)  # (non-finite rows: the stats pass)
        tl.store(gsamp_ptr + row * n_samples + k, s, mask=k < n_samples)
        tl.debug_barrier()
        # tau just above the largest sample: every sample counts, the entries above it are summed exactly
        tau = tl.max(tl.max(s, axis=1), axis=0).to(tl.int32, bitcast=True) + 1
        lo, hi = sample_bracket(gsamp_ptr + row * n_samples, n_samples, tau, tl.full((), 0.0, tl.float64),
                                tl.full((), 1.0, tl.float64), p.to(tl.float64), Z, SG, NS_BLOCK, 8, TPS_SHARED,
                                NS_REM, HI_SAMPLES)
        status = tl.full((), 2, tl.int32)
    tl.store(plan_ptr + row * 4, status)
    tl.store(plan_ptr + row * 4 + 1, lo)
    tl.store(plan_ptr + row * 4 + 2, hi)
    pdl_exit(PDL)


@triton.jit
def _stats_bracket_kernel(probs_ptr, vocab, n_chunks, n_groups, chunk_sum_ptr, chunk_bad_ptr, gmax_ptr,
                          plan_ptr, mhi_ptr, cnt_ptr, slots_ptr, CHUNK: tl.constexpr, G: tl.constexpr,
                          CAP: tl.constexpr, COPY_MODE: tl.constexpr, bmass_ptr=None, BINS: tl.constexpr = 0,
                          BIN_SUB: tl.constexpr = 128, PDL: tl.constexpr = 0):
    """Pass 2, the one read: row stats and the bracket's copy-out of one chunk."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK // G)[:, None] * G + tl.arange(0, G)[None, :]
    # probs is the call's input, written by no launch of the call: loaded before the wait (PDL)
    pdl_signal(PDL)
    x = tl.load(probs_ptr + row * vocab + offs, mask=offs < vocab, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    n_bad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
    x = tl.maximum(x, 0.0)
    store_chunk_stats(x, n_bad, row, chunk, n_chunks, n_groups, 1, chunk_sum_ptr, chunk_bad_ptr, gmax_ptr,
                      gmax_ptr, CHUNK, G, G, False)
    status = tl.load(plan_ptr + row * 4)
    if status >= 2:
        lo = tl.load(plan_ptr + row * 4 + 1)
        hi = tl.load(plan_ptr + row * 4 + 2)
        bracket_chunk(x, row, chunk, n_chunks, status, lo, hi, mhi_ptr, cnt_ptr, slots_ptr, CHUNK, G, CAP,
                      COPY_MODE, bmass_ptr, BINS, BIN_SUB)


@triton.jit
def _resolve_kernel(probs_ptr, vocab, n_chunks, n_groups, chunk_sum_ptr, chunk_bad_ptr, p_ptr, p_val,
                    plan_ptr, target_ptr, params_ptr, flag_ptr, mhi_ptr, cnt_ptr, slots_ptr, cand_ptr, list_cap, gmax_ptr,
                    gid_ptr, HAS_P_ARR: tl.constexpr, CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr,
                    CAP: tl.constexpr, SUB: tl.constexpr, REG: tl.constexpr, G: tl.constexpr, COPY: tl.constexpr,
                    EXACT_SPAN: tl.constexpr, LOW_TAU: tl.constexpr, bmass_ptr=None, BINS: tl.constexpr = 0,
                    BIN_W: tl.constexpr = 0, BIN_STEP: tl.constexpr = 4096, PDL: tl.constexpr = 0):
    """Pass 3: the row's exact cutoff and kept mass (the write parameters), its NaN flag."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    ch = tl.arange(0, CH_BLOCK)
    chm = ch < n_chunks
    total = tl.sum(tl.load(chunk_sum_ptr + row * n_chunks + ch, mask=chm, other=0.0), axis=0)
    n_bad = tl.sum(tl.load(chunk_bad_ptr + row * n_chunks + ch, mask=chm, other=0), axis=0)
    if HAS_P_ARR:
        p = tl.load(p_ptr + row)
    else:
        p = p_val
    t = tl.full((), 0x7F800000, tl.int32)  # +inf: keep nothing (empty or NaN rows)
    kept = tl.full((), 0.0, tl.float64)
    if (n_bad == 0) & (total > 0.0):
        status = tl.load(plan_ptr + row * 4)
        if status >= 2:
            lo = tl.load(plan_ptr + row * 4 + 1)
            hi = tl.load(plan_ptr + row * 4 + 2)
            tl.store(target_ptr + row, p.to(tl.float64) * total)
            tl.debug_barrier()  # (read back by bracket_resolve)
            t, kept = bracket_resolve(row, status, lo, hi, target_ptr, probs_ptr, vocab, n_chunks,
                                      n_groups, mhi_ptr, cnt_ptr, slots_ptr, cand_ptr, list_cap, gmax_ptr, gid_ptr,
                                      CH_BLOCK, NG_BLOCK, CAP, SUB, REG, G, COPY, EXACT_SPAN, bmass_ptr, BINS, BIN_W,
                                      BIN_STEP, LOW_TAU)
        else:  # p >= 1: every positive entry
            t = tl.full((), 0, tl.int32)
            kept = total
    tl.store(flag_ptr + row, (n_bad > 0).to(tl.int32))
    tl.store(params_ptr + row * 4, 0.0)
    tl.store(params_ptr + row * 4 + 1, 1.0)
    tl.store(params_ptr + row * 4 + 2, t.to(tl.float32, bitcast=True))
    tl.store(params_ptr + row * 4 + 3, reciprocal_f32(kept))
    pdl_exit(PDL)


def top_p_renorm_presample(probs: torch.Tensor, top_p: TopP, config: Optional[RenormConfig] = None,
                           fingerprint_out: Optional[torch.Tensor] = None, workspace=None,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`renorm_top_p.top_p_renorm_triton`'s contract (a Workspace with samples and bracket buffers),
    through the four launches above."""
    cfg = config or default_config()
    rows, vocab = probs.shape
    out = torch.empty_like(probs) if out is None else out
    if rows == 0:
        if fingerprint_out is not None:
            fill_fingerprint(out, fingerprint_out)
        return out
    if cfg.bracket_chunk not in (0, cfg.chunk):
        raise ValueError("RenormConfig: top_p_presample reads each chunk once: bracket_chunk must be 0 or chunk")
    s = shapes_for(rows, vocab, cfg)
    ws = workspace or workspace_for(s, cfg, probs.device, True, True)
    has_arr = isinstance(top_p, torch.Tensor)
    p_arr = top_p if has_arr else ws.params
    p_val = 0.0 if has_arr else float(top_p)
    sb = cfg.presample_block
    ns_main, ns_rem = sample_blocks(s.n_samples, s.ns_block, cfg.tps_split, 32 * cfg.select_warps)
    _presample_kernel[(rows,)](
        probs, vocab, s.n_samples, ws.gsamp, ws.plan, p_arr, p_val, float(cfg.z),
        HAS_P_ARR=has_arr, SG=cfg.sample_stride, SB=sb, NB_BLOCK=triton.next_power_of_2(triton.cdiv(s.n_samples, sb)),
        NS_BLOCK=ns_main, NS_REM=ns_rem, TPS_SHARED=bool(cfg.tps_shared), HI_SAMPLES=cfg.bracket_hi_samples,
        **pdl_args(cfg, s, probs.device, first=True), num_warps=cfg.select_warps,
        **reg_cap(cfg.select_maxnreg, cfg.select_warps))
    _stats_bracket_kernel[(rows, s.n_chunks)](
        probs, vocab, s.n_chunks, s.n_groups, ws.chunk_sum, ws.chunk_bad, ws.gmax, ws.plan, ws.mhi, ws.cnt, ws.slots,
        CHUNK=s.chunk, G=cfg.group, CAP=s.cap, COPY_MODE=copy_mode(cfg), **bins_args(ws, cfg),
        **pdl_args(cfg, s, probs.device), num_warps=cfg.pass_warps,
        **reg_cap(cfg.bracket_pass_maxnreg or cfg.bracket_maxnreg, cfg.pass_warps))
    _resolve_kernel[(rows,)](
        probs, vocab, s.n_chunks, s.n_groups, ws.chunk_sum, ws.chunk_bad, p_arr, p_val, ws.plan, ws.target, ws.params,
        ws.flag,
        ws.mhi, ws.cnt, ws.slots, ws.cand, ws.list_cap, ws.gmax, ws.gid,
        HAS_P_ARR=has_arr, CH_BLOCK=s.ch_block, NG_BLOCK=s.ng_block, CAP=s.cap, SUB=cfg.sub, REG=cfg.bracket_reg,
        G=cfg.group, COPY=max(1, min(8, 8192 // s.cap)), EXACT_SPAN=exact_span(cfg), LOW_TAU=cfg.tau_groups,
        **bins_args(ws, cfg, BIN_W=bins_window(cfg)), **pdl_args(cfg, s, probs.device, late=True),
        num_warps=cfg.bracket_warps, **reg_cap(cfg.bracket_maxnreg, cfg.bracket_warps))
    write_pass(probs, out, s, ws, cfg, fingerprint_out)
    return out


__all__ = ["top_p_renorm_presample"]
