"""Emulation of flashinfer's non-deterministic multi-CTA renorm kernels (CPU or GPU, torch).

flashinfer 0.7.2.post1's default ``top_p_renorm_probs`` (AIR radix, rows > 2048 entries) and
``top_k_renorm_probs`` (multi-CTA radix) split a row over several thread blocks; each block sums
its share of the kept mass in float32 and adds it to one float32 with ``atomicAdd``, in whatever
order the blocks arrive, then multiplies by the reciprocal. Float addition is not associative,
so two calls on the same bytes (or two TP ranks) can differ in the last bits.

This module keeps that shape faithfully: the kept set is the reference's (kernels/reference.py:
same cutoffs, same tie rule), the row is cut into chunks of ``chunk`` entries, each chunk's
kept mass is a float32 sum, and the partial sums are added in float32 in a fresh random order
on every call, from an unseeded source (``os.urandom``), so calls and ranks disagree the way the
real kernels do. Same signatures as the references; the TP harness uses it for
``--renorm emulated-atomic``.
"""

from __future__ import annotations

import os

import torch

from tpguard.kernels.reference import (
    Param,
    min_p_keep,
    prepare_rows,
    row_param,
    top_k_keep,
    top_p_keep,
)

DEFAULT_CHUNK = 1024  # most entries per emulated thread block
MIN_BLOCKS = 8  # a row is cut into at least this many blocks: two partial sums always commute


def _fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))


def atomic_order_sum(values: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """float32 [rows]: per-chunk float32 sums of a [rows, vocab] float32 tensor, added in float32
    in a random order per row (a new order on every call). Chunks hold at most ``chunk`` entries
    and a row has at least MIN_BLOCKS of them (fewer for rows shorter than that)."""
    rows, vocab = values.shape
    chunk = max(1, min(chunk, -(-vocab // MIN_BLOCKS)))
    n = max(1, -(-vocab // chunk))
    padded = torch.nn.functional.pad(values, (0, n * chunk - vocab)) if n * chunk != vocab else values
    partials = padded.reshape(rows, n, chunk).sum(dim=2)
    order = torch.argsort(torch.rand(rows, n, generator=_fresh_generator()), dim=1).to(values.device)
    shuffled = partials.gather(1, order)
    acc = torch.zeros(rows, dtype=torch.float32, device=values.device)
    for i in range(n):  # one atomicAdd per block, in arrival order
        acc = acc + shuffled[:, i]
    return acc


def _renormalize_atomic(x: torch.Tensor, keep: torch.Tensor, bad: torch.Tensor, chunk: int) -> torch.Tensor:
    keep = keep & (x > 0)
    kept = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    total = atomic_order_sum(kept, chunk)
    scale = 1.0 / torch.clamp(total, min=1e-8)  # flashinfer: rcp(max(sum, 1e-8)), then a multiply
    out = kept * scale[:, None]
    return torch.where(bad[:, None], torch.full((), float("nan"), dtype=x.dtype, device=x.device), out)


def top_k_renorm_emulated_atomic(probs: torch.Tensor, top_k: Param, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    x, bad = prepare_rows(probs)
    return _renormalize_atomic(x, top_k_keep(x, top_k), bad, chunk)


def top_p_renorm_emulated_atomic(probs: torch.Tensor, top_p: Param, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    x, bad = prepare_rows(probs)
    return _renormalize_atomic(x, top_p_keep(x, top_p), bad, chunk)


def top_k_top_p_renorm_emulated_atomic(probs: torch.Tensor, top_k: Param, top_p: Param,
                                       chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Two emulated calls, as SGLang makes them (top-k, then top-p on its output)."""
    rows, _ = probs.shape
    k = row_param(top_k, rows, torch.int64, probs.device, "top_k")
    return top_p_renorm_emulated_atomic(top_k_renorm_emulated_atomic(probs, k, chunk), top_p, chunk)


def min_p_renorm_emulated_atomic(probs: torch.Tensor, min_p: Param, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    x, bad = prepare_rows(probs)
    return _renormalize_atomic(x, min_p_keep(x, min_p), bad, chunk)


# Names matching the references, for harness lookups by operation.
top_k_renorm = top_k_renorm_emulated_atomic
top_p_renorm = top_p_renorm_emulated_atomic
top_k_top_p_renorm = top_k_top_p_renorm_emulated_atomic
min_p_renorm = min_p_renorm_emulated_atomic

__all__ = [
    "atomic_order_sum",
    "min_p_renorm_emulated_atomic",
    "top_k_renorm_emulated_atomic",
    "top_k_top_p_renorm_emulated_atomic",
    "top_p_renorm_emulated_atomic",
]
