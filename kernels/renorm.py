"""Public API: deterministic, batch-invariant renorms of probabilities (docs/kernels.md).

    top_k_renorm(probs, top_k)             top_p_renorm(probs, top_p)
    top_k_top_p_renorm(probs, top_k, top_p) min_p_renorm(probs, min_p)

``probs`` is float32, float16 or bfloat16 ``[rows, vocab]`` and the output has its dtype (the
kernels work in float32, exact for the 16-bit inputs, and round the output once, to nearest even);
a parameter is a Python number or a tensor with one value
per row (or a single value). ``backend``: ``"auto"`` (Triton on CUDA tensors, the torch
reference elsewhere), ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"torch"``.
Both backends give the same kept sets and values within 2 ulp (in practice the same bits).
Triton calls go through a small cache of per-shape call plans (kernels/renorm_plan.py: reused
workspace, direct launches; ``TPGUARD_RENORM_PLANS=0`` turns it off, `clear_plans()` empties it).

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

import math
from typing import Union

import torch

from tpguard.config import interpreting
from tpguard.kernels import reference

Param = Union[int, float, torch.Tensor]

BACKENDS = ("auto", "triton", "torch")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # probabilities in; the output has the same dtype
# The one tie rule of every tpguard renorm (and of every sglang path TPGUARD_RENORM=deterministic reroutes:
# hooks/sglang_renorm.py), the rule of flashinfer's CUDA kernels; `tpguard doctor` prints it.
TIE_RULE = ("ties at the cutoff are kept: every entry equal to the cutoff value stays (flashinfer's CUDA "
            "kernels keep x >= pivot), so top-k keeps more than k entries when the k-th largest value repeats "
            "([.4, .2, .2, .1, .1], top_k=2 -> [.5, .25, .25, 0, 0]), and top-p and min-p keep every entry "
            "tied with their cutoff; the result never depends on the entries' positions")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _check_probs(probs) -> None:
    if not isinstance(probs, torch.Tensor):
        raise ValueError(f"probs must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dtype not in DTYPES:
        raise ValueError(f"probs must be float32, float16 or bfloat16, got {probs.dtype}")
    if probs.dim() != 2:
        raise ValueError(f"probs must be 2-D [rows, vocab], got shape {tuple(probs.shape)}")
    if probs.shape[1] == 0:
        raise ValueError("probs has an empty vocabulary (shape [rows, 0])")


def _check_param(value, rows: int, name: str, integer: bool) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() not in (1, rows):
            raise ValueError(f"{name} has {value.numel()} values for {rows} rows (expected 1 or {rows})")
        if value.dim() > 1 and value.numel() != 1 and value.shape[0] != rows:
            raise ValueError(f"{name} must have shape [rows], got {tuple(value.shape)}")
        if integer and value.dtype.is_floating_point:
            raise ValueError(f"{name} must hold integers, got {value.dtype}")
        if not integer and not (value.dtype.is_floating_point):
            raise ValueError(f"{name} must hold floats, got {value.dtype}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if integer and not float(value).is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_range(value, name: str, validate: bool, lo: float, hi: float, lo_open: bool) -> None:
    """Range of a scalar always; of a tensor only with validate (it costs a host sync)."""
    if isinstance(value, torch.Tensor):
        if not validate or value.numel() == 0:
            return
        v = value.detach().double()
        bad = torch.isnan(v) | (v > hi) | ((v <= lo) if lo_open else (v < lo))
        if bool(bad.any()):
            first = float(v[bad].reshape(-1)[0])
            raise ValueError(f"{name} values must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {first!r}")
        return
    v = float(value)
    if math.isnan(v) or v > hi or (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}")


def _check_top_p(top_p, rows: int, validate: bool) -> None:
    _check_param(top_p, rows, "top_p", integer=False)
    _check_range(top_p, "top_p", validate, 0.0, 1.0, lo_open=True)


def _check_top_k(top_k, rows: int, validate: bool) -> None:
    _check_param(top_k, rows, "top_k", integer=True)
    if isinstance(top_k, torch.Tensor):
        if validate and top_k.numel() and bool((top_k < 1).any()):
            raise ValueError(f"top_k values must be >= 1, got {int(top_k.min())}")
    elif int(top_k) < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k!r}")


def _use_triton(probs: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return probs.is_cuda and triton_available()
    if not triton_available():
        raise ValueError("backend='triton' needs the triton package")
    if not probs.is_cuda and not interpreting():
        raise ValueError("backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    return True


def _device_param(value: Param, probs: torch.Tensor, dtype: torch.dtype):
    """A scalar stays a Python number; a tensor becomes a contiguous [rows] tensor on probs' device."""
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach().reshape(-1).to(device=probs.device, dtype=dtype)
    if t.numel() == 1 and probs.shape[0] != 1:
        t = t.expand(probs.shape[0])
    return t.contiguous()


def _device_top_k(top_k: Param, probs: torch.Tensor):
    """k clamped to [1, vocab]: an int, or an int32 [rows] tensor on probs' device (no sync)."""
    vocab = probs.shape[1]
    if not isinstance(top_k, torch.Tensor):
        return int(min(max(int(top_k), 1), vocab))
    t = top_k.detach().reshape(-1).to(device=probs.device).clamp(1, vocab).to(torch.int32)
    if t.numel() == 1 and probs.shape[0] != 1:
        t = t.expand(probs.shape[0])
    return t.contiguous()


