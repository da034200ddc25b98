"""One tensor's lanes: `_rows_kernel` hashes a tensor's rows of words, and `_hash_words` launches it
(or the TMA lane launch, kernels/fingerprint_tma.py) and the finalize (kernels/fingerprint_finalize.py).

Reference: `tpguard.kernels.fingerprint_reference` (numpy); bit-identical whatever the config.

``_rows_kernel``, grid ``(row_blocks, chunks)``: a program walks a ``[BR, BN]`` tile along the
columns of its chunk (long rows: ``rows_per_tile`` rows x ``block_words / rows_per_tile``; short
rows: many rows per tile) in 32-bit integer math, summing groups of 4 words into uint64 lane
accumulators (ptxas turns that into 3-input adds with two carries: one 64-bit add per 2 words). It
writes the row fingerprints (one chunk per row) or fixed partial lane sums ``[chunks, rows, 2]``
that ``_finalize_kernel`` adds up. The "top" hash over the row fingerprints is fused into the last
kernel when all rows fit one program; otherwise the caller hashes the row fingerprints as one long
row of words.
"""

from __future__ import annotations

import torch

from tpguard.kernels import fingerprint_tma
from tpguard.kernels.fingerprint_config import KernelConfig
from tpguard.kernels.fingerprint_finalize import _finalize_chunks
from tpguard.kernels.fingerprint_words import (_MAX_GRID_Y, _next_pow2, _reg_opts, _seed_args, _tile, _warps,
                                               _Words)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: nothing here is defined or launched
    triton = None

if triton is not None:
    from tpguard.kernels.fingerprint_finalize import _finalize_kernel
    from tpguard.kernels.fingerprint_hash import (_C2, _row_fp, _seed64, _store_partials, _tile_lane_sums,
                                                  _tile_origin, _top_lane_sums)

    # Seed halves arrive as value + 2**32, so Triton always types them int64 (one compiled
    # variant per shape class, not per seed); `.to(tl.uint32)` keeps the low 32 bits.
    @triton.jit(do_not_specialize=["s_lo", "s_hi", "t_lo", "t_hi"])
    def _rows_kernel(words_ptr, rows_out_ptr, partial_ptr, top_ptr,
                     n_rows, n_words, row_stride,
                     s_lo, s_hi, t_lo, t_hi,
                     MODE: tl.constexpr, EB: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                     CHUNK_TILES: tl.constexpr, SHIFTS: tl.constexpr):
        """MODE 0: partial lane sums [chunks, rows, 2]; 1: row fingerprints; 2: row fingerprints
        and the top hash (a single program holds all rows)."""
        rb = tl.program_id(0)
        c = tl.program_id(1)
        s_lo = s_lo.to(tl.uint32)
        s_hi = s_hi.to(tl.uint32)
        rows, row_ok, rows_ld, col0, width = _tile_origin(rb, c, n_rows, n_words, BR, BN, CHUNK_TILES)
        cols = col0 + tl.arange(0, BN)
        ptrs = words_ptr + rows_ld.to(tl.int64)[:, None] * row_stride + cols[None, :]
        pos = (cols.to(tl.uint32) * _C2 + s_lo)[None, :]
        l1, l2 = _tile_lane_sums(ptrs, pos, width // BN, width % BN, EB, BR, BN, SHIFTS)
        if MODE == 0:
            _store_partials(partial_ptr, c, n_rows, rows, row_ok, l1, l2)
        else:
            fp = _row_fp(l1, l2, _seed64(s_lo, s_hi))
            tl.store(rows_out_ptr + rows, fp.to(tl.int64, bitcast=True), mask=row_ok)
            if MODE == 2:
                t_lo = t_lo.to(tl.uint32)
                t_hi = t_hi.to(tl.uint32)
                t1, t2 = _top_lane_sums(fp, rows, row_ok, t_lo)
                top = _row_fp(t1, t2, _seed64(t_lo, t_hi))
                tl.store(top_ptr, top.to(tl.int64, bitcast=True))


def _hash_words(w: _Words, seed: int, top_seed: int | None, cfg: KernelConfig):
    """Row fingerprints int64 [rows] of a word view and, when `top_seed` is given and the top
    hash can be fused, the top hash int64 [1] (else None). 1 or 2 launches."""
    device = w.data.device
    rows_out = torch.empty(w.rows, dtype=torch.int64, device=device)
    if w.rows == 0:
        return rows_out, None
    br, bn, chunk_tiles, chunks = _tile(w.rows, w.n_words, cfg)
    if chunks > _MAX_GRID_Y:
        raise ValueError(f"rows of {w.n_words} words need {chunks} chunks (> {_MAX_GRID_Y}); "
                         "raise KernelConfig.chunk_words")
    row_blocks = -(-w.rows // br)
    s_lo, s_hi = _seed_args(seed)
    want_top = top_seed is not None
    t_lo, t_hi = _seed_args(top_seed if want_top else 0)
    top = torch.empty(1, dtype=torch.int64, device=device) if want_top else None
    top_arg = top if want_top else rows_out
    meta = dict(EB=w.eb, BR=br, BN=bn, CHUNK_TILES=chunk_tiles, SHIFTS=cfg.shifts,
                num_warps=_warps(br * bn, cfg), **_reg_opts(cfg))
    if chunks == 1 and (row_blocks == 1 or not want_top or w.rows > cfg.finalize_rows):
        mode = 2 if (want_top and row_blocks == 1) else 1
        _rows_kernel[(row_blocks, 1)](w.data, rows_out, rows_out, top_arg, w.rows, w.n_words,
                                      w.row_stride, s_lo, s_hi, t_lo, t_hi, MODE=mode, **meta)
        return rows_out, (top if mode == 2 else None)
    partial = torch.empty((chunks, w.rows, 2), dtype=torch.int64, device=device)
    fuse_top = want_top and w.rows <= cfg.finalize_rows
    fbr = _next_pow2(w.rows) if fuse_top else min(cfg.finalize_rows, _next_pow2(w.rows))
    if cfg.lane_tma != "off" and fingerprint_tma.usable(w, br, bn, cfg):
        fingerprint_tma.launch_lanes(w, partial, s_lo, br, bn, chunk_tiles, chunks, cfg)
    else:
        _rows_kernel[(row_blocks, chunks)](w.data, rows_out, partial, top_arg, w.rows, w.n_words,
                                           w.row_stride, s_lo, s_hi, t_lo, t_hi, MODE=0, **meta)
    fbc = _finalize_chunks(fbr, chunks)
    _finalize_kernel[(-(-w.rows // fbr),)](partial, rows_out, top_arg, w.rows, chunks,
                                           s_lo, s_hi, t_lo, t_hi, TOP=fuse_top, BR=fbr, BC=fbc,
                                           num_warps=_warps(fbr * fbc, cfg))
    return rows_out, (top if fuse_top else None)


def _hash_row_fingerprints(rows_out: torch.Tensor, top_seed: int, cfg: KernelConfig) -> torch.Tensor:
    """The top hash, int64 [1], of row fingerprints int64 [rows] hashed as one row of 2 x rows words
    (low then high): for more rows than one finalize program fuses."""
    rows = rows_out.numel()
    words = rows_out.view(torch.int32).view(1, 2 * rows)
    top, _ = _hash_words(_Words(words, 1, 2 * rows, 0, 4), top_seed, None, cfg)
    return top
