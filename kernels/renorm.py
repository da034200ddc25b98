"""Public API: deterministic, batch-invariant renorms of probabilities (docs/kernels.md).

    top_k_renorm(probs, top_k)             top_p_renorm(probs, top_p)
    top_k_top_p_renorm(probs, top_k, top_p) min_p_renorm(probs, min_p)

``probs`` is float32, float16 or bfloat16 ``[rows, vocab]`` and the output has its dtype (the
kernels work in float32, exact for the 16-bit inputs, and round the output once, to nearest even);
a parameter is a number (Python's or numpy's) or a tensor with one value
per row (or a single value). ``backend`` (renorm words, tpguard/renorm_words.py):
``"deterministic"`` (the default: tpguard's Triton kernels on CUDA tensors, the torch reference
elsewhere), ``"tpguard"`` (the Triton kernels: CUDA, or CPU under ``TRITON_INTERPRET=1``) or
``"torch"`` (the reference, kernels/reference.py). Both give the same kept sets and values within
2 ulp (in practice the same bits).
Triton calls go through a small cache of per-shape call plans (kernels/renorm_plan.py: reused
workspace, direct launches; ``TPGUARD_RENORM_PLANS=0`` turns it off, `clear_plans()` empties it),
a repeated call straight to its plan where it meets its lane's conditions (kernels/renorm_lane.py).

Bad input raises ``ValueError`` with one line: a non-tensor, a dtype other than float32, float16
or bfloat16, a tensor that is not 2-D, an empty vocabulary, a parameter whose length is neither 1 nor rows,
``top_k < 1``, ``top_p`` outside (0, 1], ``min_p`` outside [0, 1] or NaN. Checking the values of
a parameter *tensor* needs a device-to-host copy; ``validate=False`` skips it (for CUDA graphs)
and the kernels then clamp: k to [1, vocab], p <= 0 keeps the top value, p >= 1 keeps all,
min_p to [0, 1]. A row that holds a NaN or an infinity comes back as a row of NaN (documented
behaviour, no host sync). ``top_k >= vocab`` keeps every entry; in ``top_k_top_p_renorm`` it
skips the top-k stage altogether.
"""

from __future__ import annotations

import torch

from tpguard.kernels import reference, renorm_lane
from tpguard.kernels.renorm_args import (
    DTYPES,
    Param,
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
    triton_available,
)

# The one tie rule of every tpguard renorm (and of every sglang path TPGUARD_RENORM reroutes:
# hooks/sglang_renorm.py), the rule of flashinfer's CUDA kernels; `tpguard doctor` prints it.
TIE_RULE = ("ties at the cutoff are kept: every entry equal to the cutoff value stays (flashinfer's CUDA "
            "kernels keep x >= pivot), so top-k keeps more than k entries when the k-th largest value repeats "
            "([.4, .2, .2, .1, .1], top_k=2 -> [.5, .25, .25, 0, 0]), and top-p and min-p keep every entry "
            "tied with their cutoff; the result never depends on the entries' positions")


# `fingerprint_out` (all four): a 1-element int64 tensor on probs' device that receives
# fingerprint_tensor(out): on the Triton path from the write pass itself (renorm_write_fp.py),
# so the guard gets target_probs' fingerprint without reading the output again.

_REFERENCES = {
    "top_k": lambda probs, k, p: reference.top_k_renorm_reference(probs, k),
    "top_p": lambda probs, k, p: reference.top_p_renorm_reference(probs, p),
    "top_k_top_p": lambda probs, k, p: reference.top_k_top_p_renorm_reference(probs, k, p),
    "min_p": lambda probs, k, p: reference.min_p_renorm_reference(probs, p),
}


_RENORM_PLAN = None  # kernels/renorm_plan.py once imported: an import statement costs ~0.3 us per eager call


def _renorm_plan():
    """kernels/renorm_plan.py, imported on first use (the torch reference path needs no Triton)."""
    global _RENORM_PLAN
    if _RENORM_PLAN is None:
        from tpguard.kernels import renorm_plan

        _RENORM_PLAN = renorm_plan
    return _RENORM_PLAN


