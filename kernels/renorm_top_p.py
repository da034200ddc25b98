"""Deterministic, batch-invariant top-p renorm (Triton). Reference: kernels/reference.py
(``top_p_renorm_reference``); semantics, tie rule and guarantees: docs/kernels.md.

Cutoff ``t`` = the largest value whose upper mass ``sum(x[x >= t])`` reaches ``p * sum(x)``.

Per row (select kernel below, after the row-stats pass of renorm_passes.py):
* tau = the ``tau_groups``-th largest group max (at most ``tau_groups_short`` on short rows:
  `top_p_tau_groups`); the groups whose max is >= tau hold every entry >= tau, so the exact upper
  mass M(>= tau) is read from them (the entries >= tau, about that many, are copied out). If
  M(>= tau) >= P the cutoff is among those entries: exact radix search over them in registers,
  done (peaky rows).
* Otherwise (flat rows) the cutoff is below tau: a bracket [lo, hi) for it is estimated from the
  sampled entries (ratio estimator of the mass in [t, tau), z standard deviations each side) and
  handed to the bracket passes, which verify it exactly and fall back to a whole-row search.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from tpguard.kernels.pdl import pdl_enter
from tpguard.kernels.radix_select import reciprocal_f32
from tpguard.kernels.renorm_args import fill_fingerprint
from tpguard.kernels.renorm_config import RenormConfig, default_config, pdl_args, reg_cap, search_rounds, top_p_tau_groups
from tpguard.kernels.renorm_passes import launch_bracket, launch_row_stats
from tpguard.kernels.renorm_top_p_select import sample_blocks, top_p_plan
from tpguard.kernels.renorm_workspace import shapes_for, workspace_for
from tpguard.kernels.renorm_write_fp import write_pass

TopP = Union[float, torch.Tensor]


@triton.jit
def _top_p_select_kernel(probs_ptr, vocab, n_chunks, n_groups, n_samples,
                         chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, gid_ptr, cand_ptr, list_cap,
                         p_ptr, p_val, params_ptr, flag_ptr, plan_ptr, target_ptr, Z,
                         HAS_P_ARR: tl.constexpr, G: tl.constexpr, SG: tl.constexpr,
                         CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr, NS_BLOCK: tl.constexpr,
                         SUB: tl.constexpr, REG: tl.constexpr, TAU_GROUPS: tl.constexpr,
                         CSUB: tl.constexpr, TPS_SHARED: tl.constexpr = False,
                         NS_REM: tl.constexpr = 0, NG_REM: tl.constexpr = 0, HI_SAMPLES: tl.constexpr = 0,
                         ENTRY_ROUNDS: tl.constexpr = 16, PDL: tl.constexpr = 0):
    """The per-row top-p plan (module doc): writes the row's plan, target and params.
    NS_REM / NG_REM > 0 (RenormConfig.tps_split): the samples / the group maxima of the tau search as a
    main block plus a remainder block (sample_blocks): NS_BLOCK is then the samples' main block, NG_BLOCK // 2
    the group maxima's."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    ch = tl.arange(0, CH_BLOCK)
    chm = ch < n_chunks
    total = tl.sum(tl.load(chunk_sum_ptr + row * n_chunks + ch, mask=chm, other=0.0), axis=0)
    n_bad = tl.sum(tl.load(chunk_bad_ptr + row * n_chunks + ch, mask=chm, other=0), axis=0)
    if HAS_P_ARR:
        p = tl.load(p_ptr + row)
    else:
        p = p_val
    status = tl.full((), 1, tl.int32)
    thr = tl.full((), 0x7F800000, tl.int32)  # +inf: keep nothing (empty or NaN rows)
    kept = tl.full((), 0.0, tl.float64)
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32)
    target = tl.full((), 0.0, tl.float64)
    if (n_bad == 0) & (total > 0.0):
        gidx = tl.arange(0, NG_BLOCK)
        gb = tl.load(gmax_ptr + row * n_groups + gidx, mask=gidx < n_groups, other=0.0,
                     cache_modifier=".cg").to(tl.int32, bitcast=True)
        if NG_REM > 0:
            gk = tl.arange(0, NG_BLOCK // 2 // NG_REM)[:, None] * NG_REM
            gj = tl.arange(0, NG_REM)[None, :]
            gbm = tl.load(gmax_ptr + row * n_groups + gk + gj, mask=gk + gj < n_groups, other=0.0,
                          cache_modifier=".cg").to(tl.int32, bitcast=True)
            gbr = tl.load(gmax_ptr + row * n_groups + NG_BLOCK // 2 + gj, mask=NG_BLOCK // 2 + gj < n_groups,
                          other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
        else:
            gbm = None
            gbr = None
        status, thr, kept, lo, hi, target = top_p_plan(
            probs_ptr + row * vocab, gid_ptr + row * n_groups, cand_ptr + row * list_cap, list_cap,
            gb, gidx, tl.max(gb, axis=0), gsamp_ptr + row * n_samples, n_samples, vocab, total, p,
            G, SG, NS_BLOCK, SUB, REG, TAU_GROUPS, Z, CSUB, TPS_SHARED, NS_REM, gbm, gbr, NG_REM > 0,
            HI_SAMPLES, ENTRY_ROUNDS)
    full = status >= 2
    tl.store(flag_ptr + row, (n_bad > 0).to(tl.int32))
    tl.store(plan_ptr + row * 4, status)
    tl.store(plan_ptr + row * 4 + 1, lo)
    tl.store(plan_ptr + row * 4 + 2, hi)
    tl.store(target_ptr + row, target)
    tl.store(params_ptr + row * 4, 0.0)
    tl.store(params_ptr + row * 4 + 1, 1.0)
    tl.store(params_ptr + row * 4 + 2, tl.where(full, 0.0, thr.to(tl.float32, bitcast=True)))
    tl.store(params_ptr + row * 4 + 3, tl.where(full, 0.0, reciprocal_f32(kept)))




def workspace_flags(vocab: int, top_k=None, top_p=None) -> tuple:
    """(with_sample, with_bracket) of the workspace a top-p call uses (renorm_plan.py asks)."""
    return True, True


def top_p_renorm_triton(probs: torch.Tensor, top_p: TopP, config: Optional[RenormConfig] = None,
                        fingerprint_out: Optional[torch.Tensor] = None, workspace=None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton top-p renorm of a float32 [rows, vocab] tensor (no input checks: see renorm.py).
    `fingerprint_out`: a 1-element int64 device tensor that receives fingerprint(out) from the
    write pass (renorm_write_fp.py). `workspace`: a `Workspace` of `workspace_flags` for these
    shapes and config, reused across calls (renorm_plan.py); None: a fresh one. `out`: a contiguous
    float32 tensor of probs' shape to write (renorm_plan's row split: a row slice of the whole output)."""
    cfg = config or default_config()
    rows, vocab = probs.shape
    out = torch.empty_like(probs) if out is None else out
    if rows == 0:
        if fingerprint_out is not None:
            fill_fingerprint(out, fingerprint_out)
        return out
    s = shapes_for(rows, vocab, cfg)
    ws = workspace or workspace_for(s, cfg, probs.device, *workspace_flags(vocab))
    has_arr = isinstance(top_p, torch.Tensor)
    p_arr = top_p if has_arr else ws.params
    p_val = 0.0 if has_arr else float(top_p)
    select_args = (probs, vocab, s.n_chunks, s.n_groups, s.n_samples,
                   ws.chunk_sum, ws.chunk_bad, ws.gmax, ws.gsamp, ws.gid, ws.cand, ws.list_cap,
                   p_arr, p_val, ws.params, ws.flag, ws.plan, ws.target, float(cfg.z))
    threads = 32 * cfg.select_warps  # no remainder block smaller than the CTA (sample_blocks)
    ns_main, ns_rem = sample_blocks(s.n_samples, s.ns_block, cfg.tps_split, threads)
    ng_rem = sample_blocks(s.n_groups, s.ng_block, cfg.tps_split, threads)[1]
    blocks = dict(HAS_P_ARR=has_arr, G=cfg.group, SG=cfg.sample_stride, CH_BLOCK=s.ch_block, NG_BLOCK=s.ng_block,
                  NS_BLOCK=ns_main, SUB=cfg.sub, REG=cfg.reg, TAU_GROUPS=top_p_tau_groups(cfg, s.n_groups),
                  CSUB=cfg.compact_sub, TPS_SHARED=bool(cfg.tps_shared),
                  NS_REM=ns_rem, NG_REM=ng_rem, HI_SAMPLES=cfg.bracket_hi_samples,
                  ENTRY_ROUNDS=search_rounds(cfg, probs.dtype), **pdl_args(cfg, s, probs.device))
    launch_row_stats(probs, s, ws, cfg, with_sample=True)
    _top_p_select_kernel[(rows,)](*select_args, **blocks, num_warps=cfg.select_warps,
                                  **reg_cap(cfg.select_maxnreg, cfg.select_warps))
    launch_bracket(probs, s, ws, cfg)
    write_pass(probs, out, s, ws, cfg, fingerprint_out)
    return out
