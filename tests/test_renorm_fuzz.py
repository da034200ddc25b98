"""Randomised cases of the four renorms and of the fused logits -> target probs op through their public
surfaces. Renorms against the torch reference (kernels/reference.py): flashinfer's names for top-k and
top-p (kernels/flashinfer_api.py), tpguard's for top-k + top-p and min-p (kernels/renorm.py,
``validate=False`` so out-of-range values reach the kernels' clamps). A case mixes row kinds in one batch
(flat, peaky, exact ties, sparse, one-hot, all-zero, subnormal, negative, unnormalised, mass below
2^-128, NaN / inf), takes scalar or per-row parameters (out of range too), and checks: the reference's
NaN rows, kept set and values (within 1 ulp); the same bits from repeat calls (on a GPU: Triton's launch,
the recording, the direct launches and the plan graphs of kernels/renorm_plan.py); the same bits for a
slice of its rows called alone; a fingerprint slot that holds the output's fingerprint. The fused op
(kernels/target_probs.py): logits rows of other kinds (peaky, ties, masked, all masked, NaN, +inf, 1e30,
constant), temperatures, top-k, top-p and min-p per row or scalar, against the reference's renorm of the
kernel's own weights, bit for bit, and the same repeat, slice and fingerprint checks.

CPU (Triton interpreter): a few cases at small vocabularies (the renorms with the default and the small
block shapes, renorm_setup.SMALL). GPU: ``TPGUARD_FUZZ_CASES`` cases (default 48, split over GPU_BLOCKS
tests) of each at LLM vocabularies and odd ones, 1-300 rows."""

from __future__ import annotations

import os
import random

import pytest
import torch
from renorm_setup import DEVICE, SMALL_TEXT

from tpguard import fingerprint as fp_host
from tpguard.kernels import flashinfer_api as fa
from tpguard.kernels import reference as ref
from tpguard.kernels import renorm
from tpguard.kernels import target_probs as tp
from tpguard.kernels.fingerprint_reference import fingerprint_reference

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN rows

ON_GPU = DEVICE == "cuda"
KINDS = ("flat", "peaky", "ties", "sparse", "onehot", "zeros", "subnormal", "negative", "scaled", "tiny", "bad")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OPS = ("top_k", "top_p", "top_k_top_p", "min_p")
VOCABS = (1, 7, 4097, 32000, 50257, 128256, 151936, 163840, 262144) if ON_GPU else (1, 33, 300, 1500, 4097)
ROWS = (1, 2, 3, 5, 8, 9, 17, 64, 65, 130, 256, 300) if ON_GPU else (1, 2, 3, 5, 9)
GPU_CASES = int(os.environ.get("TPGUARD_FUZZ_CASES", "48"))


def make_row(kind: str, vocab: int, g: torch.Generator) -> torch.Tensor:
    """One float32 row of `kind` (module doc)."""
    if kind in ("flat", "peaky", "subnormal", "negative", "scaled", "tiny", "bad"):
        scale = 5.0 if kind == "peaky" else 1.0
        x = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * scale, 0).float()
        if kind == "subnormal":  # a third of the entries float32 subnormals (zeros or subnormals in 16 bits)
            x = torch.where(torch.rand(vocab, generator=g) < 0.3, x * 1e-38, x)
        elif kind == "negative":
            flip = torch.rand(vocab, generator=g) < 0.3
            x = torch.where(flip, -x, x)
            x[torch.randint(vocab, (1,), generator=g)] = -0.0
        elif kind == "scaled":
            x = x * 1000.0  # an unnormalised row: top-p measures p of its own sum
        elif kind == "tiny":  # a row mass below 2^-128: no float32 1 / S (kept entries inf; top-k + top-p NaN)
            x = x * 2.0 ** -130
        elif kind == "bad":
            x[torch.randint(vocab, (1,), generator=g)] = float("nan") if torch.rand(1, generator=g) < 0.5 \
                else float("inf")
        return x
    if kind == "ties":  # few distinct values: ties at every cutoff
        x = torch.randint(1, 4, (vocab,), generator=g).float()
        return x / x.sum()
    x = torch.zeros(vocab)
    if kind == "sparse":
        n = int(torch.randint(1, 11, (1,), generator=g))
        x[torch.randint(vocab, (n,), generator=g)] = torch.rand(n, generator=g) + 0.01
    elif kind == "onehot":
        x[torch.randint(vocab, (1,), generator=g)] = 1.0
    return x


