"""The per-row top-k (+ top-p) select (Triton device function `top_k_select_row`) and the
arguments of the kernels that run it: the top-k select kernel (renorm_top_k.py), the one-launch
top-k (renorm_top_k_fused.py) and the logits-to-probs select (target_probs.py). The method:
renorm_top_k.py's module doc; references: kernels/reference.py (``top_k_renorm_reference``,
``top_k_top_p_renorm_reference``, ``joint_renorm_reference``).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from tpguard.kernels.radix_select import (
    compact_values,
    kth_largest_bits,
    kth_largest_block,
    list_groups_block,
    load_values,
    mass_cutoff_bits,
    mass_cutoff_block,
    reciprocal_f32,
    search_start,
    upper_mass,
)
from tpguard.kernels.renorm_config import RenormConfig, search_rounds, top_p_tau_groups
from tpguard.kernels.renorm_top_p_select import top_p_plan

TopK = Union[int, torch.Tensor]
TopP = Union[float, torch.Tensor]


@triton.jit
def _top_k_stages(src, gid, n, vocab, k, first, t0, max_bits, p,
                  WITH_TOP_P: tl.constexpr, GATHER: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                  REG: tl.constexpr, JOINT: tl.constexpr = False, tm_bits=0, ENTRY_ROUNDS: tl.constexpr = 16):
    """(pivot bits, r1, top-p cutoff bits, r2) from candidates holding every entry >= pivot: from one
    register block read once when n <= REG, else streamed.
    ENTRY_ROUNDS: the pivot search's rounds (renorm_config.search_rounds: the pivot is an entry; the top-p
    stage searches fp32(x * r1), which is not, in all 16).
    JOINT (the logits-to-probs path, kernels/target_probs.py): no renormalisation between the stages
    (r1 = 1: top-p on the top-k set's own values), then min-p's cutoff `tm_bits` (0: none) raises the
    second cutoff, and r2 renormalises once."""
    if n <= REG:
        v = load_values(src, gid, tl.arange(0, REG), n, vocab, 0, 1.0, GATHER, False, G)
        thr1, r1, thr2, r2 = _top_k_stages_block(v, k, first, t0, max_bits, p, WITH_TOP_P, JOINT, tm_bits,
                                                 ENTRY_ROUNDS)
    else:
        thr1, r1, thr2, r2 = _top_k_stages_streamed(src, gid, n, vocab, k, first, t0, max_bits, p, WITH_TOP_P,
                                                    GATHER, G, SUB, JOINT, tm_bits, ENTRY_ROUNDS)
    return thr1, r1, thr2, r2


@triton.jit
def _top_k_stages_block(v, k, first, t0, max_bits, p, WITH_TOP_P: tl.constexpr, JOINT: tl.constexpr, tm_bits,
                        ENTRY_ROUNDS: tl.constexpr):
    """_top_k_stages on the candidates in one register block v (padding 0). Each stage computes from v what
    radix_select's register helpers compute from a fresh read of the same block (the same values, block and
    reductions, so the same bits): one gather of the candidates instead of one per stage (two for top-k, up to four
    with top-p and min-p), each a dependent global round trip in the per-row select."""
    b = v.to(tl.int32, bitcast=True)
    thr1 = kth_largest_block(b, k, first, t0, ENTRY_ROUNDS)
    if JOINT:
        r1 = tl.full((), 1.0, tl.float32)
    else:
        r1 = reciprocal_f32(tl.sum(tl.where(b >= thr1, v.to(tl.float64), 0.0), axis=0))
    thr2 = tl.full((), 0, tl.int32)
    r2 = tl.full((), 1.0, tl.float32)
    if WITH_TOP_P:
        # top-p on the top-k output y = fp32(x * r1) (x >= pivot): load_values' scaled read
        y = tl.where(b >= thr1, v * r1, 0.0)
        mass_y = tl.sum(y.to(tl.float64), axis=0)  # upper_mass at 0: every y (>= 0) in the same tree
        kept_y = mass_y
        if p < 1.0:
            first2, t02 = _scaled_search_start(thr1, max_bits, r1)
            thr2, kept_y = mass_cutoff_block(y, p.to(tl.float64) * mass_y, 0.0, first2, t02)
        if JOINT:
            if tm_bits > thr2:  # min-p's cutoff above top-p's: it decides the kept set
                thr2 = tm_bits
                kept_y = tl.sum(tl.where(y.to(tl.int32, bitcast=True) >= tm_bits, y.to(tl.float64), 0.0), axis=0)
        r2 = reciprocal_f32(kept_y)
    return thr1, r1, thr2, r2


@triton.jit
def _scaled_search_start(thr1, max_bits, r1):
    """search_start of the top-p stage: its cutoff lies among fp32(x * r1) for pivot <= x <= the row max."""
    y_lo = (thr1.to(tl.float32, bitcast=True) * r1).to(tl.int32, bitcast=True)
    y_hi = (max_bits.to(tl.float32, bitcast=True) * r1).to(tl.int32, bitcast=True)
    return search_start(y_lo, y_hi)


@triton.jit
def _top_k_stages_streamed(src, gid, n, vocab, k, first, t0, max_bits, p, WITH_TOP_P: tl.constexpr,
                           GATHER: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr, JOINT: tl.constexpr,
                           tm_bits, ENTRY_ROUNDS: tl.constexpr):
    """_top_k_stages on more candidates than a register block holds, SUB at a time from L1 / L2."""
    thr1 = kth_largest_bits(src, gid, n, vocab, k, 0, 0, 1.0, first, t0, ENTRY_ROUNDS, GATHER, False, G, SUB)
    if JOINT:
        r1 = tl.full((), 1.0, tl.float32)
    else:
        r1 = reciprocal_f32(upper_mass(src, gid, n, vocab, thr1, 0, 1.0, GATHER, False, G, SUB))
    thr2 = tl.full((), 0, tl.int32)
    r2 = tl.full((), 1.0, tl.float32)
    if WITH_TOP_P:
        mass_y = upper_mass(src, gid, n, vocab, 0, thr1, r1, GATHER, True, G, SUB)
        kept_y = mass_y
        if p < 1.0:
            first2, t02 = _scaled_search_start(thr1, max_bits, r1)
            thr2, kept_y = mass_cutoff_bits(src, gid, n, vocab, p.to(tl.float64) * mass_y, 0.0, thr1, r1,
                                            first2, t02, GATHER, True, G, SUB)
        if JOINT:
            if tm_bits > thr2:
                thr2 = tm_bits
                kept_y = upper_mass(src, gid, n, vocab, tm_bits, thr1, r1, GATHER, True, G, SUB)
        r2 = reciprocal_f32(kept_y)
    return thr1, r1, thr2, r2


@triton.jit
def top_k_select_row(row, probs_ptr, vocab, n_chunks, n_groups, n_samples,
                     chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, gid_ptr, cand_ptr, list_cap,
                     k_ptr, k_val, p_ptr, p_val, params_ptr, flag_ptr, plan_ptr, target_ptr, Z,
                     HAS_K_ARR: tl.constexpr, HAS_P_ARR: tl.constexpr, WITH_TOP_P: tl.constexpr,
                     G: tl.constexpr, SG: tl.constexpr, CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr,
                     NS_BLOCK: tl.constexpr, SUB: tl.constexpr, REG: tl.constexpr,
                     TAU_GROUPS: tl.constexpr, CSUB: tl.constexpr,
                     mp_ptr=None, mp_val=0.0, chunk_mp_ptr=None, HAS_MP_ARR: tl.constexpr = False,
                     WITH_MIN_P: tl.constexpr = False, JOINT: tl.constexpr = False,
                     SHORT: tl.constexpr = False, ENTRY_ROUNDS: tl.constexpr = 16):
    """The per-row top-k (+ top-p) plan (module doc): writes the row's plan, target and params.
    Shared by `_top_k_select_kernel` and the one-launch kernel (renorm_top_k_fused.py), which reads
    row stats other CTAs of its own launch wrote: hence ``.cg`` (L2) loads of them.
    JOINT, WITH_MIN_P (the logits-to-probs path, kernels/target_probs.py; WITH_TOP_P with it): top-k,
    top-p on the top-k set's values and min-p (cutoff fp32(row max * min_p)) as one kept set, one
    renormalisation; `chunk_mp_ptr`: the stats pass's per-chunk float64 mass of the entries at or
    above min-p's cutoff, for rows without top-k (k >= vocab).
    SHORT, ENTRY_ROUNDS (RenormConfig.short_searches): the group-max search starts below the leading zero
    bits of the row max; the searches whose answer is an entry run ENTRY_ROUNDS rounds."""
    src = probs_ptr + row * vocab
    gid_row = gid_ptr + row * n_groups
    list_row = cand_ptr + row * list_cap
    ch = tl.arange(0, CH_BLOCK)
    chm = ch < n_chunks
    # the group maxima loaded beside the chunk sums, not after the branch on them: one global round trip
    # on the row's critical path instead of two (an empty or NaN row does not use them)
    gidx = tl.arange(0, NG_BLOCK)
    gb = tl.load(gmax_ptr + row * n_groups + gidx, mask=gidx < n_groups, other=0.0,
                 cache_modifier=".cg").to(tl.int32, bitcast=True)
    total = tl.sum(tl.load(chunk_sum_ptr + row * n_chunks + ch, mask=chm, other=0.0, cache_modifier=".cg"), axis=0)
    n_bad = tl.sum(tl.load(chunk_bad_ptr + row * n_chunks + ch, mask=chm, other=0, cache_modifier=".cg"), axis=0)
    if HAS_K_ARR:
        k = tl.load(k_ptr + row)
    else:
        k = k_val
    k = tl.minimum(tl.maximum(k, 1), vocab)
    p = 1.0
    if WITH_TOP_P:
        if HAS_P_ARR:
            p = tl.load(p_ptr + row)
        else:
            p = p_val
    mp = 0.0
    if WITH_MIN_P:
        if HAS_MP_ARR:
            mp = tl.load(mp_ptr + row)
        else:
            mp = mp_val
        mp = tl.minimum(tl.maximum(mp, 0.0), 1.0)

    # defaults: keep every positive entry, renormalised by the row mass (k >= vocab)
    status = tl.full((), 1, tl.int32)
    thr1 = tl.full((), 0, tl.int32)
    r1 = reciprocal_f32(total)
    thr2 = tl.full((), 0, tl.int32)
    r2 = tl.full((), 1.0, tl.float32)
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32)
    target = tl.full((), 0.0, tl.float64)
    if (n_bad == 0) & (total > 0.0):
        max_bits = tl.max(gb, axis=0)
        tm_bits = 0
        if WITH_MIN_P:
            tm_bits = (max_bits.to(tl.float32, bitcast=True) * mp).to(tl.int32, bitcast=True)
        if k < vocab:
            # a: a lower bound (16 bits) of the k-th largest group max, hence of the pivot; every
            # entry >= pivot lies in a group whose max is >= a (k groups without ties)
            if SHORT:  # the answer is <= max_bits: it has max_bits's leading zeros
                fa, ta = search_start(tl.zeros_like(max_bits), max_bits)
                a_block = kth_largest_block(gb, k, fa, ta, 8)
            else:
                a_block = kth_largest_block(gb, k, 0, 0, 8)
            a = tl.maximum(a_block, 1)
            n_sel = list_groups_block(gid_row, gb, gidx, a)
            tl.debug_barrier()
            n_cand = n_sel * G
            first, t0 = search_start(tl.where(a_block > 0, a, 0), max_bits)
            if n_cand <= REG:
                thr1, r1, thr2, r2 = _top_k_stages(src, gid_row, n_cand, vocab, k, first, t0, max_bits, p,
                                                   WITH_TOP_P, True, G, SUB, REG, JOINT, tm_bits, ENTRY_ROUNDS)
            else:  # large k: keep only the entries >= a (about k of them)
                count, _ = compact_values(src, gid_row, n_cand, vocab, a, list_row, list_cap, True, G, CSUB)
                tl.debug_barrier()
                if count <= list_cap:
                    thr1, r1, thr2, r2 = _top_k_stages(list_row, list_row, count, count, k, first, t0, max_bits,
                                                       p, WITH_TOP_P, False, G, SUB, REG, JOINT, tm_bits, ENTRY_ROUNDS)
                else:
                    thr1, r1, thr2, r2 = _top_k_stages(src, gid_row, n_cand, vocab, k, first, t0, max_bits, p,
                                                       WITH_TOP_P, True, G, SUB, REG, JOINT, tm_bits, ENTRY_ROUNDS)
        else:
            if WITH_TOP_P:
                # k >= vocab disables the top-k stage: plain top-p (docs/kernels.md)
                r1 = tl.full((), 1.0, tl.float32)
                kept = total
                if WITH_MIN_P:
                    # min-p's cutoff is above top-p's exactly when the mass at or above it is below top-p's
                    # target: then it alone decides the kept set (no top-p search). p >= 1 keeps every entry
                    # in top-p, so min-p decides even where the mass below its cutoff is lost in float64
                    m_mp = tl.sum(tl.load(chunk_mp_ptr + row * n_chunks + ch, mask=chm, other=0.0), axis=0)
                    if (m_mp < p.to(tl.float64) * total) | ((p >= 1.0) & (mp > 0.0)):
                        thr2 = tm_bits
                        kept = m_mp
                    else:
                        status, thr2, kept, lo, hi, target = top_p_plan(
                            src, gid_row, list_row, list_cap, gb, gidx, max_bits, gsamp_ptr + row * n_samples,
                            n_samples, vocab, total, p, G, SG, NS_BLOCK, SUB, REG, TAU_GROUPS, Z, CSUB,
                            ENTRY_ROUNDS=ENTRY_ROUNDS)
                else:
                    status, thr2, kept, lo, hi, target = top_p_plan(
                        src, gid_row, list_row, list_cap, gb, gidx, max_bits, gsamp_ptr + row * n_samples,
                        n_samples, vocab, total, p, G, SG, NS_BLOCK, SUB, REG, TAU_GROUPS, Z, CSUB,
                            ENTRY_ROUNDS=ENTRY_ROUNDS)
                r2 = reciprocal_f32(kept)
    else:
        thr1 = tl.full((), 0x7F800000, tl.int32)  # +inf: keep nothing (empty or NaN rows)
    nan_row = n_bad > 0
    if WITH_TOP_P and not JOINT:
        # a top-k kept mass below 2^-128 has no float32 1 / S: the first stage's kept entries are inf, and
        # the reference's second stage, seeing them, gives a NaN row (kernels/reference.py)
        nan_row = nan_row | (r1 == float("inf"))
    tl.store(flag_ptr + row, nan_row.to(tl.int32))
    tl.store(plan_ptr + row * 4, status)
    tl.store(plan_ptr + row * 4 + 1, lo)
    tl.store(plan_ptr + row * 4 + 2, hi)
    tl.store(target_ptr + row, target)
    tl.store(params_ptr + row * 4, thr1.to(tl.float32, bitcast=True))
    tl.store(params_ptr + row * 4 + 1, r1)
    tl.store(params_ptr + row * 4 + 2, thr2.to(tl.float32, bitcast=True))
    tl.store(params_ptr + row * 4 + 3, r2)


def workspace_flags(vocab: int, top_k=None, top_p=None) -> tuple:
    """(with_sample, with_bracket, with_sync) of the workspace a call uses (renorm_plan.py asks):
    the bracket passes serve only rows whose k >= vocab (plain top-p); a scalar k < vocab has none:
    two launches and the samples skipped; the one-launch kernel's sync words (16 bytes a row) for
    the calls it may serve (renorm_top_k_fused.fused_fits): top-k alone, or a scalar k < vocab."""
    full_top_p = top_p is not None and (isinstance(top_k, torch.Tensor) or int(top_k) >= vocab)
    return full_top_p, full_top_p, not full_top_p


def select_launch_args(probs: torch.Tensor, top_k: TopK, top_p: Optional[TopP], s, ws, cfg: RenormConfig):
    """(arguments, constexprs but PDL) of `top_k_select_row`'s kernels: the select kernel and, with `out` and
    the sync words after them, the one-launch kernel (renorm_top_k_fused.py)."""
    vocab = s.vocab
    with_top_p = top_p is not None
    has_k = isinstance(top_k, torch.Tensor)
    has_p = isinstance(top_p, torch.Tensor)
    args = (probs, vocab, s.n_chunks, s.n_groups, s.n_samples,
            ws.chunk_sum, ws.chunk_bad, ws.gmax, ws.gsamp, ws.gid, ws.cand, ws.list_cap,
            top_k if has_k else ws.flag, 0 if has_k else int(min(max(int(top_k), 1), vocab)),
            top_p if has_p else ws.params, 1.0 if (has_p or not with_top_p) else float(top_p),
            ws.params, ws.flag, ws.plan, ws.target, float(cfg.z))
    blocks = dict(HAS_K_ARR=has_k, HAS_P_ARR=has_p, WITH_TOP_P=with_top_p,
                  G=cfg.group, SG=cfg.sample_stride, CH_BLOCK=s.ch_block, NG_BLOCK=s.ng_block, NS_BLOCK=s.ns_block,
                  SUB=cfg.sub, REG=cfg.reg, TAU_GROUPS=top_p_tau_groups(cfg, s.n_groups),
                  CSUB=cfg.compact_sub, SHORT=bool(cfg.short_searches),
                  ENTRY_ROUNDS=search_rounds(cfg, probs.dtype))
    return args, blocks


__all__ = ["select_launch_args", "top_k_select_row", "workspace_flags"]
