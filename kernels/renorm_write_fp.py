"""Pass 5 of the deterministic renorm with the fingerprint of its output emitted on the way.

`_renorm_write_fp_kernel` is `renorm_passes._renorm_write_kernel` (same grid (rows, chunks), same
CHUNK, same math: ``out = where(keep, (x * r1) * r2, 0)``, NaN rows, params ``[rows, 4]`` =
thr1, r1, thr2, r2 and flag) plus, over the words it stores (an fp32 entry, or a float16 / bfloat16
entry zero-extended: the output is in the input's dtype), the row-hash lane sums of the
fingerprint definition (`tpguard.kernels.fingerprint_reference`, tpguard.fp/2: h_j and h_j ** 2 at word position
j = column, summed into uint64 L1, L2). Each (row, chunk) program stores its two sums into partials ``[chunks, rows, 2]``
(the fingerprint kernels' layout), which `_finalize_kernel` (kernels/fingerprint_finalize.py) turns into
``fingerprint_rows(out)`` and ``fingerprint(out)``: no second read of the 168 MB output.

References: the output is `launch_write`'s (kernels/renorm_passes.py; torch reference
kernels/reference.py); the fingerprints are `tpguard.kernels.fingerprint_reference.fingerprint_rows_reference` /
`fingerprint_reference` (numpy). Integer sums: no atomics, any order gives the same bits.

Cost: the write pass is memory-bound (one read + one write); the hash adds ~15 integer
instructions per word (one row per program: the position mix is per word, not shared by rows as
in the standalone kernel): +8.4 us over the plain write at 256 x 163840 on an H200. One extra tiny launch
(finalize: ~rows x chunks x 16 bytes read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpguard.kernels import fingerprint_reference as ref
from tpguard.kernels.fingerprint_config import SHIFT_H16, KernelConfig, default_config
from tpguard.kernels.fingerprint_finalize import _finalize_chunks, _finalize_kernel
from tpguard.kernels.fingerprint_hash import _C2, _shr, _word_hashes
from tpguard.kernels.fingerprint_lanes import _hash_row_fingerprints
from tpguard.kernels.fingerprint_words import _next_pow2, _seed_args, _warps
from tpguard.kernels.pdl import pdl_enter
from tpguard.kernels.renorm_args import check_fingerprint_slot
from tpguard.kernels.renorm_config import pdl_args
from tpguard.kernels.renorm_passes import launch_write, load_write_params, to_out_dtype, write_value

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

TAIL_BLOCK = 1024  # columns per step of a row's last, partial chunk
# fmix32 shifts as IMAD.HI (a bitmask, see KernelConfig.shifts): the two ">>16" ones
# here, where the standalone kernel's default is none (the write's float compares and selects
# already load the integer ALU pipe). Chosen with fp/1 (`bench guard --fused-probs`:
# h's and g's ">>16" +8.8 / +8.7 us over the plain write, all six +10.8 / +11.2); fp/2 has only h's
# three shifts. A `fp_config` passed to the launcher overrides it.
WRITE_SHIFTS = SHIFT_H16


@triton.jit
def _write_block_lanes(probs_ptr, out_ptr, row, offs, vocab, thr1, r1, thr2, r2, fill, live,
                       s_lo, MASKED: tl.constexpr, SHIFTS: tl.constexpr,
                       POS_MULHI: tl.constexpr):
    """A block of columns of one row: the write of `_renorm_write_kernel` (the same
    `write_value`) and the lane sums (L1, L2) of the fp32 words stored. MASKED: a block that
    crosses the row's end (full blocks skip every mask)."""
    if MASKED:
        mask = offs < vocab
        x = tl.load(probs_ptr + row * vocab + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(probs_ptr + row * vocab + offs).to(tl.float32)
    # the output in its own dtype (fp16 / bf16 rounded here, to nearest even): the stored bits are the hashed bits
    out = to_out_dtype(write_value(x, thr1, r1, thr2, r2, live, fill), out_ptr)
    if MASKED:
        tl.store(out_ptr + row * vocab + offs, out, mask=mask)
    else:
        tl.store(out_ptr + row * vocab + offs, out)
    # the fingerprint's words (kernels/fingerprint_reference.py): one per element, a 2-byte element zero-extended
    if out_ptr.dtype.element_ty.primitive_bitwidth == 16:
        word = out.to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        word = out.to(tl.uint32, bitcast=True)
    # word position = column; P = pos ^ (pos >> 16), the shift as IMAD.HI (FMA pipe, not ALU)
    pos = offs.to(tl.uint32) * _C2 + s_lo
    pmix = pos ^ _shr(pos, 16, POS_MULHI)
    h, g = _word_hashes(word, pmix, SHIFTS)
    if MASKED:  # columns past the row's end count nothing
        h = tl.where(mask, h, 0)
        g = tl.where(mask, g, 0)
    # integer sums: the order (and the compiler's reduction tree) cannot change the bits
    return tl.sum(h.to(tl.uint64), axis=0), tl.sum(g.to(tl.uint64), axis=0)


@triton.jit(do_not_specialize=["s_lo"])
def _renorm_write_fp_kernel(probs_ptr, out_ptr, vocab, params_ptr, flag_ptr, partial_ptr, n_rows,
                            s_lo, CHUNK: tl.constexpr, TAIL: tl.constexpr,
                            SHIFTS: tl.constexpr, POS_MULHI: tl.constexpr, PDL: tl.constexpr = 0):
    """Grid (rows, chunks) of CHUNK columns, as `_renorm_write_kernel`; partial lane sums
    [chunks, rows, 2]. A row's last, partial chunk is walked in TAIL-column blocks (masked), so
    that its code needs no more registers than the full chunks' unmasked path."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    thr1, r1, thr2, r2, live, fill = load_write_params(params_ptr, flag_ptr, row)
    s_lo = s_lo.to(tl.uint32)
    col0 = chunk * CHUNK
    if col0 + CHUNK <= vocab:
        l1, l2 = _write_block_lanes(probs_ptr, out_ptr, row, col0 + tl.arange(0, CHUNK), vocab,
                                    thr1, r1, thr2, r2, fill, live, s_lo,
                                    False, SHIFTS, POS_MULHI)
    else:
        l1 = tl.zeros([], dtype=tl.uint64)
        l2 = tl.zeros([], dtype=tl.uint64)
        for b in range(0, tl.cdiv(vocab - col0, TAIL)):
            a1, a2 = _write_block_lanes(probs_ptr, out_ptr, row, col0 + b * TAIL + tl.arange(0, TAIL),
                                        vocab, thr1, r1, thr2, r2, fill, live, s_lo,
                                        True, SHIFTS, POS_MULHI)
            l1 += a1
            l2 += a2
    p = partial_ptr + (chunk.to(tl.int64) * n_rows + row) * 2
    tl.store(p, l1.to(tl.int64, bitcast=True))
    tl.store(p + 1, l2.to(tl.int64, bitcast=True))


def launch_write_fp(probs: torch.Tensor, out: torch.Tensor, s, ws, cfg, *,
                    fp_out: torch.Tensor | None = None, rows_out: torch.Tensor | None = None,
                    fp_config: KernelConfig | None = None, dependent: bool = False) -> torch.Tensor | None:
    """`launch_write` (same arguments, same `out` bit for bit) that also writes
    ``fingerprint(out)`` (int64 bits) into the 1-element int64 tensor `fp_out` and, if given,
    ``fingerprint_rows(out)`` into the int64 [rows] tensor `rows_out`. `out` must be the
    contiguous float32, float16 or bfloat16 [rows, vocab] tensor the caller receives: its dtype and
    shape are hashed (a 2-byte element as one zero-extended word, as the fingerprint defines).
    2 launches (3 above `KernelConfig.finalize_rows` rows), no host sync, graph
    capturable (scratch from torch.empty). `dependent`: a later launch of a renorm call (write_pass; PDL as
    `launch_write`'s). Returns `fp_out`."""
    if out.dim() != 2 or not out.is_contiguous() or out.dtype not in OUT_DTYPES:
        raise ValueError("launch_write_fp: out must be a contiguous float32, float16 or bfloat16 [rows, vocab] "
                         f"tensor, got {out.dtype} {tuple(out.shape)}")
    rows, vocab = s.rows, s.vocab
    if tuple(out.shape) != (rows, vocab):
        raise ValueError(f"launch_write_fp: out is {tuple(out.shape)}, shapes say {(rows, vocab)}")
    device = out.device
    if fp_out is None:
        fp_out = torch.empty((), dtype=torch.int64, device=device)
    fp_out = check_fingerprint_slot(fp_out, device, "launch_write_fp")
    fcfg = fp_config or default_config()
    shifts = fp_config.shifts if fp_config is not None else WRITE_SHIFTS
    row_seed = ref.row_seed(out.dtype, tuple(out.shape))
    top_seed = ref.top_seed(out.dtype, tuple(out.shape))
    if rows_out is None:
        rows_out = torch.empty(rows, dtype=torch.int64, device=device)
    elif rows_out.dtype != torch.int64 or rows_out.numel() != rows or not rows_out.is_contiguous():
        raise ValueError(f"launch_write_fp: rows_out must be a contiguous int64 [{rows}] tensor")
    if rows == 0:  # nothing written: the fingerprint is a constant of dtype and shape
        fp_out.fill_(ref.empty_hash(top_seed))
        return fp_out
    s_lo, s_hi = _seed_args(row_seed)
    t_lo, t_hi = _seed_args(top_seed)
    partial = torch.empty((s.n_chunks, rows, 2), dtype=torch.int64, device=device)
    _renorm_write_fp_kernel[(rows, s.n_chunks)](
        probs, out, vocab, ws.params, ws.flag, partial, rows, s_lo,
        CHUNK=s.chunk, TAIL=min(s.chunk, TAIL_BLOCK), SHIFTS=shifts, POS_MULHI=True,
        **pdl_args(cfg, s, probs.device, first=not dependent), num_warps=cfg.pass_warps,
    )
    fuse_top = rows <= fcfg.finalize_rows
    fbr = _next_pow2(rows) if fuse_top else fcfg.finalize_rows
    fbc = _finalize_chunks(fbr, s.n_chunks)
    _finalize_kernel[(-(-rows // fbr),)](
        partial, rows_out, fp_out, rows, s.n_chunks, s_lo, s_hi, t_lo, t_hi,
        TOP=fuse_top, BR=fbr, BC=fbc, num_warps=_warps(fbr * fbc, fcfg),
        **pdl_args(cfg, s, probs.device),
    )
    if not fuse_top:  # many rows: hash the row fingerprints as one row of words
        fp_out.view(1).copy_(_hash_row_fingerprints(rows_out, top_seed, fcfg).view(1))
    return fp_out


def write_pass(probs: torch.Tensor, out: torch.Tensor, s, ws, cfg,
               fingerprint_out: torch.Tensor | None = None) -> None:
    """The renorm pipelines' last pass: `launch_write`, or with `fingerprint_out` the fused write
    that also emits ``fingerprint(out)`` into that 1-element int64 tensor."""
    if fingerprint_out is None:
        launch_write(probs, out, s, ws, cfg, dependent=True)
    else:
        launch_write_fp(probs, out, s, ws, cfg, fp_out=fingerprint_out, dependent=True)


__all__ = ["launch_write_fp", "write_pass"]
