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
