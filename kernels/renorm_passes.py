"""The passes every tpguard renorm runs over a [rows, vocab] float32 batch (design: docs/design-renorm.md).

1. ``row_stats``  (rows x chunks programs, one read of the batch): per chunk the float64 sum and a
   non-finite flag; per group of G consecutive entries its max (``gmax``); one pseudo-random
   entry per SG entries (``gsamp``).
2. a per-row *select* kernel (one program per row, in renorm_top_k/top_p/min_p.py) that finds the
   cutoff from the group maxima, held in registers: the entries that can pass a cutoff lie in
   the groups whose max passes it, so it reads only those groups back ("gather"). A top-p or
   min-p row whose cutoff lies deep in a flat distribution is marked FULL instead, with a bracket
   [lo, hi) for the cutoff estimated from gsamp.
3. ``bracket`` (FULL rows only, rows x chunks programs, one more read): the exact float64 mass of
   the entries >= hi and the entries in [lo, hi), copied out in order.
4. ``bracket_select`` (FULL rows only, one program per row): the exact cutoff among the copied
   entries; if the bracket was too low, among the groups whose max is >= hi; if it was too high
   or a huge tie overflowed it, over the whole row. Every path gives the same answer. The bracket
   pass also sums the copied entries' mass per sub-bracket (``bracket_bins``) and the search runs
   on the entries of the one sub-bracket holding the cutoff (exact sums: same bits).
5. ``renorm_write`` (rows x chunks programs, one read + one write): the output.

Everything a row's output depends on is computed by programs that see only that row, with block
shapes fixed by the vocabulary size: no float atomics, no batch-size-dependent configuration,
every sum in a fixed order. Torch reference: kernels/reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpguard.kernels import interpreter_fix
from tpguard.kernels.pdl import pdl_enter, pdl_signal, pdl_wait
from tpguard.kernels.radix_select import (
    bin_shift,
    list_groups_block,
    mass_cutoff_any,
    mass_cutoff_bits,
    mass_cutoff_block_bins,
    reciprocal_f32,
    search_start,
    upper_mass_any,
)
from tpguard.kernels.renorm_config import RenormConfig, pdl_args, reg_cap, search_rounds
from tpguard.kernels.renorm_workspace import Shapes, Workspace

interpreter_fix.install()  # bfloat16 <-> float32 casts of subnormals under the interpreter

# Row status written by the select kernels.
STATUS_DONE = 1
STATUS_FULL_SELECT = 2  # top-p: exact cutoff from the bracket pass
STATUS_FULL_SUM = 3  # min-p: cutoff known, kept mass from the bracket pass


# --- pass 1: row statistics ------------------------------------------------------------------

@triton.jit
def row_stats_chunk(probs_ptr, row, chunk, vocab, n_chunks, n_groups, n_samples,
                    chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr,
                    CHUNK: tl.constexpr, G: tl.constexpr, SG: tl.constexpr, WRITE_SAMPLE: tl.constexpr):
    """One chunk of one row: its float64 sum, non-finite count, group maxima and samples."""
    row_stats_loaded(load_chunk(probs_ptr, row, chunk, vocab, CHUNK, G), row, chunk, n_chunks, n_groups, n_samples,
                     chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, CHUNK, G, SG, WRITE_SAMPLE)


@triton.jit
def load_chunk(probs_ptr, row, chunk, vocab, CHUNK: tl.constexpr, G: tl.constexpr):
    """One chunk of one row as a [CHUNK // G, G] block in the input's dtype (padding 0); `row_stats_loaded`
    takes it, so a caller can load the next chunk before it reduces this one (renorm_top_k_fused.py)."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK // G)[:, None] * G + tl.arange(0, G)[None, :]
    return tl.load(probs_ptr + row * vocab + offs, mask=offs < vocab, other=0.0)


@triton.jit
def row_stats_loaded(raw, row, chunk, n_chunks, n_groups, n_samples, chunk_sum_ptr, chunk_bad_ptr, gmax_ptr,
                     gsamp_ptr, CHUNK: tl.constexpr, G: tl.constexpr, SG: tl.constexpr, WRITE_SAMPLE: tl.constexpr):
    """`row_stats_chunk` of a chunk already loaded (`load_chunk`)."""
    gi = tl.arange(0, CHUNK // G)
    col = tl.arange(0, G)
    x = raw.to(tl.float32)  # fp16 / bf16: exact
    bad = (x != x) | (tl.abs(x) == float("inf"))
    n_bad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
    x = tl.maximum(x, 0.0)
    # (store_chunk_stats' code, inline: the one-launch top-k compiles to other SASS through the call)
    mass = tl.sum(tl.sum(x.to(tl.float64), axis=1), axis=0)
    g = chunk * (CHUNK // G) + gi
    tl.store(gmax_ptr + row * n_groups + g, tl.max(x, axis=1), mask=g < n_groups)
    if WRITE_SAMPLE:
        # one entry per run of SG entries, at a fixed pseudo-random position, taken from registers
        s = g // (SG // G)
        pos = ((s * 40503) ^ (s >> 3)) & (SG - 1)
        holder = (g % (SG // G)) == (pos // G)
        picked = tl.sum(tl.where(col[None, :] == (pos % G)[:, None], x, 0.0), axis=1)
        tl.store(gsamp_ptr + row * n_samples + s, picked, mask=holder & (s < n_samples))
    tl.store(chunk_sum_ptr + row * n_chunks + chunk, mass)
    tl.store(chunk_bad_ptr + row * n_chunks + chunk, n_bad)


@triton.jit
def store_chunk_stats(x, n_bad, row, chunk, n_chunks, n_groups, n_samples,
                      chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr,
                      CHUNK: tl.constexpr, G: tl.constexpr, SG: tl.constexpr, WRITE_SAMPLE: tl.constexpr):
    """The row stats of one chunk held as a [CHUNK // G, G] block of non-negative values (padding
    0): its float64 sum, group maxima and samples, and `n_bad` (its non-finite count); what
    `row_stats_chunk` stores, for passes that compute the values themselves (target_probs.py)."""
    gi = tl.arange(0, CHUNK // G)
    col = tl.arange(0, G)
    mass = tl.sum(tl.sum(x.to(tl.float64), axis=1), axis=0)
    g = chunk * (CHUNK // G) + gi
    tl.store(gmax_ptr + row * n_groups + g, tl.max(x, axis=1), mask=g < n_groups)
    if WRITE_SAMPLE:
        # one entry per run of SG entries, at a fixed pseudo-random position, taken from registers
        s = g // (SG // G)
        pos = ((s * 40503) ^ (s >> 3)) & (SG - 1)
        holder = (g % (SG // G)) == (pos // G)
        picked = tl.sum(tl.where(col[None, :] == (pos % G)[:, None], x, 0.0), axis=1)
        tl.store(gsamp_ptr + row * n_samples + s, picked, mask=holder & (s < n_samples))
    tl.store(chunk_sum_ptr + row * n_chunks + chunk, mass)
    tl.store(chunk_bad_ptr + row * n_chunks + chunk, n_bad)


@triton.jit
def _row_stats_kernel(probs_ptr, vocab, n_chunks, n_groups, n_samples,
                      chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr,
                      CHUNK: tl.constexpr, G: tl.constexpr, SG: tl.constexpr,
                      WRITE_SAMPLE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)  # the call's first launch (pdl.FIRST): a plain one that signals its dependent
    row_stats_chunk(probs_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), vocab, n_chunks, n_groups,
                    n_samples, chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, CHUNK, G, SG, WRITE_SAMPLE)


def launch_row_stats(probs: torch.Tensor, s: Shapes, ws: Workspace, cfg: RenormConfig, with_sample: bool,
                     num_warps: int = 0) -> None:
    """Pass 1. `num_warps` (default cfg.pass_warps): a float64 sum's order follows the warps, so a caller
    whose chunk sums must match another kernel's (renorm_top_k.py) passes that kernel's warps."""
    _row_stats_kernel[(s.rows, s.n_chunks)](
        probs, s.vocab, s.n_chunks, s.n_groups, s.n_samples,
        ws.chunk_sum, ws.chunk_bad, ws.gmax, ws.gsamp,
        CHUNK=s.chunk, G=cfg.group, SG=cfg.sample_stride, WRITE_SAMPLE=with_sample,
        **pdl_args(cfg, s, probs.device, first=True),
        num_warps=num_warps or cfg.pass_warps,
    )


# --- pass 3: the bracket (FULL rows only) ----------------------------------------------------

@triton.jit
def _bracket_kernel(probs_ptr, vocab, n_chunks, plan_ptr, mhi_ptr, cnt_ptr, slots_ptr,
                    CHUNK: tl.constexpr, G: tl.constexpr, CAP: tl.constexpr, COPY_VIEW: tl.constexpr,
                    bmass_ptr=None, BINS: tl.constexpr = 0, BIN_SUB: tl.constexpr = 128, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK // G)[:, None] * G + tl.arange(0, G)[None, :]
    status = tl.load(plan_ptr + row * 4)
    if status >= 2:
        lo = tl.load(plan_ptr + row * 4 + 1)
        hi = tl.load(plan_ptr + row * 4 + 2)
        x = tl.load(probs_ptr + row * vocab + offs, mask=offs < vocab, other=0.0).to(tl.float32)
        bracket_chunk(tl.maximum(x, 0.0), row, chunk, n_chunks, status, lo, hi, mhi_ptr, cnt_ptr, slots_ptr,
                      CHUNK, G, CAP, COPY_VIEW, bmass_ptr, BINS, BIN_SUB)


@triton.jit
def bracket_chunk(x, row, chunk, n_chunks, status, lo, hi, mhi_ptr, cnt_ptr, slots_ptr,
                  CHUNK: tl.constexpr, G: tl.constexpr, CAP: tl.constexpr, COPY_VIEW: tl.constexpr,
                  bmass_ptr=None, BINS: tl.constexpr = 0, BIN_SUB: tl.constexpr = 128):
    """The bracket pass's work on one chunk of a FULL row (status >= 2), held as a [CHUNK // G, G]
    block of non-negative values: the float64 mass of the entries >= hi, the entries in [lo, hi)
    copied out in order (CAP slots) and their count, and (status 2, BINS) their mass per
    sub-bracket (the bracket pass's body)."""
    b = x.to(tl.int32, bitcast=True)
    mhi = tl.sum(tl.sum(tl.where(b >= hi, x.to(tl.float64), 0.0), axis=1), axis=0)
    inside = (b >= lo) & (b < hi)
    if COPY_VIEW:
        # one scan over the chunk (row-major: the same positions as the group prefix plus the
        # in-group scan), and the scatter on a 1-D view: Triton lays a store of unknown
        # contiguity out one entry per thread, index bits to lanes then warps then registers,
        # and this view's index bits 0-4 are the load's lane bits (a group's 16-byte lanes, the
        # warp's groups), 5-6 its warp bits, the rest its registers: only registers permute,
        # no conversion through shared memory (the prefix path below converts pointers,
        # values and mask there: 18 more barriers). 1-D: Triton 3.6 and 3.8 order tied dims differently.
        inside_f = tl.reshape(inside.to(tl.int32), (CHUNK,))
        n_in = tl.sum(inside_f, axis=0)
        if n_in > 0:
            pos = tl.reshape(tl.cumsum(inside_f, axis=0) - 1, (CHUNK // G, G))
            LC: tl.constexpr = G // 4
            view: tl.constexpr = (CHUNK // G // (32 // LC), 32 // LC, LC, 4)
            pos_v = tl.reshape(tl.permute(tl.reshape(pos, view), (3, 0, 1, 2)), (CHUNK,))
            keep_v = tl.reshape(tl.permute(tl.reshape(inside & (pos < CAP), view), (3, 0, 1, 2)), (CHUNK,))
            x_v = tl.reshape(tl.permute(tl.reshape(x, view), (3, 0, 1, 2)), (CHUNK,))
            tl.store(slots_ptr + (row * n_chunks + chunk) * CAP + pos_v, x_v, mask=keep_v)
    else:
        inside_i = inside.to(tl.int32)
        per_group = tl.sum(inside_i, axis=1)
        n_in = tl.sum(per_group, axis=0)
        if n_in > 0:
            # in order: a prefix sum over groups, then a short one inside each group
            start = tl.cumsum(per_group, axis=0) - per_group
            pos = start[:, None] + tl.cumsum(inside_i, axis=1) - 1
            tl.store(slots_ptr + (row * n_chunks + chunk) * CAP + pos, x, mask=inside & (pos < CAP))
    if BINS > 0:
        # the copied entries' mass per sub-bracket (bracket_select's bins), read back from the
        # slots just written (about 250 per chunk on flat rows, not the chunk's 4096 entries)
        kk = tl.arange(0, BINS)
        acc = tl.zeros((BIN_SUB, BINS), tl.float64)
        if (status == 2) & (n_in > 0):
            tl.debug_barrier()
            shift = bin_shift(lo, hi, BINS)
            n_c = tl.minimum(n_in, CAP)
            for s0 in range(0, n_c, BIN_SUB):
                i = s0 + tl.arange(0, BIN_SUB)
                v = tl.load(slots_ptr + (row * n_chunks + chunk) * CAP + i, mask=i < n_c, other=0.0)
                bin_i = (v.to(tl.int32, bitcast=True) - lo) >> shift  # (padding: negative, no bin)
                acc += tl.where(bin_i[:, None] == kk[None, :], v.to(tl.float64)[:, None], 0.0)
        tl.store(bmass_ptr + (row * n_chunks + chunk) * BINS + kk, tl.sum(acc, axis=0))
    tl.store(mhi_ptr + row * n_chunks + chunk, mhi)
    tl.store(cnt_ptr + row * n_chunks + chunk, n_in)


@triton.jit
def _search_bracket_list(cand_row, n, target, m_hi, first, t0, G: tl.constexpr, SUB: tl.constexpr,
                         REG: tl.constexpr, ENTRY_ROUNDS: tl.constexpr = 16):
    """bracket_select's search among the n bracket entries listed at cand_row (the default path)."""
    t, kept = mass_cutoff_any(cand_row, cand_row, n, n, target, m_hi, 0, 1.0, first, t0,
                              False, False, G, SUB, REG, ENTRY_ROUNDS)
    return t, kept


@triton.jit
def _bracket_select_kernel(probs_ptr, vocab, n_chunks, n_groups, plan_ptr, target_ptr, params_ptr,
                           mhi_ptr, cnt_ptr, slots_ptr, cand_ptr, list_cap, gmax_ptr, gid_ptr,
                           CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr, CAP: tl.constexpr,
                           SUB: tl.constexpr, REG: tl.constexpr, G: tl.constexpr, COPY: tl.constexpr,
                           EXACT_SPAN: tl.constexpr, bmass_ptr, BINS: tl.constexpr, BIN_W: tl.constexpr,
                           BIN_STEP: tl.constexpr = 4096, ENTRY_ROUNDS: tl.constexpr = 16, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    status = tl.load(plan_ptr + row * 4)
    if status >= 2:
        lo = tl.load(plan_ptr + row * 4 + 1)
        hi = tl.load(plan_ptr + row * 4 + 2)
        t, kept = bracket_resolve(row, status, lo, hi, target_ptr, probs_ptr, vocab, n_chunks, n_groups, mhi_ptr,
                                  cnt_ptr, slots_ptr, cand_ptr, list_cap, gmax_ptr, gid_ptr, CH_BLOCK, NG_BLOCK,
                                  CAP, SUB, REG, G, COPY, EXACT_SPAN, bmass_ptr, BINS, BIN_W, BIN_STEP, ENTRY_ROUNDS)
        tl.store(params_ptr + row * 4 + 2, t.to(tl.float32, bitcast=True))
        tl.store(params_ptr + row * 4 + 3, reciprocal_f32(kept))


@triton.jit
def bracket_resolve(row, status, lo, hi, target_ptr, probs_ptr, vocab, n_chunks, n_groups, mhi_ptr, cnt_ptr, slots_ptr,
                    cand_ptr, list_cap, gmax_ptr, gid_ptr, CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr,
                    CAP: tl.constexpr, SUB: tl.constexpr, REG: tl.constexpr, G: tl.constexpr, COPY: tl.constexpr,
                    EXACT_SPAN: tl.constexpr, bmass_ptr, BINS: tl.constexpr, BIN_W: tl.constexpr,
                    BIN_STEP: tl.constexpr = 4096, ENTRY_ROUNDS: tl.constexpr = 16):
    """bracket_select's (cutoff bits, kept mass) of a FULL row (status 2: top-p, its target mass at
    target_ptr[row]; 3: min-p, whose cutoff is hi and whose kept mass the bracket pass summed).
    ENTRY_ROUNDS (renorm_config.search_rounds): every search here has nothing at or above its target
    outside the searched entries (m_hi < target, or 0), so its cutoff is an entry: rounds past the
    entries' last bit are skipped."""
    ch = tl.arange(0, CH_BLOCK)
    chm = ch < n_chunks
    m_hi = tl.sum(tl.load(mhi_ptr + row * n_chunks + ch, mask=chm, other=0.0), axis=0)
    counts = tl.load(cnt_ptr + row * n_chunks + ch, mask=chm, other=0)
    overflow = tl.max(counts, axis=0) > CAP
    t = hi
    kept = m_hi
    if status == 2:
        target = tl.load(target_ptr + row)
        src = probs_ptr + row * vocab
        cand_row = cand_ptr + row * list_cap
        # gather the chunks' slots into one list, in chunk order, COPY chunks per step
        n = tl.full((), 0, tl.int32)
        idx = tl.arange(0, CAP)
        for c0 in range(0, n_chunks, COPY):
            cc = c0 + tl.arange(0, COPY)
            cnt_c = tl.minimum(tl.load(cnt_ptr + row * n_chunks + cc, mask=cc < n_chunks, other=0), CAP)
            start = n + tl.cumsum(cnt_c, axis=0) - cnt_c
            inside = idx[None, :] < cnt_c[:, None]
            v = tl.load(slots_ptr + (row * n_chunks + cc[:, None]) * CAP + idx[None, :], mask=inside, other=0.0)
            tl.store(cand_row + start[:, None] + idx[None, :], v, mask=inside)
            n += tl.sum(cnt_c, axis=0)
        tl.debug_barrier()
        # the bins are exact (hence equal to any other summation) when the bracket is narrow
        # and holds <= REG entries; the bin's entries (< n) are compacted after the list
        kk = tl.arange(0, BINS)
        bin_mass = tl.sum(tl.load(bmass_ptr + (row * n_chunks + ch[:, None]) * BINS + kk[None, :],
                                  mask=chm[:, None], other=0.0), axis=0)
        e_lo = tl.maximum(lo >> 23, 1)  # biased exponents; subnormals share exponent 1's ulp
        e_hi = tl.maximum((hi - 1) >> 23, 1)
        scratch_at = ((n + 15) >> 4) << 4  # after the list (bracket_select stays idempotent)
        use_bins = (overflow == 0) & (n <= REG) & (e_hi - e_lo <= EXACT_SPAN) & (scratch_at + n <= list_cap)
        if use_bins:
            m_in = tl.sum(bin_mass, axis=0)
        else:
            m_in = upper_mass_any(cand_row, cand_row, n, n, 0, 0, 1.0, False, False, G, SUB, REG)
        if (overflow == 0) & (m_hi < target) & (m_hi + m_in >= target):
            first, t0 = search_start(lo, hi - 1)
            found = use_bins
            if use_bins:
                t, kept, found = mass_cutoff_block_bins(cand_row, n, target, m_hi, bin_mass, lo,
                                                        bin_shift(lo, hi, BINS),
                                                        cand_row + tl.multiple_of(scratch_at, 16),
                                                        max(32, min(REG, BIN_STEP)), BIN_W, BINS,
                                                        32 - 2 * ENTRY_ROUNDS)
            if found == 0:  # (no usable bins, or a bin over BIN_W entries)
                t, kept = _search_bracket_list(cand_row, n, target, m_hi, first, t0, G, SUB, REG, ENTRY_ROUNDS)
        elif m_hi >= target:
            # the sample bracket was too low: the cutoff is >= hi, so every entry that counts
            # lies in a group whose max is >= hi
            gidx = tl.arange(0, NG_BLOCK)
            gb = tl.load(gmax_ptr + row * n_groups + gidx, mask=gidx < n_groups, other=0.0)
            gb = gb.to(tl.int32, bitcast=True)
            gid_row = gid_ptr + row * n_groups
            n_sel = list_groups_block(gid_row, gb, gidx, hi)
            tl.debug_barrier()
            first, t0 = search_start(hi, tl.max(gb, axis=0))
            t, kept = mass_cutoff_any(src, gid_row, n_sel * G, vocab, target, 0.0, 0, 1.0, first, t0,
                                      True, False, G, SUB, REG, ENTRY_ROUNDS)
        else:
            # too high, or a huge tie overflowed the bracket: search the whole row
            t, kept = mass_cutoff_bits(src, src, vocab, vocab, target, 0.0, 0, 1.0, 0, 0,
                                       False, False, G, SUB, ENTRY_ROUNDS)
    return t, kept


def exact_span(cfg: RenormConfig) -> int:
    """Most binades between lo and hi for which a float64 sum of <= bracket_reg bracket entries is
    exact in any order (each a multiple of ulp(lo): n * hi < 2**53 ulp(lo))."""
    return 29 - (cfg.bracket_reg.bit_length() - 1)


def bins_window(cfg: RenormConfig) -> int:
    """Entries of the one sub-bracket bracket_select searches (about 2x a bin's share of bracket_reg);
    a bin with more falls back to the default search."""
    return max(32, 2 * cfg.bracket_reg // cfg.bracket_bins)


def bins_args(ws: Workspace, cfg: RenormConfig, **extra) -> dict:
    """The bins' launch arguments."""
    return dict(bmass_ptr=ws.bmass, BINS=cfg.bracket_bins, **extra)


def copy_view(cfg: RenormConfig) -> bool:
    """The bracket pass's copy-out (docs/design-renorm.md, "Registers and occupancy"): one scan over the
    chunk stored from a view in the load's own lane / warp layout, no shared-memory shuffle (bracket pass
    100 -> 75 us, top-p flat 386 -> 364 on an H200), where that view fits: 4 <= group <= 128 and a chunk
    >= 128 (one lane per entry of a 32-wide slice); elsewhere a prefix over the groups and a scan inside
    each (the same slots)."""
    return 4 <= cfg.group <= 128 and cfg.chunk >= 128


def launch_bracket(probs: torch.Tensor, s: Shapes, ws: Workspace, cfg: RenormConfig) -> None:
    """Pass 3 (the bracket pass, FULL rows) and pass 4 (bracket_select, their exact cutoff)."""
    _bracket_kernel[(s.rows, s.n_chunks)](
        probs, s.vocab, s.n_chunks, ws.plan, ws.mhi, ws.cnt, ws.slots,
        CHUNK=s.chunk, G=cfg.group, CAP=s.cap, COPY_VIEW=copy_view(cfg), **bins_args(ws, cfg),
        **pdl_args(cfg, s, probs.device), num_warps=cfg.pass_warps,
        **reg_cap(cfg.bracket_pass_maxnreg or cfg.bracket_maxnreg, cfg.pass_warps),
    )
    _bracket_select_kernel[(s.rows,)](
        probs, s.vocab, s.n_chunks, s.n_groups, ws.plan, ws.target, ws.params, ws.mhi, ws.cnt, ws.slots,
        ws.cand, ws.list_cap, ws.gmax, ws.gid,
        CH_BLOCK=s.ch_block, NG_BLOCK=s.ng_block, CAP=s.cap, SUB=cfg.sub, REG=cfg.bracket_reg, G=cfg.group,
        COPY=max(1, min(8, 8192 // s.cap)), EXACT_SPAN=exact_span(cfg), ENTRY_ROUNDS=search_rounds(cfg, probs.dtype),
        num_warps=cfg.bracket_warps,
        **bins_args(ws, cfg, BIN_W=bins_window(cfg)),
        **pdl_args(cfg, s, probs.device),
        **reg_cap(cfg.bracket_maxnreg, cfg.bracket_warps),
    )


# --- pass 5: write ---------------------------------------------------------------------------

@triton.jit
def load_write_params(params_ptr, flag_ptr, row):
    """A row's write parameters (thr1, r1, thr2, r2; params [rows, 4]), whether it is a live
    (not NaN) row, and what its dropped entries become (NaN on a NaN row, else 0)."""
    # .cg (L2): in the one-launch top-k (renorm_top_k_fused.py) another CTA of the same launch wrote
    # them, and rows share a 128-byte line that L1 may hold from a row that was ready earlier
    thr1 = tl.load(params_ptr + row * 4, cache_modifier=".cg")
    r1 = tl.load(params_ptr + row * 4 + 1, cache_modifier=".cg")
    thr2 = tl.load(params_ptr + row * 4 + 2, cache_modifier=".cg")
    r2 = tl.load(params_ptr + row * 4 + 3, cache_modifier=".cg")
    nan_row = tl.load(flag_ptr + row, cache_modifier=".cg") != 0
    return thr1, r1, thr2, r2, nan_row == 0, tl.where(nan_row, float("nan"), 0.0)


@triton.jit
def round_bf16(x):
    """fp32 -> bfloat16, rounded to nearest even with integer operations: the GPU's conversion does
    the same, the Triton interpreter's truncates (and torch rounds to nearest even), so the kernels
    round themselves to give the same bits everywhere. NaN stays a (quiet) NaN."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_out_dtype(value, out_ptr):
    """fp32 output values in `out_ptr`'s dtype (float32, float16 or bfloat16), rounded to nearest
    even: what `tl.store` to `out_ptr` stores, made explicit so that the fingerprint hashes the same
    bits (renorm_write_fp.py)."""
    if out_ptr.dtype.element_ty == tl.bfloat16:
        out = round_bf16(value)
    else:
        out = value.to(out_ptr.dtype.element_ty)
    return out


@triton.jit
def store_probs(out_ptr, value, mask):
    """Store fp32 probabilities in `out_ptr`'s dtype (`to_out_dtype`)."""
    tl.store(out_ptr, to_out_dtype(value, out_ptr), mask=mask)


@triton.jit
def write_value(x, thr1, r1, thr2, r2, live, fill):
    """The output entry: kept entries renormalised in two roundings, fp32(fp32(x * r1) * r2);
    the others `fill`. Shared by both write kernels (renorm_write_fp.py), so their outputs
    are the same bits."""
    y = x * r1
    keep = (x >= thr1) & (x > 0.0) & (y >= thr2)
    return tl.where(keep & live, y * r2, fill)


@triton.jit
def _renorm_write_kernel(probs_ptr, out_ptr, vocab, params_ptr, flag_ptr, CHUNK: tl.constexpr,
                         PDL: tl.constexpr = 0):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < vocab
    # probs is the call's input, written by no launch of the call: loaded before the wait (PDL)
    pdl_signal(PDL)
    x = tl.load(probs_ptr + row * vocab + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    thr1, r1, thr2, r2, live, fill = load_write_params(params_ptr, flag_ptr, row)
    store_probs(out_ptr + row * vocab + offs, write_value(x, thr1, r1, thr2, r2, live, fill), mask)


def launch_write(probs: torch.Tensor, out: torch.Tensor, s: Shapes, ws: Workspace, cfg: RenormConfig,
                 dependent: bool = False) -> None:
    """The write pass. `dependent`: a later launch of a renorm call (write_pass); alone (the default) it is a
    call's first launch: plain, and it waits for nothing before it loads `probs`."""
    _renorm_write_kernel[(s.rows, s.n_chunks)](
        probs, out, s.vocab, ws.params, ws.flag, CHUNK=s.chunk,
        **pdl_args(cfg, s, probs.device, first=not dependent),
        num_warps=cfg.pass_warps,
    )
