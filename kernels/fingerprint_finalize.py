"""Finalize: partial lane sums ``[chunks, rows, 2]`` (int64) -> row fingerprints, and the top hash
when all rows fit one program. Integer sums are order-independent: no atomics, and the result does
not depend on the chunking. Launched after the one-tensor lane launch (kernels/fingerprint_lanes.py,
fingerprint_tma.py) and after the renorm write pass (renorm_write_fp.py, as its PDL dependent).

Reference: `tpguard.kernels.fingerprint_reference` (numpy).
"""

from __future__ import annotations

from tpguard.kernels.fingerprint_words import _next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: nothing here is defined or launched
    triton = None

if triton is not None:
    from tpguard.kernels.fingerprint_hash import _row_fp, _seed64, _top_lane_sums
    from tpguard.kernels.pdl import pdl_enter

    @triton.jit
    def _partial_sums(partial_ptr, rows, row_ok, n_rows, n_chunks, BR: tl.constexpr,
                      BC: tl.constexpr):
        """Row lane sums from partials [chunks, rows, 2], BC chunks at a time."""
        l1 = tl.zeros([BR], dtype=tl.uint64)
        l2 = tl.zeros([BR], dtype=tl.uint64)
        for c0 in range(0, n_chunks, BC):
            cs = c0 + tl.arange(0, BC)
            m = row_ok[:, None] & (cs < n_chunks)[None, :]
            p = partial_ptr + (cs.to(tl.int64)[None, :] * n_rows + rows[:, None]) * 2
            l1 += tl.sum(tl.load(p, mask=m, other=0).to(tl.uint64, bitcast=True), axis=1)
            l2 += tl.sum(tl.load(p + 1, mask=m, other=0).to(tl.uint64, bitcast=True), axis=1)
        return l1, l2

    @triton.jit(do_not_specialize=["s_lo", "s_hi", "t_lo", "t_hi"])
    def _finalize_kernel(partial_ptr, rows_out_ptr, top_ptr, n_rows, n_chunks,
                         s_lo, s_hi, t_lo, t_hi, TOP: tl.constexpr, BR: tl.constexpr,
                         BC: tl.constexpr, PDL: tl.constexpr = 0):
        """Partial lane sums [chunks, rows, 2] -> row fingerprints (and, if TOP, in a single
        program, the top hash). PDL (kernels/pdl.py): as the renorm write pass's dependent."""
        pdl_enter(PDL)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = rows < n_rows
        l1, l2 = _partial_sums(partial_ptr, rows, row_ok, n_rows, n_chunks, BR, BC)
        fp = _row_fp(l1, l2, _seed64(s_lo.to(tl.uint32), s_hi.to(tl.uint32)))
        tl.store(rows_out_ptr + rows, fp.to(tl.int64, bitcast=True), mask=row_ok)
        if TOP:
            t_lo = t_lo.to(tl.uint32)
            t_hi = t_hi.to(tl.uint32)
            t1, t2 = _top_lane_sums(fp, rows, row_ok, t_lo)
            tl.store(top_ptr, _row_fp(t1, t2, _seed64(t_lo, t_hi)).to(tl.int64, bitcast=True))


def _finalize_chunks(rows_per_program: int, chunks: int) -> int:
    """Chunks summed per finalize step: up to 4096 partials per [rows, chunks] tile."""
    return max(1, min(_next_pow2(chunks), 4096 // rows_per_program))
