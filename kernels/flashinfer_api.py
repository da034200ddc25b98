"""A drop-in for flashinfer.sampling's renorm functions on tpguard's deterministic kernels.

Same names, signatures and parameter errors as flashinfer 0.7.2.post1 (flashinfer/sampling.py and
csrc/renorm.cu, csrc/sampling_utils.h), so code written for ``flashinfer.sampling`` runs unchanged
with this module in its place (``import tpguard.kernels.flashinfer_api as sampling``)::

    top_p_renorm_probs(probs, top_p, is_deterministic=False)      top_p_renorm_prob (alias)
    top_k_renorm_probs(probs, top_k, is_deterministic=False)      top_k_renorm_prob (alias)
    top_k_mask_logits(logits, top_k)

* A parameter is a number, Python's or numpy's (every row), or a tensor of shape ``(batch_size,)``, one
  value per row, of any numeric dtype (flashinfer converts: ``top_p`` with ``.float()``, ``top_k`` with
  ``.int()``). A 0-d tensor, a tensor of more than one dimension or of another length raises
  flashinfer's ``ValueError`` (`check_tensor_param`, messages word for word).
* Values are not checked (flashinfer checks none, and a check of a tensor would cost a host
  sync): ``top_k`` is clamped to ``[1, vocab]`` (``>= vocab`` keeps every entry), ``top_p <= 0``
  keeps the largest value, ``top_p >= 1`` every positive entry. Outside flashinfer's documented
  range ``(0, vocab)`` the two differ: flashinfer's kernels read ``k`` as unsigned, so a negative
  ``top_k`` keeps every entry there and the largest value here (SGLang passes no negative k: its
  "no top-k" is 2^30).
* Output in the input's dtype: float32, float16, bfloat16. flashinfer 0.7.2.post1's
  ``top_k_renorm_probs`` and ``top_k_mask_logits`` do the same; its ``top_p_renorm_probs`` casts a
  16-bit input to float32 first and returns float32: here top-p keeps the input's dtype too (the
  kernels work in float32 and round the output once). Another floating dtype (float64) is cast to
  float32 by top-p, as flashinfer does, and refused by top-k (flashinfer asserts).
* ``is_deterministic`` is accepted and changes nothing: every call is deterministic and
  batch-invariant (docs/kernels.md).
* Tie rule: every entry equal to the cutoff is kept (`tpguard.kernels.renorm.TIE_RULE`), what
  flashinfer's CUDA kernels do.
* Not flashinfer's: CPU tensors work (the torch reference, or Triton under
  ``TRITON_INTERPRET=1``), and the renorms take ``fingerprint_out=`` (docs/kernels.md), which the
  SGLang plugin uses.

``top_k_mask_logits`` keeps the logits >= the k-th largest of their row (ties kept; ``-inf``
entries count as values) and sets the others to ``-inf``; a row holding a NaN comes back as NaN.
It is computed with torch (a top-k per row: deterministic, batch-invariant; capturable in a CUDA graph);
no Triton kernel.
"""

from __future__ import annotations

import numbers
from typing import Union

import torch

from tpguard.config import interpreting
from tpguard.kernels import renorm, renorm_lane
from tpguard.kernels.renorm_args import DTYPES, triton_available

TopP = Union[torch.Tensor, float]
TopK = Union[torch.Tensor, int]


def check_tensor_param(param, reference: torch.Tensor) -> None:
    """flashinfer's `check_tensor_param` (csrc/sampling_utils.h): a tensor parameter must be 1-D
    with one value per row of `reference`; the same ValueError messages."""
    if not isinstance(param, torch.Tensor):
        return
    if param.dim() == 0:
        raise ValueError("Expected a 1D tensor of shape (batch_size,) or scalar for the sampling parameter, "
                         "but got a 0-dimensional tensor.")
    if param.dim() > 1:
        raise ValueError(f"Expected a 1D tensor or scalar for the sampling parameter, but got a {param.dim()}D tensor.")
    if param.shape[0] != reference.shape[0]:
        raise ValueError(f"Sampling parameter tensor batch size mismatch: expected length {reference.shape[0]} "
                         f"to match the reference tensor batch size, but got length {param.shape[0]}.")


