"""GPU fast path of tpguard fingerprints (Triton).

Reference: `tpguard.fingerprint` (numpy: `fingerprint_rows_reference`, `combine_rows_reference`);
its docstring holds the definition. Everything here is bit-identical to it, whatever the config.

Design (one read pass over the data, no host sync):

* A tensor is viewed, without a copy, as ``[rows, n_words]`` 1-, 2- or 4-byte words with a row
  stride (8-/16-byte dtypes: 2/4 int32 words per element). Only a tensor whose rows are not
  contiguous blocks of memory is copied first (``.contiguous()``).
* ``_rows_kernel``, grid ``(row_blocks, chunks)``: a program walks a ``[BR, BN]`` tile along the
  columns of its chunk (long rows: 1 row x ``block_words``; short rows: many rows per tile) in
  32-bit integer math, summing groups of 4 words into uint64 lane accumulators (ptxas turns that
  into 3-input adds with two carries: one 64-bit add per 2 words). It writes the row fingerprints
  (one chunk per row) or fixed partial lane sums ``[chunks, rows, 2]`` that ``_finalize_kernel``
  adds up. Integer sums are order-independent: no atomics, and the result does not depend on the
  chunking.
* The "top" hash over the row fingerprints is fused into the last kernel when all rows fit one
  program; otherwise the row fingerprints are hashed as one long row of words.
* ``fingerprint_many_triton``: many tensors through a device table of segment records (address,
  rows, words, stride, seeds, output index, ...): lane launches for the segments that need
  partial sums (short rows of many rows: 1; long rows: 1 per (16-byte aligned or not, word size)
  class present, or 1 per long tensor with ``KernelConfig.many_long="rows"``), then ONE finish
  launch that finalizes those and reads each small tensor (rows of <= 64 words, <= 16384 words)
  whole in one program. The guard's decisions set is 1 launch, its full set 2; each value is
  stored straight into the caller's vector slot (``out_index``), and the guard's step counter
  is bumped by the same launch (``bump_index``).
* Host time: a plan records the arguments that Triton passes to each compiled kernel's launcher
  and then calls the launcher directly (`_Launch`; checked bit for bit against Triton's own
  launch once per kernel per process; ``TPGUARD_FAST_LAUNCH=0`` turns it off).
* Long rows are hashed ``rows_per_tile`` side by side: a thread holds the same columns of
  several rows, so the per-column position work (``_pos_mix``) is shared by those rows.
* Loads of the column loop: the next step's words are loaded before the current ones are
  hashed (deeper register prefetch, Triton's cp.async pipeline and cache hints measured no
  better on an H200: docs/design-fingerprint.md, "Tried and lost"). One tensor on sm_90+: the lane
  launch reads through TMA instead (kernels/fingerprint_tma.py, `KernelConfig.lane_tma`; docs/design-fingerprint.md).
* Per-row groups of words are summed through ``tl.reshape`` WITHOUT ``can_reorder``: a reordering
  reshape let the sm_90 compiler mix rows of multi-row tiles (GPU run 1: wrong row fingerprints
  of [3, 5] tensors and of the guard's decisions set); the interpreter never reorders.

Cost: ~14 SASS instructions per 32-bit word in the loop of the default tile (fp/2; fp/1's second
fmix32 made it ~22; sm_90, Triton 3.6, counted offline; docs/design-fingerprint.md).
Measured on an H200 the loop is bound by loads in flight, not by issue: the one-tensor default
`SINGLE_TENSOR_CONFIG` reads 256 x 163840 fp32 in 45.8-47.2 us through TMA (48.4-48.9 with ldg loads in
the same processes, runs 39-40), `torch.sum` in ~46.
`tpguard.bench.fingerprint` measures it.

CUDA graphs: launchers allocate outputs and scratch with ``torch.empty`` on the current stream,
never read data on the host and have no data-dependent shapes, so they can be captured. Callers
preallocate nothing, but must (1) call each launcher once before capture with the same shapes and
dtypes (Triton compiles on first use) and (2) for ``fingerprint_many_triton``, warm up with the
same tensors (same addresses) or hold a `ManyPlan` built outside capture (its segment table is
copied to the device once, when the plan is built).
"""

from __future__ import annotations

import importlib
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

# shared with the renorm call plans' direct launches (kernels/direct_launch.py)
from tpguard.config import interpreting
from tpguard.kernels.direct_launch import DirectLaunch, current_stream, device_guard, hooks_idle, sm_count

# The module, not the `tpguard.fingerprint` function that tpguard/__init__ re-exports.
ref = importlib.import_module("tpguard.fingerprint")

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: available() is False and nothing below is launched
    triton = None
    tl = None

# Read once: @triton.jit chooses the CPU interpreter at decoration time (Triton's own spellings).
INTERPRET = interpreting()


