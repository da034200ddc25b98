"""Block shapes of tpguard's renorm kernels (`RenormConfig`), the process default
(``TPGUARD_RENORM_CONFIG``, read when used: `default_config()`), and the launch options that follow
from a config (register caps, programmatic dependent launch). Results depend only on the config and
the vocabulary size, never on the batch (docs/design-renorm.md).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from tpguard.config import renorm_config_text
from tpguard.kernels import pdl


@dataclass(frozen=True)
class RenormConfig:
    """Block shapes. Results depend only on these and the vocabulary size, never on the batch.

    Defaults: the fastest correct variants of the H200 sweeps (docs/benchmarks.md and
    docs/design-renorm.md); every option gives the same output bits."""

    # every streaming pass at 4 warps x 4096 entries (chunk4k_w4): top-p flat 386 vs 396 us at
    # 8 warps x 8192, the other ops equal
    chunk: int = 4096  # entries per program in the full passes (a power of two, >= 64)
    pass_warps: int = 4
    select_warps: int = 8  # the per-row kernels hold a row's group maxima in registers
    sub: int = 1024  # entries per step when the per-row searches stream
    reg: int = 2048  # candidates searched from registers (more are streamed)
    # bracket_select at 8 warps (2 CTAs per SM: 256 rows in one wave): top-p flat 314 -> 299 us, logits x 4
    # 297 -> 282, bracket_select 49.6 -> 33.7 us (16 warps at 1 CTA per SM ran two waves; 16 warps / 8192
    # beat 32 / 16384)
    bracket_warps: int = 8
    bracket_reg: int = 16384  # bracket entries searched from registers (~10-14k on flat rows; 8192 was slower)
    group: int = 32  # G: entries per gmax group
    sample_stride: int = 32  # SG: one sampled entry per SG entries (a multiple of G)
    tau_groups: int = 512  # top-p: groups gathered before falling back to the bracket pass
    # top-p searches of whole short rows (<= SHORT_ROW_GROUPS groups: vocab <= 32768 at G = 32; the top-p renorm
    # and the rows top-k leaves whole): at most this many tau groups (`top_p_tau_groups`; 0: tau_groups
    # everywhere). Same bits; top-p on peaky rows 12-17 % faster at 32000, while at 128256 and 163840 fewer
    # groups lose from 64 peaky rows (docs/benchmarks.md, "Top-p's tau groups on short rows")
    tau_groups_short: int = 256
    # warps of top-k alone's select kernel (its three launches and the one-launch kernel; its row stats run at
    # the same warps) on rows of <= SHORT_ROW_GROUPS groups (vocab <= 32768 at G = 32); 0: select_warps. 4 CTAs
    # per SM instead of 2: H100, graph, 32000, top-k(40) at 1024 rows 183.7 -> 164.6 us fp32, 127.2 -> 106.5
    # bf16, at 256 rows 0.6-2.3 us faster, 1-64 rows within noise; the top-p select kernel lost at 4 warps below
    # 1024 rows (docs/benchmarks.md, "Top-k's select at 4 warps on short rows (H100)")
    top_k_select_warps_short: int = 4
    min_p_groups: int = 512  # min-p: most groups gathered before the bracket pass
    list_cap: int = 16384  # gathered entries above the cutoff's lower bound kept per row
    compact_sub: int = 4096  # entries per step when a select kernel compacts gathered groups
    cap_per_chunk: int = 1024  # bracket entries kept per chunk before the fallback searches
    z: float = 5.0  # bracket half-width in standard deviations of the sample estimate
    # --- register and occupancy options (docs/design-renorm.md, "Registers and occupancy") ---
    # register caps (ptxas .maxnreg; 0 = none). Uncapped, ptxas gives the 8-warp select kernels
    # 255 registers (1 CTA per SM: 256 rows = 2 waves) and the bracket pass 134 (1 CTA per SM);
    # at 128 both fit 2 CTAs per SM, with 0-32 bytes of stack (sm_90a, cuobjdump).
    select_maxnreg: int = 128
    bracket_maxnreg: int = 128
    # the bracket pass's own cap (0: bracket_maxnreg): the streaming pass compiles to ~100 registers (5 CTAs per
    # SM at 4 warps) where bracket_select needs its 128. H200, graph: top-p flat 330 -> 316 us at 80
    # (96: 320, 64: 320), top-p logits x 4 305 -> 298, min-p flat 206 -> 202
    bracket_pass_maxnreg: int = 80
    # B (docs/design-renorm.md, "Sub-bracket bins"): the bracket pass sums its entries' mass per 1/B
    # of [lo, hi) (by bit pattern); bracket_select searches only the sub-bracket holding the cutoff (a power of
    # two, 2..64). bracket_select 85 -> 50 us, the bracket pass 75 -> 95 us, top-p flat 363 -> 349 us at
    # B = 8 against no bins (16: 351, 4: 355, 32: 365)
    bracket_bins: int = 8
    # top-p select (docs/design-renorm.md, "Top-p: where the estimate's rounds went"): while the bracket's lo
    # and hi searches agree, one 6-sum reduction per round instead of 12 (same bits). The select pass
    # 55.0 -> 46.7 us, top-p flat 347 -> 339 us; 0 = the two searches apart. (top-k + top-p with k >= vocab,
    # plain top-p inside the top-k select kernel, keeps them apart: not measured there)
    tps_shared: int = 1
    # top-p select (same section; 0 = one padded block): 1 = the sample bracket's samples as a power-of-two
    # main block plus a power-of-two remainder block (4096 + 1024 at vocab 163840, not one padded 8192 block;
    # 128256: 4096, unchanged), and the tau search's group maxima likewise (exact int64 counts: same tau); same
    # output bits (float32 summation order differs, so the estimated bracket may differ: it is verified
    # exactly). H200, graph: the select pass 46.6 -> 37.7 us, top-p flat 336 -> 326 us, peaky 210 -> 207.
    tps_split: int = 1
    # top-p select (same section; 0 = off): with fewer than this many samples in [hi, tau), hi = tau (the
    # estimate's variance there rests on a handful of samples; a bracket ending below the cutoff sends the row
    # to bracket_select's slowest path). Top-p on logits N(0, 1) x 4 437 -> 305 us. The top-p select kernel
    # only (top-k + top-p with k >= vocab, whose select kernel runs the same plan, keeps the old rule and no
    # tps_split: not measured there)
    bracket_hi_samples: int = 16
    # (kernels/row_split.py; 1 = off) a call captured in a CUDA graph runs its rows in this many parts, each on
    # its own stream, so that one part's streaming passes overlap the other's per-row kernels (same bits: the
    # kernels are batch-invariant). H200, graph, 256 x 163840: top-p flat 327.6 -> 314.6 us, top-p logits x 4
    # 307.9 -> 270.4
    graph_row_split: int = 2
    # (kernels/pdl.py; docs/design-renorm.md, "Launches"; 0 = plain launches) programmatic dependent launch
    # (sm_90+): every launch of a call after its first is made with the PDL attribute and waits
    # (griddepcontrol.wait) before it touches anything an earlier launch wrote; 1: every kernel signals its
    # dependents at its start, so the next kernel's CTAs are resident (and the write pass has its chunk
    # loaded) when the one before ends. Same bits (the same kernels, the same order of sums). H200, 256 x
    # 163840, eager / graph us: top-p flat 304.4 / 290.9 -> 295.8 / 286.9, top-k(40) 169.0 / 163.1 -> 163.5 /
    # 158.7, top-k + top-p 180.2 / 174.5 -> 173.6 / 169.7, min-p
    # 203.3 / 193.9 -> 198.6 / 190.0; top-p peaky 210.4 / 193.0 -> 209.4 / 198.9
    pdl: int = 1
    # calls of fewer rows launch plainly (a split call's parts as the whole call: renorm_plan._part_config):
    # H200, pdl=1, top-p at 1 / 8 / 64 rows 57.5 -> 60.0, 63.0 -> 73.9, 121.8 -> 125.9 us from a graph (1 row
    # eagerly 84.3 -> 98.3; top-k gained 1-5 us from a graph there); at 256 rows top-p flat, top-k, top-k +
    # top-p and min-p gained 4-9 us eagerly and 4-5 from a graph, top-p peaky lost 5.9 from a graph
    pdl_min_rows: int = 128
    # top-k (alone, or with top-p) on rows of more than SHORT_ROW_GROUPS groups: PDL from this many rows
    # (`op_config`; 0: pdl_min_rows). H100, 64 x 163840, graph: bf16 top-k 43.1 -> 40.8 us; it lost at 32000, and
    # top-p lost at 64 rows on both (docs/benchmarks.md, "Top-k at 16-64 rows")
    top_k_pdl_min_rows: int = 64
    # (kernels/renorm_top_k_fused.py; 0 = the three launches at every batch size) top-k alone, or top-k + top-p
    # with a scalar k < vocab, at <= this many rows: one launch (row stats, select and write in one grid, a
    # row's CTAs waiting on its select) instead of three; same bits. H200, 163840, eager: top-k(40) at 1 / 8
    # rows 52 / 51 -> 38 / 37 us (flashinfer 45 / 47)
    fused_rows: int = 8
    # top-k alone on rows of <= SHORT_ROW_GROUPS groups (vocab <= 32768 at G = 32): the one launch up to this many
    # rows (`top_k_fused_rows`; 0: fused_rows there too; fused_rows = 0: no one launch anywhere). H100, 64 x 32000:
    # 0.1-2 us more device time for two launches' host time fewer (~7 us); on longer rows it lost
    # (docs/benchmarks.md, "Top-k at 16-64 rows")
    fused_rows_short: int = 64
    # chunks per CTA of the one-launch kernel (same chunk sums); 0: the fewest that fit the grid on the GPU
    # at one CTA per SM (renorm_top_k_fused.chunks_per_cta)
    fused_per_cta: int = 0
    # (0 = off) the one-launch kernel loads a CTA's next chunk while it reduces or writes the one before, and its
    # first output chunk's input before it waits for the row's select; the same code on the same values: same bits.
    # H100, graph: 15 of 24 top-k cells at 1-64 x 32000-163840 faster, 8 slower, 668 against 682 us summed
    fused_prefetch: int = 1
    # (0 = off) the searches skip rounds that cannot set a bit of their answer (`search_rounds`): the float32
    # patterns of float16 / bfloat16 entries end in 13 / 16 zero bits, so a search whose answer is one of the
    # row's own entries (top-k's pivot, top-p's cutoffs: among its largest groups, in bracket_select) stops after
    # 10 / 8 of its 16 radix-4 rounds; top-k's group-max search starts below the row max's leading zero bits.
    # Same bits. H100, graph: bf16 / fp16 top-k 2-5 us faster in 20 of 24 cells, top-p 2-10 in 23 of 24 (1 x 32000
    # bf16 flat 40.7 -> 35.3) (docs/benchmarks.md, "Searches that stop at a 16-bit input's last bit")
    short_searches: int = 1

    def replace(self, **changes) -> "RenormConfig":
        return dataclasses.replace(self, **changes)

    def __hash__(self) -> int:
        # cached: every eager call hashes its config in the plan key (~1 us for ~40 fields)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h


SHORT_ROW_GROUPS = 1024


def top_p_tau_groups(cfg: RenormConfig, n_groups: int) -> int:
    """The top-p select kernel's tau groups at a row of `n_groups` groups: a function of the vocabulary
    and the config only, like every block shape (batch invariance)."""
    if cfg.tau_groups_short and n_groups <= SHORT_ROW_GROUPS:
        return min(cfg.tau_groups, cfg.tau_groups_short)
    return cfg.tau_groups


def top_k_select_warps(cfg: RenormConfig, n_groups: int, with_top_p: bool) -> int:
    """Warps of the top-k select kernel (and of the one-launch top-k, and of top-k's row stats) at a row
    of `n_groups` groups: a function of the op, the vocabulary and the config only (batch invariance).
    Top-k + top-p keeps select_warps (its select runs a top-p search; not measured at 4 warps)."""
    if cfg.top_k_select_warps_short and n_groups <= SHORT_ROW_GROUPS and not with_top_p:
        return cfg.top_k_select_warps_short
    return cfg.select_warps


def top_k_fused_rows(cfg: RenormConfig, n_groups: int, with_top_p: bool) -> int:
    """Most rows of a call that takes the one-launch top-k (kernels/renorm_top_k_fused.py) at a row of
    `n_groups` groups: fused_rows, or fused_rows_short for top-k alone on short rows (0: never)."""
    if cfg.fused_rows and cfg.fused_rows_short and n_groups <= SHORT_ROW_GROUPS and not with_top_p:
        return max(cfg.fused_rows, cfg.fused_rows_short)
    return cfg.fused_rows


def op_config(cfg: RenormConfig, op: str, rows: int, vocab: int) -> RenormConfig:
    """The config one call of renorm `op` runs under, its launches and its plan key alike: `cfg`, or for
    top-k (alone or with top-p) on rows of more than SHORT_ROW_GROUPS groups at top_k_pdl_min_rows to
    pdl_min_rows rows, `cfg` with PDL from top_k_pdl_min_rows rows. Launch options only: the same bits."""
    low = cfg.top_k_pdl_min_rows
    if (op == "top_k" or op == "top_k_top_p") and cfg.pdl and 0 < low <= rows < cfg.pdl_min_rows \
            and vocab > SHORT_ROW_GROUPS * cfg.group:
        return _pdl_from(cfg, low)
    return cfg


@functools.lru_cache(maxsize=16)
def _pdl_from(cfg: RenormConfig, rows: int) -> RenormConfig:
    # one object per (config, rows): the plan key hashes it, and a call must not pay for replace()
    return cfg.replace(pdl_min_rows=rows)


def search_rounds(cfg: RenormConfig, dtype: torch.dtype) -> int:
    """Radix-4 rounds (2 bits each, from bit 31 down) of a search whose answer is an entry read from `dtype`:
    the rounds after them test only bits that are 0 in every such entry (`RenormConfig.short_searches`)."""
    if cfg.short_searches:
        if dtype == torch.bfloat16:
            return 8  # bits 31..16 (8 exponent and 7 mantissa bits below the sign)
        if dtype == torch.float16:
            return 10  # bits 31..12: float16's 10 mantissa bits end at float32's bit 13
    return 16


@functools.lru_cache(maxsize=16)
def config_from_env(text: str) -> RenormConfig:
    """``TPGUARD_RENORM_CONFIG="chunk=4096,pass_warps=4"``: block shapes for the whole process.
    Every rank must use the same value (like any kernel configuration); results depend on it
    only where a float64 sum ties at the cutoff. Cached per text: one config object per value, so
    that the per-shape caches keyed on it (shapes, call plans) keep hitting."""
    from tpguard.config import replace_from_text

    return replace_from_text(RenormConfig(), text, "TPGUARD_RENORM_CONFIG")


def default_config() -> RenormConfig:
    """The config of calls that pass none: ``TPGUARD_RENORM_CONFIG`` over `RenormConfig`'s defaults,
    read at the call (tpguard.config.renorm_config_text)."""
    return config_from_env(renorm_config_text())


def pdl_mode(cfg: RenormConfig, s, device: torch.device) -> int:
    """cfg.pdl for one call (`s`: its renorm_workspace.Shapes): 0 (plain launches) below
    cfg.pdl_min_rows rows or on a device without grid dependency control (kernels/pdl.py)."""
    if not cfg.pdl or s.rows < cfg.pdl_min_rows or not pdl.supported(device):
        return 0
    return int(cfg.pdl)


def pdl_args(cfg: RenormConfig, s, device: torch.device, *, first: bool = False) -> dict:
    """A launch's PDL constexpr and options (kernels/pdl.py). `first`: the call's first launch (plain,
    it only signals its dependent; also the write pass launched on its own); else a dependent launch
    (the PDL attribute; it waits before dependent work)."""
    mode = pdl_mode(cfg, s, device)
    if first:
        return {"PDL": pdl.first(mode)}
    return {"PDL": pdl.dependent(mode), **pdl.launch_options(mode)}


def reg_cap(n: int, num_warps: int) -> dict:
    """Launch options for a register cap (none when 0), at most what one CTA of num_warps may hold
    (64K registers per SM: a 32-warp CTA must stay at 64); the interpreter ignores them."""
    if not n:
        return {}
    return {"maxnreg": max(24, min(int(n), 65536 // (32 * num_warps)) // 8 * 8)}


__all__ = ["RenormConfig", "config_from_env", "default_config", "pdl_args", "pdl_mode", "reg_cap", "search_rounds",
           "top_k_select_warps", "top_p_tau_groups"]