def check_fingerprint_slot(fp_out, device: torch.device, who: str = "fingerprint_out") -> torch.Tensor:
    """`fp_out` if it is a 1-element int64 tensor on `device` (a 0-d slot or a [1] view of the
    guard's vector), else a one-line ValueError. The one check of every `fingerprint_out=`."""
    if not isinstance(fp_out, torch.Tensor) or fp_out.dtype != torch.int64 or fp_out.numel() != 1 \
            or fp_out.device != device:
        got = (f"{fp_out.dtype} {tuple(fp_out.shape)} on {fp_out.device}" if isinstance(fp_out, torch.Tensor)
               else type(fp_out).__name__)
        raise ValueError(f"{who}: fingerprint_out must be a 1-element int64 tensor on {device}, got {got}")
    return fp_out


def _check_fingerprint_out(fp_out, probs: torch.Tensor) -> None:
    if fp_out is not None:
        check_fingerprint_slot(fp_out, probs.device)


def _reference_out(out: torch.Tensor, fp_out) -> torch.Tensor:
    """The torch path honours `fingerprint_out` too: fingerprint(out), one extra read."""
    if fp_out is not None:
        from tpguard.kernels.fingerprint import fingerprint_on_device

        fp_out.view(1).copy_(fingerprint_on_device(out).view(1))
    return out


# `fingerprint_out` (all four): a 1-element int64 tensor on probs' device that receives
# tpguard.fingerprint(out): on the Triton path from the write pass itself (renorm_write_fp.py),
# so the guard gets target_probs' fingerprint without reading the output again.

_REFERENCES = {
    "top_k": lambda probs, k, p: reference.top_k_renorm_reference(probs, k),
    "top_p": lambda probs, k, p: reference.top_p_renorm_reference(probs, p),
    "top_k_top_p": lambda probs, k, p: reference.top_k_top_p_renorm_reference(probs, k, p),
    "min_p": lambda probs, k, p: reference.min_p_renorm_reference(probs, p),
}


def run_op(op: str, probs: torch.Tensor, top_k: Param | None = None, top_p: Param | None = None, *,
           backend: str = "auto", fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """`op` (top_k, top_p, top_k_top_p or min_p; min-p's parameter is `top_p`) on probabilities and
    parameters already checked (`probs` 2-D float32 / float16 / bfloat16, parameters of 1 or rows
    values): the Triton kernels or the torch reference by `backend`, no value checks (k clamped to
    [1, vocab], p and min_p as documented). The public functions below and the flashinfer-style
    surface (kernels/flashinfer_api.py) call it after their own checks."""
    _check_fingerprint_out(fingerprint_out, probs)
    if _use_triton(probs, backend):
        from tpguard.kernels import renorm_plan

        k = _device_top_k(top_k, probs) if top_k is not None else None
        p = _device_param(top_p, probs, torch.float32) if top_p is not None else None
        return renorm_plan.run(op, probs.contiguous(), k, p, fingerprint_out=fingerprint_out)
    return _reference_out(_REFERENCES[op](probs, top_k, top_p), fingerprint_out)


def top_k_renorm(probs: torch.Tensor, top_k: Param, *, backend: str = "auto", validate: bool = True,
                 fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the entries >= the k-th largest of each row (ties kept), renormalised to sum 1."""
    _check_probs(probs)
    _check_top_k(top_k, probs.shape[0], validate)
    return run_op("top_k", probs, top_k, backend=backend, fingerprint_out=fingerprint_out)


def top_p_renorm(probs: torch.Tensor, top_p: Param, *, backend: str = "auto", validate: bool = True,
                 fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the smallest top set whose mass reaches p * row mass (ties at the cutoff kept), renormalised."""
    _check_probs(probs)
    _check_top_p(top_p, probs.shape[0], validate)
    return run_op("top_p", probs, top_p=top_p, backend=backend, fingerprint_out=fingerprint_out)


def top_k_top_p_renorm(probs: torch.Tensor, top_k: Param, top_p: Param, *, backend: str = "auto",
                       validate: bool = True, fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """top-k renorm, then top-p renorm of the result (SGLang's order); top_k >= vocab skips top-k."""
    _check_probs(probs)
    _check_top_k(top_k, probs.shape[0], validate)
    _check_top_p(top_p, probs.shape[0], validate)
    return run_op("top_k_top_p", probs, top_k, top_p, backend=backend, fingerprint_out=fingerprint_out)


def min_p_renorm(probs: torch.Tensor, min_p: Param, *, backend: str = "auto", validate: bool = True,
                 fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the entries >= fp32(row max * min_p), renormalised."""
    _check_probs(probs)
    _check_param(min_p, probs.shape[0], "min_p", integer=False)
    _check_range(min_p, "min_p", validate, 0.0, 1.0, lo_open=False)
    return run_op("min_p", probs, top_p=min_p, backend=backend, fingerprint_out=fingerprint_out)


def clear_plans() -> None:
    """Drop the cached call plans (workspaces, recorded launches: kernels/renorm_plan.py)."""
    from tpguard.kernels import renorm_plan

    renorm_plan.clear_plans()


__all__ = ["DTYPES", "TIE_RULE", "clear_plans", "min_p_renorm", "run_op", "top_k_renorm", "top_k_top_p_renorm",
           "top_p_renorm", "triton_available"]
