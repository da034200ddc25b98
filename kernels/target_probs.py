"""Deterministic, batch-invariant ``logits -> target_probs`` (Triton): temperature, softmax, top-k,
top-p and min-p in one pass family. Reference: kernels/reference.py (``target_probs_reference``);
semantics and measurements: docs/kernels.md ("From logits").

What it replaces: sglang's verify steps (DFlash's ``build_speculative_verify_target_probs``, EAGLE's
sampling verify, the harness's target probs) compute ``softmax(logits / T)`` and then a top-k and a
top-p renorm: 3-5 launches, each a full read and write of a [rows, vocab] float32 tensor. Here:

1. ``_logit_max_kernel`` (rows x chunks, one read of the logits): each chunk's max and non-finite
   count.
2. ``_softmax_stats_kernel`` (rows x chunks, one read): the row max M from the chunk maxima, the
   weights ``w = exp2((x - M) * c)`` with ``c = fp32(log2(e) / T)`` (the unnormalised softmax: the
   row's largest is exactly 1), written to the output buffer, and the row stats of the renorms
   (renorm_passes.store_chunk_stats: chunk sums, group maxima, samples), plus, with min-p, each
   chunk's mass at or above min-p's cutoff ``fp32(max(w) * min_p)``.
3. the per-row select of top-k + top-p (renorm_top_k.top_k_select_row with JOINT: top-p on the
   top-k set's own weights, then min-p, one kept set), the bracket passes for rows without top-k
   whose top-p cutoff lies deep in a flat row, and the write pass over the output buffer in place:
   ``out = fp32(w * fp32(1 / S))``, S the float64 mass of the kept weights.

So the softmax is never written as probabilities and renormalised again: one renormalisation, of
the weights, and 3 reads + 2 writes of the batch (4 reads with the bracket passes) where softmax +
top-k + top-p renorms take ~7-8 reads and 3 writes. Every value a row's output depends on comes from programs
that see only that row, in a fixed order: deterministic and batch-invariant like the renorms.

``exp2`` is the one operation whose last bit differs between implementations (the GPU's ex2.approx,
numpy's under the interpreter, torch's in the reference): the kernel's weights are within a few ulp
of the reference's, and its output is bit for bit the reference's *renorm* of the kernel's own
weights (`softmax_weights_triton` exposes them; tests compare both ways).

The write pass reads what the stats pass wrote, so these launches never use programmatic dependent
launch (its write pass would load its input before waiting).

Eager calls of `target_probs` go through the renorms' call plans (kernels/renorm_plan.py, `PLAN_OP`):
a plan per call shape and parameter kinds owns the workspace (`FusedWorkspace`) and, on a GPU, the
launches recorded at its second call, replayed directly (``TPGUARD_RENORM_PLANS=0``: a fresh
workspace and Triton's launches per call, as `target_probs_triton` alone does).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from tpguard.kernels import reference, renorm_plan
from tpguard.kernels.renorm_args import (
    check_fingerprint_slot,
    check_param,
    check_probs,
    check_range,
    check_top_k,
    check_top_p,
    device_param,
    device_top_k,
    fill_fingerprint,
    kernel_for,
)
from tpguard.kernels.renorm_config import RenormConfig, default_config, reg_cap
from tpguard.kernels.renorm_graph import FP, K, MP, P, PROBS, T
from tpguard.kernels.renorm_passes import launch_bracket, store_chunk_stats
from tpguard.kernels.renorm_top_k_select import select_launch_args, top_k_select_row, workspace_flags
from tpguard.kernels.renorm_workspace import Shapes, Workspace, shapes_for, workspace_for
from tpguard.kernels.renorm_write_fp import write_pass

Param = Union[int, float, torch.Tensor]
LOG2E = 1.4426950408889634
# log2(e) as float64 bits: the kernels build the float64 constant from them (a float literal in a
# Triton kernel is float32)
LOG2E_BITS = tl.constexpr(struct.unpack("<q", struct.pack("<d", LOG2E))[0])

@triton.jit
def _logit_max_kernel(logits_ptr, vocab, n_chunks, cmax_ptr, cbad_ptr, CHUNK: tl.constexpr):
    """Pass 1: per chunk the max of the logits (NaN ignored) and the count of NaN / +inf entries."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * vocab + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    bad = (x != x) | (x == float("inf"))
    tl.store(cmax_ptr + row * n_chunks + chunk, tl.max(tl.where(x == x, x, float("-inf")), axis=0))
    tl.store(cbad_ptr + row * n_chunks + chunk, tl.sum(bad.to(tl.int32), axis=0))


