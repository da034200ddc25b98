"""Triton device helpers: cutoff searches over float32 bit patterns (radix-4 bisection).

Non-negative float32 values order like their int32 bit patterns, so "the k-th largest value"
and "the largest value whose upper mass reaches P" are searches over 31-bit integers: up to 16
rounds, each testing the three non-zero values of the next 2-bit digit. Counts are exact int32
sums and masses float64 sums in a fixed order (fixed block shapes, fixed loop order), so a
search gives the same bits on every call, batch size and row position. A search whose answer
is known to lie in [lo, hi] starts after the bits lo and hi share (``search_start``).

The per-row kernels are latency-bound (one program per row, dependent steps), so values live in
registers when they fit (``*_block`` helpers, ``REG`` entries) and are streamed in ``SUB``-entry
steps from L1/L2 otherwise; ``*_any`` picks one by the count, a function of the row alone.

A "candidate source" is either a contiguous run of ``n`` values at ``src_ptr`` (GATHER=False)
or, with GATHER=True, the groups of G consecutive entries of a row whose group ids are listed
at ``gid_ptr`` (``n`` = groups * G). With SCALED=True a value ``x`` is read as
``fp32(x * scale)`` when ``x >= thr`` and 0 otherwise: the output of an earlier top-k renorm,
recomputed on the fly exactly as the write pass computes it.

Optional bracket_select searches (RenormConfig bsel_radix / bsel_window; kernels/NOTES.md,
"Session 3 variants"): ``mass_cutoff_block_wide`` (2**k - 1 probes per round) and
``mass_cutoff_block_window`` (the rounds after the second on the window's entries only); both
give mass_cutoff_block's cutoff and kept-mass bits. ``mass_cutoff_block_bins`` (bracket_bins):
the rounds on one sub-bracket's entries, chosen from per-bin masses the bracket pass summed.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The interpreter runs a tl.reduce with a custom combine function element by element in Python
# (seconds per call on a 16k block); there, packed sums fall back to one numpy tl.sum each.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes"))


@triton.jit
def load_values(src_ptr, gid_ptr, idx, n, vocab, thr_bits, scale,
                GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr):
    """Candidate values at positions idx (0 where idx >= n); negatives read as 0."""
    valid = idx < n
    if GATHER:
        gid = tl.load(gid_ptr + idx // G, mask=valid, other=0)
        elem = gid * G + idx % G
        valid = valid & (elem < vocab)
        x = tl.load(src_ptr + elem, mask=valid, other=0.0)
    else:
        x = tl.load(src_ptr + idx, mask=valid, other=0.0)
    x = tl.maximum(x, 0.0)
    if SCALED:
        x = tl.where(x.to(tl.int32, bitcast=True) >= thr_bits, x * scale, 0.0)
    return x


@triton.jit
def search_start(lo_bits, hi_bits):
    """(first round, prefix): the rounds before the first 2-bit digit where lo and hi differ
    decide nothing; the search starts from their shared prefix."""
    diff = lo_bits ^ hi_bits
    first = tl.full((), 0, tl.int32)
    found = diff < 0  # bit 31 differs: start at round 0
    for r in range(16):
        digit = (diff >> (30 - 2 * r)) & 3
        found = found | (digit != 0)
        first += tl.where(found, 0, 1)
    first = tl.minimum(first, 15)
    keep_bits = 2 * first  # high bits kept from lo
    mask = tl.where(keep_bits == 0, 0, -(1 << (32 - keep_bits)))
    return first, lo_bits & mask


@triton.jit
def _pick(t, probes, d, ok):
    """The largest digit d (0 always allowed) whose probe passed, and its probe."""
    best = tl.max(tl.where(ok | (d == 0), d, 0), axis=0)
    return best, tl.sum(tl.where(d == best, probes, 0), axis=0)


# --- register blocks -------------------------------------------------------------------------

@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def sum3(a, b, c):
    """Three block sums in one reduction (one barrier sequence on the GPU)."""
    if INTERPRETED:
        sa = tl.sum(a, axis=0)
        sb = tl.sum(b, axis=0)
        sc = tl.sum(c, axis=0)
    else:
        sa, sb, sc = tl.reduce((a, b, c), 0, _add3)
    return sa, sb, sc


@triton.jit
def kth_largest_block(b, k, first, t0, last):
    """Largest pattern t with #{b >= t} >= k (t0 when none), over a register block of
    non-negative bit patterns (padding 0). Rounds first..last-1; last < 16 leaves low bits 0.

    The three probe counts of a round come from one int64 reduction (20-bit fields, exact for
    blocks below 2**20 entries): one block-wide barrier sequence per round instead of three."""
    t = t0
    for r in range(first, last):
        shift = 30 - 2 * r
        c1 = t + (1 << shift)
        c2 = t + (2 << shift)  # negative (bit 31 set) in round 0: not a pattern
        c3 = t + (3 << shift)
        w = ((b >= c1) & (c1 >= 0)).to(tl.int64) + (((b >= c2) & (c2 >= 0)).to(tl.int64) << 20) \
            + (((b >= c3) & (c3 >= 0)).to(tl.int64) << 40)
        packed = tl.sum(w, axis=0)
        ok1 = (c1 >= 0) & ((packed & 0xFFFFF) >= k)
        ok2 = (c2 >= 0) & (((packed >> 20) & 0xFFFFF) >= k)
        ok3 = (c3 >= 0) & ((packed >> 40) >= k)
        t = tl.where(ok3, c3, tl.where(ok2, c2, tl.where(ok1, c1, t)))
    return t


@triton.jit
def mass_cutoff_block(v, target, base_mass, first, t0):
    """(t, m) over a register block of values (padding 0): the largest pattern t whose upper
    mass m = base_mass + sum(v >= t) is >= target and > 0 (t0 and its mass when none)."""
    b = v.to(tl.int32, bitcast=True)  # same registers as v
    t = t0
    m_t = base_mass + tl.sum(tl.where(b >= t0, v.to(tl.float64), 0.0), axis=0)
    for r in range(first, 16):
        shift = 30 - 2 * r
        c1 = t + (1 << shift)
        c2 = t + (2 << shift)
        c3 = t + (3 << shift)
        # the three probe masses in one reduction (one barrier sequence per round, not three)
        # (float64 copies made per round, not held across rounds: twice the registers of v)
        s1, s2, s3 = sum3(tl.where(b >= c1, v, 0.0).to(tl.float64), tl.where(b >= c2, v, 0.0).to(tl.float64),
                          tl.where(b >= c3, v, 0.0).to(tl.float64))
        m1 = base_mass + s1
        m2 = base_mass + s2
        m3 = base_mass + s3
        ok1 = (c1 >= 0) & (m1 >= target) & (m1 > 0.0)
        ok2 = (c2 >= 0) & (m2 >= target) & (m2 > 0.0)
        ok3 = (c3 >= 0) & (m3 >= target) & (m3 > 0.0)
        m_t = tl.where(ok3, m3, tl.where(ok2, m2, tl.where(ok1, m1, m_t)))
        t = tl.where(ok3, c3, tl.where(ok2, c2, tl.where(ok1, c1, t)))
    return t, m_t


@triton.jit
def _add7(a0, a1, a2, a3, a4, a5, a6, b0, b1, b2, b3, b4, b5, b6):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6


@triton.jit
def _add15(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14,
           b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14):
    return (a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8, a9 + b9,
            a10 + b10, a11 + b11, a12 + b12, a13 + b13, a14 + b14)


@triton.jit
def _above(b, x, c):
    return tl.where(b >= c, x, 0.0)


@triton.jit
def _step(t, m_t, c, s, d, dmax, base_mass, inner, target, INNER: tl.constexpr):
    """Probe c (digit d, block sum s) becomes the answer if it passed. Probes are taken in
    ascending order, so the largest passing one wins (as in the radix-4 rounds). Its upper mass
    is base_mass + s, or base_mass + (inner + s) for a window block (mass_cutoff_block_window)."""
    if INNER:
        m = base_mass + (inner + s)
    else:
        m = base_mass + s
    ok = (d < dmax) & (c >= 0) & (m >= target) & (m > 0.0)
    return tl.where(ok, c, t), tl.where(ok, m, m_t)


@triton.jit
def _round_wide(b, x, t, m_t, step, dmax, base_mass, inner, target, BITS: tl.constexpr, INNER: tl.constexpr):
    """One round of the wide search: probes t + d * step, d = 1 .. 2**BITS - 1 (those with
    d < dmax), their block sums from one reduction."""
    if BITS == 2:
        c1 = t + step
        c2 = c1 + step
        c3 = c2 + step
        s1, s2, s3 = sum3(_above(b, x, c1), _above(b, x, c2), _above(b, x, c3))
        t, m_t = _step(t, m_t, c1, s1, 1, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c2, s2, 2, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c3, s3, 3, dmax, base_mass, inner, target, INNER)
    elif BITS == 3:
        c1 = t + step
        c2 = c1 + step
        c3 = c2 + step
        c4 = c3 + step
        c5 = c4 + step
        c6 = c5 + step
        c7 = c6 + step
        if INTERPRETED:
            s1 = tl.sum(_above(b, x, c1), axis=0)
            s2 = tl.sum(_above(b, x, c2), axis=0)
            s3 = tl.sum(_above(b, x, c3), axis=0)
            s4 = tl.sum(_above(b, x, c4), axis=0)
            s5 = tl.sum(_above(b, x, c5), axis=0)
            s6 = tl.sum(_above(b, x, c6), axis=0)
            s7 = tl.sum(_above(b, x, c7), axis=0)
        else:
            s1, s2, s3, s4, s5, s6, s7 = tl.reduce(
                (_above(b, x, c1), _above(b, x, c2), _above(b, x, c3), _above(b, x, c4),
                _above(b, x, c5), _above(b, x, c6), _above(b, x, c7)), 0, _add7)
        t, m_t = _step(t, m_t, c1, s1, 1, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c2, s2, 2, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c3, s3, 3, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c4, s4, 4, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c5, s5, 5, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c6, s6, 6, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c7, s7, 7, dmax, base_mass, inner, target, INNER)
    else:
        tl.static_assert(BITS == 4)
        c1 = t + step
        c2 = c1 + step
        c3 = c2 + step
        c4 = c3 + step
        c5 = c4 + step
        c6 = c5 + step
        c7 = c6 + step
        c8 = c7 + step
        c9 = c8 + step
        c10 = c9 + step
        c11 = c10 + step
        c12 = c11 + step
        c13 = c12 + step
        c14 = c13 + step
        c15 = c14 + step
        if INTERPRETED:
            s1 = tl.sum(_above(b, x, c1), axis=0)
            s2 = tl.sum(_above(b, x, c2), axis=0)
            s3 = tl.sum(_above(b, x, c3), axis=0)
            s4 = tl.sum(_above(b, x, c4), axis=0)
            s5 = tl.sum(_above(b, x, c5), axis=0)
            s6 = tl.sum(_above(b, x, c6), axis=0)
            s7 = tl.sum(_above(b, x, c7), axis=0)
            s8 = tl.sum(_above(b, x, c8), axis=0)
            s9 = tl.sum(_above(b, x, c9), axis=0)
            s10 = tl.sum(_above(b, x, c10), axis=0)
            s11 = tl.sum(_above(b, x, c11), axis=0)
            s12 = tl.sum(_above(b, x, c12), axis=0)
            s13 = tl.sum(_above(b, x, c13), axis=0)
            s14 = tl.sum(_above(b, x, c14), axis=0)
            s15 = tl.sum(_above(b, x, c15), axis=0)
        else:
            s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = tl.reduce(
                (_above(b, x, c1), _above(b, x, c2), _above(b, x, c3), _above(b, x, c4),
                _above(b, x, c5), _above(b, x, c6), _above(b, x, c7), _above(b, x, c8),
                _above(b, x, c9), _above(b, x, c10), _above(b, x, c11), _above(b, x, c12),
                _above(b, x, c13), _above(b, x, c14), _above(b, x, c15)), 0, _add15)
        t, m_t = _step(t, m_t, c1, s1, 1, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c2, s2, 2, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c3, s3, 3, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c4, s4, 4, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c5, s5, 5, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c6, s6, 6, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c7, s7, 7, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c8, s8, 8, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c9, s9, 9, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c10, s10, 10, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c11, s11, 11, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c12, s12, 12, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c13, s13, 13, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c14, s14, 14, dmax, base_mass, inner, target, INNER)
        t, m_t = _step(t, m_t, c15, s15, 15, dmax, base_mass, inner, target, INNER)
    return t, m_t


@triton.jit
def _rounds_wide(b, v, t, m_t, nb, nlow, base_mass, inner, target, BITS: tl.constexpr, INNER: tl.constexpr):
    """Rounds over bits nlow .. nb - 1 of the pattern (the bits above nb are the prefix in t),
    BITS per round from the top; the top round may be narrower (digits d < dmax)."""
    n_rounds = (nb - nlow + (BITS - 1)) // BITS
    for k in range(0, n_rounds):
        shift = nlow + (n_rounds - 1 - k) * BITS
        dmax = tl.full((), 1, tl.int32) << tl.minimum(nb - shift, BITS)
        step = tl.full((), 1, tl.int32) << shift  # int32: probes past bit 31 wrap negative (not patterns)
        # (ptxas keeps this float64 copy of the block in registers across rounds, as it does for
        # mass_cutoff_block: one conversion per entry, not per probe)
        x = v.to(tl.float64)
        t, m_t = _round_wide(b, x, t, m_t, step, dmax, base_mass, inner, target, BITS, INNER)
    return t, m_t


@triton.jit
def mass_cutoff_block_wide(v, target, base_mass, first, t0, BITS: tl.constexpr):
    """mass_cutoff_block with 2**BITS - 1 probes per round (BITS = 2, 3 or 4): the same answer
    and the same kept-mass bits, in fewer rounds (bsel_radix; kernels/NOTES.md, session 3).

    The search covers exactly the radix-4 search's range (the 32 - 2 * first bits below the
    prefix t0). Every probe's mass is the float64 sum of the same block entries through the
    same reduction tree as in mass_cutoff_block (one field of a tuple reduction is reduced like
    a single sum), so the predicate, a monotone function of the probe, gives the same largest
    passing pattern and the same mass."""
    b = v.to(tl.int32, bitcast=True)
    m_t = base_mass + tl.sum(tl.where(b >= t0, v.to(tl.float64), 0.0), axis=0)
    return _rounds_wide(b, v, t0, m_t, 32 - 2 * first, 0, base_mass, 0.0, target, BITS, False)


@triton.jit
def compact_in_order(v, keep, dst_ptr, REG: tl.constexpr):
    """Store the entries of the register block v (REG entries) where keep holds to dst_ptr, in
    block order. Put a barrier before reading them back."""
    # in-order positions from a two-level prefix sum (rows of 32 entries: a 1-D scan over
    # the whole block costs ~2.5k instructions per thread and spills under the cap)
    in2 = tl.reshape(keep.to(tl.int32), (REG // 32, 32))
    per_row = tl.sum(in2, axis=1)
    pos = tl.reshape((tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(in2, axis=1) - 1, (REG,))
    tl.store(dst_ptr + pos, v, mask=keep)


@triton.jit
def mass_cutoff_block_window(src_ptr, n, target, base_mass, first, t0, lo, hi, scratch_ptr, scratch_ok,
                             REG: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr, EXACT_SPAN: tl.constexpr):
    """mass_cutoff_block over the n <= REG bracket entries at src_ptr (all in [lo, hi)): two
    radix-4 rounds over the whole block, then the entries left in the window [t, t + 2**wb)
    that can still hold the cutoff (usually a few hundred) are compacted, in order, to
    scratch_ptr (W entries) and the remaining rounds (BITS per round) run on W entries instead
    of the whole block (bsel_window; kernels/NOTES.md, session 3).

    Same answer and bits as mass_cutoff_block: every entry is a multiple of ulp(lo), so when
    the block's total stays below 2**53 ulp(lo) (hi / lo < 2**EXACT_SPAN, checked; else the
    rounds go on over the whole block, reloaded) every float64 partial sum is exact and any
    summation order gives the same block sums; a probe's sum in the window is inner + (window
    entries >= probe), inner = the exact mass of the block entries above the window."""
    ri = tl.arange(0, REG)
    v = tl.maximum(tl.load(src_ptr + ri, mask=ri < n, other=0.0), 0.0)
    b = v.to(tl.int32, bitcast=True)
    m_t = base_mass + tl.sum(tl.where(b >= t0, v.to(tl.float64), 0.0), axis=0)
    nb = 32 - 2 * first
    wb = tl.maximum(nb - 4, 0)  # bits left after the two whole-block rounds
    t, m_t = _rounds_wide(b, v, t0, m_t, nb, wb, base_mass, 0.0, target, 2, False)
    if wb > 0:
        # the block reloaded (volatile: not merged with the first load, not hoisted above the
        # rounds), at addresses computed after the rounds (t >> 31 is 0: t is a pattern, >= 0)
        # so neither the rounds' float64 copy of the block nor its 64-bit addresses live on
        ri2 = ri + (t >> 31)
        v = tl.maximum(tl.load(src_ptr + ri2, mask=ri2 < n, other=0.0, volatile=True), 0.0)
        b = v.to(tl.int32, bitcast=True)
        rel = b - t  # (no overflow: both non-negative)
        inwin = (b >= t) & ((rel >> wb) == 0) & (b > 0)
        n_win = tl.sum(inwin.to(tl.int32), axis=0)
        e_lo = tl.maximum(lo >> 23, 1)  # biased exponents; subnormals share exponent 1's ulp
        e_hi = tl.maximum((hi - 1) >> 23, 1)
        if scratch_ok & (n_win <= W) & (e_hi - e_lo <= EXACT_SPAN):
            inner = tl.sum(tl.where((b >= t) & ((rel >> wb) != 0), v.to(tl.float64), 0.0), axis=0)
            # in-order positions from a two-level prefix sum (rows of 32 entries: a 1-D scan over
            # the whole block costs ~2.5k instructions per thread and spills under the cap); the
            # code of compact_in_order, kept inline: called, the IR comes out in another order and
            # ptxas allocates registers differently (this variant's SASS stays byte-identical)
            in2 = tl.reshape(inwin.to(tl.int32), (REG // 32, 32))
            per_row = tl.sum(in2, axis=1)
            pos = tl.reshape((tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(in2, axis=1) - 1, (REG,))
            tl.store(scratch_ptr + pos, v, mask=inwin)
            tl.debug_barrier()
            wi = tl.arange(0, W)
            w = tl.load(scratch_ptr + wi, mask=wi < n_win, other=0.0)
            t, m_t = _rounds_wide(w.to(tl.int32, bitcast=True), w, t, m_t, wb, 0, base_mass, inner, target,
                                  BITS, True)
        else:
            t, m_t = _rounds_wide(b, v, t, m_t, wb, 0, base_mass, 0.0, target, 2, False)
    return t, m_t


@triton.jit
def bin_shift(lo, hi, B: tl.constexpr):
    """log2 of the sub-bracket width (bracket_bins): the smallest shift with (hi - 1 - lo) >> shift
    < B, so every pattern b in [lo, hi) lies in bin (b - lo) >> shift, one of 0 .. B - 1."""
    # = max(bit length of the span - log2(B), 0); the bit length from the exponent of the span as
    # a float64 (exact for any int32)
    span = tl.maximum(hi - 1 - lo, 0)
    e = (span.to(tl.float64).to(tl.int64, bitcast=True) >> 52).to(tl.int32) - 1022
    log2_b: tl.constexpr = B.bit_length() - 1
    return tl.maximum(tl.where(span > 0, e, 0) - log2_b, 0)


@triton.jit
def mass_cutoff_block_bins(src_ptr, n, target, base_mass, bin_mass, lo, shift, scratch_ptr,
                           STEP: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr):
    """(t, m, ok): mass_cutoff_block's answer and kept-mass bits over the n <= REG bracket entries
    at src_ptr (all in [lo, hi)), searched among one sub-bracket's entries only (bracket_bins;
    kernels/NOTES.md, "Sub-bracket bins"). bin_mass: the exact float64 mass of the entries in
    each bin (b - lo) >> shift. ok is 0 (nothing decided) when the bin holds more than W entries.

    Exactness (checked by the caller: hi / lo < 2**EXACT_SPAN, n <= REG): every entry is a multiple
    of ulp(lo) and any sum of them stays below 2**53 ulp(lo), so every float64 partial sum is exact
    and S(c) = the mass of the entries >= c does not depend on the order of summation. The upper
    mass at bin k's first pattern is S = the bins >= k; the cutoff lies in the last bin kb whose
    base_mass + S passes the predicate (a monotone function of the pattern), and a probe c in bin kb
    has S(c) = inner (the bins above kb) + the bin's entries >= c: the same float64 value as the
    whole-block sum, so the same predicate, the same largest passing pattern and the same mass.
    scratch_ptr: room for n entries."""
    k = tl.arange(0, B)
    s_ge = tl.sum(tl.where(k[None, :] >= k[:, None], bin_mass[None, :], 0.0), axis=1)  # bins >= k
    m_k = base_mass + s_ge
    kb = tl.max(tl.where((m_k >= target) & (m_k > 0.0), k, 0), axis=0)  # bin 0 passes (checked)
    inner = tl.sum(tl.where(k > kb, bin_mass, 0.0), axis=0)
    t = lo + (kb << shift)
    m_t = base_mass + (inner + tl.sum(tl.where(k == kb, bin_mass, 0.0), axis=0))
    # the bin's entries compacted in list order, STEP at a time (the whole REG block at once
    # spills under the register cap); positions stay below n (scratch_ptr has room for n)
    n_w = tl.full((), 0, tl.int32)
    for s0 in range(0, n, STEP):
        ri = s0 + tl.arange(0, STEP)
        v = tl.load(src_ptr + ri, mask=ri < n, other=0.0)
        b = v.to(tl.int32, bitcast=True)
        inbin = (b >= t) & (((b - t) >> shift) == 0)  # (padding 0 < lo <= t)
        compact_in_order(v, inbin, scratch_ptr + n_w, STEP)
        n_w += tl.sum(inbin.to(tl.int32), axis=0)
    tl.debug_barrier()
    ok = n_w <= W
    if ok:
        wi = tl.arange(0, W)
        w = tl.load(scratch_ptr + wi, mask=wi < n_w, other=0.0)
        # rounds over the bin's offsets [0, 2**shift) from t (patterns past the bin's entries add
        # nothing to inner, fail like the bin above; past bit 31 they wrap negative: not patterns)
        t, m_t = _rounds_wide(w.to(tl.int32, bitcast=True), w, t, m_t, shift, 0, base_mass, inner, target,
                              BITS, True)
    return t, m_t, ok


@triton.jit
def list_groups_block(gid_row_ptr, gbits, gidx, cut_bits):
    """Write, in order, the ids of the groups (a register block of their max bits) whose max is
    >= cut_bits; return their count. Put a barrier between this and reading the list back."""
    sel = gbits >= cut_bits
    sel_i = sel.to(tl.int32)
    pos = tl.cumsum(sel_i, axis=0) - 1
    tl.store(gid_row_ptr + pos, gidx, mask=sel)
    return tl.sum(sel_i, axis=0)


# --- streamed (SUB entries per step, one block reduction per round) --------------------------

@triton.jit
def kth_largest_bits(src_ptr, gid_ptr, n, vocab, k, base_count, thr_bits, scale, first, t0, last,
                     GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr):
    """Largest bit pattern t with base_count + #{v >= t} >= k (t0 when none): the k-th largest.
    Rounds run from ``first`` (from prefix ``t0``; 0, 0 for a full search) to ``last``."""
    d = tl.arange(0, 4)
    t = t0
    for r in range(first, last):
        probes = t + (d << (30 - 2 * r))
        acc = tl.zeros((SUB, 4), dtype=tl.int32)
        for s in range(0, n, SUB):
            v = load_values(src_ptr, gid_ptr, s + tl.arange(0, SUB), n, vocab, thr_bits, scale,
                            GATHER, SCALED, G)
            b = v.to(tl.int32, bitcast=True)
            acc += (b[:, None] >= probes[None, :]).to(tl.int32)
        counts = tl.sum(acc, axis=0)
        ok = (probes >= 0) & (base_count + counts >= k)
        best, t = _pick(t, probes, d, ok)
    return t


@triton.jit
def mass_cutoff_bits(src_ptr, gid_ptr, n, vocab, target, base_mass, thr_bits, scale, first, t0,
                     GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr):
    """(t, m): the largest bit pattern t whose upper mass m = base_mass + sum(v >= t) is
    >= target and > 0 (t0 and its upper mass when none)."""
    d = tl.arange(0, 4)
    t = t0
    m_t = tl.full((), 0.0, tl.float64)
    for r in range(first, 16):
        probes = t + (d << (30 - 2 * r))
        acc = tl.zeros((SUB, 4), dtype=tl.float64)
        for s in range(0, n, SUB):
            v = load_values(src_ptr, gid_ptr, s + tl.arange(0, SUB), n, vocab, thr_bits, scale,
                            GATHER, SCALED, G)
            b = v.to(tl.int32, bitcast=True)
            acc += tl.where(b[:, None] >= probes[None, :], v.to(tl.float64)[:, None], 0.0)
        masses = tl.sum(acc, axis=0) + base_mass
        ok = (probes >= 0) & (masses >= target) & (masses > 0.0)
        best, t = _pick(t, probes, d, ok)
        m_t = tl.sum(tl.where(d == best, masses, 0.0), axis=0)
    return t, m_t


@triton.jit
def upper_mass(src_ptr, gid_ptr, n, vocab, t_bits, thr_bits, scale,
               GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr):
    """float64 sum of the values v >= t (bit patterns), in a fixed order."""
    acc = tl.zeros((SUB,), dtype=tl.float64)
    for s in range(0, n, SUB):
        v = load_values(src_ptr, gid_ptr, s + tl.arange(0, SUB), n, vocab, thr_bits, scale,
                        GATHER, SCALED, G)
        b = v.to(tl.int32, bitcast=True)
        acc += tl.where(b >= t_bits, v.to(tl.float64), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def compact_values(src_ptr, gid_ptr, n, vocab, cut_bits, list_ptr, CAP,
                   GATHER: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr):
    """Copy, in order, the positive candidates >= cut_bits to list_ptr (the first CAP of them);
    return their count and float64 mass. Put a barrier before reading the list back."""
    count = tl.full((), 0, tl.int32)
    acc = tl.zeros((SUB,), dtype=tl.float64)
    for s in range(0, n, SUB):
        v = load_values(src_ptr, gid_ptr, s + tl.arange(0, SUB), n, vocab, 0, 1.0, GATHER, False, G)
        keep = (v.to(tl.int32, bitcast=True) >= cut_bits) & (v > 0.0)
        keep_i = keep.to(tl.int32)
        pos = count + tl.cumsum(keep_i, axis=0) - 1
        tl.store(list_ptr + pos, v, mask=keep & (pos < CAP))
        acc += tl.where(keep, v.to(tl.float64), 0.0)
        count += tl.sum(keep_i, axis=0)
    return count, tl.sum(acc, axis=0)


# --- either way ---------------------------------------------------------------------------------

@triton.jit
def kth_largest_any(src_ptr, gid_ptr, n, vocab, k, thr_bits, scale, first, t0,
                    GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                    REG: tl.constexpr):
    """The k-th largest candidate (bits), from registers when n <= REG."""
    if n <= REG:
        v = load_values(src_ptr, gid_ptr, tl.arange(0, REG), n, vocab, thr_bits, scale, GATHER, SCALED, G)
        t = kth_largest_block(v.to(tl.int32, bitcast=True), k, first, t0, 16)
    else:
        t = kth_largest_bits(src_ptr, gid_ptr, n, vocab, k, 0, thr_bits, scale, first, t0, 16,
                             GATHER, SCALED, G, SUB)
    return t


@triton.jit
def mass_cutoff_any(src_ptr, gid_ptr, n, vocab, target, base_mass, thr_bits, scale, first, t0,
                    GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                    REG: tl.constexpr):
    """mass_cutoff over the candidates, from registers when n <= REG."""
    if n <= REG:
        v = load_values(src_ptr, gid_ptr, tl.arange(0, REG), n, vocab, thr_bits, scale, GATHER, SCALED, G)
        t, m = mass_cutoff_block(v, target, base_mass, first, t0)
    else:
        t, m = mass_cutoff_bits(src_ptr, gid_ptr, n, vocab, target, base_mass, thr_bits, scale, first, t0,
                                GATHER, SCALED, G, SUB)
    return t, m


@triton.jit
def mass_cutoff_any_wide(src_ptr, gid_ptr, n, vocab, target, base_mass, thr_bits, scale, first, t0,
                         GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                         REG: tl.constexpr, BITS: tl.constexpr):
    """mass_cutoff_any with mass_cutoff_block_wide for the register block (same answer and bits)."""
    if n <= REG:
        v = load_values(src_ptr, gid_ptr, tl.arange(0, REG), n, vocab, thr_bits, scale, GATHER, SCALED, G)
        t, m = mass_cutoff_block_wide(v, target, base_mass, first, t0, BITS)
    else:
        t, m = mass_cutoff_bits(src_ptr, gid_ptr, n, vocab, target, base_mass, thr_bits, scale, first, t0,
                                GATHER, SCALED, G, SUB)
    return t, m


@triton.jit
def mass_cutoff_any_window(src_ptr, n, target, base_mass, first, t0, lo, hi, scratch_ptr, scratch_ok,
                           SUB: tl.constexpr, REG: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr,
                           EXACT_SPAN: tl.constexpr):
    """mass_cutoff_any over a contiguous list of bracket entries, with mass_cutoff_block_window
    for the register block (same answer and bits)."""
    if n <= REG:
        t, m = mass_cutoff_block_window(src_ptr, n, target, base_mass, first, t0, lo, hi, scratch_ptr, scratch_ok,
                                        REG, W, BITS, EXACT_SPAN)
    else:
        t, m = mass_cutoff_bits(src_ptr, src_ptr, n, n, target, base_mass, 0, 1.0, first, t0,
                                False, False, 1, SUB)
    return t, m


@triton.jit
def upper_mass_any(src_ptr, gid_ptr, n, vocab, t_bits, thr_bits, scale,
                   GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                   REG: tl.constexpr):
    """upper_mass of the candidates, from one register block when n <= REG."""
    if n <= REG:
        v = load_values(src_ptr, gid_ptr, tl.arange(0, REG), n, vocab, thr_bits, scale, GATHER, SCALED, G)
        m = tl.sum(tl.where(v.to(tl.int32, bitcast=True) >= t_bits, v.to(tl.float64), 0.0), axis=0)
    else:
        m = upper_mass(src_ptr, gid_ptr, n, vocab, t_bits, thr_bits, scale, GATHER, SCALED, G, SUB)
    return m


@triton.jit
def reciprocal_f32(mass):
    """fp32(1 / mass) from a float64 mass, 0 for an empty mass."""
    safe = tl.where(mass > 0.0, mass, 1.0)
    return tl.where(mass > 0.0, (1.0 / safe).to(tl.float32), 0.0)
