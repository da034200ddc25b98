"""The shapes and scratch of one renorm call: `Shapes` (block counts of a [rows, vocab] batch under a
`RenormConfig`) and `Workspace` (the per-call buffers every pass reads and writes, carved from one
allocation per dtype; renorm_plan.py keeps one per cached call shape).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from tpguard.kernels.renorm_config import RenormConfig, top_k_fused_rows

MAX_BLOCK = 1 << 20  # register blocks searched by kth_largest_block (20-bit count fields)


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
    cap: int  # bracket entries kept per chunk


@functools.lru_cache(maxsize=256)
def shapes_for(rows: int, vocab: int, cfg: RenormConfig) -> Shapes:
    """Block shapes for a batch (cached: the host path of a call stays a few microseconds)."""
    if cfg.sample_stride % cfg.group or cfg.chunk % cfg.sample_stride:
        raise ValueError("RenormConfig: sample_stride must be a multiple of group, chunk of sample_stride")
    if cfg.bracket_bins & (cfg.bracket_bins - 1) or not 2 <= cfg.bracket_bins <= 64:
        raise ValueError("RenormConfig: bracket_bins must be a power of two in 2..64")
    if cfg.top_k_select_warps_short not in (0, 1, 2, 4, 8, 16):
        raise ValueError(f"RenormConfig: top_k_select_warps_short must be 0 or a power of two <= 16, "
                         f"got {cfg.top_k_select_warps_short}")
    if cfg.pdl not in (0, 1):
        raise ValueError(f"RenormConfig: pdl must be 0 or 1, got {cfg.pdl}")
    if cfg.tps_split not in (0, 1):
        raise ValueError(f"RenormConfig: tps_split must be 0 or 1, got {cfg.tps_split}")
    for name in ("reg", "bracket_reg"):  # register blocks (tl.arange); exact_span assumes it too
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"RenormConfig: {name} must be a power of two, got {v}")
    chunk = cfg.chunk  # fixed (not shrunk for short rows): fewer kernel variants to compile
    if chunk & (chunk - 1) or chunk < max(64, cfg.group):
        raise ValueError("RenormConfig: chunk must be a power of two >= 64 and >= group")
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
        cap=min(cfg.cap_per_chunk, chunk),
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
    mhi: torch.Tensor  # float64 [rows * n_chunks]
    cnt: torch.Tensor  # int32 [rows * n_chunks]
    slots: torch.Tensor  # float32 [rows * n_chunks * cap]
    bmass: torch.Tensor  # float64 [rows * n_chunks * bracket_bins]: bracket mass per sub-bracket (bracket_bins)
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
    list_cap = max(min(cfg.list_cap, s.vocab), s.n_chunks * s.cap if with_bracket else 0)
    numel = {
        "chunk_sum": r * s.n_chunks, "chunk_bad": r * s.n_chunks, "gmax": r * s.n_groups,
        "gsamp": r * s.n_samples if with_sample else 1, "gid": r * s.n_groups, "cand": r * list_cap,
        "params": r * 4, "flag": r, "plan": r * 4, "target": r,
        "mhi": r * s.n_chunks if with_bracket else 1, "cnt": r * s.n_chunks if with_bracket else 1,
        "slots": r * s.n_chunks * s.cap if with_bracket else 1,
        "bmass": r * s.n_chunks * cfg.bracket_bins if with_bracket else 1,
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
    # only where the one launch may run (renorm_config.top_k_fused_rows): the zeros are a fill launch per workspace
    fused = with_sync and s.rows <= top_k_fused_rows(cfg, s.n_groups, False)
    sync = torch.zeros(s.rows * SYNC_WORDS if fused else 0, dtype=torch.int32, device=device)
    return Workspace(list_cap=list_cap, cap=s.cap, sync=sync, **views)


__all__ = ["MAX_BLOCK", "SYNC_WORDS", "Shapes", "Workspace", "shapes_for", "workspace_for"]
