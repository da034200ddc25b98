"""Deterministic, batch-invariant top-p renorm (Triton). Reference: kernels/reference.py
(``top_p_renorm_reference``); semantics, tie rule and guarantees: docs/kernels.md.

Cutoff ``t`` = the largest value whose upper mass ``sum(x[x >= t])`` reaches ``p * sum(x)``.

Per row (select kernel below, after the row-stats pass of renorm_passes.py):
* tau = the ``tau_groups``-th largest group max; the groups whose max is >= tau hold every entry
  >= tau, so the exact upper mass M(>= tau) is read from them (the entries >= tau, about
  tau_groups of them, are copied out). If M(>= tau) >= P the cutoff is among those entries:
  exact radix search over them in registers, done (peaky rows).
* Otherwise (flat rows) the cutoff is below tau: a bracket [lo, hi) for it is estimated from the
  sampled entries (ratio estimator of the mass in [t, tau), z standard deviations each side) and
  handed to the bracket passes, which verify it exactly and fall back to a whole-row search.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from tpguard.kernels.radix_select import (
    compact_values,
    kth_largest_block,
    list_groups_block,
    mass_cutoff_any,
    mass_cutoff_bits,
    reciprocal_f32,
    search_start,
    upper_mass_any,
)
from tpguard.kernels.renorm_passes import (
    DEFAULT_CONFIG,
    RenormConfig,
    launch_bracket,
    launch_row_stats,
    launch_write,
    shapes_for,
    workspace_for,
)

TopP = Union[float, torch.Tensor]


@triton.jit
def _estimate(sb, sv, sq, c, q_low, inv_a, var_scale, floor, Z, m_tau, m_low):
    """(estimated upper mass at c < tau, its half-width), float64."""
    above = sb >= c
    a = tl.sum(tl.where(above, sv, 0.0), axis=0)
    q = tl.sum(tl.where(above, sq, 0.0), axis=0)
    f = a * inv_a
    var = var_scale * ((1.0 - f) * (1.0 - f) * q + f * f * (q_low - q))
    half = (Z * tl.sqrt(tl.maximum(var, 0.0)) + floor).to(tl.float64)
    return m_tau + m_low * f.to(tl.float64), half


@triton.jit
def _bracket_digit(t, shift, sb, sv, sq, tau, target, sign, q_low, inv_a, var_scale, floor, Z, m_tau, m_low):
    """One search round: the largest digit whose probe c < tau has estimate + sign * half >= target."""
    c1 = t + (1 << shift)
    c2 = t + (2 << shift)
    c3 = t + (3 << shift)
    e1, h1 = _estimate(sb, sv, sq, c1, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    e2, h2 = _estimate(sb, sv, sq, c2, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    e3, h3 = _estimate(sb, sv, sq, c3, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    ok1 = (c1 >= 0) & (c1 < tau) & (e1 + sign * h1 >= target)
    ok2 = (c2 >= 0) & (c2 < tau) & (e2 + sign * h2 >= target)
    ok3 = (c3 >= 0) & (c3 < tau) & (e3 + sign * h3 >= target)
    return tl.where(ok3, c3, tl.where(ok2, c2, tl.where(ok1, c1, t)))


@triton.jit
def sample_bracket(samp_row_ptr, n_samples, tau, m_tau, m_low, target, Z, W: tl.constexpr,
                   NS_BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    """(lo, hi): a bracket for a cutoff below tau, from the sampled entries < tau.

    The mass in [c, tau) is estimated as m_low * (sampled mass in [c, tau)) / (sampled mass
    < tau) (a ratio estimator; m_low = total - M(>= tau) is exact) with the variance of
    Bernoulli(1/W) sampling. lo is the largest c whose estimate minus Z deviations still reaches
    the target, hi the first pattern above the largest c whose estimate plus Z deviations does;
    both to 2 * ROUNDS bits (rounded outwards). A miss only costs time: the bracket is verified.
    The estimate is statistical, so float32 is plenty (and deterministic).
    """
    i = tl.arange(0, NS_BLOCK)
    s = tl.maximum(tl.load(samp_row_ptr + i, mask=i < n_samples, other=0.0), 0.0)
    sb = s.to(tl.int32, bitcast=True)
    sv = tl.where(sb < tau, s, 0.0)
    sq = sv * sv
    a_low = tl.sum(sv, axis=0)
    q_low = tl.sum(sq, axis=0)
    inv_a = tl.where(a_low > 0.0, 1.0 / tl.where(a_low > 0.0, a_low, 1.0), 0.0)
    m_low32 = m_low.to(tl.float32)
    var_scale = (W - 1.0) / W * (m_low32 * inv_a) * (m_low32 * inv_a)
    floor = 1e-4 * m_low32
    t_lo = tl.full((), 0, tl.int32)
    t_hi = tl.full((), 0, tl.int32)
    for r in range(ROUNDS):
        shift = 30 - 2 * r
        t_lo = _bracket_digit(t_lo, shift, sb, sv, sq, tau, target, -1.0, q_low, inv_a, var_scale, floor, Z,
                              m_tau, m_low)
        t_hi = _bracket_digit(t_hi, shift, sb, sv, sq, tau, target, 1.0, q_low, inv_a, var_scale, floor, Z,
                              m_tau, m_low)
    lo = tl.where(a_low > 0.0, tl.maximum(t_lo, 1), 1)
    hi = tl.where(a_low > 0.0, tl.minimum(t_hi + (1 << (32 - 2 * ROUNDS)), tau), tau)
    lo = tl.minimum(lo, hi)
    return lo, hi


@triton.jit
def top_p_plan(src, gid_row, list_row, list_cap, gb, gidx, max_bits, samp_row, n_samples, vocab, total, p,
               G: tl.constexpr, SG: tl.constexpr, NS_BLOCK: tl.constexpr, SUB: tl.constexpr,
               REG: tl.constexpr, TAU_GROUPS: tl.constexpr, Z, CSUB: tl.constexpr):
    """(status, thr bits, kept mass, lo, hi, target) for top-p on one row (see module doc).
    gb: the row's group maxima (bits) in registers."""
    target = p.to(tl.float64) * total
    status = tl.full((), 1, tl.int32)
    thr = tl.full((), 0, tl.int32)
    kept = total
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32)
    if p < 1.0:
        # tau: the TAU_GROUPS-th largest group max, to 16 bits (rounded down)
        tau = tl.maximum(kth_largest_block(gb, TAU_GROUPS, 0, 0, 8), 1)
        n_sel = list_groups_block(gid_row, gb, gidx, tau)
        tl.debug_barrier()
        n_cand = n_sel * G
        count = tl.full((), 0, tl.int32)
        if n_cand <= REG:
            m_tau = upper_mass_any(src, gid_row, n_cand, vocab, tau, 0, 1.0, True, False, G, SUB, REG)
        else:  # keep only the entries >= tau: usually about TAU_GROUPS of them
            count, m_tau = compact_values(src, gid_row, n_cand, vocab, tau, list_row, list_cap, True, G, CSUB)
            tl.debug_barrier()
        if (m_tau >= target) & (m_tau > 0.0):
            first, t0 = search_start(tau, max_bits)
            if n_cand <= REG:
                thr, kept = mass_cutoff_any(src, gid_row, n_cand, vocab, target, 0.0, 0, 1.0, first, t0,
                                            True, False, G, SUB, REG)
            elif count <= list_cap:
                thr, kept = mass_cutoff_any(list_row, list_row, count, count, target, 0.0, 0, 1.0, first, t0,
                                            False, False, G, SUB, REG)
            else:
                thr, kept = mass_cutoff_bits(src, gid_row, n_cand, vocab, target, 0.0, 0, 1.0, first, t0,
                                             True, False, G, SUB)
        else:
            lo, hi = sample_bracket(samp_row, n_samples, tau, m_tau, total - m_tau, target, Z,
                                    SG, NS_BLOCK, 8)
            status = tl.full((), 2, tl.int32)
    return status, thr, kept, lo, hi, target


