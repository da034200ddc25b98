"""The fingerprint definition (tpguard.kernels.fingerprint_reference, numpy) and its public API
(tpguard.fingerprint): stability, properties, and
CPU/GPU equality where CUDA exists (the compiled Triton kernels run in a subprocess, outside any
TRITON_INTERPRET=1 that tests/conftest.py sets)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tpguard import fingerprint as fp
from tpguard.kernels import fingerprint_reference as ref

M32, M64 = ref.M32, ref.M64

# Computed once from the definition (tpguard.fp/2) and frozen: a change here changes every
# trace written from then on (a new definition needs a new FORMAT_VERSION).
GOLDEN = {
    "f32_3x4": (lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4),
                "4f85d2c7a0293298", ["a8ca84cda35df955", "da851e7079d3bc62", "aa14822b8860492c"]),
    "i64_10": (lambda: torch.arange(10, dtype=torch.int64),
               "f31078c6ca818c19", ["6da3b2a29923302c", "e132d36ae269f220", "ad97aabd65e68f6e"]),
    "bool_0d": (lambda: torch.tensor(True), "5d7ff7734e184086", ["4c23741fd2226906"]),
    "bf16_2x3": (lambda: torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16),
                 "1c98c7184885550b", ["79fd9d03c2432549", "91df356ff316de84"]),
    "u8_rng16": (lambda: torch.arange(16, dtype=torch.uint8),
                 "dbe023b636ac04f7", ["916f73e6adc611e1", "1fe483db34972e5b", "8d3de0642b60b462"]),
    "f64_2x2x2": (lambda: torch.arange(8, dtype=torch.float64).reshape(2, 2, 2) / 3,
                  "9bf5ca38e6897272", ["00c974080783171a", "2f0c15346a7ba359"]),
    "f32_empty_0x3": (lambda: torch.empty(0, 3, dtype=torch.float32), "745b2846a1ddad06", []),
    "i32_3x0": (lambda: torch.empty(3, 0, dtype=torch.int32),
                "7e85d57cf8bac822", ["6e0016c9a84e77d9"] * 3),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_values(name):
    make, top, rows = GOLDEN[name]
    t = make()
    assert fp.format_fp(fp.fingerprint_tensor(t)) == top
    got_rows = [fp.format_fp(int(v)) for v in fp.fingerprint_rows(t).view(torch.int64)]
    assert got_rows[:3] == rows


# --- an independent pure-Python transcription of the docstring definition ---------------------

def _fmix32(x):
    x ^= x >> 16
    x = (x * ref.FMIX32_A) & M32
    x ^= x >> 13
    x = (x * ref.FMIX32_B) & M32
    return x ^ (x >> 16)


def _fmix64(x):
    x ^= x >> 33
    x = (x * ref.FMIX64_A) & M64
    x ^= x >> 33
    x = (x * ref.FMIX64_B) & M64
    return x ^ (x >> 33)


def _row_hash(words, seed):
    s_lo = seed & M32
    l1 = l2 = 0
    for j, w in enumerate(words):
        h = _fmix32(((w * ref.C1) & M32) ^ ((j * ref.C2 + s_lo) & M32))
        l1 += h
        l2 += h * h
    return _fmix64((l1 & M64) ^ _fmix64((l2 & M64) ^ seed))


def _words(row: torch.Tensor) -> list[int]:
    data = bytes(row.contiguous().view(torch.uint8).reshape(-1).tolist()) if row.numel() else b""
    size = row.element_size()
    step = size if size < 4 else 4
    return [int.from_bytes(data[i:i + step], "little") for i in range(0, len(data), step)]


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5,
    lambda: torch.arange(10, dtype=torch.int64) * -7,
    lambda: torch.tensor(False),
    lambda: torch.linspace(-3, 3, 6).reshape(2, 3).to(torch.float16),
    lambda: torch.arange(5, dtype=torch.int8) - 2,
    lambda: torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(3, 2),
])
def test_reference_follows_the_docstring(make):
    t = make()
    rows = t.shape[0] if t.dim() else 1
    flat = t.reshape(rows, -1)
    seed = ref.row_seed(t.dtype, tuple(t.shape))
    want_rows = [_row_hash(_words(flat[r]), seed) for r in range(rows)]
    top_words = [w for v in want_rows for w in (v & M32, v >> 32)]
    assert [int(v) & M64 for v in ref.fingerprint_rows_reference(t)] == want_rows
    assert fp.fingerprint_tensor(t) == _row_hash(top_words, ref.top_seed(t.dtype, tuple(t.shape)))


# --- properties --------------------------------------------------------------------------------

def test_deterministic_and_typed():
    t = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    assert fp.fingerprint_tensor(t) == fp.fingerprint_tensor(t.clone())
    rows = fp.fingerprint_rows(t)
    assert rows.dtype == torch.uint64 and rows.shape == (5,)
    dev = fp.fingerprint_device(t)
    assert dev.dtype == torch.int64 and dev.dim() == 0
    assert ref.to_unsigned(int(dev)) == fp.fingerprint_tensor(t)
    assert 0 <= fp.fingerprint_tensor(t) < 1 << 64


def test_single_bit_and_permutation_change_the_value():
    t = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    base = fp.fingerprint_tensor(t)
    flipped = t.clone()
    flipped.view(torch.int32)[2, 17] ^= 1  # one ulp
    assert fp.fingerprint_tensor(flipped) != base
    changed = (fp.fingerprint_rows(flipped).view(torch.int64) != fp.fingerprint_rows(t).view(torch.int64))
    assert changed.tolist() == [False, False, True, False]
    swapped = t.clone()
    swapped[1, [3, 9]] = swapped[1, [9, 3]]
    assert fp.fingerprint_tensor(swapped) != base
    assert fp.fingerprint_tensor(t.flip(0)) != base


def test_dtype_and_shape_are_covered():
    t = torch.arange(24, dtype=torch.float32)
    variants = [t, t.view(torch.int32), t.view(4, 6), t.view(6, 4), t.view(2, 12), t.view(4, 6, 1),
                t.view(1, 24), torch.zeros(24, dtype=torch.float32), torch.zeros(24, dtype=torch.int32),
                torch.zeros(0, 4), torch.zeros(4, 0), torch.zeros(0)]
    values = [fp.fingerprint_tensor(v) for v in variants]
    assert len(set(values)) == len(values)


def test_views_hash_their_logical_content():
    t = torch.randn(6, 10, generator=torch.Generator().manual_seed(2))
    for view in (t.t(), t[:, 1:], t[::2], t[:, ::3], t.unsqueeze(1).expand(6, 3, 10)):
        assert fp.fingerprint_tensor(view) == fp.fingerprint_tensor(view.contiguous())


def test_format_and_parse():
    assert fp.format_fp(0) == "0" * 16
    assert fp.format_fp(-1) == "f" * 16
    assert fp.parse_fp(fp.format_fp(0x0123456789ABCDEF)) == 0x0123456789ABCDEF
    assert ref.to_unsigned(ref.to_signed(M64)) == M64
    with pytest.raises(ValueError):
        fp.parse_fp("abc")


def test_fingerprint_many_reference_path():
    tensors = [torch.arange(256, dtype=torch.int32), torch.arange(16, dtype=torch.uint8),
               torch.randn(3, 5), torch.tensor(2.5), torch.empty(0, 3)]
    got = fp.fingerprint_many(tensors)
    assert got.dtype == torch.int64 and got.shape == (5,)
    assert [ref.to_unsigned(int(v)) for v in got] == [fp.fingerprint_tensor(t) for t in tensors]
    assert fp.fingerprint_many([]).shape == (0,)
    with pytest.raises(TypeError, match="torch.Tensor"):
        fp.fingerprint_many([torch.zeros(2), "x"])


# --- GPU: the compiled Triton kernels equal the reference ----------------------------------

GPU_CHECK = textwrap.dedent("""
    import torch
    from tpguard import fingerprint as fp
    from tpguard.config import interpreting
    from tpguard.kernels import direct_launch as dl
    from tpguard.kernels import fingerprint as k
    from tpguard.kernels import fingerprint_reference as ref
    assert k.available() and not interpreting()
    g = torch.Generator().manual_seed(0)

    def make(shape, dtype):
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) > 0.5
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype)
        return torch.randint(-1000, 1000, shape, generator=g).to(dtype)

    def same(t_cpu, config=None):
        t = t_cpu.cuda()
        rows = k.fingerprint_rows_triton(t, config=config).cpu()
        want = ref.fingerprint_rows_reference(t_cpu)
        assert torch.equal(rows, want), (t.shape, t.dtype, "rows")
        top = ref.to_unsigned(int(k.fingerprint_triton(t, config=config).item()))
        assert top == fp.fingerprint_tensor(t_cpu) == fp.fingerprint_tensor(t), (t.shape, t.dtype, "top")

    small = k.KernelConfig(block_words=256, chunk_words=1024, finalize_rows=16)
    dtypes = [torch.bool, torch.int8, torch.uint8, torch.bfloat16, torch.float16, torch.float32,
              torch.int32, torch.int64, torch.float64]
    if hasattr(torch, "float8_e4m3fn"):
        dtypes.append(torch.float8_e4m3fn)
    shapes = [(), (1,), (7,), (3, 5), (2, 3, 11), (0,), (0, 4), (4, 0), (5, 37), (3, 2049),
              (64, 5000), (2000,), (1, 40000)]
    for dtype in dtypes:
        for shape in shapes:
            same(make(shape, dtype))
    for cfg in (small, k.KernelConfig(shifts=0), k.KernelConfig(shifts=k.SHIFT_ALL), k.KernelConfig(shifts=2),
                k.KernelConfig(block_words=2048, rows_per_tile=1, chunk_words=16384),
                k.KernelConfig(block_words=4096, rows_per_tile=4, num_warps=4, chunk_words=2048),
                k.KernelConfig(block_words=16384, num_warps=16, chunk_words=8192)):
        same(make((9, 7000), torch.float32), cfg)
        same(make((40, 300), torch.bfloat16), cfg)
        same(make((3000,), torch.int64), cfg)
    base = make((20, 3000), torch.float32)
    for view in (base[:, 1:], base[::3], base.t(), base[:, ::2], base[2:5, 10:2050],
                 base.view(20, 30, 100).permute(1, 0, 2), base[0].expand(4, 3000), base[:, 0]):
        same(view)
    same(make((256, 163840), torch.float32))

    # the TMA lane launch (kernels/fingerprint_tma.py): the one-tensor default on sm_90+; other tiles forced.
    # Tensors are made on the GPU (a CPU view's .cuda() is a dense copy: the padded stride would be lost), and
    # the TMA launches are counted (both paths give the same bits).
    import dataclasses
    from tpguard.kernels import fingerprint_tma as ft
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    one = k.SINGLE_TENSOR_CONFIG
    tma_calls = []
    real_launch = ft.launch_lanes
    ft.launch_lanes = lambda *a: (tma_calls.append(1), real_launch(*a))

    def same_on_gpu(t, config, tma):
        tma_calls.clear()
        want = ref.fingerprint_rows_reference(t.cpu())
        assert torch.equal(k.fingerprint_rows_triton(t, config=config).cpu(), want), (t.shape, t.stride(), "rows")
        top = ref.to_unsigned(int(k.fingerprint_triton(t, config=config).item()))
        assert top == ref.combine_rows_reference(want, t.dtype, tuple(t.shape)), (t.shape, t.stride(), "top")
        assert bool(tma_calls) == tma, (t.shape, t.stride(), config, len(tma_calls))

    same_on_gpu(make((256, 163840), torch.float32).cuda(), one, hopper)
    if hopper:
        wide = make((12, 3004), torch.float32).cuda()
        for cfg in (dataclasses.replace(one, lane_tma="on", tma_stages=2, tma_warps=8),
                    k.KernelConfig(block_words=512, chunk_words=1024, lane_tma="on")):
            for t in (make((9, 20000), torch.float32), make((64, 12288), torch.int32),
                      make((17, 3000), torch.float64), make((8, 8196), torch.float32)):
                same_on_gpu(t.cuda(), cfg, True)
            assert wide[:, :3000].stride(0) == 3004
            same_on_gpu(wide[:, :3000], cfg, True)
        for t in (make((9, 3001), torch.float32).cuda(), make((1, 20000), torch.float32).cuda().expand(9, 20000),
                  make((3, 20000), torch.float32).cuda(), make((9, 20000), torch.bfloat16).cuda()):
            same_on_gpu(t, one, False)  # not TMA layouts or tiles: the ldg kernel
    ft.launch_lanes = real_launch

    # fingerprint_many: kernels == reference, fixed launch count
    tensors = [make((256,), torch.int32), make((256,), torch.int64), make((32, 8), torch.int32),
               torch.randint(0, 255, (16,), dtype=torch.uint8), make((3, 5000), torch.float32),
               make((3, 5000), torch.float32)[:, 1:], make((4, 6), torch.float32).t(),
               torch.tensor(1.5), torch.empty(0, 3), make((5, 77), torch.bfloat16)]
    cuda = [t.cuda() for t in tensors]
    assert torch.equal(k.fingerprint_many_triton(cuda).cpu(), ref.fingerprint_many_reference(tensors))
    assert torch.equal(fp.fingerprint_many(cuda).cpu(), ref.fingerprint_many_reference(tensors))
    assert k.ManyPlan(cuda).launches <= 3 + 1 + 1  # 3 long classes, finish, 1 copy
    # the guard's "decisions" set (tpguard.bench.guard.make_tensors): short rows of 4 word sizes
    decisions = [torch.randint(0, 255, (16,), dtype=torch.uint8), make((64,), torch.int64),
                 make((64, 4), torch.int64), make((64, 4), torch.float32),
                 make((64, 4), torch.int32), make((64,), torch.int32), make((3, 5), torch.bool)]
    assert torch.equal(k.fingerprint_many_triton([t.cuda() for t in decisions]).cpu(),
                       ref.fingerprint_many_reference(decisions))

    # long-row variants, in-place outputs with a bumped counter, direct (recorded) launches
    # (+ many one-word rows, and a bf16 view 2 bytes off alignment: long rows, unaligned path)
    extra = tensors + [make((5000, 4), torch.int32), make((3, 1500), torch.bfloat16)[:, 1:]]
    extra_cuda = [t.cuda() for t in extra]
    for cfg in (k.KernelConfig(many_long="rows"), k.KernelConfig(many_long="table", maxnreg=128),
                k.KernelConfig(block_words=8192, num_warps=8, many_long="rows"),
                k.KernelConfig(chunk_words=2048, rows_per_tile=4), k.KernelConfig(shifts=3, many_long="rows"),
                k.KernelConfig(block_words=2048, maxnreg=None, chunk_words=16384)):
        assert torch.equal(k.fingerprint_many_triton(cuda, config=cfg).cpu(),
                           ref.fingerprint_many_reference(tensors)), cfg
        assert torch.equal(k.fingerprint_many_triton(extra_cuda, config=cfg).cpu(),
                           ref.fingerprint_many_reference(extra)), cfg
    plan = k.ManyPlan(cuda, out_index=[2 * i + 1 for i in range(len(cuda))], bump_index=0)
    vec = torch.zeros(2 * len(cuda) + 1, dtype=torch.int64, device="cuda")
    for step in range(4):  # the second run() sets up direct launches, the later ones use them
        cuda[0].add_(1)
        plan.run(out=vec)
        want = ref.fingerprint_many_reference([t.cpu() for t in cuda])
        assert torch.equal(vec[1::2].cpu(), want) and int(vec[0]) == step + 1, (step, plan.fast_launch)
    print("direct launches:", plan.fast_launch, dl.FAILURES or "")

    # CUDA graphs: capture single (through TMA on sm_90+) and many launchers, change data in place, replay
    x = make((64, 20000), torch.float32).cuda()
    small_set = [t.cuda() for t in tensors[:4]]
    k.fingerprint_triton(x); k.fingerprint_many_triton(small_set)  # warm-up outside capture
    k.fingerprint_many_triton(small_set)  # second run: direct launches set up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one = k.fingerprint_triton(x)
        many = k.fingerprint_many_triton(small_set)
    for step in range(3):
        x.add_(1.0)
        small_set[0].add_(1)
        graph.replay()
        torch.cuda.synchronize()
        assert ref.to_unsigned(int(one.item())) == fp.fingerprint_tensor(x.cpu()), step
        assert torch.equal(many.cpu(), ref.fingerprint_many_reference([t.cpu() for t in small_set])), step
    print("GPU OK")
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernels_equal_reference():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", GPU_CHECK], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and "GPU OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