@triton.jit
def scale_of_temperature(t):
    """c = fp32(log2(e) / fp64(fp32(t))): `temperature_scale`'s value (a float64 division rounds to
    nearest, as IEEE's and torch's do; then one rounding to float32). t is rounded to float32 here, so a
    scalar argument arrives as the caller wrote it (the interpreter holds a Python float as float64)."""
    log2e = tl.full([], LOG2E_BITS, tl.int64).to(tl.float64, bitcast=True)
    return (log2e / tl.cast(tl.cast(t, tl.float32), tl.float64)).to(tl.float32)  # tl.cast: a scalar too


@triton.jit
def _softmax_stats_kernel(logits_ptr, w_ptr, vocab, n_chunks, n_groups, n_samples, cmax_ptr, cbad_ptr,
                          t_ptr, t_val, mp_ptr, mp_val, chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr,
                          chunk_mp_ptr, HAS_T_ARR: tl.constexpr, HAS_MP_ARR: tl.constexpr,
                          WITH_MIN_P: tl.constexpr, CHUNK: tl.constexpr, CH_BLOCK: tl.constexpr,
                          G: tl.constexpr, SG: tl.constexpr, WRITE_SAMPLE: tl.constexpr):
    """Pass 2: the weights w = exp2((x - M) * c) of one chunk (0 on a NaN row), stored to w_ptr,
    and their row stats; with min-p the chunk's float64 mass of w >= fp32(max(w) * min_p). c comes
    from the row's temperature here (one division per program), not from a host-side tensor op."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ch = tl.arange(0, CH_BLOCK)
    chm = ch < n_chunks
    m = tl.max(tl.load(cmax_ptr + row * n_chunks + ch, mask=chm, other=float("-inf")), axis=0)
    n_bad = tl.sum(tl.load(cbad_ptr + row * n_chunks + ch, mask=chm, other=0), axis=0)
    bad = (n_bad > 0) | (m == float("-inf"))  # NaN / +inf anywhere, or nothing finite: a NaN row
    if HAS_T_ARR:
        c = scale_of_temperature(tl.load(t_ptr + row))
    else:
        c = scale_of_temperature(t_val)
    gi = tl.arange(0, CHUNK // G)
    col = tl.arange(0, G)
    offs = chunk * CHUNK + gi[:, None] * G + col[None, :]
    inside = offs < vocab
    x = tl.load(logits_ptr + row * vocab + offs, mask=inside, other=float("-inf")).to(tl.float32)
    w = tl.exp2((x - m) * c)
    w = tl.where(inside & (bad == 0), w, 0.0)
    tl.store(w_ptr + row * vocab + offs, w, mask=inside)
    store_chunk_stats(w, bad.to(tl.int32), row, chunk, n_chunks, n_groups, n_samples,
                      chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, CHUNK, G, SG, WRITE_SAMPLE)
    if WITH_MIN_P:
        if HAS_MP_ARR:
            mp = tl.load(mp_ptr + row)
        else:
            mp = mp_val
        mp = tl.minimum(tl.maximum(mp, 0.0), 1.0)
        w_max = tl.exp2((m - m) * c)  # the row max's own weight (the select's max group max): 1
        t_m = (w_max * mp).to(tl.int32, bitcast=True)
        above = tl.where(w.to(tl.int32, bitcast=True) >= t_m, w.to(tl.float64), 0.0)
        tl.store(chunk_mp_ptr + row * n_chunks + chunk, tl.sum(tl.sum(above, axis=1), axis=0))


@triton.jit
def _target_select_kernel(probs_ptr, vocab, n_chunks, n_groups, n_samples,
                          chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, gid_ptr, cand_ptr, list_cap,
                          k_ptr, k_val, p_ptr, p_val, params_ptr, flag_ptr, plan_ptr, target_ptr, Z,
                          mp_ptr, mp_val, chunk_mp_ptr,
                          HAS_K_ARR: tl.constexpr, HAS_P_ARR: tl.constexpr, WITH_TOP_P: tl.constexpr,
                          G: tl.constexpr, SG: tl.constexpr, CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr,
                          NS_BLOCK: tl.constexpr, SUB: tl.constexpr, REG: tl.constexpr,
                          TAU_GROUPS: tl.constexpr, CSUB: tl.constexpr,
                          HAS_MP_ARR: tl.constexpr, WITH_MIN_P: tl.constexpr, SHORT: tl.constexpr = False,
                          ENTRY_ROUNDS: tl.constexpr = 16):
    """Pass 3: top-k, top-p and min-p of one row's weights as one kept set (top_k_select_row, JOINT)."""
    top_k_select_row(tl.program_id(0).to(tl.int64), probs_ptr, vocab, n_chunks, n_groups, n_samples,
                     chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, gid_ptr, cand_ptr, list_cap,
                     k_ptr, k_val, p_ptr, p_val, params_ptr, flag_ptr, plan_ptr, target_ptr, Z,
                     HAS_K_ARR, HAS_P_ARR, WITH_TOP_P, G, SG, CH_BLOCK, NG_BLOCK, NS_BLOCK, SUB, REG,
                     TAU_GROUPS, CSUB, mp_ptr, mp_val, chunk_mp_ptr, HAS_MP_ARR, WITH_MIN_P, True,
                     SHORT, ENTRY_ROUNDS)


