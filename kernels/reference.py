"""Torch references for tpguard's renorm kernels; also the CPU fallback (docs/kernels.md).

Semantics (the same as flashinfer 0.7.2.post1's ``top_k_renorm_probs`` / ``top_p_renorm_probs``
on every row with no tie at the cutoff; the Triton kernels in this folder must match these
functions: the same kept set, values within 2 ulp, in practice bit-identical):

* Input: float32, float16 or bfloat16 probabilities ``[rows, vocab]``; the output has the input's
  dtype (flashinfer's ``top_k_renorm_probs`` does the same). Every step runs on the entries as
  float32 (exact for the 16-bit types), the output is rounded to its dtype once, at the end (to
  nearest even). Entries ``< 0`` (and ``-0.0``) count as 0. A row holding a NaN or an infinity comes
  back as a row of NaN (no host sync is needed to detect it).
* **top-k**: the pivot is the k-th largest value of the row, counting repeats
  (flashinfer's radix pivot); every entry ``>= pivot`` is kept. ``k`` is clamped to ``[1, vocab]``.
* **top-p**: ``P = p * total`` with ``total`` the row sum (flashinfer's AIR top-p scales by the
  row sum too). The cutoff ``t`` is the largest value whose upper mass ``sum(x[x >= t])`` reaches
  ``P``: walking the values in descending order, the first value at which the inclusive running
  mass is ``>= P``. Every entry ``>= t`` is kept. ``p >= 1`` keeps every positive entry; ``p <= 0``
  keeps the largest value only.
* **min-p**: the cutoff is ``fp32(max(row) * min_p)``; every entry ``>= cutoff`` is kept.
* **top-k + top-p**: top-k renorm, then top-p renorm of its float32 output (SGLang's dense verify
  path calls ``top_k_renorm_prob`` then ``top_p_renorm_prob``), both float32 roundings included (a
  16-bit output is rounded once, after the second). A row with ``k >= vocab`` skips the top-k stage
  (plain top-p: no intermediate renormalisation).
* **Tie rule**: every entry equal to the cutoff value is kept (flashinfer keeps ``x >= pivot``),
  so a tie can keep more than k entries; SGLang's sort-based torch path instead keeps a prefix of
  the tied entries in sort order, which depends on their positions.
* Zero entries are never "kept" (they stay 0). A row whose kept mass is 0 comes back as zeros.
* **Normalisation**: the kept mass ``S`` is summed in float64 (exact to far below float32's
  resolution), ``r = fp32(1 / S)``, and each kept entry is ``fp32(x * r)``: within 1 ulp of the
  exact quotient. flashinfer multiplies by an approximate reciprocal of a float32 sum and SGLang's
  torch path divides by a float32 sum; both land within 2 ulp of these values. A kept mass below
  2^-128 (rows scaled far below a distribution) overflows ``r`` to inf: the kept entries come back
  inf, and top-k + top-p gives a NaN row (its second stage sees the first stage's inf entries); the
  kernels agree.
* All running sums (``total``, upper masses) are float64, so two implementations that add in a
  different order agree on the cutoff except when ``P`` falls within ~1e-16 relative of a
  running mass (a tie at the cutoff, in the wide sense).
"""

from __future__ import annotations

from typing import Union

import torch

