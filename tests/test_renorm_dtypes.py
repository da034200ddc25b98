"""float16 and bfloat16 probabilities through every renorm (top-k, top-p, top-k + top-p, min-p):
the Triton kernels against the torch references (kernels/reference.py), the output in the input's
dtype, the write pass's fingerprint against `tpguard.fingerprint`'s host definition, determinism and
batch invariance. On CPU under the Triton interpreter: small vocabularies, a few rows, the small
block shapes (chunk 256) and the default ones (chunk 4096), vocabularies on and around chunk
boundaries so that full chunks, partial tails and one-chunk rows are all written."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from renorm_setup import DEVICE, GPU_ALL, SMALL, launch_values

from tpguard import fingerprint as fp_host
from tpguard.kernels import reference as ref
from tpguard.kernels.fingerprint_reference import fingerprint_reference
from tpguard.kernels.renorm import min_p_renorm, top_k_renorm, top_k_top_p_renorm, top_p_renorm
from tpguard.kernels.renorm_config import default_config, search_rounds
from tpguard.kernels.renorm_top_k import top_k_renorm_triton, top_k_top_p_renorm_triton
from tpguard.kernels.renorm_top_p import top_p_renorm_triton
from tpguard.kernels.renorm_min_p import min_p_renorm_triton

DEFAULT_CONFIG = default_config()  # the process's config (TPGUARD_RENORM_CONFIG)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN rows

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CONFIGS = {"default": DEFAULT_CONFIG, "small": SMALL}
# (op, triton launcher, reference, parameters)
OPS = {
    "top_k": (top_k_renorm_triton, ref.top_k_renorm_reference, (40,)),
    "top_p": (top_p_renorm_triton, ref.top_p_renorm_reference, (0.9,)),
    "top_k_top_p": (top_k_top_p_renorm_triton, ref.top_k_top_p_renorm_reference, (60, 0.8)),
    "min_p": (min_p_renorm_triton, ref.min_p_renorm_reference, (0.05,)),
}


@pytest.fixture(autouse=True)
def _gpu_subset(request):
    # on a GPU every block shape and dtype is a compile: the default-config cases run there
    if DEVICE == "cuda" and not GPU_ALL and "small" in request.node.name:
        pytest.skip("GPU run: default block shapes only (TPGUARD_RENORM_GPU_TESTS=all runs every test)")


def make_rows(rows: int, vocab: int, kind: str, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = {"flat": 1.0, "peaky": 5.0}[kind]
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale
    return torch.softmax(logits, dim=-1).to(dtype).to(DEVICE)


def special_rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    x = make_rows(7, vocab, "flat", 99, torch.float32).cpu()
    x[0] = 0.0
    x[0, vocab // 3] = 1.0  # one non-zero entry
    x[1] = 1.0 / vocab  # every entry tied
    x[2, : vocab // 2] = 0.0  # half zeros
    x[3, 1] = float("nan")  # NaN row
    x[4] = 0.0  # all zeros
    x[5, ::2] = -x[5, ::2]  # negative entries count as 0
    x[6, 5] = float("inf")  # infinity: NaN row
    return x.to(dtype).to(DEVICE)


def assert_matches(out: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype) -> None:
    """The reference's dtype, NaN rows and kept set, and the same bits (a 2-ulp float32 gap of the
    two implementations' sums would still round to the same 16-bit value almost always: allow 1)."""
    assert out.dtype == dtype and expect.dtype == dtype and out.shape == expect.shape
    nan_out, nan_exp = torch.isnan(out), torch.isnan(expect)
    assert torch.equal(nan_out, nan_exp), "NaN rows differ"
    o = torch.where(nan_out, 0.0, out.float()).cpu().to(dtype)
    e = torch.where(nan_exp, 0.0, expect.float()).cpu().to(dtype)
    diff_keep = (o > 0) != (e > 0)
    assert not diff_keep.any(), f"kept sets differ in rows {diff_keep.any(1).nonzero().flatten().tolist()}"
    gap = (ref.bits(o).long() - ref.bits(e).long()).abs().max().item()
    assert gap <= 1, f"max ulp gap {gap}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cfg, vocab, rows, kind", [
    ("small", 256, 3, "flat"),  # exactly one chunk
    ("small", 257, 2, "peaky"),  # one chunk and a one-entry tail
    ("small", 1500, 3, "flat"),  # 5 full chunks and a tail: the bracket passes
    ("small", 1024, 2, "peaky"),  # 4 full chunks, no tail
    ("default", 100, 3, "flat"),  # a short row: one partial chunk
    ("default", 4097, 2, "flat"),  # one full 4096 chunk and a one-entry tail
])
def test_kernel_matches_reference(dtype, op, cfg, vocab, rows, kind):
    launch, reference, params = OPS[op]
    x = make_rows(rows, vocab, kind, seed=vocab + rows, dtype=dtype)
    out = launch(x, *params, config=CONFIGS[cfg])
    assert_matches(out, reference(x, *params), dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("cfg, vocab", [pytest.param("small", 300, marks=pytest.mark.slow), ("default", 2100)])
def test_special_rows(dtype, cfg, vocab):
    x = special_rows(vocab, dtype)
    c = CONFIGS[cfg]
    for op, (launch, reference, params) in OPS.items():
        assert_matches(launch(x, *params, config=c), reference(x, *params), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])  # float16 has no 2^-140
