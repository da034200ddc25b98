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
   or a huge tie overflowed it, over the whole row. Every path gives the same answer. With
   ``bracket_bins`` the bracket pass also sums the copied entries' mass per sub-bracket and the
   search runs on the entries of the one sub-bracket holding the cutoff (exact sums: same bits).
5. ``renorm_write`` (rows x chunks programs, one read + one write): the output.

Everything a row's output depends on is computed by programs that see only that row, with block
shapes fixed by the vocabulary size: no float atomics, no batch-size-dependent configuration,
every sum in a fixed order. Torch reference: kernels/reference.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


from tpguard.kernels import pdl
from tpguard.kernels.pdl import pdl_enter, pdl_exit, pdl_signal, pdl_wait
from tpguard.kernels.radix_select import (
    bin_shift,
    kth_largest_block,
    list_groups_block,
    mass_cutoff_any,
    mass_cutoff_bits,
    mass_cutoff_block_bins,
    reciprocal_f32,
    search_start,
    upper_mass_any,
)

# Row status written by the select kernels.
STATUS_DONE = 1
STATUS_FULL_SELECT = 2  # top-p: exact cutoff from the bracket pass
STATUS_FULL_SUM = 3  # min-p: cutoff known, kept mass from the bracket pass
MAX_BLOCK = 1 << 20  # register blocks searched by kth_largest_block (20-bit count fields)


