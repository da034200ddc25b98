"""The one-tensor fingerprint's lane launch read through Hopper TMA (sm_90+).

Reference: `tpguard.kernels.fingerprint_reference` (numpy: `fingerprint_rows_reference`,
`combine_rows_reference`); the same bits as kernels/fingerprint_lanes.py's `_rows_kernel` MODE 0, which
this replaces where it can (`usable`): the same partial lane sums ``[chunks, rows, 2]`` for the same
`_finalize_kernel`.

Why: the ldg kernel keeps loads in flight by a manual register double buffer; here TMA copies each
``[8, 256]`` tile of 4-byte words into a 3-deep shared-memory ring (`tl.range(num_stages=3)`), so
4 warps hash while the next tiles land. Measured (docs/design-fingerprint.md, one H200, 256 x 163840
fp32, CUDA graph replays): lane launch 42.8 us vs 44.1, `fingerprint_triton` as a whole 45.7 vs
47.1 us (3.67 vs 3.57 TB/s); a plain TMA read of the tensor 39.8 us, the best plain ldg read 39.0. In
the product: 45.8-47.2 us per fingerprint vs 48.4-48.9 with ldg loads.

Used by `fingerprint_triton` / `fingerprint_rows_triton` through `_hash_words` (kernels/fingerprint_lanes.py);
not by `fingerprint_many_triton` (`KernelConfig.lane_tma`).

When (`usable`): `KernelConfig.lane_tma` "auto" (the one-tensor default) or "on" on a CUDA GPU of
compute capability >= 9, and "on" under the Triton interpreter (tests); 4-byte words (fp32,
int32, 8-/16-byte dtypes); the measured tile shape ([rows_per_tile, 4-256] columns, so rows of 5 and
more at the one-tensor default: a TMA box holds at most 256 per dimension and at least 16 bytes a row);
a 16-byte aligned base and row stride, the stride at least a row (TMA's rules; not a broadcast view).
Anything else takes the ldg kernel, with the same result.

CUDA graphs: the descriptor (a CUtensorMap built by Triton's launcher on the host) is a kernel
parameter holding the tensor's address, so a captured launch reads the tensor it was captured with,
as the ldg kernel does.
"""

from __future__ import annotations

import functools

import torch

from tpguard.config import interpreting
from tpguard.kernels.fingerprint_config import KernelConfig
from tpguard.kernels.fingerprint_words import _Words

try:
    import triton
except ImportError:  # CPU-only install: `usable` is False
    triton = None
try:  # Triton >= 3.4 (host tensor descriptors); older: `usable` is False
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

BOX_MAX = 256  # TMA: at most 256 elements per box dimension


@functools.lru_cache(maxsize=16)
def _hopper_or_newer(device: str) -> bool:
    # ROCm reports its own capabilities (an MI300: (9, 4)) through the same call: NVIDIA only
    return torch.version.hip is None and torch.cuda.get_device_capability(torch.device(device)) >= (9, 0)


def usable(w: _Words, br: int, bn: int, cfg: KernelConfig) -> bool:
    """True when the lane launch for tile [br, bn] of `w` can read through TMA (module docstring)."""
    if cfg.lane_tma == "off" or TensorDescriptor is None or triton is None or w.eb != 4:
        return False
    # The measured tiles: [rows_per_tile, block_words / rows_per_tile] (rows of 5 and more at the one-tensor
    # default), a box row of 16 bytes to 256 words. Not the tall tiles of short rows.
    if br != cfg.rows_per_tile or not 4 <= bn <= BOX_MAX or br * bn != cfg.block_words:
        return False
    # 16-byte aligned base and row stride; a stride below the row (0: a broadcast view) is not a TMA layout
    if w.data.data_ptr() % 16 or w.row_stride % 4 or w.row_stride < w.n_words:
        return False
    device = w.data.device
    if device.type == "cuda":  # "auto" and "on" alike: TMA needs sm_90+
        return not interpreting() and _hopper_or_newer(str(device))
    return cfg.lane_tma == "on" and interpreting()  # CPU tensors under the interpreter: tests ask for it


