"""The renorm API's arguments: checks (one-line ValueErrors), conversions for the kernels, the
``fingerprint_out=`` slot, and which implementation a call runs (`backend=`). Triton-free: the torch
reference path needs none of the kernels (docs/kernels.md, "API").
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Union

import torch

from tpguard.config import interpreting

Param = Union[int, float, torch.Tensor]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # probabilities in; the output has the same dtype
# `backend=` of the renorm API, renorm words (tpguard/renorm_words.py):
# "deterministic" picks per call (tpguard's Triton kernels on CUDA tensors, the torch reference
# elsewhere), "tpguard" the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1), "torch" the reference.
BACKENDS = ("deterministic", "tpguard", "torch")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def kernel_for(probs: torch.Tensor, backend: str) -> str:
    """What a call with `backend` runs on `probs`: "tpguard" (the Triton kernels) or "torch" (the
    reference); a one-line ValueError for an unknown word or kernels that cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "deterministic":
        return "tpguard" if probs.is_cuda and triton_available() else "torch"
    if not triton_available():
        raise ValueError("backend='tpguard' needs the triton package")
    if not probs.is_cuda and not interpreting():
        raise ValueError("backend='tpguard' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    return "tpguard"


def check_probs(probs, name: str = "probs") -> None:
    """A [rows, vocab] float32 / float16 / bfloat16 tensor (the renorms' probs, target_probs' logits)."""
    if not isinstance(probs, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dtype not in DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {probs.dtype}")
    if probs.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, vocab], got shape {tuple(probs.shape)}")
    if probs.shape[1] == 0:
        raise ValueError(f"{name} has an empty vocabulary (shape [rows, 0])")


def check_param(value, rows: int, name: str, integer: bool) -> None:
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
    # numbers.Real: Python's numbers and numpy's scalars (np.int64(40), np.float32(0.9)), not bools
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if integer and not float(value).is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")


def check_range(value, name: str, validate: bool, lo: float, hi: float, lo_open: bool) -> None:
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


def check_top_p(top_p, rows: int, validate: bool) -> None:
    if type(top_p) is float:  # the usual call, ahead of the general checks (host time per eager call)
        if not 0.0 < top_p <= 1.0:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        return
    check_param(top_p, rows, "top_p", integer=False)
    check_range(top_p, "top_p", validate, 0.0, 1.0, lo_open=True)


def check_top_k(top_k, rows: int, validate: bool) -> None:
    if type(top_k) is int:  # the usual call, ahead of the general checks (host time per eager call)
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k!r}")
        return
    check_param(top_k, rows, "top_k", integer=True)
    if isinstance(top_k, torch.Tensor):
        if validate and top_k.numel() and bool((top_k < 1).any()):
            raise ValueError(f"top_k values must be >= 1, got {int(top_k.min())}")
    elif int(top_k) < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k!r}")


def tensor_ready(t: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype) -> bool:
    """`t` is already what the kernels take: a contiguous [rows] `dtype` tensor on probs' device (SGLang's
    per-request parameters): passed as it is, with no torch call (each costs host time on every call)."""
    return t.dtype == dtype and t.dim() == 1 and t.shape[0] == probs.shape[0] and t.device == probs.device \
        and t.is_contiguous()


def device_param(value: Param, probs: torch.Tensor, dtype: torch.dtype):
    """A scalar stays a Python number; a tensor becomes a contiguous [rows] tensor on probs' device."""
    if not isinstance(value, torch.Tensor) or tensor_ready(value, probs, dtype):
        return value
    t = value.detach().reshape(-1).to(device=probs.device, dtype=dtype)
    if t.numel() == 1 and probs.shape[0] != 1:
        t = t.expand(probs.shape[0])
    return t.contiguous()


def device_top_k(top_k: Param, probs: torch.Tensor):
    """A scalar k as given (renorm_plan.run clamps it to [1, vocab]), or an int32 [rows] tensor on probs' device
    (no sync), clamped unless it was one already (the kernels clamp what they load)."""
    if not isinstance(top_k, torch.Tensor) or tensor_ready(top_k, probs, torch.int32):
        return top_k  # the kernels clamp a loaded k to [1, vocab] themselves (top_k_select_row): no clamp launch
    t = top_k.detach().reshape(-1).to(device=probs.device).clamp(1, probs.shape[1]).to(torch.int32)
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


def fill_fingerprint(out: torch.Tensor, fp_out: torch.Tensor) -> torch.Tensor:
    """``fingerprint(out)`` into `fp_out` the usual way (one read of `out`): for the renorm
    API's paths without a write pass (no rows; the torch reference), so that every path honours
    ``fingerprint_out=``."""
    from tpguard.kernels.fingerprint import fingerprint_on_device  # Triton's import: only when owed

    fp_out = check_fingerprint_slot(fp_out, out.device)
    fp_out.view(1).copy_(fingerprint_on_device(out).view(1))
    return fp_out


__all__ = ["BACKENDS", "DTYPES", "Param", "check_fingerprint_slot", "check_param", "check_probs", "check_range",
           "check_top_k", "check_top_p", "device_param", "device_top_k", "fill_fingerprint", "kernel_for",
           "tensor_ready", "triton_available"]
