"""Triton fingerprint kernels (tpguard.kernels.fingerprint) vs the numpy reference, bit for bit,
on CPU tensors under the Triton interpreter: dtypes, shapes, row lengths around the tile size,
chunked rows, strided views, fingerprint_many, and the hash's properties."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from tpguard import fingerprint as fp  # noqa: E402
from tpguard.config import interpreting  # noqa: E402
from tpguard.kernels import direct_launch as dl  # noqa: E402
from tpguard.kernels import fingerprint as kfp  # noqa: E402
from tpguard.kernels import fingerprint_reference as ref  # noqa: E402

# CPU tensors need the interpreter (tests/conftest.py); gpu/check.sh's TRITON_INTERPRET=0 runs skip here
pytestmark = pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET=0: Triton kernels on CPU tensors")

# Small tiles so that rows of a few thousand words span several chunks (cheap under the interpreter).
CHUNKY = kfp.KernelConfig(block_words=256, chunk_words=1024, num_warps=4, finalize_rows=16)

DTYPES = [torch.bool, torch.int8, torch.uint8, torch.bfloat16, torch.float16, torch.float32,
          torch.int32, torch.int64, torch.float64]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def top_value(t, config=None) -> int:
    out = kfp.fingerprint_triton(t, config=config)
    assert out.dtype == torch.int64 and out.dim() == 0 and out.device == t.device
    return ref.to_unsigned(int(out))


def assert_matches(t, config=None):
    want = ref.fingerprint_rows_reference(t)
    rows = kfp.fingerprint_rows_triton(t, config=config)
    assert rows.dtype == torch.int64 and rows.shape == want.shape
    assert torch.equal(rows, want), f"row fingerprints differ: {tuple(t.shape)} {t.dtype}"
    assert top_value(t, config) == ref.combine_rows_reference(want, t.dtype, tuple(t.shape)), \
        f"fingerprint differs: {tuple(t.shape)} {t.dtype}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_shapes(dtype):
    for shape in [(), (1,), (7,), (3, 5), (2, 3, 11), (0,), (0, 4), (4, 0), (5, 37)]:
        assert_matches(make(shape, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.int8], ids=str)
def test_row_lengths_around_the_tile(dtype):
    # default tile: 2048 words; lengths below, at and past it, and not multiples of it
    for n in [1, 3, 5, 1000, 2047, 2048, 2049, 5000]:
        assert_matches(make((2, n), dtype, seed=n))


def test_row_counts():
    for rows in [0, 1, 2, 17, 63, 64]:
        assert_matches(make((rows, 100), torch.float32, seed=rows))
        assert_matches(make((rows, 3), torch.int64, seed=rows))  # short rows share a tile
    assert_matches(make((2000,), torch.int32))  # > finalize_rows: top hash as a second pass


@pytest.mark.parametrize("shape,dtype", [((5, 3000), torch.float32), ((3, 1024), torch.float32),
                                         ((3, 1025), torch.float32), ((2, 2500), torch.int64),
                                         ((4, 2100), torch.bfloat16), ((40, 3), torch.float32),
                                         ((300,), torch.int64)], ids=str)
def test_chunked_rows_and_many_rows(shape, dtype):
    assert_matches(make(shape, dtype), CHUNKY)


def test_strided_views():
    base = make((20, 300), torch.float32)
    views = [base[:, 1:], base[::3], base.t(), base[:, ::2], base[2:5, 10:250],
             base.view(20, 30, 10).permute(1, 0, 2), base[0].expand(4, 300), base[:, 0],
             base[3], base.unsqueeze(1), base.double()[:, 3:], base.to(torch.bfloat16)[1:, 5:]]
    for view in views:
        assert_matches(view)
    assert top_value(base.t()) == top_value(base.t().contiguous())
    assert_matches(base[:, 7:], CHUNKY)


def test_configs_agree():
    """Tiling and code shape never change the result (integer sums are order-independent)."""
    x = make((3, 2500), torch.float32)
    y = make((300,), torch.int16)
    want = (top_value(x), top_value(y))
    for cfg in [kfp.KernelConfig(shifts=0), kfp.KernelConfig(shifts=kfp.SHIFT_ALL), kfp.KernelConfig(shifts=2),
                kfp.KernelConfig(shifts=1), CHUNKY,
                kfp.KernelConfig(block_words=128, chunk_words=1024, num_warps=2, finalize_rows=4, shifts=3)]:
        assert (top_value(x, cfg), top_value(y, cfg)) == want


def test_one_ulp_permutation_dtype_and_shape_change_the_value():
    x = make((4, 1000), torch.float32)
    base_rows = kfp.fingerprint_rows_triton(x)
    base = top_value(x)

    bumped = x.clone()
    bumped[2, 517] = torch.nextafter(bumped[2, 517], torch.tensor(float("inf")))
    assert top_value(bumped) != base
    assert (kfp.fingerprint_rows_triton(bumped) != base_rows).tolist() == [False, False, True, False]

    swapped = x.clone()
    swapped[1, [3, 900]] = swapped[1, [900, 3]]
    assert top_value(swapped) != base
    assert top_value(x.flip(0)) != base
    assert torch.equal(kfp.fingerprint_rows_triton(x.flip(0)), base_rows.flip(0))

    h = make((3, 50), torch.bfloat16)
    h2 = h.clone()
    h2.view(torch.int16)[0, 0] ^= 1
    assert top_value(h2) != top_value(h)

    t = torch.arange(24, dtype=torch.float32)
    reinterpretations = [t, t.view(torch.int32), t.view(4, 6), t.view(6, 4), t.view(2, 12),
                         t.view(4, 6, 1), t.view(1, 24), torch.zeros(24), torch.zeros(24, dtype=torch.int32),
                         torch.zeros(0, 4), torch.zeros(4, 0), torch.zeros(0)]
    values = [top_value(v) for v in reinterpretations]
    assert len(set(values)) == len(values)


def guard_like_set():
    return [make((256,), torch.int32, 1), make((256,), torch.int64, 2), make((32, 8), torch.int32, 3),
            torch.randint(0, 256, (16,), dtype=torch.uint8),  # rng state
            make((3, 5000), torch.float32, 4),  # long rows, 16-byte aligned
            make((3, 5001), torch.float32, 5)[:, 1:],  # long rows, unaligned
            make((6, 4), torch.float32, 6).t(),  # rows not contiguous: copied by the plan
            torch.tensor(1.5), torch.empty(0, 3), make((5, 77), torch.bfloat16, 7),
            make((9,), torch.bool, 8), make((2, 100), torch.int8, 9)]


def test_fingerprint_many():
    tensors = guard_like_set()
    want = ref.fingerprint_many_reference(tensors)
    got = kfp.fingerprint_many_triton(tensors)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert [top_value(t) for t in tensors] == [ref.to_unsigned(int(v)) for v in want]
    plan = kfp.ManyPlan(tensors)
    # lane launches for long rows: fp32 aligned, fp32 / bf16 / int8 unaligned; one finish launch
    # (their finalize + all the small tensors, read whole); one copy (the transposed one)
    assert plan.launches == 4 + 1 + 1
    # A plan (and the cached one) is reused for new data at the same addresses.
    tensors[0].add_(1)
    tensors[6].mul_(2)  # the copied one
    want = ref.fingerprint_many_reference(tensors)
    assert torch.equal(plan.run(), want)
    assert torch.equal(kfp.fingerprint_many_triton(tensors), want)


def test_fingerprint_many_chunked():
    tensors = [make((2, 2500), torch.float32), make((2, 2501), torch.float32)[:, 1:],
               make((3, 700), torch.bfloat16), make((40,), torch.int64), make((20, 3), torch.int32)]
    assert torch.equal(kfp.fingerprint_many_triton(tensors, config=CHUNKY),
                       ref.fingerprint_many_reference(tensors))


def test_fingerprint_many_small_set_is_one_launch():
    tensors = guard_like_set()[:4] + [torch.empty(0, 3), torch.tensor(7, dtype=torch.int64)]
    plan = kfp.ManyPlan(tensors)
    assert plan.launches == 1  # each small tensor finished by one program: no finalize launch
    out = torch.empty(6, dtype=torch.int64)
    assert plan.run(out=out) is out
    assert torch.equal(out, ref.fingerprint_many_reference(tensors))


def test_fingerprint_many_writes_in_place_and_bumps():
    """The guard's use: values straight into its vector at given slots, plus its step counter."""
    tensors = guard_like_set()[:3] + [make((2, 300), torch.float32, 11)]
    want = ref.fingerprint_many_reference(tensors)
    vec = torch.full((12,), 5, dtype=torch.int64)
    for bump in (0, None):
        for k in range(2):
            fp.fingerprint_many(tensors, out=vec, out_index=[3, 9, 4, 7], bump_index=bump)
        assert vec[[3, 9, 4, 7]].tolist() == want.tolist() and vec[0] == 7 and vec[1] == 5
    only_long = torch.zeros(3, dtype=torch.int64)  # no small tensor: the bump still happens
    fp.fingerprint_many([tensors[3]], out=only_long, out_index=[2], bump_index=0)
    assert only_long.tolist() == [1, 0, want[3]]
    # many one-word rows (too many for one program) and long rows one launch per tensor
    tensors += [make((5000, 4), torch.int32, 12), make((3, 1500), torch.bfloat16, 13)[:, 1:]]
    cfg = kfp.KernelConfig(block_words=256, chunk_words=1024, many_long="rows", maxnreg=128)
    plan = kfp.ManyPlan(tensors, cfg)
    assert plan.launches == 1 + 2 + 1  # short lanes, 2 long tensors, finish
    assert torch.equal(plan.run(), ref.fingerprint_many_reference(tensors))
    assert plan.fast_launch == "off"  # interpreter: Triton's own launch