def test_kept_mass_below_float32_range(dtype):
    """A row of subnormal entries (kept masses below 2^-128: no float32 1 / S) against the reference: top-k, top-p
    and min-p keep their entries as inf; top-k + top-p gives a NaN row (the reference's second stage sees the
    first stage's inf entries), through the one-launch top-k (scalar k, <= fused_rows rows), the three
    launches (`fused_rows=0`) and per-row k (one row with k >= vocab: plain top-p)."""
    x = make_rows(3, 1300, "peaky", seed=5, dtype=torch.float32).cpu()
    # n distinct multiples of the dtype's smallest subnormal, spread over the row's chunks
    n, unit = (200, 2.0 ** -145) if dtype == torch.float32 else (6, 2.0 ** -133)
    x[1] = 0.0
    x[1, torch.randperm(1300, generator=torch.Generator().manual_seed(5))[:n]] = torch.arange(1, n + 1) * unit
    x = x.to(dtype).to(DEVICE)
    assert x[1].double().sum() < 2.0 ** -128 and (x[1] > 0).sum() == n
    k_rows = torch.tensor([40, 40, 1300], dtype=torch.int32, device=DEVICE)
    for cfg in (SMALL, SMALL.replace(fused_rows=0)):
        for launch, reference, params in [*OPS.values(), (top_k_top_p_renorm_triton, ref.top_k_top_p_renorm_reference,
                                                          (k_rows, 0.8))]:
            out = launch(x, *params, config=cfg)
            assert_matches(out, reference(x, *params), dtype)
            if launch is top_k_top_p_renorm_triton:
                assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()
            else:
                assert torch.isinf(out[1]).any() and not torch.isnan(out).any()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_per_row_parameters_and_ties(dtype):
    # bfloat16 has 8 significant bits: ties at the cutoff are everywhere, and every tied entry is kept
    x = make_rows(6, 700, "flat", seed=3, dtype=dtype)
    k = torch.tensor([1, 2, 40, 699, 700, 5], dtype=torch.int32, device=DEVICE)
    p = torch.tensor([1e-6, 0.25, 0.5, 0.9, 1.0, 0.99], device=DEVICE)
    mp = torch.tensor([0.0, 0.01, 0.1, 0.5, 0.9, 1.0], device=DEVICE)
    out_k = top_k_renorm_triton(x, k, config=SMALL)
    assert_matches(out_k, ref.top_k_renorm_reference(x, k), dtype)
    pivot = torch.sort(x.float(), dim=1, descending=True).values.gather(1, (k.long() - 1)[:, None])
    assert torch.equal(out_k > 0, (x.float() >= pivot) & (x > 0))
    assert_matches(top_p_renorm_triton(x, p, config=SMALL), ref.top_p_renorm_reference(x, p), dtype)
    assert_matches(min_p_renorm_triton(x, mp, config=SMALL), ref.min_p_renorm_reference(x, mp), dtype)
    assert_matches(top_k_top_p_renorm_triton(x, k, p, config=SMALL), ref.top_k_top_p_renorm_reference(x, k, p),
                   dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES.values()], ids=["fp32", *DTYPES.keys()])