def temperature_scale(temperature: Param, rows: int, device) -> Union[float, torch.Tensor]:
    """c = fp32(log2(e) / fp32(T)): a float for a scalar T, else a float32 [rows] tensor (T as float32,
    as SGLang holds temperatures; the quotient in float64, rounded once). The reference's scale; the
    stats kernel computes the same value from T itself (`scale_of_temperature`)."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.detach().reshape(-1).to(device=device, dtype=torch.float32).double()
        c = (LOG2E / t).float()
        return (c.expand(rows) if c.numel() == 1 else c).contiguous()
    return _fp32(LOG2E / _fp32(float(temperature)))


def _fp32(x: float) -> float:
    """x rounded to float32 (to nearest even), as a Python float: no tensor for a scalar."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # beyond float32's range: rounds to an infinity
        return math.copysign(math.inf, x)


@dataclass
class FusedWorkspace:
    """Per-call scratch of `target_probs_triton`: the renorm stages' `Workspace` and the logit
    passes' buffers (each written before it is read in the same call; renorm_plan.py keeps one per
    cached call shape)."""

    renorm: Workspace
    cmax: torch.Tensor  # float32 [rows * n_chunks]: each chunk's max logit (pass 1)
    cbad: torch.Tensor  # int32 [rows * n_chunks]: each chunk's count of NaN / +inf logits (pass 1)
    chunk_mp: torch.Tensor  # float64 [rows * n_chunks] (1 without min-p): each chunk's mass at or above min-p's cutoff


def fused_workspace(s: Shapes, cfg: RenormConfig, device, top_k, top_p, min_p) -> FusedWorkspace:
    """The scratch of one call of these shapes and parameters (`top_k`: None or as the launcher takes it)."""
    k = s.vocab if top_k is None else top_k
    # the samples and the bracket passes serve top-p rows without top-k (without top-p, p = 1: none)
    with_bracket = workspace_flags(s.vocab, k, top_p)[1]
    n = s.rows * s.n_chunks
    return FusedWorkspace(
        renorm=workspace_for(s, cfg, device, with_bracket, with_bracket),
        cmax=torch.empty(n, dtype=torch.float32, device=device),
        cbad=torch.empty(n, dtype=torch.int32, device=device),
        chunk_mp=torch.empty(n if min_p is not None else 1, dtype=torch.float64, device=device))


