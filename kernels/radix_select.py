"""Triton device helpers: cutoff searches over float32 bit patterns (radix-4 bisection).

Non-negative float32 values order like their int32 bit patterns, so "the k-th largest value"
and "the largest value whose upper mass reaches P" are searches over 31-bit integers: up to 16
rounds, each testing the three non-zero values of the next 2-bit digit. Counts are exact int32
sums and masses float64 sums in a fixed order (fixed block shapes, fixed loop order), so a
search gives the same bits on every call, batch size and row position. A search whose answer
is known to lie in [lo, hi] starts after the bits lo and hi share (``search_start``), and one whose
answer is an entry of a float16 / bfloat16 input ends before the bits every such entry leaves 0
(``LAST``: renorm_config.search_rounds).

The per-row kernels are latency-bound (one program per row, dependent steps), so values live in
registers when they fit (``*_block`` helpers, ``REG`` entries) and are streamed in ``SUB``-entry
steps from L1/L2 otherwise; ``*_any`` picks one by the count, a function of the row alone.

A "candidate source" is either a contiguous run of ``n`` values at ``src_ptr`` (GATHER=False)
or, with GATHER=True, the groups of G consecutive entries of a row whose group ids are listed
at ``gid_ptr`` (``n`` = groups * G). With SCALED=True a value ``x`` is read as
``fp32(x * scale)`` when ``x >= thr`` and 0 otherwise: the output of an earlier top-k renorm,
recomputed on the fly exactly as the write pass computes it.

``mass_cutoff_block_bins`` (RenormConfig.bracket_bins; docs/design-renorm.md, "Sub-bracket bins"):
mass_cutoff_block's cutoff and kept-mass bits from radix-4 rounds on one sub-bracket's entries,
chosen from per-bin masses the bracket pass summed.
"""

from __future__ import annotations


import triton
import triton.language as tl

from tpguard.config import interpreting

# The interpreter runs a tl.reduce with a custom combine function element by element in Python
# (seconds per call on a 16k block); there, packed sums fall back to one numpy tl.sum each.
# Fixed when the kernels are defined, as Triton fixes interpreted vs compiled kernels then.
INTERPRETED = tl.constexpr(interpreting())


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
    x = tl.maximum(x.to(tl.float32), 0.0)  # fp16 / bf16 probabilities: exact in float32
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
def mass_cutoff_block(v, target, base_mass, first, t0, LAST: tl.constexpr = 16):
    """(t, m) over a register block of values (padding 0): the largest pattern t whose upper
    mass m = base_mass + sum(v >= t) is >= target and > 0 (t0 and its mass when none)."""
    b = v.to(tl.int32, bitcast=True)  # same registers as v
    t = t0
    m_t = base_mass + tl.sum(tl.where(b >= t0, v.to(tl.float64), 0.0), axis=0)
    for r in range(first, LAST):
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
def _above(b, x, c):
    return tl.where(b >= c, x, 0.0)


@triton.jit
def _step(t, m_t, c, s, d, dmax, base_mass, inner, target):
    """Probe c (digit d, block sum s) becomes the answer if it passed. Probes are taken in
    ascending order, so the largest passing one wins (as in mass_cutoff_block). Its upper mass
    is base_mass + (inner + s), inner = the mass above the searched entries (mass_cutoff_block_bins)."""
    m = base_mass + (inner + s)
    ok = (d < dmax) & (c >= 0) & (m >= target) & (m > 0.0)
    return tl.where(ok, c, t), tl.where(ok, m, m_t)


@triton.jit
def _radix4_round(b, x, t, m_t, step, dmax, base_mass, inner, target):
    """One radix-4 round: probes t + d * step, d = 1 .. 3 (those with d < dmax), their block sums
    from one reduction."""
    c1 = t + step
    c2 = c1 + step
    c3 = c2 + step
    s1, s2, s3 = sum3(_above(b, x, c1), _above(b, x, c2), _above(b, x, c3))
    t, m_t = _step(t, m_t, c1, s1, 1, dmax, base_mass, inner, target)
    t, m_t = _step(t, m_t, c2, s2, 2, dmax, base_mass, inner, target)
    t, m_t = _step(t, m_t, c3, s3, 3, dmax, base_mass, inner, target)
    return t, m_t