@triton.jit
def _top_p_select_kernel(probs_ptr, vocab, n_chunks, n_groups, n_samples,
                         chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, gid_ptr, cand_ptr, list_cap,
                         p_ptr, p_val, params_ptr, flag_ptr, plan_ptr, target_ptr, Z,
                         HAS_P_ARR: tl.constexpr, G: tl.constexpr, SG: tl.constexpr,
                         CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr, NS_BLOCK: tl.constexpr,
                         SUB: tl.constexpr, REG: tl.constexpr, TAU_GROUPS: tl.constexpr,
                         CSUB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ch = tl.arange(0, CH_BLOCK)
    chm = ch < n_chunks
    total = tl.sum(tl.load(chunk_sum_ptr + row * n_chunks + ch, mask=chm, other=0.0), axis=0)
    n_bad = tl.sum(tl.load(chunk_bad_ptr + row * n_chunks + ch, mask=chm, other=0), axis=0)
    if HAS_P_ARR:
        p = tl.load(p_ptr + row)
    else:
        p = p_val
    status = tl.full((), 1, tl.int32)
    thr = tl.full((), 0x7F800000, tl.int32)  # +inf: keep nothing (empty or NaN rows)
    kept = tl.full((), 0.0, tl.float64)
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32)
    target = tl.full((), 0.0, tl.float64)
    if (n_bad == 0) & (total > 0.0):
        gidx = tl.arange(0, NG_BLOCK)
        gb = tl.load(gmax_ptr + row * n_groups + gidx, mask=gidx < n_groups, other=0.0).to(tl.int32, bitcast=True)
        status, thr, kept, lo, hi, target = top_p_plan(
            probs_ptr + row * vocab, gid_ptr + row * n_groups, cand_ptr + row * list_cap, list_cap,
            gb, gidx, tl.max(gb, axis=0), gsamp_ptr + row * n_samples, n_samples, vocab, total, p,
            G, SG, NS_BLOCK, SUB, REG, TAU_GROUPS, Z, CSUB)
    full = status >= 2
    tl.store(flag_ptr + row, (n_bad > 0).to(tl.int32))
    tl.store(plan_ptr + row * 4, status)
    tl.store(plan_ptr + row * 4 + 1, lo)
    tl.store(plan_ptr + row * 4 + 2, hi)
    tl.store(target_ptr + row, target)
    tl.store(params_ptr + row * 4, 0.0)
    tl.store(params_ptr + row * 4 + 1, 1.0)
    tl.store(params_ptr + row * 4 + 2, tl.where(full, 0.0, thr.to(tl.float32, bitcast=True)))
    tl.store(params_ptr + row * 4 + 3, tl.where(full, 0.0, reciprocal_f32(kept)))