@dataclass(frozen=True)
class RenormConfig:
    """Block shapes. Results depend only on these and the vocabulary size, never on the batch.

    Defaults: the fastest correct variants of the H200 sweeps (docs/benchmarks.md and docs/design-renorm.md:
    runs 3 and 5 for the shapes and register caps, runs 9-11 for bracket_copy, bracket_bins and
    tps_shared); every option gives the same output bits."""

    # run 5's sweep (chunk4k_w4): every streaming pass at 4 warps x 4096 entries, top-p flat
    # 386 vs 396 us at 8 warps x 8192, the other ops equal
    chunk: int = 4096  # entries per program in the full passes (a power of two, >= 64)
    pass_warps: int = 4
    select_warps: int = 8  # the per-row kernels hold a row's group maxima in registers
    sub: int = 1024  # entries per step when the per-row searches stream
    reg: int = 2048  # candidates searched from registers (more are streamed)
    # bracket_select: 8 warps (2 CTAs per SM: 256 rows in one wave) since run 21: top-p flat 314 -> 299 us, logits x 4
    # 297 -> 282, bracket_select 49.6 -> 33.7 us (run 22; 16 warps at 1 CTA per SM ran two waves; run 2 had 16 warps /
    # 8192 beat 32 / 16384)
    bracket_warps: int = 8
    bracket_reg: int = 16384  # bracket entries searched from registers (~10-14k on flat rows; run 4: was 8192)
    group: int = 32  # G: entries per gmax group
    sample_stride: int = 32  # SG: one sampled entry per SG entries (a multiple of G)
    tau_groups: int = 512  # top-p: groups gathered before falling back to the bracket pass
    min_p_groups: int = 512  # min-p: most groups gathered before the bracket pass
    list_cap: int = 16384  # gathered entries above the cutoff's lower bound kept per row
    compact_sub: int = 4096  # entries per step when a select kernel compacts gathered groups
    cap_per_chunk: int = 1024  # bracket entries kept per chunk before the fallback searches
    z: float = 5.0  # bracket half-width in standard deviations of the sample estimate
    # --- run-4 options (docs/design-renorm.md, "Registers and occupancy"); 0 keeps the run-3 behaviour ---
    tau_mass_first: int = 1  # top-p select: M(>= tau) streamed first, the tau list compacted only when needed
    bracket_chunk: int = 0  # entries per bracket-pass program (0: chunk); smaller = more CTAs per SM
    bracket_pass_warps: int = 0  # warps of the bracket pass (0: pass_warps)
    bracket_prefetch: int = 0  # bracket pass: load the chunk before the row's plan arrives (reads every row)
    # register caps (ptxas .maxnreg; 0 = none). Uncapped, ptxas gives the 8-warp select kernels
    # 255 registers (1 CTA per SM: 256 rows = 2 waves) and the bracket pass 134 (1 CTA per SM);
    # at 128 both fit 2 CTAs per SM, with 0-32 bytes of stack (sm_90a, cuobjdump).
    select_maxnreg: int = 128
    bracket_maxnreg: int = 128
    # the bracket pass's own cap (0: bracket_maxnreg): the streaming pass compiles to ~100 registers (5 CTAs per
    # SM at 4 warps) where bracket_select needs its 128. Run 20 (H200, graph): top-p flat 330 -> 316 us at 80
    # (96: 320, 64: 320), top-p logits x 4 305 -> 298, min-p flat 206 -> 202
    bracket_pass_maxnreg: int = 80
    # --- session-3 option (docs/design-renorm.md, "Registers and occupancy"; bsel_radix, bsel_window and bracket_copy=1
    # were removed in session 4 after run 9: slower, see "Session 3 variants") ---
    # bracket pass copy-out: 2 (run 9's winner: bracket pass 100 -> 75 us, top-p flat 386 -> 364) = one scan over
    # the chunk, stored from a view in the load's own lane/warp layout (no shared-memory shuffle); used where
    # that view fits (4 <= group <= 128, bracket chunk >= 128), else 0 = prefix over groups + scan inside each
    bracket_copy: int = 2
    # --- session-4 option (docs/design-renorm.md, "Sub-bracket bins"); 0 = run 9's code ---
    # B: the bracket pass sums its entries' mass per 1/B of [lo, hi) (by bit pattern); bracket_select searches
    # only the sub-bracket holding the cutoff (a power of two, 2..64). Run 10: bracket_select 85 -> 50 us, the
    # bracket pass 75 -> 95 us, top-p flat 363 -> 349 us at B = 8 (16: 351, 4: 355, 32: 365)
    bracket_bins: int = 8
    # --- session-4 option (docs/design-renorm.md, "Top-p: where the estimate's rounds went") ---
    # top-p select: while the bracket's lo and hi searches agree, one 6-sum reduction per round instead of 12
    # (same bits). Run 11: the select pass 55.0 -> 46.7 us, top-p flat 347 -> 339 us; 0 = the two searches apart.
    # (top-k + top-p with k >= vocab, plain top-p inside the top-k select kernel, keeps them apart: not measured there)
    tps_shared: int = 1
    # --- session-5 option (docs/design-renorm.md, "Top-p: where the estimate's rounds went"); 0 = run 18's code ---
    # top-p select: 1 = the sample bracket's samples as a power-of-two main block plus a power-of-two remainder
    # block (4096 + 1024 at vocab 163840, not one padded 8192 block; 128256: 4096, unchanged), and the tau search's
    # group maxima likewise (exact int64 counts: same tau); same output bits
    # (float32 summation order differs, so the estimated bracket may differ: it is verified exactly). Run 19
    # (session 6, H200, graph): the select pass 46.6 -> 37.7 us, top-p flat 336 -> 326 us, peaky 210 -> 207.
    tps_split: int = 1
    # --- session-6 option (docs/design-renorm.md, "Top-p: where the estimate's rounds went"); 0 = run 19's code ---
    # top-p select: with fewer than this many samples in [hi, tau), hi = tau (the estimate's variance there rests
    # on a handful of samples; a bracket ending below the cutoff sends the row to bracket_select's slowest path).
    # Run 20: top-p on logits N(0, 1) x 4 437 -> 305 us. The top-p select kernel only (top-k + top-p with k >= vocab,
    # whose select kernel runs the same plan, keeps the old rule and no tps_split: not measured there)
    bracket_hi_samples: int = 16
    # --- session-6 option (kernels/row_split.py); 1 = off ---
    # a call captured in a CUDA graph runs its rows in this many parts, each on its own stream, so that one part's
    # streaming passes overlap the other's per-row kernels (same bits: the kernels are batch-invariant). Run 20
    # (H200, graph, 256 x 163840): top-p flat 327.6 -> 314.6 us, top-p logits x 4 307.9 -> 270.4
    graph_row_split: int = 2
    # --- session-7 option (kernels/pdl.py; docs/design-renorm.md, "Launches"); 0 = run 23's launches ---
    # programmatic dependent launch (sm_90+): every launch of a call after its first is made with the PDL
    # attribute and waits (griddepcontrol.wait) before it touches anything an earlier launch wrote; 1: every
    # kernel signals its dependents at its start, so the next kernel's CTAs are resident (and the write pass
    # has its chunk loaded) when the one before ends; 2: the per-row kernels (select, bracket_select) signal at
    # their end instead (run 28: no faster than 1 at 256 rows but for peaky top-p from a graph). Same bits (the same
    # kernels, the same order of sums). Run 24 (H200,
    # 256 x 163840, eager / graph us): top-p flat 304.4 / 290.9 -> 295.8 / 286.9, top-k(40) 169.0 / 163.1 ->
    # 163.5 / 158.7, top-k + top-p 180.2 / 174.5 -> 173.6 / 169.7, min-p 203.3 / 193.9 -> 198.6 / 190.0; top-p
    # peaky 210.4 / 193.0 -> 209.4 / 198.9
    pdl: int = 1
    # calls of fewer rows launch plainly (a split call's parts as the whole call: renorm_plan._part_config): run 24
    # (H200, pdl=1) top-p at 1 / 8 / 64 rows 57.5 -> 60.0, 63.0 -> 73.9, 121.8 -> 125.9 us from a graph (1 row eagerly
    # 84.3 -> 98.3; top-k gained 1-5 us from a graph there); at 256 rows top-p flat, top-k, top-k + top-p and min-p
    # gained 4-9 us eagerly and 4-5 from a graph, top-p peaky lost 5.9 from a graph
    pdl_min_rows: int = 128
    # --- session-11 option (kernels/renorm_top_k_fused.py); 0 = the three launches at every batch size ---
    # top-k alone, or top-k + top-p with a scalar k < vocab, at <= this many rows: one launch (row stats, select
    # and write in one grid, a row's CTAs waiting on its select) instead of three; same bits. Run 37 (H200, 163840,
    # eager): top-k(40) at 1 / 8 rows 52 / 51 -> 38 / 37 us (flashinfer 45 / 47)
    fused_rows: int = 8
    # chunks per CTA of the one-launch kernel (same chunk sums); 0: the fewest that fit the grid on the GPU
    # at one CTA per SM (renorm_top_k_fused.chunks_per_cta, run 36)
    fused_per_cta: int = 0
    # top-p with one read before the write (kernels/renorm_top_p_presample.py; docs/kernels.md, "A faster
    # top-p"): 1 = the bracket from a 1/32 sample taken first, the row stats and the bracket's copy-out in
    # one pass; 0 = the default pipeline (renorm_top_p.py). Same cutoffs. Not measured yet: off
    top_p_presample: int = 0
    presample_block: int = 8  # consecutive entries per sample block (one 32-byte sector of float32)

    def replace(self, **changes) -> "RenormConfig":
        return dataclasses.replace(self, **changes)

    def __hash__(self) -> int:
        # cached: every eager call hashes its config in the plan key (~1 us for ~40 fields, session 11)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h