Param = Union[int, float, torch.Tensor]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The entries' bit patterns as integers (int32 for float32, int16 for the 16-bit dtypes): for
    bit-for-bit comparisons and ulp distances of outputs in any of the renorms' dtypes."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def row_param(value: Param, rows: int, dtype: torch.dtype, device: torch.device, name: str) -> torch.Tensor:
    """A per-row parameter as a [rows] tensor (a scalar or a 1-element tensor is broadcast)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(-1)
        if t.numel() == 1:
            t = t.expand(rows)
        elif t.numel() != rows:
            raise ValueError(f"{name} has {t.numel()} values for {rows} rows (expected 1 or {rows})")
        return t.to(device=device, dtype=dtype)
    return torch.full((rows,), value, dtype=dtype, device=device)


def prepare_rows(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 rows with negatives as 0, bool [rows] 'row holds a NaN or an infinity')."""
    x = probs.float()
    bad = ~torch.isfinite(x).all(dim=1)
    x = torch.where(x > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x, bad


def renormalize(x: torch.Tensor, keep: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Kept entries times fp32(1 / float64 kept mass); the rest 0; NaN rows stay NaN."""
    keep = keep & (x > 0)
    mass = torch.where(keep, x.double(), torch.zeros((), dtype=torch.float64, device=x.device)).sum(dim=1)
    positive = mass > 0
    r = torch.where(positive, 1.0 / torch.where(positive, mass, torch.ones_like(mass)), torch.zeros_like(mass))
    out = torch.where(keep & positive[:, None], x * r.float()[:, None], torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.where(bad[:, None], torch.full((), float("nan"), dtype=x.dtype, device=x.device), out)


# --- kept sets ------------------------------------------------------------------------------

def top_k_keep(x: torch.Tensor, top_k: Param) -> torch.Tensor:
    rows, vocab = x.shape
    k = row_param(top_k, rows, torch.int64, x.device, "top_k").clamp(1, vocab)
    values = torch.sort(x, dim=1, descending=True).values
    pivot = values.gather(1, (k - 1)[:, None])
    return x >= pivot


def top_p_keep(x: torch.Tensor, top_p: Param) -> torch.Tensor:
    rows, vocab = x.shape
    p = row_param(top_p, rows, torch.float32, x.device, "top_p")
    total = x.double().sum(dim=1)
    target = p.double() * total
    values = torch.sort(x, dim=1, descending=True).values
    running = torch.cumsum(values.double(), dim=1)
    first = torch.searchsorted(running, target[:, None].contiguous(), right=False).clamp(max=vocab - 1)
    cutoff = values.gather(1, first)
    keep_all = (p >= 1.0)[:, None]
    return keep_all | (x >= cutoff)


def min_p_keep(x: torch.Tensor, min_p: Param) -> torch.Tensor:
    rows, _ = x.shape
    mp = row_param(min_p, rows, torch.float32, x.device, "min_p").clamp(0.0, 1.0)
    cutoff = x.max(dim=1).values * mp
    return x >= cutoff[:, None]


# --- renorms (the CPU fallback of tpguard.kernels.renorm) -----------------------------------
# Each computes float32 output values and rounds them to the input's dtype once, at the end.

def _top_k_fp32(probs: torch.Tensor, top_k: Param) -> torch.Tensor:
    x, bad = prepare_rows(probs)
    return renormalize(x, top_k_keep(x, top_k), bad)


def _top_p_fp32(probs: torch.Tensor, top_p: Param) -> torch.Tensor:
    x, bad = prepare_rows(probs)
    return renormalize(x, top_p_keep(x, top_p), bad)


def top_k_renorm_reference(probs: torch.Tensor, top_k: Param) -> torch.Tensor:
    return _top_k_fp32(probs, top_k).to(probs.dtype)


def top_p_renorm_reference(probs: torch.Tensor, top_p: Param) -> torch.Tensor:
    return _top_p_fp32(probs, top_p).to(probs.dtype)


def top_k_top_p_renorm_reference(probs: torch.Tensor, top_k: Param, top_p: Param) -> torch.Tensor:
    """top-k renorm, then top-p renorm of its float32 output; a row with top_k >= vocab skips the
    top-k stage (no renormalisation before top-p), as the kernel does."""
    rows, vocab = probs.shape
    k = row_param(top_k, rows, torch.int64, probs.device, "top_k")
    staged = _top_k_fp32(probs, k)
    skip = (k >= vocab)[:, None]
    return _top_p_fp32(torch.where(skip, probs.float(), staged), top_p).to(probs.dtype)


def min_p_renorm_reference(probs: torch.Tensor, min_p: Param) -> torch.Tensor:
    x, bad = prepare_rows(probs)
    return renormalize(x, min_p_keep(x, min_p), bad).to(probs.dtype)


# --- logits -> target probs (the reference of kernels/target_probs.py) -------------------------

def softmax_weights_reference(logits: torch.Tensor, c: Param) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, bad): the unnormalised softmax ``w = exp2((x - M) * c)`` of float32 logits, M the row max
    and ``c = fp32(log2(e) / T)`` per row (kernels/target_probs.temperature_scale), 0 on bad rows;
    bad: a row holding a NaN or +inf, or no finite entry. The row's largest weight is exactly 1.
    (The kernel's exp2 may differ from torch's in the last bit of a weight.)"""
    x = logits.float()
    rows = x.shape[0]
    scale = row_param(c, rows, torch.float32, x.device, "temperature")
    neg_inf = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    m = torch.where(torch.isnan(x), neg_inf, x).max(dim=1).values if x.shape[1] else neg_inf.expand(rows)
    bad = torch.isnan(x).any(dim=1) | torch.isposinf(x).any(dim=1) | torch.isneginf(m)
    w = torch.exp2((x - m[:, None]) * scale[:, None])
    return torch.where(bad[:, None], torch.zeros((), dtype=x.dtype, device=x.device), w), bad


def joint_renorm_reference(w: torch.Tensor, bad: torch.Tensor, top_k: Param | None = None,
                           top_p: Param | None = None, min_p: Param | None = None) -> torch.Tensor:
    """float32 probabilities from non-negative weights: the entries that pass top-k (ties kept),
    top-p measured within the top-k set (its own weights, no renormalisation between), and min-p
    (``>= fp32(max(w) * min_p)``), renormalised once (`renormalize`); None: that stage off."""
    keep = w > 0
    if top_k is not None:
        keep = keep & top_k_keep(w, top_k)
    if top_p is not None:
        keep = keep & top_p_keep(torch.where(keep, w, torch.zeros((), dtype=w.dtype, device=w.device)), top_p)
    if min_p is not None:
        keep = keep & min_p_keep(w, min_p)
    return renormalize(w, keep, bad)


def target_probs_reference(logits: torch.Tensor, c: Param, top_k: Param | None = None,
                           top_p: Param | None = None, min_p: Param | None = None) -> torch.Tensor:
    """softmax(logits / T) -> top-k, top-p (within the top-k set), min-p, one renormalisation:
    `joint_renorm_reference` of `softmax_weights_reference`. float32 [rows, vocab]."""
    w, bad = softmax_weights_reference(logits, c)
    return joint_renorm_reference(w, bad, top_k, top_p, min_p)


__all__ = [
    "bits",
    "joint_renorm_reference",
    "softmax_weights_reference",
    "target_probs_reference",
    "min_p_renorm_reference",
    "top_k_renorm_reference",
    "top_k_top_p_renorm_reference",
    "top_p_renorm_reference",
]