@pytest.mark.parametrize("backend", ["tpguard", "torch"])
def test_fingerprint_out_is_the_returned_tensors(dtype, backend):
    """`fingerprint_out=` receives fingerprint_tensor(out) of the tensor returned, in its own dtype
    (a 2-byte entry hashed as one zero-extended word): the write pass hashes the stored bits."""
    x = make_rows(3, 700, "flat", seed=4, dtype=dtype)
    for fn, params in ((top_k_renorm, (40,)), (top_p_renorm, (0.9,)), (top_k_top_p_renorm, (60, 0.8)),
                       (min_p_renorm, (0.05,))):
        slot = torch.zeros((), dtype=torch.int64, device=DEVICE)
        out = fn(x, *params, backend=backend, fingerprint_out=slot)
        assert out.dtype == dtype
        assert fp_host.to_unsigned(int(slot)) == fingerprint_reference(out), fn.__name__
        # the same output's fingerprint as float32 differs: the dtype is hashed
        if dtype != torch.float32:
            assert fp_host.to_unsigned(int(slot)) != fp_host.fingerprint_tensor(out.float())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_repeated_calls_and_batch_invariance(dtype):
    rows = make_rows(2, 600, "flat", seed=9, dtype=dtype)
    others = make_rows(3, 600, "peaky", seed=10, dtype=dtype)
    for op, (launch, _, params) in OPS.items():
        def run(b):
            return launch(b, *params, config=SMALL)

        alone = torch.cat([run(rows[i: i + 1]) for i in range(2)])
        for got in (run(rows), run(rows), run(torch.cat([others[:2], rows, others[2:]]))[2:4]):
            assert torch.equal(ref.bits(got), ref.bits(alone)), op


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_one_launch_top_k_same_bits_as_three(dtype):
    # <= fused_rows rows take the one-launch top-k (renorm_top_k_fused.py): the same bits as the three launches
    x = make_rows(4, 700, "flat", seed=12, dtype=dtype)
    three = SMALL.replace(fused_rows=0)
    for params in ((40,), (torch.tensor([3, 700, 40, 1], dtype=torch.int32, device=DEVICE),)):
        assert torch.equal(ref.bits(top_k_renorm_triton(x, *params, config=SMALL)),
                           ref.bits(top_k_renorm_triton(x, *params, config=three)))
    assert torch.equal(ref.bits(top_k_top_p_renorm_triton(x, 40, 0.7, config=SMALL)),
                       ref.bits(top_k_top_p_renorm_triton(x, 40, 0.7, config=three)))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("cfg", ["default", pytest.param("small", marks=pytest.mark.slow)])