def _launch_weights(logits, temperature, min_p, s, ws, cfg, w, chunk_mp, with_sample, cmax, cbad):
    rows, vocab = logits.shape
    _logit_max_kernel[(rows, s.n_chunks)](logits, vocab, s.n_chunks, cmax, cbad, CHUNK=s.chunk,
                                          num_warps=cfg.pass_warps)
    has_t, has_mp = isinstance(temperature, torch.Tensor), isinstance(min_p, torch.Tensor)
    _softmax_stats_kernel[(rows, s.n_chunks)](
        logits, w, vocab, s.n_chunks, s.n_groups, s.n_samples, cmax, cbad,
        temperature if has_t else cmax, 1.0 if has_t else float(temperature), min_p if has_mp else cmax,
        0.0 if (has_mp or min_p is None) else float(min_p),
        ws.chunk_sum, ws.chunk_bad, ws.gmax, ws.gsamp, chunk_mp,
        HAS_T_ARR=has_t, HAS_MP_ARR=has_mp, WITH_MIN_P=min_p is not None, CHUNK=s.chunk, CH_BLOCK=s.ch_block,
        G=cfg.group, SG=cfg.sample_stride, WRITE_SAMPLE=with_sample, num_warps=cfg.pass_warps,
    )


def target_probs_triton(logits: torch.Tensor, temperature, top_k=None, top_p=None, min_p=None,
                        config: Optional[RenormConfig] = None,
                        fingerprint_out: Optional[torch.Tensor] = None,
                        workspace: Optional[FusedWorkspace] = None) -> torch.Tensor:
    """Triton logits -> target probs (no input checks: see `target_probs`). `temperature`: a float
    or a float32 [rows] tensor (the kernel computes `temperature_scale`'s c from it); `top_k` an int
    or an int32 [rows] tensor (None: no top-k), `top_p` and `min_p` floats or float32 [rows] tensors (None: off), all on the logits' device.
    `workspace`: a `fused_workspace` of these shapes, config and parameter kinds, reused across calls
    (renorm_plan.py); None: a fresh one. float32 [rows, vocab] out."""
    cfg = (config or default_config()).replace(pdl=0)  # the write pass reads the stats pass's output
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows == 0:
        if fingerprint_out is not None:
            fill_fingerprint(out, fingerprint_out)
        return out
    k = vocab if top_k is None else top_k
    p = 1.0 if top_p is None else top_p
    s = shapes_for(rows, vocab, cfg)
    # the samples and the bracket passes serve top-p rows without top-k (without top-p, p = 1: none)
    with_bracket = workspace_flags(vocab, k, top_p)[1]
    fws = fused_workspace(s, cfg, logits.device, top_k, top_p, min_p) if workspace is None else workspace
    ws = fws.renorm
    _launch_weights(logits, temperature, min_p, s, ws, cfg, out, fws.chunk_mp, with_bracket, fws.cmax, fws.cbad)
    args, blocks = select_launch_args(out, k, p, s, ws, cfg)
    has_mp = isinstance(min_p, torch.Tensor)
    _target_select_kernel[(rows,)](
        *args, min_p if has_mp else fws.chunk_mp, 0.0 if (has_mp or min_p is None) else float(min_p), fws.chunk_mp,
        **blocks, HAS_MP_ARR=has_mp, WITH_MIN_P=min_p is not None,
        num_warps=cfg.select_warps, **reg_cap(cfg.select_maxnreg, cfg.select_warps))
    if with_bracket:
        launch_bracket(out, s, ws, cfg)
    write_pass(out, out, s, ws, cfg, fingerprint_out)  # in place: each program reads its chunk, then writes it
    return out


def softmax_weights_triton(logits: torch.Tensor, temperature, config: Optional[RenormConfig] = None) -> torch.Tensor:
    """The kernel's weights w = exp2((x - M) * c) alone (passes 1-2; 0 on NaN rows): what the
    renorm stages of `target_probs_triton` run on (tests compare them with the reference's)."""
    cfg = config or default_config()
    rows, vocab = logits.shape
    w = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows:
        s = shapes_for(rows, vocab, cfg)
        ws = workspace_for(s, cfg, logits.device, True, False)
        cmax = torch.empty(rows * s.n_chunks, dtype=torch.float32, device=logits.device)
        cbad = torch.empty(rows * s.n_chunks, dtype=torch.int32, device=logits.device)
        _launch_weights(logits, temperature, None, s, ws, cfg, w, ws.chunk_sum, True, cmax, cbad)
    return w


