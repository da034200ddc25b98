"""Shared constants of the renorm kernel test modules: the device, the interpreter, and the small
block shapes that push small vocabularies through every path of the kernels (gather path, bracket
passes, whole-row fallbacks). TRITON_INTERPRET is set (or not) by conftest.py, before any import."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tpguard.config import interpreting
from tpguard.kernels.renorm_config import RenormConfig

INTERPRET = interpreting()
DEVICE = "cuda" if (not INTERPRET and torch.cuda.is_available()) else "cpu"
if DEVICE == "cpu" and not INTERPRET:  # raised while the importing test module is collected: it is skipped
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
# On a GPU every distinct block shape is a Triton compile (~2 s each): the modules run a smoke set
# there unless TPGUARD_RENORM_GPU_TESTS=all.
GPU_ALL = os.environ.get("TPGUARD_RENORM_GPU_TESTS", "").strip().lower() == "all"

SMALL = RenormConfig(chunk=256, sub=256, reg=128, bracket_reg=256, tau_groups=4, min_p_groups=8, list_cap=64,
                     cap_per_chunk=64, select_warps=4, bracket_warps=4, pass_warps=4, compact_sub=128)
# SMALL as TPGUARD_RENORM_CONFIG's text (the fields that differ from the defaults): the public API's config,
# read per call, so that its small vocabularies take every path (several chunks, the bracket passes)
SMALL_TEXT = ",".join(f"{f.name}={getattr(SMALL, f.name)}" for f in dataclasses.fields(SMALL)
                      if getattr(SMALL, f.name) != getattr(RenormConfig(), f.name))


def mixed_batch(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """float32 probabilities on DEVICE whose rows cycle through logits N(0, 1) x 1, x 5 and x 3.5 (flat
    rows take the bracket passes, peaky ones the gather path), with a NaN at row 2 (rows >= 3)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([[1.0], [5.0], [3.5]]).repeat(rows // 3 + 1, 1)[:rows]
    x = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale, -1).float()
    if rows > 2:
        x[2, 7] = float("nan")
    return x.to(DEVICE)


def launch_values(kernel, call, name: str) -> list:
    """The keyword `name` (a constexpr or a launch option) of each launch of `kernel` during `call()`,
    through Triton's launch path (the launches run)."""
    from unittest import mock

    seen = []
    real = kernel.run

    def run(*args, **kwargs):
        seen.append(kwargs.get(name))
        return real(*args, **kwargs)

    with mock.patch.object(kernel, "run", run):
        call()
    return seen