def top_p_renorm_triton(probs: torch.Tensor, top_p: TopP, config: Optional[RenormConfig] = None) -> torch.Tensor:
    """Triton top-p renorm of a float32 [rows, vocab] tensor (no input checks: see renorm.py)."""
    cfg = config or DEFAULT_CONFIG
    rows, vocab = probs.shape
    out = torch.empty_like(probs)
    if rows == 0:
        return out
    s = shapes_for(rows, vocab, cfg)
    ws = workspace_for(s, cfg, probs.device, with_sample=True, with_bracket=True)
    has_arr = isinstance(top_p, torch.Tensor)
    p_arr = top_p if has_arr else ws.params
    p_val = 0.0 if has_arr else float(top_p)
    launch_row_stats(probs, s, ws, cfg, with_sample=True)
    _top_p_select_kernel[(rows,)](
        probs, vocab, s.n_chunks, s.n_groups, s.n_samples,
        ws.chunk_sum, ws.chunk_bad, ws.gmax, ws.gsamp, ws.gid, ws.cand, ws.list_cap,
        p_arr, p_val, ws.params, ws.flag, ws.plan, ws.target, float(cfg.z),
        HAS_P_ARR=has_arr, G=cfg.group, SG=cfg.sample_stride, CH_BLOCK=s.ch_block, NG_BLOCK=s.ng_block,
        NS_BLOCK=s.ns_block, SUB=cfg.sub, REG=cfg.reg, TAU_GROUPS=cfg.tau_groups,
        CSUB=cfg.compact_sub, num_warps=cfg.select_warps,
    )
    launch_bracket(probs, s, ws, cfg)
    launch_write(probs, out, s, ws, cfg)
    return out
