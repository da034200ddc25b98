"""Deterministic, batch-invariant top-k and top-k + top-p renorm (Triton). References:
kernels/reference.py (``top_k_renorm_reference``, ``top_k_top_p_renorm_reference``); semantics,
tie rule and guarantees: docs/kernels.md.

Pivot = the k-th largest value (repeats counted); entries >= pivot are kept.

Per row (`top_k_select_row`, renorm_top_k_select.py, after the row-stats pass of renorm_passes.py):
the k-th largest group max ``a`` is <= the pivot (the group maxima are k of the entries), and every
entry >= the pivot lies in a group whose max is >= a. Without ties there are exactly k such groups, so the
exact radix search reads k * G entries (640 for k = 40, searched in registers) instead of the
row; for large k only the entries >= a (about k) are kept. With top-p, the second search runs
on the same entries, read as fp32(x * r_k): the kept set of the top-p stage is inside the kept
set of the top-k stage. No bracket pass is needed; ties only widen the gather.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from tpguard.kernels import renorm_top_k_fused
from tpguard.kernels.pdl import pdl_enter
from tpguard.kernels.renorm_args import fill_fingerprint
from tpguard.kernels.renorm_config import RenormConfig, default_config, pdl_args, reg_cap, top_k_select_warps
from tpguard.kernels.renorm_passes import launch_bracket, launch_row_stats
from tpguard.kernels.renorm_top_k_select import select_launch_args, top_k_select_row, workspace_flags
from tpguard.kernels.renorm_workspace import SYNC_WORDS, shapes_for, workspace_for
from tpguard.kernels.renorm_write_fp import write_pass

TopK = Union[int, torch.Tensor]
TopP = Union[float, torch.Tensor]


@triton.jit
def _top_k_select_kernel(probs_ptr, vocab, n_chunks, n_groups, n_samples,
                         chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, gid_ptr, cand_ptr, list_cap,
                         k_ptr, k_val, p_ptr, p_val, params_ptr, flag_ptr, plan_ptr, target_ptr, Z,
                         HAS_K_ARR: tl.constexpr, HAS_P_ARR: tl.constexpr, WITH_TOP_P: tl.constexpr,
                         G: tl.constexpr, SG: tl.constexpr, CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr,
                         NS_BLOCK: tl.constexpr, SUB: tl.constexpr, REG: tl.constexpr,
                         TAU_GROUPS: tl.constexpr, CSUB: tl.constexpr,
                         SHORT: tl.constexpr = False, ENTRY_ROUNDS: tl.constexpr = 16, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    top_k_select_row(tl.program_id(0).to(tl.int64), probs_ptr, vocab, n_chunks, n_groups, n_samples,
                     chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, gid_ptr, cand_ptr, list_cap,
                     k_ptr, k_val, p_ptr, p_val, params_ptr, flag_ptr, plan_ptr, target_ptr, Z,
                     HAS_K_ARR, HAS_P_ARR, WITH_TOP_P, G, SG, CH_BLOCK, NG_BLOCK, NS_BLOCK, SUB, REG,
                     TAU_GROUPS, CSUB, SHORT=SHORT, ENTRY_ROUNDS=ENTRY_ROUNDS)


def _run(probs: torch.Tensor, top_k: TopK, top_p: Optional[TopP], config: Optional[RenormConfig],
         fingerprint_out: Optional[torch.Tensor] = None, workspace=None,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    cfg = config or default_config()
    rows, vocab = probs.shape
    out = torch.empty_like(probs) if out is None else out
    if rows == 0:
        if fingerprint_out is not None:
            fill_fingerprint(out, fingerprint_out)
        return out
    flags = workspace_flags(vocab, top_k, top_p)
    full_top_p = flags[0]
    s = shapes_for(rows, vocab, cfg)
    ws = workspace or workspace_for(s, cfg, probs.device, *flags)
    select_args, blocks = select_launch_args(probs, top_k, top_p, s, ws, cfg)
    # the select's warps, and the one-launch kernel's: both paths reduce in the same order
    warps = top_k_select_warps(cfg, s.n_groups, top_p is not None)
    if renorm_top_k_fused.fused_fits(rows, vocab, top_k, top_p, fingerprint_out, cfg, probs.device) \
            and ws.sync.numel() >= rows * SYNC_WORDS:
        renorm_top_k_fused.launch_fused(select_args, blocks, out, s, ws, cfg, warps)
        return out
    # top-k alone: the row stats at the select's warps, the one-launch kernel's (renorm_top_k_fused.py), so
    # that a row with k >= vocab (renormalised by its total) gets the same chunk sums at every batch size
    launch_row_stats(probs, s, ws, cfg, with_sample=full_top_p, num_warps=0 if top_p is not None else warps)
    _top_k_select_kernel[(rows,)](*select_args, **blocks, **pdl_args(cfg, s, probs.device),
                                  num_warps=warps, **reg_cap(cfg.select_maxnreg, warps))
    if full_top_p:
        launch_bracket(probs, s, ws, cfg)
    write_pass(probs, out, s, ws, cfg, fingerprint_out)
    return out


def top_k_renorm_triton(probs: torch.Tensor, top_k: TopK, config: Optional[RenormConfig] = None,
                        fingerprint_out: Optional[torch.Tensor] = None, workspace=None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton top-k renorm of a float32 [rows, vocab] tensor (no input checks: see renorm.py).
    ``top_k`` is an int or an int32 [rows] tensor on the same device. `workspace`, `out`: as in
    top_p_renorm_triton (of `workspace_flags`)."""
    return _run(probs, top_k, None, config, fingerprint_out, workspace, out)


def top_k_top_p_renorm_triton(probs: torch.Tensor, top_k: TopK, top_p: TopP,
                              config: Optional[RenormConfig] = None,
                              fingerprint_out: Optional[torch.Tensor] = None, workspace=None,
                              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton top-k then top-p renorm (k >= vocab skips the top-k stage)."""
    return _run(probs, top_k, top_p, config, fingerprint_out, workspace, out)