def launch_lanes(w: _Words, partial: torch.Tensor, s_lo: int, br: int, bn: int, chunk_tiles: int, chunks: int,
                 cfg: KernelConfig) -> None:
    """Partial lane sums of `w` into `partial` [chunks, rows, 2] (int64), as `_rows_kernel` MODE 0."""
    # Built per call (Triton's launcher turns it into a CUtensorMap at each launch): a cached one would
    # hold the tensor's memory.
    desc = TensorDescriptor(w.data, [w.rows, w.n_words], [w.row_stride, 1], [br, bn])
    _tma_lanes_kernel[(-(-w.rows // br), chunks)](desc, partial, w.rows, w.n_words, s_lo, BR=br, BN=bn,
                                                  CHUNK_TILES=chunk_tiles, STAGES=cfg.tma_stages,
                                                  SHIFTS=cfg.shifts, num_warps=cfg.tma_warps)


if triton is not None:
    import triton.language as tl

    from tpguard.kernels.fingerprint_hash import (_C2, _M32, _as_words, _group_sum, _pos_mix, _store_partials,
                                                  _word_hashes)

    @triton.jit
    def _tma_chunk_lanes(desc, partial_ptr, rb, c, n_rows, n_words, s_lo, BR: tl.constexpr, BN: tl.constexpr,
                         CHUNK_TILES: tl.constexpr, STAGES: tl.constexpr, SHIFTS: tl.constexpr):
        """Partial lane sums of chunk c of row block rb into partial_ptr [chunks, n_rows, 2]. Rows past
        n_rows arrive as zeros (TMA's out-of-bounds fill) and are not stored; the tail step masks its
        columns. (A two-tensor launch, tried in docs/design-fingerprint.md, called it once per tensor.)"""
        s_lo = s_lo.to(tl.uint32)
        r0 = rb * BR
        rows = r0 + tl.arange(0, BR)
        row_ok = rows < n_rows
        col0 = c * (CHUNK_TILES * BN)
        width = tl.minimum(n_words - col0, CHUNK_TILES * BN)
        n_full = width // BN
        tail = width % BN
        POS_STEP: tl.constexpr = (BN * _C2) & _M32
        V: tl.constexpr = 4
        pos = ((col0 + tl.arange(0, BN)).to(tl.uint32) * _C2 + s_lo)[None, :]
        acc1 = tl.zeros([BR, BN // V], dtype=tl.uint64)
        acc2 = tl.zeros([BR, BN // V], dtype=tl.uint64)
        for k in tl.range(0, n_full, num_stages=STAGES):
            w = desc.load([r0, col0 + k * BN])
            h, g = _word_hashes(_as_words(w, 4), _pos_mix(pos), SHIFTS)
            acc1 += _group_sum(h, BR, BN, V)
            acc2 += _group_sum(g, BR, BN, V)
            pos += POS_STEP
        if tail > 0:
            cmask = tl.arange(0, BN)[None, :] < tail
            w = desc.load([r0, col0 + n_full * BN])
            h, g = _word_hashes(_as_words(w, 4), _pos_mix(pos), SHIFTS)
            acc1 += _group_sum(tl.where(cmask, h, 0), BR, BN, V)
            acc2 += _group_sum(tl.where(cmask, g, 0), BR, BN, V)
        _store_partials(partial_ptr, c, n_rows, rows, row_ok, tl.sum(acc1, axis=1), tl.sum(acc2, axis=1))

    @triton.jit(do_not_specialize=["s_lo"])
    def _tma_lanes_kernel(desc, partial_ptr, n_rows, n_words, s_lo, BR: tl.constexpr, BN: tl.constexpr,
                          CHUNK_TILES: tl.constexpr, STAGES: tl.constexpr, SHIFTS: tl.constexpr):
        """Grid (row blocks, chunks): `_tma_chunk_lanes` of program (rb, c)."""
        _tma_chunk_lanes(desc, partial_ptr, tl.program_id(0), tl.program_id(1), n_rows, n_words, s_lo, BR, BN,
                         CHUNK_TILES, STAGES, SHIFTS)