def test_short_searches_same_bits(dtype, cfg):
    """RenormConfig.short_searches: the searches whose answer is an entry stop after the rounds that can set
    one of its bits (8 for bfloat16, 10 for float16), top-k's group-max search starts below the row max's
    leading zeros: the same bits as the full searches on every path (the register and streamed searches,
    ties, per-row k with k >= vocab (plain top-p inside the top-k select), NaN and zero rows), and the
    select kernels get the short rounds."""
    import tpguard.kernels.renorm_top_k as tk_mod
    import tpguard.kernels.renorm_top_p as tp_mod

    base = CONFIGS[cfg]
    on, off = base.replace(short_searches=1), base.replace(short_searches=0)
    assert (search_rounds(on, dtype), search_rounds(off, dtype), search_rounds(on, torch.float32)) == \
        ({torch.bfloat16: 8, torch.float16: 10}[dtype], 16, 16)
    vocab = 2100 if cfg == "default" else 1500
    x = torch.cat([special_rows(vocab, dtype), make_rows(2, vocab, "peaky", 21, dtype),
                   make_rows(2, vocab, "flat", 22, dtype)])
    rows = x.shape[0]
    k = torch.tensor([1, 40, vocab, 5, 700, 40, 3, 40, vocab + 9, 17, 2], dtype=torch.int32, device=DEVICE)[:rows]
    p = torch.tensor([0.9, 0.5, 0.99, 0.2, 0.9, 0.95, 1.0, 0.8, 0.6, 0.9, 1e-6], device=DEVICE)[:rows]
    calls = {"top_k": lambda c: top_k_renorm_triton(x, 40, config=c.replace(fused_rows=0)),
             "top_k per row": lambda c: top_k_renorm_triton(x, k, config=c.replace(fused_rows=0)),
             "top_k one launch": lambda c: top_k_renorm_triton(x[7:9], 3, config=c),
             "top_p": lambda c: top_p_renorm_triton(x, 0.9, config=c),
             "top_p per row": lambda c: top_p_renorm_triton(x, p, config=c),
             "top_k_top_p per row": lambda c: top_k_top_p_renorm_triton(x, k, p, config=c)}
    for name, call in calls.items():
        assert torch.equal(ref.bits(call(on)), ref.bits(call(off))), name
    assert_matches(calls["top_k per row"](on), ref.top_k_renorm_reference(x, k), dtype)
    assert_matches(calls["top_p per row"](on), ref.top_p_renorm_reference(x, p), dtype)
    want = search_rounds(on, dtype)
    assert launch_values(tk_mod._top_k_select_kernel, lambda: calls["top_k"](on), "ENTRY_ROUNDS") == [want]
    assert launch_values(tp_mod._top_p_select_kernel, lambda: calls["top_p"](on), "ENTRY_ROUNDS") == [want]
    assert launch_values(tk_mod._top_k_select_kernel, lambda: calls["top_k"](off), "ENTRY_ROUNDS") == [16]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_short_searches_in_bracket_select(dtype):
    """Flat rows at the default block shapes take the bracket passes, and bracket_select's search (its
    sub-bracket bins: a bin of 2**shift patterns, shift >= the entries' zero bits) skips the rounds below
    the entries' last bit: the same bits as the full search and the reference's."""
    from tpguard.kernels.renorm_workspace import shapes_for, workspace_for

    x = make_rows(3, 40000, "flat", seed=71, dtype=dtype)
    p = torch.tensor([0.9, 0.5, 0.95], device=DEVICE)
    outs = []
    for short in (1, 0):
        cfg = DEFAULT_CONFIG.replace(short_searches=short)
        ws = workspace_for(shapes_for(3, 40000, cfg), cfg, x.device, True, True)
        outs.append(top_p_renorm_triton(x, p, config=cfg, workspace=ws))
        plan, m_hi = ws.plan.view(3, 4), ws.mhi.view(3, -1).sum(1)
        n_in = ws.cnt.view(3, -1).sum(1)
        # every row FULL, its cutoff inside a bracket of <= bracket_reg entries (the bins' search) whose
        # bins are wider than the entries' zero bits
        assert (plan[:, 0] == 2).all() and (n_in <= cfg.bracket_reg).all() and (m_hi < ws.target).all()
        span = (plan[:, 2] - 1 - plan[:, 1]).tolist()
        bin_bits = min(s.bit_length() for s in span) - (cfg.bracket_bins.bit_length() - 1)  # radix_select.bin_shift
        assert bin_bits >= 32 - 2 * search_rounds(DEFAULT_CONFIG, dtype)
    assert torch.equal(ref.bits(outs[0]), ref.bits(outs[1]))
    assert_matches(outs[0], ref.top_p_renorm_reference(x, p), dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_public_api_keeps_the_dtype(dtype):
    x = make_rows(3, 500, "peaky", seed=13, dtype=dtype)
    for fn, params in ((top_k_renorm, (7,)), (top_p_renorm, (0.8,)), (top_k_top_p_renorm, (20, 0.8)),
                       (min_p_renorm, (0.1,))):
        a, b = fn(x, *params, backend="tpguard"), fn(x, *params, backend="torch")
        assert a.dtype == b.dtype == dtype
        assert_matches(a, b, dtype)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        top_p_renorm(x.double(), 0.9)


@pytest.mark.skipif(DEVICE != "cuda", reason="the benchmark's shapes on the GPU only (CPU covers the paths with SMALL)")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gpu_bench_shapes(dtype):
    """Every op at vocab 163840 with the default block shapes, flat and peaky rows, per-row parameters:
    the reference's bits, repeat calls and a row alone give the same bits."""
    vocab = 163840
    x = torch.cat([make_rows(2, vocab, "flat", 31, dtype), make_rows(2, vocab, "peaky", 32, dtype)])
    k = torch.tensor([40, vocab, 1, 1024], dtype=torch.int32, device=DEVICE)
    p = torch.tensor([0.9, 0.9, 0.5, 0.95], device=DEVICE)
    runs = {op: (lambda b, launch=launch, params=params: launch(b, *params),
                 lambda b, reference=reference, params=params: reference(b, *params))
            for op, (launch, reference, params) in OPS.items()}
    runs["per_row"] = (lambda b: top_k_top_p_renorm_triton(b, k[: b.shape[0]], p[: b.shape[0]]),
                       lambda b: ref.top_k_top_p_renorm_reference(b, k[: b.shape[0]], p[: b.shape[0]]))
    for name, (op, expect) in runs.items():
        out = op(x)
        assert_matches(out, expect(x), dtype)
        assert torch.equal(ref.bits(op(x)), ref.bits(out)), name
        if name != "per_row":
            assert torch.equal(ref.bits(op(x[2:3])), ref.bits(out[2:3])), name


@triton.jit
def _cast_kernel(src_ptr, dst_ptr, n, TO_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask).to(TO_DTYPE), mask=mask)


