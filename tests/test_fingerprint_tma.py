"""The fingerprint's TMA lane launch (tpguard.kernels.fingerprint_tma) vs the numpy reference, bit for
bit, under the Triton interpreter: partial row blocks, column tails, several chunks, 8-byte dtypes,
padded row strides; and which tensors take it (`usable`): the rest fall back to the ldg kernel with
the same result. On a GPU: tests/test_fingerprint.py::test_gpu_kernels_equal_reference."""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit runs: kernels pick it at decoration

import importlib

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton.tools.tensor_descriptor")

ref = importlib.import_module("tpguard.fingerprint")
kfp = importlib.import_module("tpguard.kernels.fingerprint")
if not kfp.INTERPRET:  # imported earlier in this process without the interpreter
    kfp = importlib.reload(kfp)
ftma = importlib.import_module("tpguard.kernels.fingerprint_tma")
if ftma.KernelConfig is not kfp.KernelConfig:
    ftma = importlib.reload(ftma)

# [8, 64] tiles, 1024-word chunks: several chunks and a column tail at a few thousand words (cheap here)
SMALL_TMA = kfp.KernelConfig(block_words=512, chunk_words=1024, lane_tma="on")
ONE_TMA = dataclasses.replace(kfp.SINGLE_TENSOR_CONFIG, lane_tma="on")  # the measured [8, 256] tile


def make(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2 ** 31), 2 ** 31 - 1, shape, generator=g, dtype=dtype)


def takes_tma(t, cfg) -> bool:
    w = kfp._words(t)
    br, bn, _, chunks = kfp._tile(w.rows, w.n_words, cfg)
    return chunks > 1 and ftma.usable(w, br, bn, cfg)


def assert_matches(t, cfg):
    want = ref.fingerprint_rows_reference(t)
    assert torch.equal(kfp.fingerprint_rows_triton(t, config=cfg), want), (tuple(t.shape), t.dtype)
    top = ref.to_unsigned(int(kfp.fingerprint_triton(t, config=cfg)))
    assert top == ref.combine_rows_reference(want, t.dtype, tuple(t.shape)), (tuple(t.shape), t.dtype)


@pytest.mark.parametrize("shape,dtype", [((8, 4096), torch.float32), ((9, 3000), torch.float32),
                                         ((17, 2052), torch.int32), ((5, 1500), torch.float64),
                                         ((64, 1028), torch.float32), ((3, 8, 300), torch.float32)], ids=str)
def test_tma_lanes_equal_reference(shape, dtype):
    t = make(shape, dtype, seed=sum(shape))
    assert takes_tma(t, SMALL_TMA), "this case should read through TMA"
    assert_matches(t, SMALL_TMA)


def test_measured_tile_equals_reference():
    t = make((10, 8192 + 260), seed=1)  # [8, 256] tiles, two chunks, a tail of 4 words, a partial row block
    assert takes_tma(t, ONE_TMA)
    assert_matches(t, ONE_TMA)
    assert_matches(t, dataclasses.replace(ONE_TMA, tma_stages=1, tma_warps=8))


def test_padded_row_stride_takes_tma():
    wide = make((12, 3004), seed=2)  # row stride 3004 words = 12016 bytes, 16-byte aligned
    view = wide[:, :3000]
    assert view.stride(0) == 3004 and takes_tma(view, SMALL_TMA)
    assert_matches(view, SMALL_TMA)
    few = make((3, 3000), seed=8)  # 3 rows: a full [4, 128] tile, the 4th row out of bounds
    assert takes_tma(few, SMALL_TMA)
    assert_matches(few, SMALL_TMA)


def test_what_falls_back_to_the_ldg_kernel():
    odd_stride = make((9, 3001), seed=3)  # 12004-byte rows: not 16-byte aligned
    off_base = make((9 * 3000 + 1,), seed=4)[1:].view(9, 3000)  # base 4 bytes past an aligned address
    half = make((9, 3000), torch.bfloat16, seed=5)  # 2-byte words
    one_row = make((1, 3000), seed=6)  # a [1, 512] tile: wider than a TMA box (256)
    for t in (odd_stride, off_base, half, one_row):
        assert not takes_tma(t, SMALL_TMA), (tuple(t.shape), t.stride(), t.dtype)
        assert_matches(t, SMALL_TMA)  # same result through the ldg kernel
    t = make((9, 3000), seed=7)
    assert takes_tma(t, SMALL_TMA)
    # "auto" reads through TMA on sm_90+ GPUs only, never under the interpreter; "off" never
    assert not takes_tma(t, dataclasses.replace(SMALL_TMA, lane_tma="auto"))
    assert not takes_tma(t, dataclasses.replace(SMALL_TMA, lane_tma="off"))
    assert kfp.SINGLE_TENSOR_CONFIG.lane_tma == "auto" and kfp.DEFAULT_CONFIG.lane_tma == "off"


def test_fingerprint_many_never_takes_tma():
    # its cached plans must not hold the tensors; a TMA descriptor would
    tensors = [make((9, 3000), seed=10), make((64,), torch.int64, seed=15)]
    for many_long in ("table", "rows"):
        plan = kfp.ManyPlan(tensors, config=dataclasses.replace(SMALL_TMA, many_long=many_long))
        assert not any(launch.kernel is ftma._tma_lanes_kernel for launch in plan._kernel_launches)
        assert torch.equal(plan.run(), kfp.fingerprint_many_reference(tensors))


def test_config_rejects_bad_tma_fields():
    with pytest.raises(ValueError, match="lane_tma"):
        kfp.KernelConfig(lane_tma="yes")
    with pytest.raises(ValueError, match="tma_stages"):
        kfp.KernelConfig(tma_stages=0)