def _check_input(t, name: str) -> None:
    """flashinfer's CHECK_DIM(2, ...) as one clear ValueError (a CUDA tensor is not required here)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be a 2D tensor (batch_size, vocab_size), got shape {tuple(t.shape)}")
    if t.shape[1] == 0:
        raise ValueError(f"{name} has an empty vocabulary (shape {tuple(t.shape)})")


def _check_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"Unsupported dtype {t.dtype} of {name}, expected float32, float16, or bfloat16")


def _scalar(value, integer: bool, name: str):
    # numbers.Real: Python's numbers and numpy's scalars (np.int64(40), np.float32(0.9)), not bools
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number or a tensor of shape (batch_size,), got {type(value).__name__}")
    return int(value) if integer else float(value)


def backend_for(t: torch.Tensor) -> str:
    """The renorm API's `backend=` of a call here: "tpguard" (the Triton kernels) on CUDA tensors and,
    under the Triton interpreter, on CPU ones; else "torch" (the reference)."""
    return "tpguard" if (t.is_cuda or interpreting()) and triton_available() else "torch"


def renorm_probs(kind: str, probs: torch.Tensor, param, *, backend: str | None = None,
                 fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """top_k_renorm_probs (kind "top_k") or top_p_renorm_probs ("top_p") with flashinfer's checks and
    conversions, on `backend` (the renorm API's: "tpguard", "torch"; None: `backend_for(probs)`)."""
    if kind not in ("top_k", "top_p"):
        raise ValueError(f"kind must be top_k or top_p, got {kind!r}")
    k, p = (param, None) if kind == "top_k" else (None, param)
    # backend None runs "tpguard" wherever a plan (and so a lane) can exist: backend_for's other answer is the
    # torch reference, which makes none
    out, key = renorm_lane.through_lane(kind, probs, k, p, backend or "tpguard", fingerprint_out, False)
    if out is not None:
        return out
    _check_input(probs, "probs")
    if kind == "top_k":
        _check_dtype(probs, "probs")
    elif probs.dtype not in DTYPES:
        if not probs.dtype.is_floating_point:
            raise ValueError(f"probs must hold floats, got {probs.dtype}")
        probs = probs.float()  # flashinfer's top-p casts every input to float32
    check_tensor_param(param, probs)
    if isinstance(param, torch.Tensor):
        param = param.int() if kind == "top_k" else param.float()
    else:
        param = _scalar(param, kind == "top_k", "top_k" if kind == "top_k" else "top_p")
    if kind == "top_k":
        return renorm.run_op("top_k", probs, top_k=param, backend=backend or backend_for(probs),
                             fingerprint_out=fingerprint_out, lane_key=key)
    return renorm.run_op("top_p", probs, top_p=param, backend=backend or backend_for(probs),
                         fingerprint_out=fingerprint_out, lane_key=key)


def top_p_renorm_probs(probs: torch.Tensor, top_p: TopP, is_deterministic: bool = False, *,
                       fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """flashinfer.sampling.top_p_renorm_probs: keep the smallest top set of each row whose mass
    reaches ``top_p`` times the row's mass (ties at the cutoff kept), renormalised; deterministic."""
    return renorm_probs("top_p", probs, top_p, fingerprint_out=fingerprint_out)


def top_k_renorm_probs(probs: torch.Tensor, top_k: TopK, is_deterministic: bool = False, *,
                       fingerprint_out: torch.Tensor | None = None) -> torch.Tensor:
    """flashinfer.sampling.top_k_renorm_probs: keep the entries >= the k-th largest of each row (ties
    kept), renormalised; output in the input's dtype; deterministic."""
    return renorm_probs("top_k", probs, top_k, fingerprint_out=fingerprint_out)


top_p_renorm_prob = top_p_renorm_probs
top_k_renorm_prob = top_k_renorm_probs


def top_k_mask_logits(logits: torch.Tensor, top_k: TopK) -> torch.Tensor:
    """flashinfer.sampling.top_k_mask_logits: the logits >= the k-th largest of each row (ties kept),
    the others ``-inf``; ``top_k >= vocab`` keeps the row; output in the input's dtype. No host read
    during CUDA graph capture (a tensor ``top_k`` is then searched over the whole row)."""
    _check_input(logits, "logits")
    _check_dtype(logits, "logits")
    check_tensor_param(top_k, logits)
    rows, vocab = logits.shape
    if isinstance(top_k, torch.Tensor):
        k = top_k.int().to(device=logits.device, dtype=torch.int64).clamp(1, vocab)
        # the search's width: the largest k (one host read), or the whole row where a capture refuses the read
        capturing = logits.is_cuda and torch.cuda.is_current_stream_capturing()
        width = vocab if capturing or not rows else int(k.max())
    else:
        width = min(max(_scalar(top_k, True, "top_k"), 1), vocab)
        k = torch.full((rows,), width, dtype=torch.int64, device=logits.device)
    return _mask_below_kth(logits, k, width)


def _mask_below_kth(logits: torch.Tensor, k: torch.Tensor, width: int) -> torch.Tensor:
    """`top_k_mask_logits` with k an int64 [rows] tensor in [1, vocab] and `width` >= max(k): the pivot,
    each row's k-th largest value, is the same for every such width (tests compare them)."""
    x = logits.float()
    nan_row = torch.isnan(x).any(dim=1, keepdim=True)
    pivot = torch.topk(torch.nan_to_num(x, nan=0.0), width, dim=1).values.gather(1, (k - 1)[:, None])
    out = torch.where(x >= pivot, logits, torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))
    return torch.where(nan_row, torch.full((), float("nan"), dtype=logits.dtype, device=logits.device), out)


__all__ = ["backend_for", "check_tensor_param", "renorm_probs", "top_k_mask_logits", "top_k_renorm_prob",
           "top_k_renorm_probs", "top_p_renorm_prob", "top_p_renorm_probs"]