def pdl_mode(cfg: RenormConfig, s: "Shapes", device: torch.device) -> int:
    """cfg.pdl for one call: 0 (plain launches) below cfg.pdl_min_rows rows or on a device without
    grid dependency control (kernels/pdl.py)."""
    if not cfg.pdl or s.rows < cfg.pdl_min_rows or not pdl.supported(device):
        return 0
    return int(cfg.pdl)


def pdl_args(cfg: RenormConfig, s: "Shapes", device: torch.device, *, first: bool = False,
             late: bool = False) -> dict:
    """A launch's PDL constexpr and options (kernels/pdl.py). `first`: the call's first launch (plain,
    it only signals its dependent; also the write pass launched on its own); else a dependent launch
    (the PDL attribute; it waits before dependent work). `late`: a per-row kernel (signals at its end
    under pdl=2)."""
    mode = pdl_mode(cfg, s, device)
    if first:
        return {"PDL": pdl.first(mode)}
    return {"PDL": pdl.dependent(mode, late), **pdl.launch_options(mode)}


def reg_cap(n: int, num_warps: int) -> dict:
    """Launch options for a register cap (none when 0), at most what one CTA of num_warps may hold
    (64K registers per SM: a 32-warp CTA must stay at 64); the interpreter ignores them."""
    if not n:
        return {}
    return {"maxnreg": max(24, min(int(n), 65536 // (32 * num_warps)) // 8 * 8)}


def config_from_env(text: str) -> RenormConfig:
    """``TPGUARD_RENORM_CONFIG="chunk=4096,pass_warps=4"``: block shapes for the whole process.
    Every rank must use the same value (like any kernel configuration); results depend on it
    only where a float64 sum ties at the cutoff."""
    from tpguard.config import replace_from_text

    return replace_from_text(RenormConfig(), text, "TPGUARD_RENORM_CONFIG")


DEFAULT_CONFIG = config_from_env(os.environ.get("TPGUARD_RENORM_CONFIG", ""))


@dataclass(frozen=True)
class Shapes:
    rows: int
    vocab: int
    chunk: int
    n_chunks: int
    n_groups: int
    n_samples: int
    ch_block: int
    ng_block: int
    ns_block: int
    cap: int
    b_chunk: int  # the bracket pass's chunk, its count and block
    n_bchunks: int
    bch_block: int


@functools.lru_cache(maxsize=256)
def shapes_for(rows: int, vocab: int, cfg: RenormConfig) -> Shapes:
    """Block shapes for a batch (cached: the host path of a call stays a few microseconds)."""
    if cfg.sample_stride % cfg.group or cfg.chunk % cfg.sample_stride:
        raise ValueError("RenormConfig: sample_stride must be a multiple of group, chunk of sample_stride")
    if cfg.bracket_copy not in (0, 2):
        raise ValueError("RenormConfig: bracket_copy must be 0 or 2")
    if cfg.bracket_bins and (cfg.bracket_bins & (cfg.bracket_bins - 1) or not 2 <= cfg.bracket_bins <= 64):
        raise ValueError("RenormConfig: bracket_bins must be 0 or a power of two in 2..64")
    if cfg.top_p_presample not in (0, 1) or cfg.presample_block < 1 or cfg.presample_block & (cfg.presample_block - 1):
        raise ValueError("RenormConfig: top_p_presample must be 0 or 1, presample_block a power of two")
    if cfg.tps_split not in (0, 1):
        raise ValueError(f"RenormConfig: tps_split must be 0 or 1, got {cfg.tps_split}")
    for name in ("reg", "bracket_reg"):  # register blocks (tl.arange); exact_span assumes it too
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"RenormConfig: {name} must be a power of two, got {v}")
    chunk = cfg.chunk  # fixed (not shrunk for short rows): fewer kernel variants to compile
    b_chunk = cfg.bracket_chunk or chunk
    if b_chunk & (b_chunk - 1) or b_chunk < max(64, cfg.group):
        raise ValueError("RenormConfig: bracket_chunk must be a power of two >= 64 and >= group")
    n_bchunks = triton.cdiv(vocab, b_chunk)
    n_chunks = triton.cdiv(vocab, chunk)
    n_groups = triton.cdiv(vocab, cfg.group)
    n_samples = triton.cdiv(vocab, cfg.sample_stride)
    ng_block = max(16, triton.next_power_of_2(n_groups))
    if ng_block > MAX_BLOCK or max(cfg.reg, cfg.bracket_reg) > MAX_BLOCK:
        # kth_largest_block packs three counts into 20-bit fields of one int64
        raise ValueError(f"vocabulary of {vocab} entries is too large for group={cfg.group} "
                         f"(at most {MAX_BLOCK * cfg.group})")
    return Shapes(
        rows=rows,
        vocab=vocab,
        chunk=chunk,
        n_chunks=n_chunks,
        n_groups=n_groups,
        n_samples=n_samples,
        ch_block=max(2, triton.next_power_of_2(n_chunks)),
        ng_block=ng_block,
        ns_block=max(16, triton.next_power_of_2(n_samples)),
        cap=min(cfg.cap_per_chunk, b_chunk),
        b_chunk=b_chunk,
        n_bchunks=n_bchunks,
        bch_block=max(2, triton.next_power_of_2(n_bchunks)),
    )


@dataclass
class Workspace:
    """Per-call scratch, carved from three allocations (one per dtype); every buffer a kernel
    reads is written earlier in the same call. Buffers are flat; kernels index them by row."""

    chunk_sum: torch.Tensor  # float64 [rows * n_chunks]
    chunk_bad: torch.Tensor  # int32 [rows * n_chunks]
    gmax: torch.Tensor  # float32 [rows * n_groups]
    gsamp: torch.Tensor  # float32 [rows * n_samples]
    gid: torch.Tensor  # int32 [rows * n_groups]
    cand: torch.Tensor  # float32 [rows * list_cap]: values above a cutoff's lower bound, in order
    params: torch.Tensor  # float32 [rows * 4]: thr1, r1, thr2, r2
    flag: torch.Tensor  # int32 [rows]: 1 = NaN row
    plan: torch.Tensor  # int32 [rows, 4]: status, lo bits, hi bits, -
    target: torch.Tensor  # float64 [rows]
    mhi: torch.Tensor  # float64 [rows * n_bchunks]
    cnt: torch.Tensor  # int32 [rows * n_bchunks]
    slots: torch.Tensor  # float32 [rows * n_bchunks * cap]
    bmass: torch.Tensor  # float64 [rows * n_bchunks * bracket_bins]: bracket mass per sub-bracket (bracket_bins)
    list_cap: int
    cap: int
    # int32 [rows * SYNC_WORDS] of the one-launch top-k (renorm_top_k_fused.py), zero between calls (the
    # kernel leaves it so; poisoning zeroes ints); an empty tensor where the call cannot take it
    sync: torch.Tensor


_DTYPE_OF = {"chunk_sum": torch.float64, "target": torch.float64, "mhi": torch.float64, "bmass": torch.float64,
             "chunk_bad": torch.int32, "gid": torch.int32, "flag": torch.int32, "plan": torch.int32,
             "cnt": torch.int32, "gmax": torch.float32, "gsamp": torch.float32, "cand": torch.float32,
             "params": torch.float32, "slots": torch.float32}


@functools.lru_cache(maxsize=256)
def _layout(s: Shapes, cfg: RenormConfig, with_sample: bool, with_bracket: bool):
    """(list_cap, {dtype: (names, sizes)}): each buffer followed by padding to 64 entries
    (aligned pointers); split() of one allocation per dtype gives buffer, pad, buffer, pad..."""
    r = s.rows
    list_cap = max(min(cfg.list_cap, s.vocab), s.n_bchunks * s.cap if with_bracket else 0)
    numel = {
        "chunk_sum": r * s.n_chunks, "chunk_bad": r * s.n_chunks, "gmax": r * s.n_groups,
        "gsamp": r * s.n_samples if with_sample else 1, "gid": r * s.n_groups, "cand": r * list_cap,
        "params": r * 4, "flag": r, "plan": r * 4, "target": r,
        "mhi": r * s.n_bchunks if with_bracket else 1, "cnt": r * s.n_bchunks if with_bracket else 1,
        "slots": r * s.n_bchunks * s.cap if with_bracket else 1,
        "bmass": r * s.n_bchunks * cfg.bracket_bins if with_bracket and cfg.bracket_bins else 1,
    }
    groups = {}
    for name, n in numel.items():
        names, sizes = groups.setdefault(_DTYPE_OF[name], ([], []))
        names.append(name)
        sizes += [n, (n + 63) // 64 * 64 - n]
    return list_cap, groups


SYNC_WORDS = 4  # per row of the one-launch top-k: arrived, ready, done, padding


def workspace_for(s: Shapes, cfg: RenormConfig, device: torch.device, with_sample: bool,
                  with_bracket: bool, with_sync: bool = False) -> Workspace:
    list_cap, groups = _layout(s, cfg, with_sample, with_bracket)
    views = {}
    for dtype, (names, sizes) in groups.items():
        parts = torch.empty(sum(sizes), dtype=dtype, device=device).split(sizes)
        views.update(zip(names, parts[::2]))
    views["plan"] = views["plan"].view(s.rows, 4)
    # only where the one launch may run (<= fused_rows rows): the zeros are a fill launch per workspace
    sync = torch.zeros(s.rows * SYNC_WORDS if with_sync and s.rows <= cfg.fused_rows else 0, dtype=torch.int32,
                       device=device)
    return Workspace(list_cap=list_cap, cap=s.cap, sync=sync, **views)


# --- pass 1: row statistics ------------------------------------------------------------------

@triton.jit
def row_stats_chunk(probs_ptr, row, chunk, vocab, n_chunks, n_groups, n_samples,
                    chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr,
                    CHUNK: tl.constexpr, G: tl.constexpr, SG: tl.constexpr, WRITE_SAMPLE: tl.constexpr):
    """One chunk of one row: its float64 sum, non-finite count, group maxima and samples."""
    src = probs_ptr + row * vocab
    gi = tl.arange(0, CHUNK // G)
    col = tl.arange(0, G)
    offs = chunk * CHUNK + gi[:, None] * G + col[None, :]
    x = tl.load(src + offs, mask=offs < vocab, other=0.0).to(tl.float32)  # fp16 / bf16: exact
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
    `row_stats_chunk` stores, for passes that compute the values themselves (target_probs.py,
    renorm_top_p_presample.py)."""
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
                    CHUNK: tl.constexpr, G: tl.constexpr, CAP: tl.constexpr, PREFETCH: tl.constexpr,
                    COPY_MODE: tl.constexpr, bmass_ptr=None, BINS: tl.constexpr = 0, BIN_SUB: tl.constexpr = 128,
                    PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK // G)[:, None] * G + tl.arange(0, G)[None, :]
    if PREFETCH:
        # the chunk's load issued with the plan's, not after it (reads rows that need no bracket too)
        x = tl.load(probs_ptr + row * vocab + offs, mask=offs < vocab, other=0.0).to(tl.float32)
    status = tl.load(plan_ptr + row * 4)
    if status >= 2:
        lo = tl.load(plan_ptr + row * 4 + 1)
        hi = tl.load(plan_ptr + row * 4 + 2)
        if not PREFETCH:
            x = tl.load(probs_ptr + row * vocab + offs, mask=offs < vocab, other=0.0).to(tl.float32)
        bracket_chunk(tl.maximum(x, 0.0), row, chunk, n_chunks, status, lo, hi, mhi_ptr, cnt_ptr, slots_ptr,
                      CHUNK, G, CAP, COPY_MODE, bmass_ptr, BINS, BIN_SUB)


@triton.jit
def bracket_chunk(x, row, chunk, n_chunks, status, lo, hi, mhi_ptr, cnt_ptr, slots_ptr,
                  CHUNK: tl.constexpr, G: tl.constexpr, CAP: tl.constexpr, COPY_MODE: tl.constexpr,
                  bmass_ptr=None, BINS: tl.constexpr = 0, BIN_SUB: tl.constexpr = 128):
    """The bracket pass's work on one chunk of a FULL row (status >= 2), held as a [CHUNK // G, G]
    block of non-negative values: the float64 mass of the entries >= hi, the entries in [lo, hi)
    copied out in order (CAP slots) and their count, and (status 2, BINS) their mass per
    sub-bracket. Shared by the bracket pass and the one-read top-p pass (renorm_top_p_presample.py)."""
    b = x.to(tl.int32, bitcast=True)
    mhi = tl.sum(tl.sum(tl.where(b >= hi, x.to(tl.float64), 0.0), axis=1), axis=0)
    inside = (b >= lo) & (b < hi)
    if COPY_MODE == 2:
        # one scan over the chunk (row-major: the same positions as the group prefix plus the
        # in-group scan), and the scatter on a 1-D view: Triton lays a store of unknown
        # contiguity out one entry per thread, index bits to lanes then warps then registers,
        # and this view's index bits 0-4 are the load's lane bits (a group's 16-byte lanes, the
        # warp's groups), 5-6 its warp bits, the rest its registers: only registers permute,
        # no conversion through shared memory (modes 0 and 1 convert pointers, values and
        # mask there: 18 more barriers). 1-D: Triton 3.6 and 3.8 order tied dims differently.
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
                         REG: tl.constexpr):
    """bracket_select's search among the n bracket entries listed at cand_row (the default path)."""
    t, kept = mass_cutoff_any(cand_row, cand_row, n, n, target, m_hi, 0, 1.0, first, t0,
                              False, False, G, SUB, REG)
    return t, kept


@triton.jit
def _bracket_select_kernel(probs_ptr, vocab, n_chunks, n_groups, plan_ptr, target_ptr, params_ptr,
                           mhi_ptr, cnt_ptr, slots_ptr, cand_ptr, list_cap, gmax_ptr, gid_ptr,
                           CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr, CAP: tl.constexpr,
                           SUB: tl.constexpr, REG: tl.constexpr, G: tl.constexpr, COPY: tl.constexpr,
                           EXACT_SPAN: tl.constexpr,
                           bmass_ptr=None, BINS: tl.constexpr = 0, BIN_W: tl.constexpr = 0,
                           BIN_STEP: tl.constexpr = 4096, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    status = tl.load(plan_ptr + row * 4)
    if status >= 2:
        lo = tl.load(plan_ptr + row * 4 + 1)
        hi = tl.load(plan_ptr + row * 4 + 2)
        t, kept = bracket_resolve(row, status, lo, hi, target_ptr, probs_ptr, vocab, n_chunks, n_groups, mhi_ptr,
                                  cnt_ptr, slots_ptr, cand_ptr, list_cap, gmax_ptr, gid_ptr, CH_BLOCK, NG_BLOCK,
                                  CAP, SUB, REG, G, COPY, EXACT_SPAN, bmass_ptr, BINS, BIN_W, BIN_STEP)
        tl.store(params_ptr + row * 4 + 2, t.to(tl.float32, bitcast=True))
        tl.store(params_ptr + row * 4 + 3, reciprocal_f32(kept))
    pdl_exit(PDL)


@triton.jit
def bracket_resolve(row, status, lo, hi, target_ptr, probs_ptr, vocab, n_chunks, n_groups, mhi_ptr, cnt_ptr, slots_ptr,
                    cand_ptr, list_cap, gmax_ptr, gid_ptr, CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr,
                    CAP: tl.constexpr, SUB: tl.constexpr, REG: tl.constexpr, G: tl.constexpr, COPY: tl.constexpr,
                    EXACT_SPAN: tl.constexpr, bmass_ptr=None, BINS: tl.constexpr = 0, BIN_W: tl.constexpr = 0,
                    BIN_STEP: tl.constexpr = 4096, LOW_TAU: tl.constexpr = 0):
    """bracket_select's (cutoff bits, kept mass) of a FULL row (status 2: top-p, its target mass at
    target_ptr[row]; 3: min-p, whose cutoff is hi and whose kept mass the bracket pass summed). LOW_TAU > 0 (renorm_top_p_presample.py, whose
    brackets come from samples alone and can end far below a peaky row's cutoff): when the bracket is
    too low, first the LOW_TAU groups with the largest maxima (and every group above hi), as the
    top-p select does."""
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
        # (the default mass and search are written in both branches of BINS: one runtime flag
        # for both would make Triton compile the bins code, and its names, without bins too)
        if BINS > 0:
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
        else:
            m_in = upper_mass_any(cand_row, cand_row, n, n, 0, 0, 1.0, False, False, G, SUB, REG)
        if (overflow == 0) & (m_hi < target) & (m_hi + m_in >= target):
            first, t0 = search_start(lo, hi - 1)
            if BINS > 0:
                found = use_bins
                if use_bins:
                    t, kept, found = mass_cutoff_block_bins(cand_row, n, target, m_hi, bin_mass, lo,
                                                            bin_shift(lo, hi, BINS),
                                                            cand_row + tl.multiple_of(scratch_at, 16),
                                                            max(32, min(REG, BIN_STEP)), BIN_W, BINS)
                if found == 0:  # (no usable bins, or a bin over BIN_W entries)
                    t, kept = _search_bracket_list(cand_row, n, target, m_hi, first, t0, G, SUB, REG)
            else:
                t, kept = _search_bracket_list(cand_row, n, target, m_hi, first, t0, G, SUB, REG)
        elif m_hi >= target:
            # the sample bracket was too low: the cutoff is >= hi, so every entry that counts
            # lies in a group whose max is >= hi
            gidx = tl.arange(0, NG_BLOCK)
            gb = tl.load(gmax_ptr + row * n_groups + gidx, mask=gidx < n_groups, other=0.0)
            gb = gb.to(tl.int32, bitcast=True)
            gid_row = gid_ptr + row * n_groups
            low = hi
            if LOW_TAU > 0:
                # the LOW_TAU largest groups first (a peaky row's cutoff lies among them)
                tau = tl.maximum(tl.maximum(kth_largest_block(gb, LOW_TAU, 0, 0, 8), 1), hi)
                n_tau = list_groups_block(gid_row, gb, gidx, tau)
                tl.debug_barrier()
                m_tau = upper_mass_any(src, gid_row, n_tau * G, vocab, tau, 0, 1.0, True, False, G, SUB, REG)
                if m_tau >= target:
                    low = tau
                tl.debug_barrier()
            n_sel = list_groups_block(gid_row, gb, gidx, low)
            tl.debug_barrier()
            first, t0 = search_start(low, tl.max(gb, axis=0))
            t, kept = mass_cutoff_any(src, gid_row, n_sel * G, vocab, target, 0.0, 0, 1.0, first, t0,
                                      True, False, G, SUB, REG)
        else:
            # too high, or a huge tie overflowed the bracket: search the whole row
            t, kept = mass_cutoff_bits(src, src, vocab, vocab, target, 0.0, 0, 1.0, 0, 0,
                                       False, False, G, SUB)
    return t, kept


def exact_span(cfg: RenormConfig) -> int:
    """Most binades between lo and hi for which a float64 sum of <= bracket_reg bracket entries is
    exact in any order (each a multiple of ulp(lo): n * hi < 2**53 ulp(lo))."""
    return 29 - (cfg.bracket_reg.bit_length() - 1)


def bins_window(cfg: RenormConfig) -> int:
    """Entries of the one sub-bracket bracket_select searches (about 2x a bin's share of bracket_reg);
    a bin with more falls back to the default search."""
    return max(32, 2 * cfg.bracket_reg // cfg.bracket_bins) if cfg.bracket_bins else 0


def bins_args(ws: Workspace, cfg: RenormConfig, **extra) -> dict:
    """The bins' launch arguments; none with bracket_bins=0 (the default kernels stay as they were)."""
    return dict(bmass_ptr=ws.bmass, BINS=cfg.bracket_bins, **extra) if cfg.bracket_bins else {}


def copy_mode(cfg: RenormConfig) -> int:
    """The bracket pass's copy-out: cfg.bracket_copy, but 2's store view needs 4 <= group <= 128 and
    a bracket chunk >= 128 (one lane per entry of a 32-wide slice); elsewhere mode 0 (same slots)."""
    if cfg.bracket_copy == 2 and not (4 <= cfg.group <= 128 and (cfg.bracket_chunk or cfg.chunk) >= 128):
        return 0
    return cfg.bracket_copy


def launch_bracket(probs: torch.Tensor, s: Shapes, ws: Workspace, cfg: RenormConfig) -> None:
    _bracket_kernel[(s.rows, s.n_bchunks)](
        probs, s.vocab, s.n_bchunks, ws.plan, ws.mhi, ws.cnt, ws.slots,
        CHUNK=s.b_chunk, G=cfg.group, CAP=s.cap, PREFETCH=bool(cfg.bracket_prefetch),
        COPY_MODE=copy_mode(cfg), **bins_args(ws, cfg),
        **pdl_args(cfg, s, probs.device), num_warps=cfg.bracket_pass_warps or cfg.pass_warps,
        **reg_cap(cfg.bracket_pass_maxnreg or cfg.bracket_maxnreg, cfg.bracket_pass_warps or cfg.pass_warps),
    )
    _bracket_select_kernel[(s.rows,)](
        probs, s.vocab, s.n_bchunks, s.n_groups, ws.plan, ws.target, ws.params, ws.mhi, ws.cnt, ws.slots,
        ws.cand, ws.list_cap, ws.gmax, ws.gid,
        CH_BLOCK=s.bch_block, NG_BLOCK=s.ng_block, CAP=s.cap, SUB=cfg.sub, REG=cfg.bracket_reg, G=cfg.group,
        COPY=max(1, min(8, 8192 // s.cap)), EXACT_SPAN=exact_span(cfg), num_warps=cfg.bracket_warps,
        **bins_args(ws, cfg, BIN_W=bins_window(cfg)),
        **pdl_args(cfg, s, probs.device, late=True),
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
