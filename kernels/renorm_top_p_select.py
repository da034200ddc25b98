"""The per-row top-p plan (Triton device functions), shared by the top-p select kernel
(renorm_top_p.py) and the top-k + top-p select (renorm_top_k_select.py): `top_p_plan` finds a row's cutoff among its largest groups or hands a
bracket [lo, hi) estimated from the row's samples (`sample_bracket`) to the bracket passes. The
method: renorm_top_p.py's module doc; reference: kernels/reference.py (``top_p_renorm_reference``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpguard.kernels.radix_select import (
    INTERPRETED,
    compact_values,
    kth_largest_block,
    list_groups_block,
    mass_cutoff_any,
    mass_cutoff_bits,
    search_start,
    upper_mass,
    upper_mass_any,
)


@triton.jit
def _add12(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
           b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11):
    return (a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5,
            a6 + b6, a7 + b7, a8 + b8, a9 + b9, a10 + b10, a11 + b11)


@triton.jit
def _estimate(a, q, q_low, inv_a, var_scale, floor, Z, m_tau, m_low):
    """(estimated upper mass at a probe c < tau, its half-width), float64, from the sampled
    mass a and squared mass q at or above c."""
    f = a * inv_a
    var = var_scale * ((1.0 - f) * (1.0 - f) * q + f * f * (q_low - q))
    half = (Z * tl.sqrt(tl.maximum(var, 0.0)) + floor).to(tl.float64)
    return m_tau + m_low * f.to(tl.float64), half


@triton.jit
def _pick_digit(t, c1, c2, c3, ok1, ok2, ok3):
    return tl.where(ok3, c3, tl.where(ok2, c2, tl.where(ok1, c1, t)))


@triton.jit
def _column_sums6(b, x, x2, c1, c2, c3):
    """Axis-0 sums of the 3 probes' (mass, squared mass) over a sample block: over a [K, R] block
    (RenormConfig.tps_split) K entries per column, held by one thread, so no shuffles and no
    barrier; over the default 1-D block the round's whole reduction."""
    if INTERPRETED:
        s0, s1 = tl.sum(tl.where(b >= c1, x, 0.0), axis=0), tl.sum(tl.where(b >= c1, x2, 0.0), axis=0)
        s2, s3 = tl.sum(tl.where(b >= c2, x, 0.0), axis=0), tl.sum(tl.where(b >= c2, x2, 0.0), axis=0)
        s4, s5 = tl.sum(tl.where(b >= c3, x, 0.0), axis=0), tl.sum(tl.where(b >= c3, x2, 0.0), axis=0)
    else:
        s0, s1, s2, s3, s4, s5 = tl.reduce(
            (tl.where(b >= c1, x, 0.0), tl.where(b >= c1, x2, 0.0),
             tl.where(b >= c2, x, 0.0), tl.where(b >= c2, x2, 0.0),
             tl.where(b >= c3, x, 0.0), tl.where(b >= c3, x2, 0.0)), 0, _add6)
    return s0, s1, s2, s3, s4, s5


@triton.jit
def _split_sums6(sv, sq, rv, rq, c1, c2, c3):
    """The round's 6 sums over the split samples (tps_split): main block [K, R] and remainder
    block [1, R] summed per column (main first), then one 6-operand reduction over the R columns."""
    sb = sv.to(tl.int32, bitcast=True)
    rb = rv.to(tl.int32, bitcast=True)
    m0, m1, m2, m3, m4, m5 = _column_sums6(sb, sv, sq, c1, c2, c3)
    r0, r1, r2, r3, r4, r5 = _column_sums6(rb, rv, rq, c1, c2, c3)
    if INTERPRETED:
        s0, s1, s2 = tl.sum(m0 + r0, axis=0), tl.sum(m1 + r1, axis=0), tl.sum(m2 + r2, axis=0)
        s3, s4, s5 = tl.sum(m3 + r3, axis=0), tl.sum(m4 + r4, axis=0), tl.sum(m5 + r5, axis=0)
    else:
        s0, s1, s2, s3, s4, s5 = tl.reduce((m0 + r0, m1 + r1, m2 + r2, m3 + r3, m4 + r4, m5 + r5), 0, _add6)
    return s0, s1, s2, s3, s4, s5