@triton.jit
def _radix4_rounds(b, v, t, m_t, nb, base_mass, inner, target, low):
    """Rounds over bits low .. nb - 1 of the pattern (the bits above nb are the prefix in t; the bits
    below low are 0 in the answer), 2 per round from the top; the top round may be narrower (digits
    d < dmax)."""
    n_rounds = (tl.maximum(nb - low, 0) + 1) // 2
    for k in range(0, n_rounds):
        shift = low + (n_rounds - 1 - k) * 2
        dmax = tl.full((), 1, tl.int32) << tl.minimum(nb - shift, 2)
        step = tl.full((), 1, tl.int32) << shift  # int32: probes past bit 31 wrap negative (not patterns)
        # (ptxas keeps this float64 copy of the block in registers across rounds, as it does for
        # mass_cutoff_block: one conversion per entry, not per probe)
        x = v.to(tl.float64)
        t, m_t = _radix4_round(b, x, t, m_t, step, dmax, base_mass, inner, target)
    return t, m_t


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
                           STEP: tl.constexpr, W: tl.constexpr, B: tl.constexpr, ZERO_BITS: tl.constexpr = 0):
    """(t, m, ok): mass_cutoff_block's answer and kept-mass bits over the n <= REG bracket entries
    at src_ptr (all in [lo, hi)), searched among one sub-bracket's entries only (bracket_bins;
    docs/design-renorm.md, "Sub-bracket bins"). bin_mass: the exact float64 mass of the entries in
    each bin (b - lo) >> shift. ok is 0 (nothing decided) when the bin holds more than W entries.

    Exactness (checked by the caller: hi / lo < 2**EXACT_SPAN, n <= REG): every entry is a multiple
    of ulp(lo) and any sum of them stays below 2**53 ulp(lo), so every float64 partial sum is exact
    and S(c) = the mass of the entries >= c does not depend on the order of summation. The upper
    mass at bin k's first pattern is S = the bins >= k; the cutoff lies in the last bin kb whose
    base_mass + S passes the predicate (a monotone function of the pattern), and a probe c in bin kb
    has S(c) = inner (the bins above kb) + the bin's entries >= c: the same float64 value as the
    whole-block sum, so the same predicate, the same largest passing pattern and the same mass.
    scratch_ptr: room for n entries. ZERO_BITS (renorm_config.search_rounds): the low bits that are 0 in
    every entry (16 for bfloat16 inputs): that answer is the bin's start or one of its entries, so when
    the start is a multiple of 2**ZERO_BITS the rounds skip those bits."""
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
        low = tl.where((shift >= ZERO_BITS) & ((t & ((1 << ZERO_BITS) - 1)) == 0), ZERO_BITS, 0)
        t, m_t = _radix4_rounds(w.to(tl.int32, bitcast=True), w, t, m_t, shift, base_mass, inner, target, low)
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
                     GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                     LAST: tl.constexpr = 16):
    """(t, m): the largest bit pattern t whose upper mass m = base_mass + sum(v >= t) is
    >= target and > 0 (t0 and its upper mass when none)."""
    d = tl.arange(0, 4)
    t = t0
    m_t = tl.full((), 0.0, tl.float64)
    # at least one round: it sets m_t (with LAST < 16 a search may start at or past LAST)
    for r in range(tl.minimum(first, LAST - 1), LAST):
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
def mass_cutoff_any(src_ptr, gid_ptr, n, vocab, target, base_mass, thr_bits, scale, first, t0,
                    GATHER: tl.constexpr, SCALED: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                    REG: tl.constexpr, LAST: tl.constexpr = 16):
    """mass_cutoff over the candidates, from registers when n <= REG; rounds first..LAST-1 (LAST < 16:
    renorm_config.search_rounds, only where base_mass < target, so that the answer is an entry or t0)."""
    if n <= REG:
        v = load_values(src_ptr, gid_ptr, tl.arange(0, REG), n, vocab, thr_bits, scale, GATHER, SCALED, G)
        t, m = mass_cutoff_block(v, target, base_mass, first, t0, LAST)
    else:
        t, m = mass_cutoff_bits(src_ptr, gid_ptr, n, vocab, target, base_mass, thr_bits, scale, first, t0,
                                GATHER, SCALED, G, SUB, LAST)
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
