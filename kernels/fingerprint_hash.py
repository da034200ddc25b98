"""The fingerprint's hash in Triton: the building blocks every fingerprint kernel shares (the
word hash, per-row lane sums of a tile, the row and top hashes, partial sums' layout).

Reference: `tpguard.kernels.fingerprint_reference` (numpy), whose docstring holds the definition;
the kernels built on these (kernels/fingerprint_lanes.py, fingerprint_finalize.py,
fingerprint_segments.py, fingerprint_tma.py, and the renorm write pass, renorm_write_fp.py) match it
bit for bit.

* Long rows are hashed ``rows_per_tile`` side by side: a thread holds the same columns of
  several rows, so the per-column position work (``_pos_mix``) is shared by those rows.
* Loads of the column loop (`_tile_lane_sums`): the next step's words are loaded before the
  current ones are hashed (deeper register prefetch, Triton's cp.async pipeline and cache hints
  measured no better on an H200: docs/design-fingerprint.md, "Tried and lost").
* Per-row groups of words are summed through ``tl.reshape`` WITHOUT ``can_reorder``: a reordering
  reshape let the sm_90 compiler mix rows of multi-row tiles (wrong row fingerprints of [3, 5]
  tensors and of the guard's decisions set on a GPU); the interpreter never reorders.

Cost: ~14 SASS instructions per 32-bit word in the loop of the default tile (fp/2; fp/1's second
fmix32 made it ~22; sm_90, Triton 3.6, counted offline; docs/design-fingerprint.md).
"""

from __future__ import annotations

from tpguard.kernels import fingerprint_reference as ref
from tpguard.kernels import interpreter_fix

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: nothing here is defined or launched
    triton = None
    tl = None

interpreter_fix.install()  # the kernels built on these have runtime loop bounds