@triton.jit
def _split_sums12(sv, sq, rv, rq, l1, l2, l3, h1, h2, h3):
    """_split_sums6 for both ends' probes: 12 column sums, one 12-operand reduction."""
    sb = sv.to(tl.int32, bitcast=True)
    rb = rv.to(tl.int32, bitcast=True)
    m0, m1, m2, m3, m4, m5 = _column_sums6(sb, sv, sq, l1, l2, l3)
    r0, r1, r2, r3, r4, r5 = _column_sums6(rb, rv, rq, l1, l2, l3)
    m6, m7, m8, m9, m10, m11 = _column_sums6(sb, sv, sq, h1, h2, h3)
    r6, r7, r8, r9, r10, r11 = _column_sums6(rb, rv, rq, h1, h2, h3)
    if INTERPRETED:
        s0, s1, s2 = tl.sum(m0 + r0, axis=0), tl.sum(m1 + r1, axis=0), tl.sum(m2 + r2, axis=0)
        s3, s4, s5 = tl.sum(m3 + r3, axis=0), tl.sum(m4 + r4, axis=0), tl.sum(m5 + r5, axis=0)
        s6, s7, s8 = tl.sum(m6 + r6, axis=0), tl.sum(m7 + r7, axis=0), tl.sum(m8 + r8, axis=0)
        s9, s10, s11 = tl.sum(m9 + r9, axis=0), tl.sum(m10 + r10, axis=0), tl.sum(m11 + r11, axis=0)
    else:
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11 = tl.reduce(
            (m0 + r0, m1 + r1, m2 + r2, m3 + r3, m4 + r4, m5 + r5,
             m6 + r6, m7 + r7, m8 + r8, m9 + r9, m10 + r10, m11 + r11), 0, _add12)
    return s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11