def _interpreter_index_fix() -> None:
    """Triton < 3.8's interpreter turns a scalar (a 1-element array) into a loop bound with
    ``int(data)``, which NumPy >= 2.4 rejects, so no kernel with a runtime loop bound runs under
    it. Re-install that conversion with ``.squeeze()``, as Triton 3.8 does. Interpreter only."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "tpguard_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.tpguard_index_fix = True
    interpreter._patch_lang_tensor = patched


def _triton_version() -> tuple[int, int]:
    import re

    m = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


if INTERPRET and triton is not None and _triton_version() < (3, 8):
    _interpreter_index_fix()


# KernelConfig.shifts bits: the shifts of h's fmix32 (">>16": two per word, ">>13": one).
SHIFT_H16, SHIFT_H13 = 1, 2
SHIFT_ALL = 3


@dataclass(frozen=True)
class KernelConfig:
    """Tiling and code shape. Results never depend on it (integer sums), only speed does."""

    # Defaults (fingerprint_many; one tensor: SINGLE_TENSOR_CONFIG): the fastest correct config of the
    # H200 sweeps (docs/benchmarks.md; run 5: shifts=0 57.4 us for 256 x 163840 fp32 vs 59.9 with fp/1's
    # four ">>16" shifts as IMAD.HI; maxnreg=128: the full set 104 vs 108 us).
    block_words: int = 4096  # words per program per loop step (a [rows_per_tile, BN] tile)
    rows_per_tile: int = 8  # long rows: rows hashed side by side, sharing per-column work
    # columns of a row per program; longer rows are split into chunks. 8192: runs 9 and 10 (55.6 / 55.4 us
    # for 256 x 163840 fp32 vs 56.3 / 56.4 at 4096; the full guard set 101.9 vs 104.2 us in run 9)
    chunk_words: int = 8192
    num_warps: int = 4  # for full tiles; smaller tiles use fewer
    finalize_rows: int = 1024  # rows per finalize program; also the limit for a fused top hash
    # Which of the 3 fmix32 shifts per word run as IMAD.HI on the FMA pipe instead of SHF on the
    # integer ALU pipe (a bitmask of SHIFT_*: 0 none, 1 the two ">>16", 3 all).
    # docs/design-fingerprint.md, "Tried and lost".
    shifts: int = 0
    # fingerprint_many, long rows: "table" one launch per word-size class through the segment
    # table (GPU run 3 at these defaults: 119.5 us for 2 x 168 MB = 2 x the single-tensor time);
    # "rows" one launch per long tensor, the single-tensor kernel's grid and code shape (for
    # configs where the table kernel needs more registers: 163 vs 127 at [8, 1024] x 8 warps)
    many_long: str = "table"
    maxnreg: int | None = 128  # register cap for the long-row lane launches (None: compiler's)
    # > 0 sizes the chunks (any whole number of tiles, not only chunk_words) so that the programs fill
    # the GPU's SMs x this many CTAs about once, evenly (one tensor; fingerprint_many's long rows: over all
    # the segments of a lane launch). Runs 19-20 (session 6): one tensor 48.6-48.9 us at 7, 53.9 at 8, 52.1
    # at 14 (the 8-warp default: 48.3); the full set 114.0 / 100.3 us at 7 / 14 vs 93.5: an option, off
    # (docs/design-fingerprint.md, "Tried and lost").
    fill_ctas_per_sm: int = 0
    # One tensor's lane launch read through Hopper TMA (kernels/fingerprint_tma.py; run 38: 45.7 vs 47.1 us
    # for 256 x 163840 fp32): "auto" on sm_90+ GPUs where the tensor allows, "on" there and under the
    # interpreter too (tests), "off" never. fingerprint_many never uses it: its cached plans must not hold the
    # tensors, and a descriptor does (run 39 measured it anyway: docs/design-fingerprint.md, "Tried and lost").
    lane_tma: str = "off"
    tma_stages: int = 3  # shared-memory ring depth (run 38: 3 best; 2 48.6 us, 4 44.2 us lane launch)
    tma_warps: int = 4  # run 38: 4 warps 42.8 us vs 8 warps 43.4 us lane launch

    def __post_init__(self):
        if self.many_long not in ("table", "rows"):
            raise ValueError(f"KernelConfig.many_long must be 'table' or 'rows', got {self.many_long!r}")
        if self.lane_tma not in ("auto", "on", "off"):
            raise ValueError(f"KernelConfig.lane_tma must be 'auto', 'on' or 'off', got {self.lane_tma!r}")
        if self.tma_stages < 1 or self.tma_warps < 1:
            raise ValueError("KernelConfig.tma_stages and tma_warps must be >= 1")
        for name in ("block_words", "rows_per_tile", "chunk_words", "finalize_rows"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {value}")
        if not 0 <= self.shifts <= SHIFT_ALL:
            raise ValueError(f"KernelConfig.shifts must be a bitmask in [0, {SHIFT_ALL}], got {self.shifts}")
        if self.fill_ctas_per_sm < 0:
            raise ValueError(f"KernelConfig.fill_ctas_per_sm must be >= 0, got {self.fill_ctas_per_sm}")
        if self.rows_per_tile > self.block_words:
            raise ValueError("KernelConfig.rows_per_tile must not exceed block_words")


def _config_from_env(text: str) -> KernelConfig:
    """``TPGUARD_FP_CONFIG="many_long=rows"`` (any KernelConfig fields, ``NAME=VALUE,...``):
    fingerprint_many's config (the guard's sets) for the process; the values never depend on it,
    only the speed (benchmarks time variants this way)."""
    from tpguard.config import replace_from_text

    return replace_from_text(KernelConfig(), text, "TPGUARD_FP_CONFIG")


DEFAULT_CONFIG = _config_from_env(os.environ.get("TPGUARD_FP_CONFIG", ""))  # fingerprint_many (the guard's sets)
# One tensor (fingerprint / fingerprint_rows): fp/2's sweep (run 14, H200, 256 x 163840 fp32 graph) 50.3 us
# vs 56.0 at the defaults: 16 words per thread uncapped take 64 registers, so 8 CTAs per SM hold the 640
# programs of [8 rows, 8192 words] in one wave (the defaults: 528 slots, 1.2 waves). fingerprint_many's
# full set (2 x 168 MB, twice the programs) gained nothing from it there (97.0 vs 93.4 us).
# Session 6: 8 warps of 8 words per thread, 48.3 us vs 50.0 at 4 warps in the same run (run 20; fill_ctas_per_sm=7:
# 48.6-48.9), 47.5 us as the default (run 22); a plain Triton read of the same tensor: 40-41 us
# (docs/design-fingerprint.md).
# Session 12: the lane launch through TMA on sm_90+ (lane_tma="auto"; run 38: 45.7 us vs 47.1 with ldg loads).
SINGLE_TENSOR_CONFIG = KernelConfig(block_words=2048, num_warps=8, maxnreg=None, lane_tma="auto")
SHORT_ROW_WORDS = 64  # fingerprint_many: rows of up to this many words share tiles


def available() -> bool:
    """Triton importable and usable: CUDA present, or the Triton CPU interpreter is on."""
    if triton is None:
        return False
    return INTERPRET or torch.cuda.is_available()


# --- Triton kernels ------------------------------------------------------------------------

if triton is not None:
    from tpguard.kernels.pdl import pdl_enter

    _C1 = tl.constexpr(ref.C1)
    _C2 = tl.constexpr(ref.C2)
    _FMIX32_A = tl.constexpr(ref.FMIX32_A)
    _FMIX32_B = tl.constexpr(ref.FMIX32_B)
    _FMIX64_A = tl.constexpr(ref.FMIX64_A)
    _FMIX64_B = tl.constexpr(ref.FMIX64_B)
    _M32 = tl.constexpr(ref.M32)

    # fingerprint_many segment record: int64 fields
    _REC = tl.constexpr(12)
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


# --- host side: word views, tiling ---------------------------------------------------------

_WORD_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_MAX_GRID_Y = 65535


@dataclass
class _Words:
    """A tensor as [rows, n_words] words of `eb` bytes, row stride in words; `data` is a word-typed
    view whose data_ptr() is word 0 of row 0."""

    data: torch.Tensor
    rows: int
    n_words: int
    row_stride: int
    eb: int


def _check_tensor(t, who: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{who}: only dense (strided) tensors can be fingerprinted, got {t.layout}")
    size = t.element_size()
    if size not in (1, 2) and size % 4:
        raise ValueError(f"{who}: unsupported element size {size} bytes ({t.dtype})")
    if t.device.type != "cuda" and not (INTERPRET and t.device.type == "cpu"):
        raise ValueError(f"{who}: the Triton path needs a CUDA tensor, got {t.device} "
                         "(tpguard.fingerprint handles CPU tensors)")
    t = t.detach()
    if t.is_conj():  # lazily conjugated view: hash the values it stands for
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _trailing_contiguous(t: torch.Tensor) -> bool:
    """Each row t[r] (the dims after the first) is one contiguous block of memory."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _words(t: torch.Tensor) -> _Words:
    """Word view of a checked tensor; copies only when its rows are not contiguous blocks."""
    if t.dim() == 0:
        t = t.reshape(1)
    if not _trailing_contiguous(t):
        t = t.contiguous()
    rows = t.shape[0]
    cols = t.numel() // rows if rows else 0
    size = t.element_size()
    eb = min(size, 4)
    per = max(1, size // 4)
    if rows == 0 or cols == 0:  # nothing is read; a word-typed pointer all the same
        return _Words(t.reshape(-1).view(_WORD_DTYPE[eb]), rows, cols * per, 0, eb)
    row_stride = t.stride(0) if rows > 1 else 0
    view = torch.as_strided(t, (rows, cols), (row_stride, 1)).view(_WORD_DTYPE[eb])
    return _Words(view, rows, cols * per, row_stride * per, eb)


def _seed_args(seed: int) -> tuple[int, int]:
    lo, hi = ref.split_seed(seed)
    return lo + (1 << 32), hi + (1 << 32)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _tile(rows: int, n_words: int, cfg: KernelConfig, slots: int = 0) -> tuple[int, int, int, int]:
    """(BR, BN, chunk_tiles, chunks): long rows get [rows_per_tile, block_words / rows_per_tile]
    tiles (rows side by side share the per-column position work), short rows many per tile.
    `slots` > 0 (CTAs the GPU holds at once): chunks of as many tiles as spread the programs
    (row blocks x chunks) over about `slots`, evenly, instead of chunk_words."""
    br_long = max(1, min(cfg.rows_per_tile, _next_pow2(max(rows, 1))))
    bn = min(_next_pow2(max(n_words, 1)), cfg.block_words // br_long)
    br = max(1, min(cfg.block_words // bn, _next_pow2(max(rows, 1))))
    chunk_tiles = max(1, cfg.chunk_words // bn)
    if slots > 0:
        tiles = -(-n_words // bn)
        want_chunks = max(1, slots // -(-rows // br))
        chunk_tiles = max(1, -(-tiles // want_chunks))
    chunks = max(1, -(-n_words // (chunk_tiles * bn)))
    return br, bn, chunk_tiles, chunks


def _warps(tile: int, cfg: KernelConfig) -> int:
    return max(1, min(cfg.num_warps, tile // 256))




def _hash_words(w: _Words, seed: int, top_seed: int | None, cfg: KernelConfig):
    """Row fingerprints int64 [rows] of a word view and, when `top_seed` is given and the top
    hash can be fused, the top hash int64 [1] (else None). 1 or 2 launches."""
    device = w.data.device
    rows_out = torch.empty(w.rows, dtype=torch.int64, device=device)
    if w.rows == 0:
        return rows_out, None
    slots = cfg.fill_ctas_per_sm * sm_count(device, 4) if cfg.fill_ctas_per_sm else 0
    br, bn, chunk_tiles, chunks = _tile(w.rows, w.n_words, cfg, slots)
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


def _finalize_chunks(rows_per_program: int, chunks: int) -> int:
    """Chunks summed per finalize step: up to 4096 partials per [rows, chunks] tile."""
    return max(1, min(_next_pow2(chunks), 4096 // rows_per_program))


def _empty_hash(seed: int) -> int:
    """Row hash of zero words (a host constant from the seed; no data involved)."""
    out = ref.hash_rows_reference(np.zeros((1, 0), dtype=np.uint32), seed)
    return ref.to_signed(int(out[0]))


# --- public API: one tensor ----------------------------------------------------------------

def fingerprint_rows_triton(t: torch.Tensor, *, config: KernelConfig | None = None) -> torch.Tensor:
    """int64 [rows] (uint64 bits) on t's device, equal to `fingerprint_rows_reference(t)`.
    1 launch (rows of <= chunk_words words) or 2."""
    t = _check_tensor(t, "fingerprint_rows")
    cfg = config or SINGLE_TENSOR_CONFIG
    w = _words(t)
    with device_guard(t.device):
        rows_out, _ = _hash_words(w, ref.row_seed(t.dtype, tuple(t.shape)), None, cfg)
    return rows_out


def fingerprint_triton(t: torch.Tensor, *, config: KernelConfig | None = None) -> torch.Tensor:
    """0-d int64 (uint64 bits) on t's device, equal to the reference `fingerprint(t)`.
    1 launch (small tensors), 2 (rows up to finalize_rows), at most 4 (more rows)."""
    t = _check_tensor(t, "fingerprint")
    cfg = config or SINGLE_TENSOR_CONFIG
    w = _words(t)
    top_seed = ref.top_seed(t.dtype, tuple(t.shape))
    if w.rows == 0:  # no data: a constant of dtype and shape (one fill, no sync)
        return torch.full((), _empty_hash(top_seed), dtype=torch.int64, device=t.device)
    with device_guard(t.device):
        rows_out, top = _hash_words(w, ref.row_seed(t.dtype, tuple(t.shape)), top_seed, cfg)
        if top is None:  # too many rows to fuse: hash the row fingerprints as one row of words
            words = rows_out.view(torch.int32).view(1, 2 * w.rows)
            top, _ = _hash_words(_Words(words, 1, 2 * w.rows, 0, 4), top_seed, None, cfg)
    return top.view(())


# --- public API: many tensors --------------------------------------------------------------

_REC_FIELDS = 12  # = _REC in the kernels
_PLAN_CACHE: OrderedDict[tuple, ManyPlan] = OrderedDict()
_PLAN_CACHE_SIZE = 64
_CAPTURED_PLANS: dict[tuple, ManyPlan] = {}  # used inside a CUDA graph capture: never evicted


class _Launch(DirectLaunch):
    """One fixed kernel launch (grid, arguments, meta) repeated by a plan, optionally with a
    different `out` tensor at argument `out_pos` each time.

    Fast path (host time; kernels/direct_launch.py): Triton's ``kernel[grid](...)`` binds and
    specializes the arguments and looks up the compiled kernel on every call (30-80 us of Python
    per launch on the GPU machine's Triton 3.6). `record()` keeps the positional arguments Triton
    hands the compiled kernel's launcher; later launches call the launcher directly with those,
    only the stream and `out` substituted, and only after `ManyPlan` / `guard_compare` /
    `heal_copy` compared a direct launch with Triton's own bit for bit (`prepare_fast`, once per
    kernel per process); anything else (interpreter, other layouts, launch hooks, failures):
    Triton's launch."""

    __slots__ = ("out_pos", "_out_align")

    def __init__(self, kernel, grid: tuple, args: tuple, meta: dict, out_pos: int | None = None):
        super().__init__(kernel, grid, args, meta)
        self.out_pos, self._out_align = out_pos, 0

    @property
    def ready(self) -> bool:
        return self.run is not None

    def _bound(self, out):
        if self.out_pos is None:
            return self.args
        args = list(self.args)
        args[self.out_pos] = out
        return args

    def normal(self, out=None):
        self.compiled = self.kernel[self.grid](*self._bound(out), **self.meta)

    def __call__(self, out=None, fast: bool = False):
        # direct only with `out` at the recorded alignment and no launch hook added since (profilers)
        if fast and self.run is not None and (out is None or (out.data_ptr() % 16 == self._out_align
                                                              and out.is_cuda)) \
                and hooks_idle(*self.hooks):
            return self.launch(current_stream(), [out])
        return self.normal(out)

    def record(self, out=None) -> bool:
        """Record the launcher's arguments (no GPU work); True if the layout is recognised and
        `out` was found among them. Needs a normal launch before (the compiled kernel)."""
        # views_ok: the guard's comparison writes `out` next to `gathered` in one buffer; the callers
        # key their cached launches on the other arguments' addresses
        role = {} if out is None or self.out_pos is None else {0: out}  # lane launches never read `out`
        if not super().record(role, {}, keep_args=True, args=self._bound(out), views_ok=True):
            return False
        if self.out_pos is not None and not self.slots:
            self.refusal = "output argument not found among the launcher's arguments"
            self.forget()
            return False
        self._out_align = out.data_ptr() % 16 if role else 0
        return True

    def forget(self) -> None:
        self.run, self.template, self.slots, self.keep = None, None, (), []


_FAST_VALIDATED: dict[str, bool] = {}  # compiled variant -> direct launch equal to Triton's (process)
FAST_LAUNCH_FAILURES: dict[str, str] = {}  # kernel names -> why the direct path was refused (benchmarks print it)


def fast_launch_enabled() -> bool:
    return FAST_LAUNCH and not INTERPRET and triton is not None


def prepare_fast(launches: list[_Launch], out, rerun) -> bool:
    """After a normal run of `launches` into `out`: record their launchers; if one of these
    kernels was never checked in this process, `rerun()` must repeat the run with direct
    launches (from the same starting state, into a scratch tensor) and say whether it equals
    `out` (one host sync, once per kernel). False: Triton's launch stays."""
    try:
        for launch in launches:
            if not launch.record(out):
                raise RuntimeError(f"launcher layout not recognised ({launch.refusal})")
        names = {launch.variant for launch in launches}
        if any(_FAST_VALIDATED.get(n) is False for n in names):
            raise RuntimeError("direct launch disagreed before")
        if not all(_FAST_VALIDATED.get(n) for n in names):
            ok = rerun()
            for n in names:
                _FAST_VALIDATED[n] = _FAST_VALIDATED.get(n, True) and ok
            if not ok:
                raise RuntimeError("direct launch disagreed")
        return True
    except Exception as e:  # noqa: BLE001 - any failure: Triton's own launch, as before
        FAST_LAUNCH_FAILURES[",".join(sorted({launch.name for launch in launches}))] = \
            f"{type(e).__name__}: {e}"[:300]
        for launch in launches:
            launch.forget()
        return False


FAST_LAUNCH = os.environ.get("TPGUARD_FAST_LAUNCH", "1") != "0"  # 0: always Triton's launch
SMALL_SEGMENT_WORDS = 16384  # fingerprint_many: a segment of rows x BN words up to this: 1 program
SMALL_TILE = 4096  # words per tile of the small-segment kernel


class ManyPlan:
    """Fingerprints of one fixed list of tensors in a fixed number of launches.
    A plan owns its scratch (partial sums): run one plan on one stream at a time.

    Built on the host from addresses, dtypes, shapes and strides (never data). Its segment table
    is copied to the device once, at construction (pinned memory, asynchronous). `run()` is
    capturable in a CUDA graph: keep the plan alive as long as the graph, and the tensors at the
    same addresses (with ``keep_tensors`` the plan holds references to them). Tensors whose rows
    are not contiguous blocks are copied into scratch owned by the plan at each run (one copy
    launch each). The plan owns its scratch of partial sums: one run at a time per plan.

    Launches: lane launches for the segments that need partial sums (short rows of many rows;
    long rows by word size, or one per long tensor with ``many_long="rows"``), then ONE finish
    launch (`_many_finish_kernel`) that finalizes those and reads and hashes each small segment
    (rows of <= 64 words, <= SMALL_SEGMENT_WORDS words in all, and empty tensors) whole in one
    program. A set of small tensors (the guard's decisions set) is that one launch.

    ``out_index``: where each fingerprint goes in `run`'s `out` (default 0..n-1), so that a caller
    (the guard) gets them written straight into its own vector; ``bump_index``: an int64 slot of
    `out` that each run adds 1 to (the guard's device step counter), done by the finish launch.
    """

    # ordinary tensors even when made under inference mode: each run copies into the scratch of
    # non-contiguous tensors, maybe outside it
    @torch.inference_mode(False)
    def __init__(self, tensors: list[torch.Tensor], config: KernelConfig | None = None, *,
                 keep_tensors: bool = True, out_index: list[int] | None = None,
                 bump_index: int | None = None):
        cfg = config or DEFAULT_CONFIG
        if not tensors:
            raise ValueError("fingerprint_many: no tensors")
        tensors = [_check_tensor(t, "fingerprint_many") for t in tensors]
        device = tensors[0].device
        for t in tensors:
            if t.device != device:
                raise ValueError(f"fingerprint_many: tensors must share one device, "
                                 f"got {device} and {t.device}")
        if INTERPRET and device.type != "cpu":
            raise ValueError("fingerprint_many: under TRITON_INTERPRET=1 the segment table holds "
                             "host addresses; pass CPU tensors")
        if out_index is not None and len(out_index) != len(tensors):
            raise ValueError("fingerprint_many: out_index needs one index per tensor")
        self.device = device
        self.n = len(tensors)
        self.config = cfg
        self.out_index = list(out_index) if out_index is not None else list(range(self.n))
        self.out_size = max(self.out_index + [bump_index if bump_index is not None else -1]) + 1
        self.bump_index = bump_index
        self._copy_index = [i for i, t in enumerate(tensors)
                            if t.dim() >= 2 and not _trailing_contiguous(t)]
        self._scratch = [torch.empty_like(tensors[i], memory_format=torch.contiguous_format)
                         for i in self._copy_index]
        views = list(tensors)
        for i, scratch in zip(self._copy_index, self._scratch):
            views[i] = scratch
        self._sources = tensors if keep_tensors else None

        short, long_aligned, long_unaligned, small = [], [], [], []
        for i, t in enumerate(views):
            w = _words(t)
            seg = (i, t, w)
            if w.rows == 0 or w.n_words == 0:
                small.append(seg)  # nothing to read: the small kernel's loop hashes no words
            elif w.n_words <= SHORT_ROW_WORDS:
                short.append(seg)
            elif w.data.data_ptr() % 16 == 0 and (w.row_stride * w.eb) % 16 == 0:
                long_aligned.append(seg)
            else:
                long_unaligned.append(seg)
        small_bn = _next_pow2(max((w.n_words for _, _, w in short), default=1))
        small += [x for x in short if x[2].rows * small_bn <= SMALL_SEGMENT_WORDS]
        short = [x for x in short if x[2].rows * small_bn > SMALL_SEGMENT_WORDS]

        short_bn = _next_pow2(max((w.n_words for _, _, w in short), default=1))
        short_rows = _next_pow2(max((w.rows for _, _, w in short), default=1))
        groups = [(short, max(1, min(cfg.block_words // short_bn, short_rows)), short_bn, False, 0)]
        per_segment = []
        if cfg.many_long == "rows":
            per_segment = [(x, aligned) for aligned, segs in ((True, long_aligned),
                                                              (False, long_unaligned)) for x in segs]
        else:
            for aligned, segs in ((True, long_aligned), (False, long_unaligned)):
                for eb in (4, 2, 1):  # one launch per word size: no dead loop copies in registers
                    groups.append(_long_group([x for x in segs if x[2].eb == eb], cfg, aligned, eb))
        records: list[list[int]] = []
        lane_specs = []  # ("table", grid, rec0, n_recs, meta) or ("seg", grid, record, meta)
        part = 0
        slots = cfg.fill_ctas_per_sm * sm_count(device, 4) if cfg.fill_ctas_per_sm else 0
        for segs, br, bn, aligned, eb in groups:
            if not segs:
                continue
            chunk_tiles = max(1, cfg.chunk_words // bn)
            if slots and eb:  # long rows: chunks sized so the launch's programs fill the SMs about once
                tiles = sum(-(-w.rows // br) * -(-w.n_words // bn) for _, _, w in segs)
                chunk_tiles = max(1, -(-tiles // slots))
            rec0, item = len(records), 0
            for i, t, w in segs:
                chunks = max(1, -(-w.n_words // (chunk_tiles * bn)))
                records.append(_record(i, t, w, part, chunks, item, self.out_index[i]))
                part += chunks * w.rows * 2
                item += -(-w.rows // br) * chunks
            meta = dict(BR=br, BN=bn, CHUNK_TILES=chunk_tiles, ALIGNED=aligned, EB=eb,
                        SHIFTS=cfg.shifts, num_warps=_warps(br * bn, cfg))
            if eb:
                meta.update(_reg_opts(cfg))
            lane_specs.append(("table", (item,), rec0, len(segs), meta))
        for (i, t, w), aligned in per_segment:
            br, bn, chunk_tiles, chunks = _tile(w.rows, w.n_words, cfg, slots)
            if chunks > _MAX_GRID_Y:
                raise ValueError(f"rows of {w.n_words} words need {chunks} chunks (> {_MAX_GRID_Y}); "
                                 "raise KernelConfig.chunk_words")
            records.append(_record(i, t, w, part, chunks, 0, self.out_index[i]))
            meta = dict(EB=w.eb, BR=br, BN=bn, CHUNK_TILES=chunk_tiles, ALIGNED=aligned,
                        SHIFTS=cfg.shifts, num_warps=_warps(br * bn, cfg),
                        **_reg_opts(cfg))
            s_lo, _ = _seed_args(ref.row_seed(t.dtype, tuple(t.shape)))
            lane_specs.append(("seg", (-(-w.rows // br), chunks),
                               (w.data.data_ptr(), part, w.rows, w.n_words, w.row_stride, s_lo),
                               meta))
            part += chunks * w.rows * 2
        self.n_lane_records = len(records)
        for i, t, w in small:
            records.append(_record(i, t, w, 0, 1, 0, self.out_index[i]))
        self.n_records = len(records)
        self.n_small = len(small)
        self.partial_size = max(part, 2)
        lane_rows = [r[1] for r in records[:self.n_lane_records]]
        max_chunks = max((r[8] for r in records[:self.n_lane_records]), default=1)
        self._fbr = max(1, min(256, _next_pow2(max(lane_rows, default=1))))
        self._fbc = _finalize_chunks(self._fbr, max_chunks)
        host = torch.tensor(records, dtype=torch.int64).reshape(-1)
        if device.type == "cuda":
            host = host.pin_memory()
        self.table = host.to(device, non_blocking=True)
        self._host_table = host  # read by the asynchronous copy: keep it alive
        self._partial = torch.empty(self.partial_size, dtype=torch.int64, device=device)

        self._kernel_launches: list[_Launch] = []
        bump = bump_index is not None
        sbn = _next_pow2(max(max((w.n_words for _, _, w in small), default=1), 1))
        small_rows = _next_pow2(max((w.rows for _, _, w in small), default=1))
        for spec in lane_specs:
            if spec[0] == "table":
                _, grid, rec0, n_recs, meta = spec
                self._kernel_launches.append(_Launch(_many_lanes_kernel, grid,
                                                     (self.table, self._partial, rec0, n_recs), meta))
            else:
                _, grid, args, meta = spec
                self._kernel_launches.append(_Launch(_seg_lanes_kernel, grid,
                                                     (args[0], self._partial) + args[1:], meta))
        sbr = max(1, min(SMALL_TILE // sbn, small_rows))  # 1 x 1 without small tensors
        self._kernel_launches.append(_Launch(
            _many_finish_kernel, (self.n_records,),
            (self.table, self._partial, None, self.n_lane_records, bump_index if bump else 0),
            dict(FBR=self._fbr, FBC=self._fbc, SBR=sbr, SBN=sbn, HAS_LANE=self.n_lane_records > 0,
                 HAS_SMALL=bool(small), BUMP=bump,
                 num_warps=max(_warps(self._fbr * self._fbc, cfg) if self.n_lane_records else 1,
                               _warps(sbr * sbn, cfg) if small else 1)),
            out_pos=2))
        # fast launches: "untested" until the second run outside capture sets them up
        self._runs = 0
        self._fast = "untested" if (fast_launch_enabled() and device.type == "cuda") else "off"

    @property
    def launches(self) -> int:
        """Kernel launches per run(): copies of non-contiguous tensors + lane launches + 1."""
        return len(self._copy_index) + len(self._kernel_launches)

    @property
    def fast_launch(self) -> str:
        """"on" (launchers called directly), "off", or "untested" (before the first run)."""
        return self._fast

    def _launch_all(self, out: torch.Tensor, fast: bool = False) -> None:
        for launch in self._kernel_launches:
            launch(out, fast=fast)

    def _first_run(self, out: torch.Tensor) -> None:
        """Triton's launches into `out`, then the fast path's set-up (`prepare_fast`): recorded
        launchers, and (once per kernel per process) a direct run from the same starting state
        that must give the same `out`, bit for bit."""
        before = out.clone()
        self._launch_all(out)

        def rerun() -> bool:
            direct = before.clone()
            # poison the scratch the normal run filled: a direct lane launch that wrote nothing
            # (or elsewhere) must show up in the finish kernel's output
            self._partial.fill_(-1)
            self._launch_all(direct, fast=True)
            return torch.equal(direct, out)

        self._fast = "on" if prepare_fast(self._kernel_launches, out, rerun) else "off"

    def run(self, out: torch.Tensor | None = None,
            tensors: list[torch.Tensor] | None = None) -> torch.Tensor:
        """int64 fingerprints (uint64 bits) at `out[out_index[i]]` (default: [n], in the order
        the tensors were given). `out`: optional preallocated int64 tensor on the plan's device
        (required with a bump index). `tensors`: the tensors, if the plan was built without
        keeping them (same addresses, dtypes, shapes, strides)."""
        sources = tensors if tensors is not None else self._sources
        if self._copy_index and sources is None:
            raise ValueError("ManyPlan.run: pass the tensors (the plan was built without them)")
        if out is None:
            if self.bump_index is not None:
                raise ValueError("ManyPlan.run: pass `out` (the plan bumps one of its slots)")
            out = torch.empty(self.out_size, dtype=torch.int64, device=self.device)
        elif out.dtype != torch.int64 or out.device != self.device or out.numel() < self.out_size \
                or not out.is_contiguous():
            raise ValueError(f"ManyPlan.run: out must be a contiguous int64 tensor of >= {self.out_size} "
                             f"elements on {self.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        with device_guard(self.device):
            for i, scratch in zip(self._copy_index, self._scratch):
                scratch.copy_(sources[i])
            if self._fast == "untested" and not torch.cuda.is_current_stream_capturing():
                self._runs += 1
                if self._runs >= 2:  # a plan used once (addresses that moved) never pays for it
                    self._first_run(out)
                else:
                    self._launch_all(out)
            else:
                self._launch_all(out, fast=self._fast == "on")
        return out


def _reg_opts(cfg: KernelConfig) -> dict:
    return {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}


def _long_group(segs: list, cfg: KernelConfig, aligned: bool, eb: int) -> tuple:
    """(segments, BR, BN, aligned, eb) of a long-rows launch: [rows_per_tile, BN] tiles, fewer
    rows per tile when no segment has that many rows."""
    rows = _next_pow2(max((w.rows for _, _, w in segs), default=1))
    br = max(1, min(cfg.rows_per_tile, rows))
    return segs, br, cfg.block_words // br, aligned, eb


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


def fingerprint_many_triton(tensors: list[torch.Tensor], *, config: KernelConfig | None = None,
                            out: torch.Tensor | None = None, out_index: list[int] | None = None,
                            bump_index: int | None = None) -> torch.Tensor:
    """int64 [n]: 0-d fingerprints of several tensors on one device, in at most 5 launches
    (+1 copy per tensor whose rows are not contiguous blocks), independent of n; 1 launch when
    every tensor is small (the guard's decisions set). With `out` / `out_index` / `bump_index`:
    see `ManyPlan` (written in place, `out` returned).

    Plans are cached by the tensors' (address, dtype, shape, strides) and the output layout.
    Under CUDA graph capture a cached plan is required (warm up with the same tensors first); it
    is then kept for good.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fingerprint_many: expected torch.Tensor items, got {type(t).__name__}")
    key = (tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in tensors),
           config or DEFAULT_CONFIG, tuple(out_index) if out_index is not None else None, bump_index)
    plan = _CAPTURED_PLANS.get(key) or _PLAN_CACHE.get(key)
    capturing = tensors[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if plan is None:
        if capturing:
            raise RuntimeError("fingerprint_many: no plan for these tensors during CUDA graph "
                               "capture; call it once with the same tensors before capturing, "
                               "or build a ManyPlan outside capture")
        plan = ManyPlan(tensors, config, keep_tensors=False,  # the cache must not pin memory
                        out_index=out_index, bump_index=bump_index)
        _PLAN_CACHE[key] = plan
        while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
            _PLAN_CACHE.popitem(last=False)
    elif key in _PLAN_CACHE:
        _PLAN_CACHE.move_to_end(key)
    if capturing:
        _CAPTURED_PLANS[key] = plan
    return plan.run(out=out, tensors=tensors)


def fingerprint_many_reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64 [n] on the host: the numpy reference fingerprint of each tensor."""
    values = [ref.combine_rows_reference(ref.fingerprint_rows_reference(t), t.dtype, tuple(t.shape))
              for t in tensors]
    return torch.tensor([ref.to_signed(v) for v in values], dtype=torch.int64)


def fingerprint_many(tensors: list[torch.Tensor], *, out: torch.Tensor | None = None,
                     out_index: list[int] | None = None,
                     bump_index: int | None = None) -> torch.Tensor:
    """int64 [n] (uint64 bits): fingerprints of several tensors, on their (common) device.
    CUDA tensors go to the Triton kernels when available; anything else to the numpy reference.
    With `out`: written to out[out_index[i]] (default i) and out[bump_index] += 1; returns out."""
    tensors = list(tensors)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fingerprint_many: expected torch.Tensor items, got {type(t).__name__}")
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"fingerprint_many: tensors must share one device, got "
                         f"{sorted({str(t.device) for t in tensors})}")
    if device.type == "cuda" and available() and not INTERPRET:
        return fingerprint_many_triton(tensors, out=out, out_index=out_index, bump_index=bump_index)
    values = fingerprint_many_reference(tensors).to(device)
    if out is None and out_index is None and bump_index is None:
        return values
    if out is None:
        raise ValueError("fingerprint_many: out_index / bump_index need `out`")
    idx = out_index if out_index is not None else list(range(len(tensors)))
    out.index_copy_(0, torch.tensor(idx, dtype=torch.long, device=out.device), values)
    if bump_index is not None:
        out[bump_index:bump_index + 1].add_(1)
    return out


# Last: it imports this module's kernels and KernelConfig (the TMA lane launch of `_hash_words`).
from tpguard.kernels import fingerprint_tma  # noqa: E402
