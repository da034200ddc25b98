"""Tiling and code shape of the fingerprint kernels (`KernelConfig`) and their defaults.

Results never depend on the config (integer sums), only speed does. `default_config()` is
fingerprint_many's (the guard's sets), read from ``TPGUARD_FP_CONFIG`` when used;
`SINGLE_TENSOR_CONFIG` is the one-tensor launchers'. Figures: docs/design-fingerprint.md and
docs/benchmarks.md (one H200, 256 x 163840 fp32 unless said).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tpguard.config import fingerprint_config_text, replace_from_text

# KernelConfig.shifts bits: the shifts of h's fmix32 (">>16": two per word, ">>13": one).
SHIFT_H16, SHIFT_H13 = 1, 2
SHIFT_ALL = 3


@dataclass(frozen=True)
class KernelConfig:
    """Tiling and code shape. Results never depend on it (integer sums), only speed does."""

    # Defaults (fingerprint_many; one tensor: SINGLE_TENSOR_CONFIG): the fastest correct config of the
    # H200 sweeps (docs/benchmarks.md; shifts=0 57.4 us for 256 x 163840 fp32 vs 59.9 with fp/1's
    # four ">>16" shifts as IMAD.HI; maxnreg=128: the full set 104 vs 108 us).
    block_words: int = 4096  # words per program per loop step (a [rows_per_tile, BN] tile)
    rows_per_tile: int = 8  # long rows: rows hashed side by side, sharing per-column work
    # columns of a row per program; longer rows are split into chunks. 8192: 55.6 / 55.4 us for
    # 256 x 163840 fp32 vs 56.3 / 56.4 at 4096 (two runs); the full guard set 101.9 vs 104.2 us
    chunk_words: int = 8192
    num_warps: int = 4  # for full tiles; smaller tiles use fewer
    finalize_rows: int = 1024  # rows per finalize program; also the limit for a fused top hash
    # Which of the 3 fmix32 shifts per word run as IMAD.HI on the FMA pipe instead of SHF on the
    # integer ALU pipe (a bitmask of SHIFT_*: 0 none, 1 the two ">>16", 3 all).
    # docs/design-fingerprint.md, "Tried and lost".
    shifts: int = 0
    # fingerprint_many, long rows: "table" one launch per word-size class through the segment
    # table (119.5 us for 2 x 168 MB at these defaults = 2 x the single-tensor time);
    # "rows" one launch per long tensor, the single-tensor kernel's grid and code shape (for
    # configs where the table kernel needs more registers: 163 vs 127 at [8, 1024] x 8 warps)
    many_long: str = "table"
    maxnreg: int | None = 128  # register cap for the long-row lane launches (None: compiler's)
    # One tensor's lane launch read through Hopper TMA (kernels/fingerprint_tma.py; 45.7 vs 47.1 us
    # for 256 x 163840 fp32): "auto" on sm_90+ GPUs where the tensor allows, "on" there and under the
    # interpreter too (tests), "off" never. fingerprint_many never uses it: its cached plans must not hold the
    # tensors, and a descriptor does (measured anyway: docs/design-fingerprint.md, "Tried and lost").
    lane_tma: str = "off"
    tma_stages: int = 3  # shared-memory ring depth (3 best; 2 48.6 us, 4 44.2 us lane launch)
    tma_warps: int = 4  # 4 warps 42.8 us vs 8 warps 43.4 us lane launch

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
        if self.rows_per_tile > self.block_words:
            raise ValueError("KernelConfig.rows_per_tile must not exceed block_words")


@functools.lru_cache(maxsize=8)
def _config_from_text(text: str) -> KernelConfig:
    return replace_from_text(KernelConfig(), text, "TPGUARD_FP_CONFIG")


def default_config() -> KernelConfig:
    """fingerprint_many's config (the guard's sets): `KernelConfig()` with ``TPGUARD_FP_CONFIG``
    (``NAME=VALUE,...`` of any fields, e.g. ``many_long=rows``) applied, read when used. The
    values never depend on it, only the speed (benchmarks time variants this way)."""
    return _config_from_text(fingerprint_config_text())


# One tensor (fingerprint_triton / fingerprint_rows_triton): 16 words per thread uncapped take 64
# registers, so 8 CTAs per SM hold the 640 programs of [8 rows, 8192 words] in one wave (the defaults:
# 528 slots, 1.2 waves): 50.3 us vs 56.0 at the defaults; fingerprint_many's full set (2 x 168 MB,
# twice the programs) gained nothing from it (97.0 vs 93.4 us). 8 warps of 8 words per thread: 48.3 us
# vs 50.0 at 4 warps (chunks sized to fill the SMs once instead: 48.6-48.9, "Tried and lost"), 47.5 us
# as the default; a plain Triton read of the same tensor: 40-41 us. The lane launch through TMA on
# sm_90+ (lane_tma="auto"): 45.7 us vs 47.1 with ldg loads (docs/design-fingerprint.md).
SINGLE_TENSOR_CONFIG = KernelConfig(block_words=2048, num_warps=8, maxnreg=None, lane_tma="auto")