def make_case(seed: int, vocabs=VOCABS, rows_choice=ROWS) -> dict:
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    vocab, rows = rnd.choice(vocabs), rnd.choice(rows_choice)
    dtype, op = rnd.choice(DTYPES), rnd.choice(OPS)
    kinds = [rnd.choice(KINDS) for _ in range(rows)]
    x = torch.stack([make_row(kind, vocab, g) for kind in kinds]).to(dtype).to(DEVICE)
    per_row = rnd.random() < 0.4
    if per_row:  # flashinfer-style tensors, values out of range included (the kernels clamp)
        k = torch.tensor([rnd.choice((-3, 0, 1, 2, 40, vocab - 1, vocab, vocab + 5, rnd.randint(1, vocab)))
                          for _ in range(rows)], dtype=torch.int64, device=DEVICE)
        p = torch.tensor([rnd.choice((-0.5, 0.0, 1e-7, 0.3, 0.9, 0.999999, 1.0, 1.5)) for _ in range(rows)],
                         dtype=torch.float64, device=DEVICE)
    else:
        k = max(1, rnd.choice((1, 2, 7, 40, 1000, vocab - 1, vocab, vocab + 3)))
        p = rnd.choice((0.0, 1e-7, 0.3, 0.5, 0.9, 0.95, 0.999999, 1.0))
    min_p = p.clamp(0.0, 1.0) if per_row else min(max(p, 0.0), 1.0)
    return dict(seed=seed, vocab=vocab, rows=rows, dtype=dtype, op=op, kinds=kinds, x=x, k=k, p=p, min_p=min_p,
                fingerprint=rnd.random() < 0.3)


def call(case: dict, x: torch.Tensor, rows: slice, slot=None) -> torch.Tensor:
    """The case's op on `x` (rows `rows` of the case) through its public surface."""
    def sel(v):
        return v[rows] if isinstance(v, torch.Tensor) else v

    op, k, p = case["op"], sel(case["k"]), sel(case["p"])
    if op == "top_k":
        return fa.top_k_renorm_probs(x, k, fingerprint_out=slot)
    if op == "top_p":
        return fa.top_p_renorm_probs(x, p, fingerprint_out=slot)
    if op == "top_k_top_p":  # (tpguard's API refuses a scalar p <= 0 whatever `validate` says)
        return renorm.top_k_top_p_renorm(x, k, p.float() if isinstance(p, torch.Tensor) else max(p, 1e-7),
                                         backend="tpguard", validate=False, fingerprint_out=slot)
    mp = sel(case["min_p"])
    return renorm.min_p_renorm(x, mp.float() if isinstance(mp, torch.Tensor) else mp, backend="tpguard",
                               validate=False, fingerprint_out=slot)


def expected(case: dict) -> torch.Tensor:
    x, op = case["x"].cpu(), case["op"]
    k = case["k"].cpu().clamp(1, case["vocab"]) if isinstance(case["k"], torch.Tensor) else case["k"]
    p = case["p"].cpu().float() if isinstance(case["p"], torch.Tensor) else case["p"]
    if op == "top_k":
        return ref.top_k_renorm_reference(x, k)
    if op == "top_p":
        return ref.top_p_renorm_reference(x, p)
    if op == "top_k_top_p":
        return ref.top_k_top_p_renorm_reference(x, k, p if isinstance(p, torch.Tensor) else max(p, 1e-7))
    mp = case["min_p"].cpu().float() if isinstance(case["min_p"], torch.Tensor) else case["min_p"]
    return ref.min_p_renorm_reference(x, mp)


def describe(case: dict) -> str:
    params = {name: (case[name].tolist() if isinstance(case[name], torch.Tensor) else case[name])
              for name in ("k", "p")}
    return (f"seed {case['seed']}: {case['op']} {case['dtype']} {case['rows']} x {case['vocab']} "
            f"kinds {case['kinds']} {params}")