def _plan_launch(values, cfg, ws, out=None):
    """`target_probs_triton` on a plan call's values (renorm_plan.PlanOp.launch; no `out`: no row split)."""
    return target_probs_triton(values[PROBS], values[T], values[K], values[P], values[MP], cfg, values[FP],
                               workspace=ws)


def _plan_workspace(rows, vocab, cfg, device, values):
    return fused_workspace(shapes_for(rows, vocab, cfg), cfg, device, values[K], values[P], values[MP])


# the fused op in the call plans (renorm_plan.py): logits in, float32 out; scalar parameters arrive in
# the select kernel's k_val and p_val, the stats and select kernels' mp_val, the stats kernel's t_val
PLAN_OP = renorm_plan.PlanOp("target_probs", _plan_launch, _plan_workspace,
                             ((K, "k_val"), (P, "p_val"), (MP, "mp_val"), (T, "t_val")), out_dtype=torch.float32)


# --- public API ----------------------------------------------------------------------------------

def _check(logits, temperature, top_k, top_p, min_p, validate: bool) -> None:
    check_probs(logits, "logits")
    rows = logits.shape[0]
    check_param(temperature, rows, "temperature", integer=False)
    check_range(temperature, "temperature", validate, 0.0, math.inf, lo_open=True)
    if top_k is not None:
        check_top_k(top_k, rows, validate)
    if top_p is not None:
        check_top_p(top_p, rows, validate)
    if min_p is not None:
        check_param(min_p, rows, "min_p", integer=False)
        check_range(min_p, "min_p", validate, 0.0, 1.0, lo_open=False)


def target_probs(logits: torch.Tensor, temperature: Param = 1.0, top_k: Optional[Param] = None,
                 top_p: Optional[Param] = None, min_p: Optional[Param] = None, *, backend: str = "deterministic",
                 validate: bool = True, fingerprint_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 target probabilities of ``logits`` [rows, vocab] (float32, float16 or bfloat16):
    ``softmax(logits / temperature)`` restricted to the entries that pass top-k (ties at the k-th
    value kept), top-p measured within the top-k set, and min-p (``>= max * min_p``), renormalised
    once. Equal to SGLang's softmax -> top_k_renorm -> top_p_renorm (-> min-p) up to rounding and
    ties at a cutoff (docs/kernels.md). A parameter: a number, Python's or numpy's (every row), or a
    tensor with 1 or rows values; None switches its stage off (as do top_k >= vocab, top_p >= 1, min_p <= 0).
    ``temperature`` must be > 0. `backend`, `validate`, `fingerprint_out`: as the renorms'
    (kernels/renorm.py). A row holding a NaN or +inf logit, or no finite one, comes back NaN."""
    _check(logits, temperature, top_k, top_p, min_p, validate)
    if fingerprint_out is not None:
        check_fingerprint_slot(fingerprint_out, logits.device)
    rows = logits.shape[0]
    if kernel_for(logits, backend) == "tpguard":
        t = device_param(temperature, logits, torch.float32)
        k = device_top_k(top_k, logits) if top_k is not None else None
        p = device_param(top_p, logits, torch.float32)
        mp = device_param(min_p, logits, torch.float32)
        # through its call plan (renorm_plan.py): cached workspace, direct launches on a GPU
        return renorm_plan.run(PLAN_OP, logits.contiguous(), k, p, fingerprint_out=fingerprint_out, min_p=mp,
                               temperature=t)
    out = reference.target_probs_reference(logits, temperature_scale(temperature, rows, logits.device),
                                           top_k, top_p, min_p)
    if fingerprint_out is not None:  # the torch path honours it too: fingerprint(out), one extra read
        fill_fingerprint(out, fingerprint_out)
    return out


__all__ = ["LOG2E", "PLAN_OP", "FusedWorkspace", "fused_workspace", "softmax_weights_triton", "target_probs",
           "target_probs_triton", "temperature_scale"]
