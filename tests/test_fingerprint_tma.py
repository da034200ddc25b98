"""The fingerprint's TMA lane launch (tpguard.kernels.fingerprint_tma) vs the numpy reference, bit for
bit, under the Triton interpreter: partial row blocks, column tails, several chunks, 8-byte dtypes,
padded row strides; and which tensors take it (`usable`): the rest fall back to the ldg kernel with
the same result. On a GPU: tests/test_fingerprint.py::test_gpu_kernels_equal_reference."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton.tools.tensor_descriptor")

from tpguard.config import interpreting  # noqa: E402
from tpguard.kernels import fingerprint as kfp  # noqa: E402
from tpguard.kernels import fingerprint_reference as ref  # noqa: E402
from tpguard.kernels import fingerprint_tma as ftma  # noqa: E402
from tpguard.kernels.fingerprint_words import _tile, _words  # noqa: E402

# CPU tensors need the interpreter (tests/conftest.py); gpu/check.sh's TRITON_INTERPRET=0 runs skip here
pytestmark = pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET=0: Triton kernels on CPU tensors")

# [8, 64] tiles, 1024-word chunks: several chunks and a column tail at a few thousand words (cheap here)
SMALL_TMA = kfp.KernelConfig(block_words=512, chunk_words=1024, lane_tma="on")
ONE_TMA = dataclasses.replace(kfp.SINGLE_TENSOR_CONFIG, lane_tma="on")  # the measured [8, 256] tile


def make(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2 ** 31), 2 ** 31 - 1, shape, generator=g, dtype=dtype)


def takes_tma(t, cfg) -> bool:
    w = _words(t)
    br, bn = _tile(w.rows, w.n_words, cfg)[:2]
    return ftma.usable(w, br, bn, cfg)


@pytest.fixture
def tma_launches(monkeypatch):
    """Counts the TMA lane launches `_hash_words` makes (both kernels give the same bits: only this
    tells the paths apart)."""
    calls = []
    real = ftma.launch_lanes
    monkeypatch.setattr(ftma, "launch_lanes", lambda *a: (calls.append(a[0].rows), real(*a)))
    return calls


def assert_matches(t, cfg, launches: list, tma: bool):
    """Rows and top fingerprint equal the reference; the lane launches (one per call) went through TMA or not."""
    launches.clear()
    want = ref.fingerprint_rows_reference(t)
    assert torch.equal(kfp.fingerprint_rows_triton(t, config=cfg), want), (tuple(t.shape), t.dtype)
    top = ref.to_unsigned(int(kfp.fingerprint_triton(t, config=cfg)))
    assert top == ref.combine_rows_reference(want, t.dtype, tuple(t.shape)), (tuple(t.shape), t.dtype)
    assert len(launches) == (2 if tma else 0), (tuple(t.shape), t.stride(), t.dtype, launches)


@pytest.mark.parametrize("shape,dtype", [((8, 4096), torch.float32), ((9, 3000), torch.float32),
                                         ((17, 2052), torch.int32), ((5, 1500), torch.float64),
                                         ((64, 1028), torch.float32), ((9, 8, 300), torch.float32)], ids=str)
def test_tma_lanes_equal_reference(shape, dtype, tma_launches):
    t = make(shape, dtype, seed=sum(shape))
    assert takes_tma(t, SMALL_TMA), "this case should read through TMA"
    assert_matches(t, SMALL_TMA, tma_launches, tma=True)


def test_measured_tile_equals_reference(tma_launches):
    t = make((10, 8192 + 260), seed=1)  # [8, 256] tiles, two chunks, a tail of 4 words, a partial row block
    assert_matches(t, ONE_TMA, tma_launches, tma=True)
    assert_matches(t, dataclasses.replace(ONE_TMA, tma_stages=1, tma_warps=8), tma_launches, tma=True)
    assert_matches(make((5, 8200), seed=2), ONE_TMA, tma_launches, tma=True)  # 5 rows: one [8, 256] row block


def test_padded_row_stride_takes_tma(tma_launches):
    wide = make((12, 3004), seed=2)  # row stride 3004 words = 12016 bytes, 16-byte aligned
    view = wide[:, :3000]
    assert view.stride(0) == 3004
    assert_matches(view, SMALL_TMA, tma_launches, tma=True)


@pytest.mark.slow
def test_what_falls_back_to_the_ldg_kernel(tma_launches):
    cases = {
        "12004-byte rows: not 16-byte aligned": make((9, 3001), seed=3),
        "base 4 bytes past an aligned address": make((9 * 3000 + 1,), seed=4)[1:].view(9, 3000),
        "2-byte words": make((9, 3000), torch.bfloat16, seed=5),
        "one row: a [1, 512] tile": make((1, 3000), seed=6),
        "3 rows: a [4, 128] tile": make((3, 3000), seed=7),
        "a broadcast view: row stride 0": make((1, 3000), seed=8).expand(9, 3000),
        "short rows: a tall [128, 4] tile": make((1000, 4), seed=9),
    }
    for why, t in cases.items():
        assert not takes_tma(t, SMALL_TMA), why
        assert_matches(t, SMALL_TMA, tma_launches, tma=False)  # same result through the ldg kernel
    t = make((9, 3000), seed=10)
    assert_matches(t, SMALL_TMA, tma_launches, tma=True)
    # "auto" reads through TMA on sm_90+ GPUs only, never under the interpreter; "off" never
    assert_matches(t, dataclasses.replace(SMALL_TMA, lane_tma="auto"), tma_launches, tma=False)
    assert_matches(t, dataclasses.replace(SMALL_TMA, lane_tma="off"), tma_launches, tma=False)
    assert kfp.SINGLE_TENSOR_CONFIG.lane_tma == "auto" and kfp.default_config().lane_tma == "off"


def test_config_rejects_bad_tma_fields():
    with pytest.raises(ValueError, match="lane_tma"):
        kfp.KernelConfig(lane_tma="yes")
    with pytest.raises(ValueError, match="tma_stages"):
        kfp.KernelConfig(tma_stages=0)