def check_case(case: dict) -> None:
    what = describe(case)
    x, rows, dtype = case["x"], case["rows"], case["dtype"]
    slot = torch.zeros((), dtype=torch.int64, device=DEVICE) if case["fingerprint"] else None
    out = call(case, x, slice(None), slot)
    expect = expected(case)
    assert out.dtype == dtype and out.shape == x.shape, what
    nan_out, nan_exp = torch.isnan(out.cpu()), torch.isnan(expect)
    assert torch.equal(nan_out, nan_exp), f"NaN rows differ: {what}"
    o = torch.where(nan_out, 0.0, out.cpu().float()).to(dtype)
    e = torch.where(nan_exp, 0.0, expect.float()).to(dtype)
    differ = ((o > 0) != (e > 0)).any(1).nonzero().flatten().tolist()
    assert not differ, f"kept sets differ in rows {differ}: {what}"
    gap = (ref.bits(o).long() - ref.bits(e).long()).abs().max().item()
    assert gap <= 1, f"max ulp gap {gap}: {what}"
    if slot is not None:
        assert fp_host.to_unsigned(int(slot)) == fingerprint_reference(out), f"fingerprint slot: {what}"
    for _ in range(3):  # on a GPU: the recording, then the direct launches (and the plan graphs)
        assert torch.equal(ref.bits(call(case, x, slice(None))), ref.bits(out)), f"a repeat call differs: {what}"
    a = random.Random(case["seed"]).randrange(rows)
    b = min(rows, a + 1 + rows // 3)
    part = call(case, x[a:b], slice(a, b))
    assert torch.equal(ref.bits(part), ref.bits(out[a:b])), f"rows {a}:{b} alone differ: {what}"


@pytest.mark.parametrize("cfg", ["default", "small"])
@pytest.mark.parametrize("seed", range(4))
def test_random_cases_small_vocab(cfg, seed, monkeypatch):
    """Under the interpreter (and on a GPU): small vocabularies, both block shapes."""
    if cfg == "small":
        monkeypatch.setenv("TPGUARD_RENORM_CONFIG", SMALL_TEXT)
    else:
        monkeypatch.delenv("TPGUARD_RENORM_CONFIG", raising=False)
    renorm.clear_plans()
    try:
        check_case(make_case(1000 * (cfg == "small") + seed, vocabs=(1, 33, 300, 1500, 4097),
                             rows_choice=(1, 2, 3, 5, 9)))
    finally:
        renorm.clear_plans()


GPU_BLOCKS = 8  # the GPU cases in 8 tests, so pytest-xdist spreads their compiles and runs over workers


def check_gpu_cases(check, make, block: int) -> None:
    """`check(make(seed))` for this block's share of the GPU_CASES seeds (seed % GPU_BLOCKS == block);
    every failing case named in one assertion."""
    seeds = range(block, GPU_CASES, GPU_BLOCKS)
    failures = []
    for seed in seeds:
        try:
            check(make(seed))
        except AssertionError as e:
            failures.append(str(e).splitlines()[0][:400])
    assert not failures, f"{len(failures)} of {len(seeds)} cases failed:\n" + "\n".join(failures)


@pytest.mark.skipif(not ON_GPU, reason="LLM vocabularies on the GPU only (the interpreter covers the paths above)")
@pytest.mark.parametrize("block", range(GPU_BLOCKS))
def test_random_cases_gpu(block):
    check_gpu_cases(check_case, make_case, block)


LOGIT_KINDS = ("normal", "peaky", "ties", "masked", "all_masked", "nan", "posinf", "huge", "constant")


def make_logit_row(kind: str, vocab: int, g: torch.Generator) -> torch.Tensor:
    """One float32 logits row of `kind`: N(0, 1) (x 6 for peaky), rounded (ties), some or all -inf,
    a NaN or +inf (NaN rows), |x| ~ 1e30, every entry equal."""
    x = torch.randn(vocab, generator=g) * (6.0 if kind == "peaky" else 1.0)
    if kind == "ties":
        x = torch.round(x * 2)
    elif kind == "masked":
        x = torch.where(torch.rand(vocab, generator=g) < 0.5, float("-inf"), x)
    elif kind == "all_masked":
        x = torch.full((vocab,), float("-inf"))
    elif kind in ("nan", "posinf"):
        x[torch.randint(vocab, (1,), generator=g)] = float("nan") if kind == "nan" else float("inf")
    elif kind == "huge":
        x = x * 1e30
    elif kind == "constant":
        x = torch.full((vocab,), 3.0)
    return x


def make_fused_case(seed: int, vocabs, rows_choice) -> dict:
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    vocab, rows, dtype = rnd.choice(vocabs), rnd.choice(rows_choice), rnd.choice(DTYPES)
    kinds = [rnd.choice(LOGIT_KINDS) for _ in range(rows)]
    x = torch.stack([make_logit_row(kind, vocab, g) for kind in kinds]).to(dtype).to(DEVICE)

    def per_row(values, dtype):
        return torch.tensor([rnd.choice(values) for _ in range(rows)], dtype=dtype, device=DEVICE)

    if rnd.random() < 0.5:  # one value per row, out of range included (the kernels clamp)
        t = per_row((0.05, 0.5, 1.0, 1.7), torch.float32)
        k = per_row((-2, 1, 5, 40, vocab, vocab + 9), torch.int64)
        p = per_row((-0.1, 1e-6, 0.5, 0.9, 1.0, 2.0), torch.float32)
        mp = per_row((0.0, 0.01, 0.3, 1.0), torch.float32)
    else:
        t = rnd.choice((0.05, 0.7, 1.0, 2.5))
        k = rnd.choice((None, 1, 20, max(1, vocab - 1), vocab + 1))  # (a scalar k < 1 is refused)
        p = rnd.choice((None, 1e-6, 0.8, 0.95, 1.0))
        mp = rnd.choice((None, 0.0, 0.05, 0.5))
    return dict(seed=seed, vocab=vocab, rows=rows, dtype=dtype, kinds=kinds, x=x, t=t, k=k, p=p, mp=mp,
                fingerprint=rnd.random() < 0.3)


def check_fused_case(case: dict) -> None:
    """The public target_probs (Triton) bit for bit the reference's renorm of the kernel's own weights
    (exp2's last bit is the one thing that differs between implementations: tests/test_target_probs.py),
    NaN rows included; then repeat calls, a row slice alone and the fingerprint slot, bit for bit."""
    params = {n: (case[n].tolist() if isinstance(case[n], torch.Tensor) else case[n]) for n in ("t", "k", "p", "mp")}
    what = f"seed {case['seed']}: {case['dtype']} {case['rows']} x {case['vocab']} kinds {case['kinds']} {params}"
    x, rows = case["x"], case["rows"]

    def sel(v, r):
        return v[r] if isinstance(v, torch.Tensor) else v

    def cpu(v):
        return v.cpu() if isinstance(v, torch.Tensor) else v

    def call(r=slice(None), slot=None):
        return tp.target_probs(x[r], sel(case["t"], r), sel(case["k"], r), sel(case["p"], r), sel(case["mp"], r),
                               backend="tpguard", validate=False, fingerprint_out=slot)

    slot = torch.zeros((), dtype=torch.int64, device=DEVICE) if case["fingerprint"] else None
    out = call(slot=slot)
    assert out.dtype == torch.float32 and out.shape == x.shape, what
    k = case["k"].clamp(1, case["vocab"]) if isinstance(case["k"], torch.Tensor) else case["k"]
    p = case["p"].clamp(0.0, 1.0) if isinstance(case["p"], torch.Tensor) else case["p"]
    w = tp.softmax_weights_triton(x, case["t"]).cpu()
    _, bad = ref.softmax_weights_reference(x.cpu(), tp.temperature_scale(cpu(case["t"]), rows, "cpu"))
    expect = ref.joint_renorm_reference(w, bad, cpu(k), cpu(p), cpu(case["mp"]))
    assert torch.equal(torch.isnan(out.cpu()), torch.isnan(expect)), f"NaN rows differ: {what}"
    assert torch.equal(ref.bits(torch.nan_to_num(out.cpu())), ref.bits(torch.nan_to_num(expect))), \
        f"not the reference's renorm of the kernel's weights: {what}"
    if slot is not None:
        assert fp_host.to_unsigned(int(slot)) == fingerprint_reference(out), f"fingerprint slot: {what}"
    for _ in range(3):
        assert torch.equal(ref.bits(call()), ref.bits(out)), f"a repeat call differs: {what}"
    a = random.Random(case["seed"]).randrange(rows)
    r = slice(a, min(rows, a + 1 + rows // 3))
    assert torch.equal(ref.bits(call(r)), ref.bits(out[r])), f"rows {r} alone differ: {what}"


@pytest.mark.parametrize("seed", range(4))
def test_fused_target_probs_random_cases(seed):
    renorm.clear_plans()
    try:
        check_fused_case(make_fused_case(seed, vocabs=(1, 33, 300, 1500, 4097), rows_choice=(1, 2, 3, 5, 9)))
    finally:
        renorm.clear_plans()


@pytest.mark.skipif(not ON_GPU, reason="LLM vocabularies on the GPU only (the interpreter covers the paths above)")
@pytest.mark.parametrize("block", range(GPU_BLOCKS))
def test_fused_target_probs_random_cases_gpu(block):
    check_gpu_cases(check_fused_case, lambda seed: make_fused_case(seed, VOCABS, ROWS), block)