def _triton_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    to = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}[dtype]
    _cast_kernel[(triton.cdiv(x.numel(), 8192),)](x, out, x.numel(), TO_DTYPE=to, BLOCK=8192)
    return out


def test_bf16_casts_match_the_gpu_conversions():
    """Every bfloat16 bit pattern to float32 (exact) and float32 patterns around every bfloat16 to
    bfloat16 (round to nearest even), subnormals included, as torch converts them: the kernels' 16-bit
    loads and stores depend on it (under the interpreter: kernels/interpreter_fix.py's cast)."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    b = patterns.view(torch.bfloat16).to(DEVICE)
    up = _triton_cast(b, torch.float32)
    finite = ~torch.isnan(b.float())
    assert torch.equal(ref.bits(up)[finite], ref.bits(b.float())[finite])
    assert torch.isnan(up[~finite]).all()
    # float32 patterns: each bfloat16 pattern shifted up, plus the halfway point and one pattern either side
    base = patterns.to(torch.int32) << 16
    f32 = torch.cat([base, base + 0x7FFF, base + 0x8000, base + 0x8001]).view(torch.float32).to(DEVICE)
    down = _triton_cast(f32, torch.bfloat16)
    finite = ~torch.isnan(f32)
    assert torch.equal(ref.bits(down)[finite], ref.bits(f32.to(torch.bfloat16))[finite])
    assert torch.isnan(down[~finite]).all()
