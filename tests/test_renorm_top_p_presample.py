"""The one-read top-p variant (kernels/renorm_top_p_presample.py, RenormConfig.top_p_presample=1)
against the torch reference and the default pipeline (the same bits: every search is exact), on
every path of its resolve: the sample bracket holding the cutoff, below it (the tau groups, then the
groups above hi), above it and overflowed (the whole row); special rows, per-row p, 16-bit input,
the fingerprint slot, determinism and batch invariance. CPU under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from renorm_setup import DEVICE, GPU_ALL, SMALL

from tpguard import fingerprint as fp_host
from tpguard.kernels import reference as ref
from tpguard.kernels.renorm_config import default_config
from tpguard.kernels.renorm_workspace import shapes_for, workspace_for
from tpguard.kernels.renorm_top_p import top_p_renorm_triton

DEFAULT_CONFIG = default_config()  # the process's config (TPGUARD_RENORM_CONFIG)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
PRE = SMALL.replace(top_p_presample=1)
VARIANTS = {  # config of the variant, and the default pipeline's
    "small": (PRE, SMALL),
    "miss": (PRE.replace(z=0.0, bracket_hi_samples=0), SMALL.replace(z=0.0, bracket_hi_samples=0)),
    "overflow": (PRE.replace(cap_per_chunk=2, list_cap=16), SMALL.replace(cap_per_chunk=2, list_cap=16)),
    "streaming": (PRE.replace(sub=32, reg=16, bracket_reg=16), SMALL.replace(sub=32, reg=16, bracket_reg=16)),
    "no_bins": (PRE.replace(bracket_bins=0, bracket_copy=0), SMALL.replace(bracket_bins=0, bracket_copy=0)),
    "default": (DEFAULT_CONFIG.replace(top_p_presample=1), DEFAULT_CONFIG),
}


@pytest.fixture(autouse=True)
def _gpu_subset(request):
    if DEVICE == "cuda" and not GPU_ALL and "default" not in request.node.name:
        pytest.skip("GPU run: default block shapes only (TPGUARD_RENORM_GPU_TESTS=all runs every test)")


def make_rows(rows: int, vocab: int, scale: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale, -1).to(dtype).to(DEVICE)


def run(x, p, cfg):
    """(output, workspace) of one call."""
    ws = workspace_for(shapes_for(x.shape[0], x.shape[1], cfg), cfg, x.device, True, True)
    return top_p_renorm_triton(x, p, config=cfg, workspace=ws), ws


def assert_same(out, default, expect):
    assert torch.equal(torch.isnan(out), torch.isnan(expect))
    assert torch.equal(torch.nan_to_num(out) > 0, torch.nan_to_num(expect) > 0), "kept sets differ"
    assert torch.equal(ref.bits(out), ref.bits(default)), "not the default pipeline's bits"


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v in ("miss", "overflow", "streaming")
                                     else v for v in VARIANTS])
def test_same_bits_as_the_default_pipeline(variant):
    pre, base = VARIANTS[variant]
    vocab = 5000 if variant == "default" else 1500
    x = torch.cat([make_rows(2, vocab, 1.0, seed=1), make_rows(1, vocab, 3.0, seed=2), make_rows(1, vocab, 6.0, seed=3)])
    p = torch.tensor([0.9, 0.4, 0.9, 0.6], device=DEVICE)
    out, ws = run(x, p, pre)
    assert_same(out, top_p_renorm_triton(x, p, config=base), ref.top_p_renorm_reference(x, p))
    assert (ws.plan[:, 0] == 2).all()  # every p < 1 row takes the bracket


@pytest.mark.slow
def test_every_resolve_path_is_taken():
    x = torch.cat([make_rows(2, 1500, 1.0, seed=4), make_rows(2, 1500, 8.0, seed=5)])
    paths = set()
    for name, p in (("small", 0.9), ("miss", 0.9), ("miss", 0.3), ("overflow", 0.9)):
        pre, base = VARIANTS[name]
        out, ws = run(x, p, pre)
        assert_same(out, top_p_renorm_triton(x, p, config=base), ref.top_p_renorm_reference(x, p))
        rows = x.shape[0]
        total = ws.chunk_sum.view(rows, -1).sum(1)
        target = p * total
        m_hi = ws.mhi.view(rows, -1).sum(1)
        overflow = ws.cnt.view(rows, -1).max(1).values > ws.cap
        for r in range(rows):
            if overflow[r]:
                paths.add("overflow")
            elif m_hi[r] >= target[r]:
                paths.add("below")  # bracket below the cutoff: the tau groups
            else:
                kept_in = bool((out[r] > 0).sum() > 0)
                paths.add("hit" if ws.cnt.view(rows, -1)[r].sum() > 0 and kept_in else "other")
    assert {"hit", "below", "overflow"} <= paths


@pytest.mark.slow
def test_special_rows_per_row_p_and_16_bit():
    x = make_rows(7, 700, 2.0, seed=6).cpu()
    x[0] = 0.0
    x[0, 5] = 1.0
    x[1] = 1.0 / 700
    x[2, :350] = 0.0
    x[3, 1] = float("nan")
    x[4] = 0.0
    x[5, ::2] = -x[5, ::2]
    x[6, 3] = float("inf")
    x = x.to(DEVICE)
    p = torch.tensor([0.5, 0.5, 1e-6, 0.9, 0.9, 0.99, 0.9], device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for q in (p, 0.7, 1.0):
            out, _ = run(xd, q, PRE)
            assert out.dtype == dtype
            assert_same(out, top_p_renorm_triton(xd, q, config=SMALL), ref.top_p_renorm_reference(xd, q))


def test_fingerprint_determinism_and_batch_invariance():
    x = make_rows(3, 900, 1.5, seed=7)
    slot = torch.zeros((), dtype=torch.int64, device=DEVICE)
    out = top_p_renorm_triton(x, 0.8, config=PRE, fingerprint_out=slot)
    assert fp_host.to_unsigned(int(slot)) == fp_host.fingerprint_tensor(out.cpu())
    assert torch.equal(ref.bits(top_p_renorm_triton(x, 0.8, config=PRE)), ref.bits(out))
    assert torch.equal(ref.bits(top_p_renorm_triton(x[1:2], 0.8, config=PRE)), ref.bits(out[1:2]))
    with pytest.raises(ValueError, match="bracket_chunk"):
        top_p_renorm_triton(x, 0.8, config=PRE.replace(bracket_chunk=128))
