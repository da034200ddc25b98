"""A tensor as the fingerprint kernels read it (rows of 1-, 2- or 4-byte words, no copy), and the
tiles they walk it in. Host side only.

A tensor is viewed, without a copy, as ``[rows, n_words]`` words with a row stride (8-/16-byte
dtypes: 2/4 int32 words per element). Only a tensor whose rows are not contiguous blocks of
memory is copied first (``.contiguous()``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpguard.config import interpreting
from tpguard.kernels.fingerprint_config import KernelConfig
from tpguard.kernels.fingerprint_reference import split_seed

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
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
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
    lo, hi = split_seed(seed)
    return lo + (1 << 32), hi + (1 << 32)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _tile(rows: int, n_words: int, cfg: KernelConfig) -> tuple[int, int, int, int]:
    """(BR, BN, chunk_tiles, chunks): long rows get [rows_per_tile, block_words / rows_per_tile]
    tiles (rows side by side share the per-column position work), short rows many per tile."""
    br_long = max(1, min(cfg.rows_per_tile, _next_pow2(max(rows, 1))))
    bn = min(_next_pow2(max(n_words, 1)), cfg.block_words // br_long)
    br = max(1, min(cfg.block_words // bn, _next_pow2(max(rows, 1))))
    chunk_tiles = max(1, cfg.chunk_words // bn)
    chunks = max(1, -(-n_words // (chunk_tiles * bn)))
    return br, bn, chunk_tiles, chunks


def _warps(tile: int, cfg: KernelConfig) -> int:
    return max(1, min(cfg.num_warps, tile // 256))


def _reg_opts(cfg: KernelConfig) -> dict:
    return {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}