def test_bad_input_gets_clear_errors():
    with pytest.raises(TypeError, match="torch.Tensor"):
        kfp.fingerprint_triton([1, 2, 3])
    with pytest.raises(ValueError, match="dense"):
        kfp.fingerprint_rows_triton(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match="no tensors"):
        kfp.ManyPlan([])
    plan = kfp.ManyPlan([torch.zeros(4, 3).t()], keep_tensors=False)
    with pytest.raises(ValueError, match="pass the tensors"):
        plan.run()
    assert kfp.fingerprint_many_triton([]).shape == (0,)
    plan = kfp.ManyPlan([torch.arange(6)])
    for bad in (torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)):
        with pytest.raises(ValueError, match="out must be"):
            plan.run(out=bad)


# --- what the compiler may do and the interpreter normally does not ---------------------------

@pytest.fixture
def compiler_freedoms(monkeypatch):
    """Make the interpreter take two liberties that compiled Triton takes: `tl.reshape(...,
    can_reorder=True)` may put elements anywhere (on sm_90 it mixed the rows of a [4, 8] tile:
    the first GPU run's mismatch), and a masked load without `other` leaves masked lanes undefined.
    Here: reordered reshapes reverse the element order, and such lanes read 0xA5 bytes."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None or not hasattr(builder, "create_reshape") \
            or not hasattr(builder, "create_masked_load"):
        pytest.skip("this Triton's interpreter has no patchable reshape/masked load")
    plain_reshape = builder.create_reshape
    plain_load = builder.create_masked_load

    def reshape(self, arg, shape, allow_reorder):
        if allow_reorder:
            return handle(np.ascontiguousarray(arg.data.reshape(-1)[::-1]).reshape(shape), arg.dtype.scalar)
        return plain_reshape(self, arg, shape, allow_reorder)

    def masked_load(self, ptrs, mask, other, *args):
        if other is None:
            dtype_tt = ptrs.get_element_ty()
            garbage = np.zeros(ptrs.data.shape, dtype=interpreter._get_np_dtype(dtype_tt))
            garbage.reshape(-1).view(np.uint8)[:] = 0xA5
            other = handle(garbage, dtype_tt)
        return plain_load(self, ptrs, mask, other, *args)

    monkeypatch.setattr(builder, "create_reshape", reshape)
    monkeypatch.setattr(builder, "create_masked_load", masked_load)


@pytest.mark.slow
def test_kernels_take_no_liberties(compiler_freedoms):
    """Multi-row tiles (short rows, long rows side by side) with reordering reshapes and undefined
    masked lanes: still the reference, so nothing depends on what the interpreter happens to do."""
    for dtype in (torch.bool, torch.uint8, torch.bfloat16, torch.float32, torch.int64):
        for shape in [(3, 5), (7,), (4, 33), (3, 1500)]:
            assert_matches(make(shape, dtype), CHUNKY)
    assert_matches(make((5, 3000), torch.float32))
    tensors = guard_like_set()
    assert torch.equal(kfp.fingerprint_many_triton(tensors), ref.fingerprint_many_reference(tensors))
    decisions = [make((256,), torch.int32, 1), make((256,), torch.int64, 2),
                 make((32, 8), torch.int32, 3), torch.randint(0, 256, (16,), dtype=torch.uint8)]
    assert torch.equal(kfp.fingerprint_many_triton(decisions), ref.fingerprint_many_reference(decisions))


def test_direct_launch_falls_back_to_triton_launch():
    """The recorded-launcher fast path needs compiled Triton; here (interpreter) recording fails
    and the launch stays Triton's own, with the same result."""
    tensors = [make((4, 3), torch.int32, 1)]
    plan = kfp.ManyPlan(tensors)
    out = torch.zeros(1, dtype=torch.int64)
    launch = plan._kernel_launches[0]
    launch.normal(out)
    assert not dl.prepare_out_launches([launch], out, lambda: True) and not launch.ready
    launch(out, fast=True)
    assert torch.equal(out, ref.fingerprint_many_reference(tensors))


def test_plan_made_under_inference_mode_runs_outside_it():
    """A plan built inside torch.inference_mode() (SGLang runs its forward there) and run outside it:
    its scratch (the copy of a non-contiguous tensor) is an ordinary tensor, so the copy works."""
    tensors = [make((6, 4), torch.float32, 6).t(), make((3, 5000), torch.float32, 4)]
    with torch.inference_mode():
        plan = kfp.ManyPlan(tensors, CHUNKY)
        assert torch.equal(plan.run(), ref.fingerprint_many_reference(tensors))
    assert torch.equal(plan.run(), ref.fingerprint_many_reference(tensors))