@triton.jit
def _bracket_round(t_lo, t_hi, shift, sv, tau, target, q_low, inv_a, var_scale, floor, Z, m_tau, m_low,
                   rv=None, SPLIT: tl.constexpr = False):
    """One search round for both ends: the largest digit whose probe c < tau has estimate -
    half >= target (lo) / estimate + half >= target (hi). The 12 sampled sums of the round
    (3 probes x 2 ends x (mass, squared mass)) come from one reduction."""
    step = tl.full((), 1, tl.int32) << shift  # int32: round 0's 2 << 30 wraps negative (not a pattern)
    l1 = t_lo + step
    l2 = l1 + step
    l3 = l2 + step
    h1 = t_hi + step
    h2 = h1 + step
    h3 = h2 + step
    # sv: the samples below tau (0 above it; every probe is >= 1): bits and squares recomputed
    # here rather than held in registers across the rounds
    sb = sv.to(tl.int32, bitcast=True)
    sq = sv * sv
    if SPLIT:  # sv, rv: the [K, R] and [1, R] sample blocks (sample_bracket)
        al1, ql1, al2, ql2, al3, ql3, ah1, qh1, ah2, qh2, ah3, qh3 = _split_sums12(
            sv, sq, rv, rv * rv, l1, l2, l3, h1, h2, h3)
    elif INTERPRETED:  # (the interpreter's tl.reduce is a Python loop: 12 numpy sums instead)
        al1, ql1 = tl.sum(tl.where(sb >= l1, sv, 0.0), axis=0), tl.sum(tl.where(sb >= l1, sq, 0.0), axis=0)
        al2, ql2 = tl.sum(tl.where(sb >= l2, sv, 0.0), axis=0), tl.sum(tl.where(sb >= l2, sq, 0.0), axis=0)
        al3, ql3 = tl.sum(tl.where(sb >= l3, sv, 0.0), axis=0), tl.sum(tl.where(sb >= l3, sq, 0.0), axis=0)
        ah1, qh1 = tl.sum(tl.where(sb >= h1, sv, 0.0), axis=0), tl.sum(tl.where(sb >= h1, sq, 0.0), axis=0)
        ah2, qh2 = tl.sum(tl.where(sb >= h2, sv, 0.0), axis=0), tl.sum(tl.where(sb >= h2, sq, 0.0), axis=0)
        ah3, qh3 = tl.sum(tl.where(sb >= h3, sv, 0.0), axis=0), tl.sum(tl.where(sb >= h3, sq, 0.0), axis=0)
    else:
        al1, ql1, al2, ql2, al3, ql3, ah1, qh1, ah2, qh2, ah3, qh3 = tl.reduce(
            (tl.where(sb >= l1, sv, 0.0), tl.where(sb >= l1, sq, 0.0),
             tl.where(sb >= l2, sv, 0.0), tl.where(sb >= l2, sq, 0.0),
             tl.where(sb >= l3, sv, 0.0), tl.where(sb >= l3, sq, 0.0),
             tl.where(sb >= h1, sv, 0.0), tl.where(sb >= h1, sq, 0.0),
             tl.where(sb >= h2, sv, 0.0), tl.where(sb >= h2, sq, 0.0),
             tl.where(sb >= h3, sv, 0.0), tl.where(sb >= h3, sq, 0.0)), 0, _add12)
    e1, d1 = _estimate(al1, ql1, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    e2, d2 = _estimate(al2, ql2, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    e3, d3 = _estimate(al3, ql3, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    t_lo = _pick_digit(t_lo, l1, l2, l3,
                       (l1 >= 0) & (l1 < tau) & (e1 - d1 >= target),
                       (l2 >= 0) & (l2 < tau) & (e2 - d2 >= target),
                       (l3 >= 0) & (l3 < tau) & (e3 - d3 >= target))
    e1, d1 = _estimate(ah1, qh1, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    e2, d2 = _estimate(ah2, qh2, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    e3, d3 = _estimate(ah3, qh3, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    t_hi = _pick_digit(t_hi, h1, h2, h3,
                       (h1 >= 0) & (h1 < tau) & (e1 + d1 >= target),
                       (h2 >= 0) & (h2 < tau) & (e2 + d2 >= target),
                       (h3 >= 0) & (h3 < tau) & (e3 + d3 >= target))
    return t_lo, t_hi


@triton.jit
def _add6(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5


@triton.jit
def _bracket_round_shared(t, shift, sv, tau, target, q_low, inv_a, var_scale, floor, Z, m_tau, m_low,
                          rv=None, SPLIT: tl.constexpr = False):
    """_bracket_round while both ends are still at the same pattern t: their probes coincide, so
    the round's 6 distinct sums (3 probes x (mass, squared mass)) are reduced once and both ends
    pick their digit from the same estimates. Every value is the one _bracket_round computes (the
    same reduction of the same operands), so the bits of lo and hi are unchanged."""
    step = tl.full((), 1, tl.int32) << shift
    c1 = t + step
    c2 = c1 + step
    c3 = c2 + step
    sb = sv.to(tl.int32, bitcast=True)
    sq = sv * sv
    if SPLIT:
        a1, q1, a2, q2, a3, q3 = _split_sums6(sv, sq, rv, rv * rv, c1, c2, c3)
    else:  # the whole (padded) block: the same 6-operand reduction over its one axis
        a1, q1, a2, q2, a3, q3 = _column_sums6(sb, sv, sq, c1, c2, c3)
    e1, d1 = _estimate(a1, q1, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    e2, d2 = _estimate(a2, q2, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    e3, d3 = _estimate(a3, q3, q_low, inv_a, var_scale, floor, Z, m_tau, m_low)
    in1 = (c1 >= 0) & (c1 < tau)
    in2 = (c2 >= 0) & (c2 < tau)
    in3 = (c3 >= 0) & (c3 < tau)
    t_lo = _pick_digit(t, c1, c2, c3, in1 & (e1 - d1 >= target), in2 & (e2 - d2 >= target),
                       in3 & (e3 - d3 >= target))
    t_hi = _pick_digit(t, c1, c2, c3, in1 & (e1 + d1 >= target), in2 & (e2 + d2 >= target),
                       in3 & (e3 + d3 >= target))
    return t_lo, t_hi


@triton.jit
def sample_bracket(samp_row_ptr, n_samples, tau, m_tau, m_low, target, Z, W: tl.constexpr,
                   NS_BLOCK: tl.constexpr, ROUNDS: tl.constexpr, SHARED: tl.constexpr = False,
                   NS_REM: tl.constexpr = 0, HI_SAMPLES: tl.constexpr = 0):
    """(lo, hi): a bracket for a cutoff below tau, from the sampled entries < tau.

    The mass in [c, tau) is estimated as m_low * (sampled mass in [c, tau)) / (sampled mass
    < tau) (a ratio estimator; m_low = total - M(>= tau) is exact) with the variance of
    Bernoulli(1/W) sampling. lo is the largest c whose estimate minus Z deviations still reaches
    the target, hi the first pattern above the largest c whose estimate plus Z deviations does;
    both to 2 * ROUNDS bits (rounded outwards). A miss only costs time: the bracket is verified.
    The estimate is statistical, so float32 is plenty (and deterministic).
    SHARED (RenormConfig.tps_shared): the rounds where lo and hi still agree reduce once for both.
    NS_REM > 0 (RenormConfig.tps_split, sample_blocks): the samples as a main block of NS_BLOCK
    entries, held as [NS_BLOCK // NS_REM, NS_REM], plus a remainder block [1, NS_REM] (no padding
    up to the next power of two); every sum adds the two per column, then reduces the columns.
    HI_SAMPLES > 0 (RenormConfig.bracket_hi_samples): when fewer than HI_SAMPLES samples lie in
    [hi, tau), hi = tau (see below).
    """
    if NS_REM > 0:
        k = tl.arange(0, NS_BLOCK // NS_REM)[:, None] * NS_REM
        j = tl.arange(0, NS_REM)[None, :]
        s = tl.maximum(tl.load(samp_row_ptr + k + j, mask=k + j < n_samples, other=0.0, cache_modifier=".cg"), 0.0)
        sv = tl.where(s.to(tl.int32, bitcast=True) < tau, s, 0.0)
        s = tl.maximum(tl.load(samp_row_ptr + NS_BLOCK + j, mask=NS_BLOCK + j < n_samples, other=0.0,
                               cache_modifier=".cg"), 0.0)
        rv = tl.where(s.to(tl.int32, bitcast=True) < tau, s, 0.0)
        a_low = tl.sum(tl.sum(sv, axis=0) + tl.sum(rv, axis=0), axis=0)
        q_low = tl.sum(tl.sum(sv * sv, axis=0) + tl.sum(rv * rv, axis=0), axis=0)
    else:
        i = tl.arange(0, NS_BLOCK)
        s = tl.maximum(tl.load(samp_row_ptr + i, mask=i < n_samples, other=0.0, cache_modifier=".cg"), 0.0)
        sv = tl.where(s.to(tl.int32, bitcast=True) < tau, s, 0.0)
        a_low = tl.sum(sv, axis=0)
        q_low = tl.sum(sv * sv, axis=0)
        rv = None
    inv_a = tl.where(a_low > 0.0, 1.0 / tl.where(a_low > 0.0, a_low, 1.0), 0.0)
    m_low32 = m_low.to(tl.float32)
    var_scale = (W - 1.0) / W * (m_low32 * inv_a) * (m_low32 * inv_a)
    floor = 1e-4 * m_low32
    t_lo = tl.full((), 0, tl.int32)
    t_hi = tl.full((), 0, tl.int32)
    if SHARED:  # two loops, not a branch per round: one round body live at a time (no stack under the cap)
        r = tl.full((), 0, tl.int32)
        while (r < ROUNDS) & (t_lo == t_hi):
            t_lo, t_hi = _bracket_round_shared(t_lo, 30 - 2 * r, sv, tau, target, q_low, inv_a, var_scale,
                                               floor, Z, m_tau, m_low, rv, NS_REM > 0)
            r += 1
        while r < ROUNDS:
            t_lo, t_hi = _bracket_round(t_lo, t_hi, 30 - 2 * r, sv, tau, target, q_low, inv_a, var_scale,
                                        floor, Z, m_tau, m_low, rv, NS_REM > 0)
            r += 1
    else:
        for r in range(ROUNDS):
            t_lo, t_hi = _bracket_round(t_lo, t_hi, 30 - 2 * r, sv, tau, target, q_low, inv_a, var_scale,
                                        floor, Z, m_tau, m_low, rv, NS_REM > 0)
    lo = tl.where(a_low > 0.0, tl.maximum(t_lo, 1), 1)
    hi = tl.where(a_low > 0.0, tl.minimum(t_hi + (1 << (32 - 2 * ROUNDS)), tau), tau)
    if HI_SAMPLES > 0:
        # A cutoff just below tau has only a handful of samples in [cutoff, tau), and the variance of
        # the estimate, computed from those samples, is then about 0: hi can land at or below the
        # cutoff (a numpy model missed on 3-30% of the bracket rows whose kept set is a few hundred to
        # a few thousand entries, logits N(0, 1) x 3.5-5 at p 0.8-0.95: docs/design-renorm.md), and such a
        # row takes bracket_select's slowest path (every group above hi, streamed). With fewer than
        # HI_SAMPLES samples in [hi, tau), that range holds about HI_SAMPLES * W entries: take it
        # into the bracket. hi = tau is above the cutoff by the row's status (M(>= tau) < target),
        # so this side cannot miss. A function of the row's samples only: deterministic,
        # batch-invariant.
        in_hi = ((sv > 0.0) & (sv.to(tl.int32, bitcast=True) >= hi)).to(tl.int32)
        if NS_REM > 0:
            in_rem = ((rv > 0.0) & (rv.to(tl.int32, bitcast=True) >= hi)).to(tl.int32)
            n_hi = tl.sum(tl.sum(in_hi, axis=0) + tl.sum(in_rem, axis=0), axis=0)
        else:
            n_hi = tl.sum(in_hi, axis=0)
        hi = tl.where(n_hi < HI_SAMPLES, tau, hi)
    lo = tl.minimum(lo, hi)
    return lo, hi


@triton.jit
def _packed_counts(b, c1, c2, c3):
    return ((b >= c1) & (c1 >= 0)).to(tl.int64) + (((b >= c2) & (c2 >= 0)).to(tl.int64) << 20) \
        + (((b >= c3) & (c3 >= 0)).to(tl.int64) << 40)


@triton.jit
def kth_largest_split(bm, br, k, ROUNDS: tl.constexpr):
    """kth_largest_block(b, k, 0, 0, ROUNDS) over a block held as a main [K, R] and a remainder
    [1, R] block (tps_split; padding 0): the same packed int64 counts (exact in any order, summed
    per column, then over the columns), so the same pattern."""
    t = tl.full((), 0, tl.int32)
    for r in range(ROUNDS):
        step = tl.full((), 1, tl.int32) << (30 - 2 * r)  # int32: round 0's c2, c3 wrap negative (not patterns)
        c1 = t + step
        c2 = c1 + step
        c3 = c2 + step
        packed = tl.sum(tl.sum(_packed_counts(bm, c1, c2, c3), axis=0) + tl.sum(_packed_counts(br, c1, c2, c3), axis=0),
                        axis=0)
        ok1 = (c1 >= 0) & ((packed & 0xFFFFF) >= k)
        ok2 = (c2 >= 0) & (((packed >> 20) & 0xFFFFF) >= k)
        ok3 = (c3 >= 0) & ((packed >> 40) >= k)
        t = tl.where(ok3, c3, tl.where(ok2, c2, tl.where(ok1, c1, t)))
    return t


@triton.jit
def top_p_plan(src, gid_row, list_row, list_cap, gb, gidx, max_bits, samp_row, n_samples, vocab, total, p,
               G: tl.constexpr, SG: tl.constexpr, NS_BLOCK: tl.constexpr, SUB: tl.constexpr,
               REG: tl.constexpr, TAU_GROUPS: tl.constexpr, Z, CSUB: tl.constexpr,
               TPS_SHARED: tl.constexpr = False, NS_REM: tl.constexpr = 0, gbm=None, gbr=None,
               TAU_SPLIT: tl.constexpr = False, HI_SAMPLES: tl.constexpr = 0, ENTRY_ROUNDS: tl.constexpr = 16):
    """(status, thr bits, kept mass, lo, hi, target) for top-p on one row (see module doc).
    gb: the row's group maxima (bits) in registers; with TAU_SPLIT (tps_split) the tau search reads
    them from gbm [K, R] + gbr [1, R] instead (kth_largest_split: the same tau). ENTRY_ROUNDS: the
    rounds of the search among the groups above tau (renorm_config.search_rounds: with nothing above
    the searched entries, the cutoff is one of them)."""
    target = p.to(tl.float64) * total
    status = tl.full((), 1, tl.int32)
    thr = tl.full((), 0, tl.int32)
    kept = total
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32)
    if p < 1.0:
        # tau: the TAU_GROUPS-th largest group max, to 16 bits (rounded down)
        if TAU_SPLIT:
            tau = tl.maximum(kth_largest_split(gbm, gbr, TAU_GROUPS, 8), 1)
        else:
            tau = tl.maximum(kth_largest_block(gb, TAU_GROUPS, 0, 0, 8), 1)
        n_sel = list_groups_block(gid_row, gb, gidx, tau)
        tl.debug_barrier()
        n_cand = n_sel * G
        count = tl.full((), 0, tl.int32)
        if n_cand <= REG:
            m_tau = upper_mass_any(src, gid_row, n_cand, vocab, tau, 0, 1.0, True, False, G, SUB, REG)
        else:  # M(>= tau) alone: flat rows never search these entries, so they are compacted only below
            m_tau = upper_mass(src, gid_row, n_cand, vocab, tau, 0, 1.0, True, False, G, CSUB)
        if (m_tau >= target) & (m_tau > 0.0):
            first, t0 = search_start(tau, max_bits)
            if n_cand > REG:  # keep only the entries >= tau: usually about TAU_GROUPS of them
                count, _ = compact_values(src, gid_row, n_cand, vocab, tau, list_row, list_cap, True, G, CSUB)
                tl.debug_barrier()
            if n_cand <= REG:
                thr, kept = mass_cutoff_any(src, gid_row, n_cand, vocab, target, 0.0, 0, 1.0, first, t0,
                                            True, False, G, SUB, REG, ENTRY_ROUNDS)
            elif count <= list_cap:
                thr, kept = mass_cutoff_any(list_row, list_row, count, count, target, 0.0, 0, 1.0, first, t0,
                                            False, False, G, SUB, REG, ENTRY_ROUNDS)
            else:
                thr, kept = mass_cutoff_bits(src, gid_row, n_cand, vocab, target, 0.0, 0, 1.0, first, t0,
                                             True, False, G, SUB, ENTRY_ROUNDS)
        else:
            lo, hi = sample_bracket(samp_row, n_samples, tau, m_tau, total - m_tau, target, Z,
                                    SG, NS_BLOCK, 8, TPS_SHARED, NS_REM, HI_SAMPLES)
            status = tl.full((), 2, tl.int32)
    return status, thr, kept, lo, hi, target


def sample_blocks(n_samples: int, ns_block: int, split: int, min_rem: int = 16) -> tuple:
    """(main, remainder) block sizes for n_samples entries padded to ns_block (RenormConfig.tps_split;
    the sample bracket's samples, and the tau search's group maxima): with split = 1 and n_samples
    at most 3/4 of ns_block, ns_block / 2 + the remainder's power of two (>= min_rem; e.g. 5120 at
    vocab 163840: 4096 + 1024, not 8192); else (ns_block, 0): one block, the default kernel.

    The select kernel passes min_rem = its thread count, a rule from a test failure later traced to
    the test kernel (an import in its body); the split search is exact with a 32-entry remainder at
    1-8 warps (test_tps_split_tau_search_exact). The rule stays: it changes nothing at vocab 163840
    (4096 + 1024 in 8 warps), and smaller remainders were never timed."""
    main = ns_block // 2
    rem = max(min_rem, triton.next_power_of_2(max(1, n_samples - main)))
    if split and main >= 2 * rem and main < n_samples:
        return main, rem
    return ns_block, 0


__all__ = ["kth_largest_split", "sample_blocks", "sample_bracket", "top_p_plan"]
