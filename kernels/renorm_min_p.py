"""Deterministic, batch-invariant min-p renorm (Triton). Reference: kernels/reference.py
(``min_p_renorm_reference``); semantics and guarantees: docs/kernels.md.

Cutoff = fp32(max(row) * min_p), known after the row-stats pass (the row max is the largest
group max). Only the kept mass is left to find: when at most ``min_p_groups`` groups have a max
>= cutoff it is summed from those groups alone (peaky rows); otherwise the bracket pass sums it
over the row (flat rows, min_p small), in a fixed order either way.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from tpguard.kernels.pdl import pdl_enter
from tpguard.kernels.radix_select import list_groups_block, reciprocal_f32, upper_mass_any
from tpguard.kernels.renorm_args import fill_fingerprint
from tpguard.kernels.renorm_config import RenormConfig, default_config, pdl_args, reg_cap
from tpguard.kernels.renorm_passes import launch_bracket, launch_row_stats
from tpguard.kernels.renorm_workspace import shapes_for, workspace_for
from tpguard.kernels.renorm_write_fp import write_pass

MinP = Union[float, torch.Tensor]


@triton.jit
def _min_p_select_kernel(probs_ptr, vocab, n_chunks, n_groups,
                         chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gid_ptr,
                         mp_ptr, mp_val, params_ptr, flag_ptr, plan_ptr, target_ptr,
                         HAS_MP_ARR: tl.constexpr, G: tl.constexpr, CH_BLOCK: tl.constexpr,
                         NG_BLOCK: tl.constexpr, SUB: tl.constexpr, REG: tl.constexpr,
                         MAX_GROUPS: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = probs_ptr + row * vocab
    gid_row = gid_ptr + row * n_groups
    ch = tl.arange(0, CH_BLOCK)
    chm = ch < n_chunks
    total = tl.sum(tl.load(chunk_sum_ptr + row * n_chunks + ch, mask=chm, other=0.0), axis=0)
    n_bad = tl.sum(tl.load(chunk_bad_ptr + row * n_chunks + ch, mask=chm, other=0), axis=0)
    if HAS_MP_ARR:
        mp = tl.load(mp_ptr + row)
    else:
        mp = mp_val
    mp = tl.minimum(tl.maximum(mp, 0.0), 1.0)
    gidx = tl.arange(0, NG_BLOCK)
    gb = tl.load(gmax_ptr + row * n_groups + gidx, mask=gidx < n_groups, other=0.0).to(tl.int32, bitcast=True)
    cutoff = tl.max(gb, axis=0).to(tl.float32, bitcast=True) * mp
    cut_bits = cutoff.to(tl.int32, bitcast=True)

    status = tl.full((), 1, tl.int32)
    thr = tl.full((), 0, tl.int32)
    kept = total
    if (n_bad == 0) & (total > 0.0):
        if cut_bits > 0:
            thr = cut_bits
            n_sel = tl.sum((gb >= cut_bits).to(tl.int32), axis=0)
            if n_sel <= MAX_GROUPS:
                n_sel = list_groups_block(gid_row, gb, gidx, cut_bits)
                tl.debug_barrier()
                kept = upper_mass_any(src, gid_row, n_sel * G, vocab, cut_bits, 0, 1.0, True, False, G, SUB, REG)
            else:
                status = tl.full((), 3, tl.int32)  # the bracket pass sums the kept mass
    else:
        thr = tl.full((), 0x7F800000, tl.int32)  # +inf: keep nothing (empty or NaN rows)
        kept = tl.full((), 0.0, tl.float64)
    tl.store(flag_ptr + row, (n_bad > 0).to(tl.int32))
    tl.store(plan_ptr + row * 4, status)
    tl.store(plan_ptr + row * 4 + 1, thr)
    tl.store(plan_ptr + row * 4 + 2, thr)
    tl.store(target_ptr + row, 0.0)
    tl.store(params_ptr + row * 4, 0.0)
    tl.store(params_ptr + row * 4 + 1, 1.0)
    tl.store(params_ptr + row * 4 + 2, thr.to(tl.float32, bitcast=True))
    tl.store(params_ptr + row * 4 + 3, reciprocal_f32(kept))


def workspace_flags(vocab: int, top_k=None, top_p=None) -> tuple:
    """(with_sample, with_bracket) of the workspace a min-p call uses (renorm_plan.py asks)."""
    return False, True


def min_p_renorm_triton(probs: torch.Tensor, min_p: MinP, config: Optional[RenormConfig] = None,
                        fingerprint_out: Optional[torch.Tensor] = None, workspace=None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton min-p renorm of a float32 [rows, vocab] tensor (no input checks: see renorm.py).
    `workspace`, `out`: as in top_p_renorm_triton."""
    cfg = config or default_config()
    rows, vocab = probs.shape
    out = torch.empty_like(probs) if out is None else out
    if rows == 0:
        if fingerprint_out is not None:
            fill_fingerprint(out, fingerprint_out)
        return out
    s = shapes_for(rows, vocab, cfg)
    ws = workspace or workspace_for(s, cfg, probs.device, *workspace_flags(vocab))
    has_arr = isinstance(min_p, torch.Tensor)
    launch_row_stats(probs, s, ws, cfg, with_sample=False)
    _min_p_select_kernel[(rows,)](
        probs, vocab, s.n_chunks, s.n_groups,
        ws.chunk_sum, ws.chunk_bad, ws.gmax, ws.gid,
        min_p if has_arr else ws.params, 0.0 if has_arr else float(min_p),
        ws.params, ws.flag, ws.plan, ws.target,
        HAS_MP_ARR=has_arr, G=cfg.group, CH_BLOCK=s.ch_block, NG_BLOCK=s.ng_block, SUB=cfg.sub,
        REG=cfg.reg, MAX_GROUPS=cfg.min_p_groups, num_warps=cfg.select_warps,
        **pdl_args(cfg, s, probs.device),
        **reg_cap(cfg.select_maxnreg, cfg.select_warps),
    )
    launch_bracket(probs, s, ws, cfg)
    write_pass(probs, out, s, ws, cfg, fingerprint_out)
    return out