def run_op(op: str, probs: torch.Tensor, top_k: Param | None = None, top_p: Param | None = None, *,
           backend: str = "deterministic", fingerprint_out: torch.Tensor | None = None,
           lane_key: tuple | None = None) -> torch.Tensor:
    """`op` (top_k, top_p, top_k_top_p or min_p; min-p's parameter is `top_p`) on probabilities and
    parameters already checked (`probs` 2-D float32 / float16 / bfloat16, parameters of 1 or rows
    values): the Triton kernels or the torch reference by `backend`, no value checks (k clamped to
    [1, vocab], p and min_p as documented). The public functions below and the flashinfer-style
    surface (kernels/flashinfer_api.py) call it after their own checks, with the call's lane key
    (kernels/renorm_lane.py: the plan's call makes the lane a later call of that signature takes)."""
    if fingerprint_out is not None:
        check_fingerprint_slot(fingerprint_out, probs.device)
    if kernel_for(probs, backend) == "tpguard":
        k = device_top_k(top_k, probs) if top_k is not None else None
        p = device_param(top_p, probs, torch.float32) if top_p is not None else None
        return _renorm_plan().run(op, probs.contiguous(), k, p, fingerprint_out=fingerprint_out, lane_key=lane_key)
    out = _REFERENCES[op](probs, top_k, top_p)
    if fingerprint_out is not None:  # the torch path honours it too: fingerprint(out), one extra read
        fill_fingerprint(out, fingerprint_out)
    return out


def top_k_renorm(probs: torch.Tensor, top_k: Param, *, backend: str = "deterministic", validate: bool = True,
                 fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the entries >= the k-th largest of each row (ties kept), renormalised to sum 1."""
    out, key = renorm_lane.through_lane("top_k", probs, top_k, None, backend, fingerprint_out, validate)
    if out is not None:
        return out
    check_probs(probs)
    check_top_k(top_k, probs.shape[0], validate)
    return run_op("top_k", probs, top_k, backend=backend, fingerprint_out=fingerprint_out, lane_key=key)


def top_p_renorm(probs: torch.Tensor, top_p: Param, *, backend: str = "deterministic", validate: bool = True,
                 fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the smallest top set whose mass reaches p * row mass (ties at the cutoff kept), renormalised."""
    out, key = renorm_lane.through_lane("top_p", probs, None, top_p, backend, fingerprint_out, validate)
    if out is not None:
        return out
    check_probs(probs)
    check_top_p(top_p, probs.shape[0], validate)
    return run_op("top_p", probs, top_p=top_p, backend=backend, fingerprint_out=fingerprint_out, lane_key=key)


def top_k_top_p_renorm(probs: torch.Tensor, top_k: Param, top_p: Param, *, backend: str = "deterministic",
                       validate: bool = True, fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """top-k renorm, then top-p renorm of the result (SGLang's order); top_k >= vocab skips top-k."""
    out, key = renorm_lane.through_lane("top_k_top_p", probs, top_k, top_p, backend, fingerprint_out, validate)
    if out is not None:
        return out
    check_probs(probs)
    check_top_k(top_k, probs.shape[0], validate)
    check_top_p(top_p, probs.shape[0], validate)
    return run_op("top_k_top_p", probs, top_k, top_p, backend=backend, fingerprint_out=fingerprint_out,
                  lane_key=key)


def min_p_renorm(probs: torch.Tensor, min_p: Param, *, backend: str = "deterministic", validate: bool = True,
                 fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the entries >= fp32(row max * min_p), renormalised."""
    out, key = renorm_lane.through_lane("min_p", probs, None, min_p, backend, fingerprint_out, validate)
    if out is not None:
        return out
    check_probs(probs)
    check_param(min_p, probs.shape[0], "min_p", integer=False)
    check_range(min_p, "min_p", validate, 0.0, 1.0, lo_open=False)
    return run_op("min_p", probs, top_p=min_p, backend=backend, fingerprint_out=fingerprint_out, lane_key=key)


def clear_plans() -> None:
    """Drop the cached call plans (workspaces, recorded launches: kernels/renorm_plan.py)."""
    _renorm_plan().clear_plans()


__all__ = ["DTYPES", "TIE_RULE", "clear_plans", "min_p_renorm", "run_op", "top_k_renorm", "top_k_top_p_renorm",
           "top_p_renorm", "triton_available"]
