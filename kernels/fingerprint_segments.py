"""fingerprint_many's segment table and its kernels: each tensor is a record in one int64 device table
(address, rows, words, stride, seeds, partial sums' offset, output index, ...), so that a fixed
number of launches hashes any number of tensors (the launch plan: kernels/fingerprint_plan.py).

* Lane launches (`_many_lanes_kernel`: one work item per program over a range of records; or
  `_seg_lanes_kernel`, one launch per long tensor with ``KernelConfig.many_long="rows"``) write
  partial lane sums for the segments that need them.
* ONE finish launch (`_many_finish_kernel`) finalizes those (`_finalize_record`) and reads and
  hashes each small segment whole in one program (`_small_record`); each value goes straight to
  its output slot, and the guard's step counter is bumped by the same launch.

Reference: `tpguard.kernels.fingerprint_reference` (numpy); bit-identical whatever the config.
"""

from __future__ import annotations

import torch

from tpguard.kernels import fingerprint_reference as ref
from tpguard.kernels.fingerprint_words import _Words

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: nothing here is defined or launched
    triton = None

_REC_FIELDS = 12  # int64 fields per record (the table's row length)

if triton is not None:
    from tpguard.kernels.fingerprint_finalize import _partial_sums
    from tpguard.kernels.fingerprint_hash import (_C2, _M32, _as_words, _pos_mix, _row_fp, _store_partials,
                                                  _tile_lane_sums, _tile_origin, _top_lane_sums, _word_hashes)

    # the record's fields (int64)
    _REC = tl.constexpr(_REC_FIELDS)
    _F_ADDR = tl.constexpr(0)  # address of word 0
    _F_ROWS = tl.constexpr(1)
    _F_WORDS = tl.constexpr(2)  # words per row
    _F_STRIDE = tl.constexpr(3)  # row stride in words
    _F_EB = tl.constexpr(4)  # bytes per word: 1, 2 or 4
    _F_SEED = tl.constexpr(5)  # row seed (uint64 bits)
    _F_TOP = tl.constexpr(6)  # top seed (uint64 bits)
    _F_PART = tl.constexpr(7)  # offset of the segment's partial lane sums [chunks, rows, 2]
    _F_CHUNKS = tl.constexpr(8)
    _F_ITEM0 = tl.constexpr(9)  # first work item (program id) of the segment in its launch
    _F_OUT = tl.constexpr(10)  # index in the output

    @triton.jit
    def _segment_fields(meta):
        """(address, rows, words per row, row stride, bytes per word, row seed) of a table record."""
        return (tl.load(meta + _F_ADDR), tl.load(meta + _F_ROWS).to(tl.int32),
                tl.load(meta + _F_WORDS).to(tl.int32), tl.load(meta + _F_STRIDE), tl.load(meta + _F_EB),
                tl.load(meta + _F_SEED).to(tl.uint64, bitcast=True))

    @triton.jit
    def _segment_base(addr, EB: tl.constexpr):
        """A segment's address (int64, from the table) as a pointer to its storage words."""
        if EB == 4:
            base = addr.to(tl.pointer_type(tl.int32))
        elif EB == 2:
            base = addr.to(tl.pointer_type(tl.int16))
        else:
            base = addr.to(tl.pointer_type(tl.uint8))
        return base

    @triton.jit
    def _segment_lane_sums(addr, rows_ld, row_stride, col0, width, s_lo,
                           EB: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                           ALIGNED: tl.constexpr, SHIFTS: tl.constexpr):
        """`_tile_lane_sums` for a segment known by its address (fingerprint_many)."""
        base = _segment_base(addr, EB)
        cols = col0 + tl.arange(0, BN)
        ptrs = base + (rows_ld.to(tl.int64) * row_stride)[:, None] + cols[None, :]
        if ALIGNED:  # host-checked: address and row stride are multiples of 16 bytes
            ptrs = tl.multiple_of(ptrs, [1, 16])
        pos = (cols.to(tl.uint32) * _C2 + s_lo)[None, :]
        return _tile_lane_sums(ptrs, pos, width // BN, width % BN, EB, BR, BN, SHIFTS)

    @triton.jit
    def _many_lanes_kernel(table_ptr, partial_ptr, rec0, n_recs,
                           BR: tl.constexpr, BN: tl.constexpr, CHUNK_TILES: tl.constexpr,
                           ALIGNED: tl.constexpr, EB: tl.constexpr, SHIFTS: tl.constexpr):
        """One work item (segment, row block, chunk) per program, over the records
        rec0 .. rec0 + n_recs - 1 of the table (sorted by first item); writes partial lane sums.
        EB: bytes per word of every segment of the launch, or 0: each record says (short rows)."""
        pid = tl.program_id(0)
        rec = rec0
        for i in range(1, n_recs):
            first = tl.load(table_ptr + (rec0 + i) * _REC + _F_ITEM0)
            rec = tl.where(pid >= first, rec0 + i, rec)
        meta = table_ptr + rec * _REC
        addr, n_rows, n_words, row_stride, eb, seed = _segment_fields(meta)
        part = tl.load(meta + _F_PART)
        n_chunks = tl.load(meta + _F_CHUNKS).to(tl.int32)
        local = pid - tl.load(meta + _F_ITEM0).to(tl.int32)
        rb = local // n_chunks
        c = local % n_chunks
        s_lo = (seed & _M32).to(tl.uint32)
        rows, row_ok, rows_ld, col0, width = _tile_origin(rb, c, n_rows, n_words, BR, BN, CHUNK_TILES)
        if EB != 0:  # one word size for the whole launch: one copy of the loop, fewer registers
            l1, l2 = _segment_lane_sums(addr, rows_ld, row_stride, col0, width, s_lo,
                                        EB, BR, BN, ALIGNED, SHIFTS)
        elif eb == 4:
            l1, l2 = _segment_lane_sums(addr, rows_ld, row_stride, col0, width, s_lo,
                                        4, BR, BN, ALIGNED, SHIFTS)
        elif eb == 2:
            l1, l2 = _segment_lane_sums(addr, rows_ld, row_stride, col0, width, s_lo,
                                        2, BR, BN, ALIGNED, SHIFTS)
        else:
            l1, l2 = _segment_lane_sums(addr, rows_ld, row_stride, col0, width, s_lo,
                                        1, BR, BN, ALIGNED, SHIFTS)
        _store_partials(partial_ptr + part, c, n_rows, rows, row_ok, l1, l2)

    @triton.jit
    def _finalize_record(table_ptr, partial_ptr, out_ptr, rec, BR: tl.constexpr, BC: tl.constexpr):
        """One segment of the lane launches: partial lane sums -> row fingerprints -> top hash."""
        meta = table_ptr + rec * _REC
        n_rows = tl.load(meta + _F_ROWS).to(tl.int32)
        seed = tl.load(meta + _F_SEED).to(tl.uint64, bitcast=True)
        top_seed = tl.load(meta + _F_TOP).to(tl.uint64, bitcast=True)
        part = tl.load(meta + _F_PART)
        n_chunks = tl.load(meta + _F_CHUNKS).to(tl.int32)
        t_lo = (top_seed & _M32).to(tl.uint32)
        t1 = tl.zeros([], dtype=tl.uint64)
        t2 = tl.zeros([], dtype=tl.uint64)
        for r0 in range(0, n_rows, BR):
            rows = r0 + tl.arange(0, BR)
            row_ok = rows < n_rows
            l1, l2 = _partial_sums(partial_ptr + part, rows, row_ok, n_rows, n_chunks, BR, BC)
            fp = _row_fp(l1, l2, seed)
            a, b = _top_lane_sums(fp, rows, row_ok, t_lo)
            t1 += a
            t2 += b
        top = _row_fp(t1, t2, top_seed)
        tl.store(out_ptr + tl.load(meta + _F_OUT), top.to(tl.int64, bitcast=True))

    @triton.jit(do_not_specialize=["s_lo"])
    def _seg_lanes_kernel(addr, partial_ptr, part, n_rows, n_words, row_stride, s_lo,
                          EB: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                          CHUNK_TILES: tl.constexpr, ALIGNED: tl.constexpr, SHIFTS: tl.constexpr):
        """fingerprint_many, ``KernelConfig.many_long = "rows"``: one launch per long segment, grid
        (row blocks, chunks) as `_rows_kernel` (no table search, no record loads held across the
        loop: the single-tensor path's registers); partial lane sums at offset `part`."""
        rb = tl.program_id(0)
        c = tl.program_id(1)
        s_lo = s_lo.to(tl.uint32)
        rows, row_ok, rows_ld, col0, width = _tile_origin(rb, c, n_rows, n_words, BR, BN, CHUNK_TILES)
        l1, l2 = _segment_lane_sums(addr, rows_ld, row_stride, col0, width, s_lo,
                                    EB, BR, BN, ALIGNED, SHIFTS)
        _store_partials(partial_ptr + part, c, n_rows, rows, row_ok, l1, l2)

    @triton.jit
    def _small_words(addr, offs, m, EB: tl.constexpr):
        base = _segment_base(addr, EB)
        return _as_words(tl.load(base + offs, mask=m, other=0), EB)

    @triton.jit
    def _small_record(table_ptr, out_ptr, rec, BR: tl.constexpr, BN: tl.constexpr):
        """One small segment (rows of <= BN words, few rows) read and finished in one program:
        row fingerprints and the top hash in one pass, no partial sums."""
        meta = table_ptr + rec * _REC
        addr, n_rows, n_words, row_stride, eb, seed = _segment_fields(meta)
        top_seed = tl.load(meta + _F_TOP).to(tl.uint64, bitcast=True)
        out_index = tl.load(meta + _F_OUT)
        s_lo = (seed & _M32).to(tl.uint32)
        t_lo = (top_seed & _M32).to(tl.uint32)
        cols = tl.arange(0, BN)
        col_ok = cols < n_words
        pmix = _pos_mix(cols.to(tl.uint32) * _C2 + s_lo)[None, :]
        t1 = tl.zeros([], dtype=tl.uint64)
        t2 = tl.zeros([], dtype=tl.uint64)
        for r0 in range(0, n_rows, BR):
            rows = r0 + tl.arange(0, BR)
            row_ok = rows < n_rows
            m = row_ok[:, None] & col_ok[None, :]
            offs = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
            if eb == 4:
                w = _small_words(addr, offs, m, 4)
            elif eb == 2:
                w = _small_words(addr, offs, m, 2)
            else:
                w = _small_words(addr, offs, m, 1)
            h, g = _word_hashes(w, pmix, 0)
            l1 = tl.sum(tl.where(m, h, 0).to(tl.uint64), axis=1)
            l2 = tl.sum(tl.where(m, g, 0).to(tl.uint64), axis=1)
            fp = _row_fp(l1, l2, seed)
            a, b = _top_lane_sums(fp, rows, row_ok, t_lo)
            t1 += a
            t2 += b
        top = _row_fp(t1, t2, top_seed)
        tl.store(out_ptr + out_index, top.to(tl.int64, bitcast=True))

    @triton.jit
    def _many_finish_kernel(table_ptr, partial_ptr, out_ptr, n_lane, bump_index,
                            FBR: tl.constexpr, FBC: tl.constexpr, SBR: tl.constexpr,
                            SBN: tl.constexpr, HAS_LANE: tl.constexpr, HAS_SMALL: tl.constexpr,
                            BUMP: tl.constexpr):
        """The last launch of fingerprint_many, one program per record: records < n_lane finish
        the lane launches' partial sums, the others (small segments) are read and hashed whole;
        each final value goes straight to out[record's output index]. The guard's decisions set
        is this launch alone. BUMP: program 0 also adds 1 to out[bump_index] (the guard's device
        step counter: one graph node fewer)."""
        pid = tl.program_id(0)
        if HAS_LANE and HAS_SMALL:
            if pid < n_lane:
                _finalize_record(table_ptr, partial_ptr, out_ptr, pid, FBR, FBC)
            else:
                _small_record(table_ptr, out_ptr, pid, SBR, SBN)
        elif HAS_LANE:
            _finalize_record(table_ptr, partial_ptr, out_ptr, pid, FBR, FBC)
        else:
            _small_record(table_ptr, out_ptr, pid, SBR, SBN)
        if BUMP:
            if pid == 0:
                tl.store(out_ptr + bump_index, tl.load(out_ptr + bump_index) + 1)


def _record(i: int, t: torch.Tensor, w: _Words, part: int, chunks: int, item0: int,
            out: int) -> list[int]:
    rec = [0] * _REC_FIELDS
    rec[0] = w.data.data_ptr()
    rec[1] = w.rows
    rec[2] = w.n_words
    rec[3] = w.row_stride
    rec[4] = w.eb
    rec[5] = ref.to_signed(ref.row_seed(t.dtype, tuple(t.shape)))
    rec[6] = ref.to_signed(ref.top_seed(t.dtype, tuple(t.shape)))
    rec[7] = part
    rec[8] = chunks
    rec[9] = item0
    rec[10] = out
    return rec