if triton is not None:
    _C1 = tl.constexpr(ref.C1)
    _C2 = tl.constexpr(ref.C2)
    _FMIX32_A = tl.constexpr(ref.FMIX32_A)
    _FMIX32_B = tl.constexpr(ref.FMIX32_B)
    _FMIX64_A = tl.constexpr(ref.FMIX64_A)
    _FMIX64_B = tl.constexpr(ref.FMIX64_B)
    _M32 = tl.constexpr(ref.M32)

    @triton.jit
    def _shr(x, K: tl.constexpr, MULHI: tl.constexpr):
        """x >> K for uint32 x. MULHI: as umulhi(x, 2**(32-K)), an IMAD.HI on the FMA pipe instead
        of a shift on the integer ALU pipe, which this kernel saturates first."""
        if MULHI:
            r = tl.umulhi(x, 1 << (32 - K))
        else:
            r = x >> K
        return r

    @triton.jit
    def _fmix32_rest(x, MULHI16: tl.constexpr, MULHI13: tl.constexpr):
        """fmix32 after its first ``x ^= x >> 16`` step."""
        x *= _FMIX32_A
        x ^= _shr(x, 13, MULHI13)
        x *= _FMIX32_B
        x ^= _shr(x, 16, MULHI16)
        return x

    @triton.jit
    def _pos_mix(pos):
        """P = pos ^ (pos >> 16), with pos = j * C2 + s_lo: per column, shared by all rows of a tile.
        Shifts distribute over xor, so fmix32(t ^ pos) = fmix32_rest(t ^ (t >> 16) ^ P): one 3-input
        xor per word instead of two xors."""
        return pos ^ (pos >> 16)

    @triton.jit
    def _fmix64(x):
        x ^= x >> 33
        x *= _FMIX64_A
        x ^= x >> 33
        x *= _FMIX64_B
        x ^= x >> 33
        return x

    @triton.jit
    def _word_hashes(w, pmix, SHIFTS: tl.constexpr):
        """The two lane terms of the definition, for uint32 words w and pmix = _pos_mix(j * C2 +
        s_lo): h_j (uint32) and h_j ** 2 (uint64: one IMAD.WIDE on the FMA pipe, where fp/1's second
        fmix32 cost ~6 integer-ALU instructions per word). SHIFTS: which of h's shifts run as
        IMAD.HI (`KernelConfig.shifts`, a bitmask of SHIFT_H16 = 1, SHIFT_H13 = 2; literals here:
        the interpreter passes ints)."""
        t = w * _C1
        h = _fmix32_rest(t ^ _shr(t, 16, (SHIFTS & 1) != 0) ^ pmix, (SHIFTS & 1) != 0, (SHIFTS & 2) != 0)
        h64 = h.to(tl.uint64)
        return h, h64 * h64

    @triton.jit
    def _as_words(x, EB: tl.constexpr):
        """Loaded storage values -> uint32 words. 1- and 2-byte values go through an unsigned view
        of their own width first, so they are zero-extended whatever the pointer's signedness."""
        if EB == 4:
            w = x.to(tl.uint32, bitcast=True)
        elif EB == 2:
            w = x.to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            w = x.to(tl.uint8, bitcast=True).to(tl.uint32)
        return w

    @triton.jit
    def _row_fp(l1, l2, seed):
        return _fmix64(l1 ^ _fmix64(l2 ^ seed))

    @triton.jit
    def _seed64(lo, hi):
        return (hi.to(tl.uint64) << 32) | lo.to(tl.uint64)

    @triton.jit
    def _group_sum(x, BR: tl.constexpr, BN: tl.constexpr, V: tl.constexpr):
        """uint32 [BR, BN] -> uint64 [BR, BN // V], sums of V adjacent words of a row, so that one
        64-bit accumulator add serves V words. The reshape must keep element order
        (can_reorder=False): with can_reorder=True the compiler may regroup elements across rows
        (it did on sm_90, Triton 3.6: a [4, 8] tile became [4, 2, 4] groups mixing rows), which
        the interpreter never does. With V words per thread the ordered reshape costs no moves."""
        x = x.to(tl.uint64)
        if V > 1:
            x = tl.sum(tl.reshape(x, [BR, BN // V, V]), axis=2)
        return x

    @triton.jit
    def _tile_lane_sums(ptrs, pos, n_full, tail, EB: tl.constexpr, BR: tl.constexpr,
                        BN: tl.constexpr, SHIFTS: tl.constexpr):
        """Per-row lane sums (L1, L2) of a [BR, BN] tile walked along its columns: ``n_full``
        unmasked steps of BN words, then ``tail`` (< BN) masked words.

        The next step's words are loaded before the current ones are hashed (manual double
        buffering), so a warp keeps a load in flight while it computes.
        """
        POS_STEP: tl.constexpr = (BN * _C2) & _M32
        V: tl.constexpr = 4 if BN >= 4 else BN
        acc1 = tl.zeros([BR, BN // V], dtype=tl.uint64)
        acc2 = tl.zeros([BR, BN // V], dtype=tl.uint64)
        nxt = tl.load(ptrs, mask=n_full > 0, other=0)
        for k in range(n_full):
            w = nxt
            nxt = tl.load(ptrs + (k + 1) * BN, mask=k + 1 < n_full, other=0)
            h, g = _word_hashes(_as_words(w, EB), _pos_mix(pos), SHIFTS)
            acc1 += _group_sum(h, BR, BN, V)
            acc2 += _group_sum(g, BR, BN, V)
            pos += POS_STEP
        if tail > 0:
            cmask = tl.arange(0, BN)[None, :] < tail
            w = tl.load(ptrs + n_full * BN, mask=cmask, other=0)
            h, g = _word_hashes(_as_words(w, EB), _pos_mix(pos), SHIFTS)
            acc1 += _group_sum(tl.where(cmask, h, 0), BR, BN, V)
            acc2 += _group_sum(tl.where(cmask, g, 0), BR, BN, V)
        return tl.sum(acc1, axis=1), tl.sum(acc2, axis=1)

    @triton.jit
    def _top_lane_sums(fp, rows, row_ok, t_lo):
        """Lane sums of the top hash over row fingerprints fp (word 2r: low half, 2r+1: high)."""
        lo = (fp & _M32).to(tl.uint32)
        hi = (fp >> 32).to(tl.uint32)
        pos_lo = (2 * rows).to(tl.uint32) * _C2 + t_lo
        h_lo, g_lo = _word_hashes(lo, _pos_mix(pos_lo), 0)
        h_hi, g_hi = _word_hashes(hi, _pos_mix(pos_lo + _C2), 0)
        l1 = tl.where(row_ok, h_lo.to(tl.uint64) + h_hi.to(tl.uint64), 0)
        l2 = tl.where(row_ok, g_lo.to(tl.uint64) + g_hi.to(tl.uint64), 0)
        return tl.sum(l1, axis=0), tl.sum(l2, axis=0)

    @triton.jit
    def _tile_origin(rb, c, n_rows, n_words, BR: tl.constexpr, BN: tl.constexpr, CHUNK_TILES: tl.constexpr):
        """Rows and columns of work item (row block rb, chunk c). Padding rows of the last row
        block read a valid row (rows_ld); their sums are never stored (row_ok)."""
        rows = rb * BR + tl.arange(0, BR)
        col0 = c * (CHUNK_TILES * BN)
        return (rows, rows < n_rows, tl.minimum(rows, n_rows - 1), col0,
                tl.minimum(n_words - col0, CHUNK_TILES * BN))

    @triton.jit
    def _store_partials(partial_ptr, c, n_rows, rows, row_ok, l1, l2):
        """Partial lane sums of chunk c, laid out [chunks, rows, 2]."""
        p = partial_ptr + (c.to(tl.int64) * n_rows + rows) * 2
        tl.store(p, l1.to(tl.int64, bitcast=True), mask=row_ok)
        tl.store(p + 1, l2.to(tl.int64, bitcast=True), mask=row_ok)
