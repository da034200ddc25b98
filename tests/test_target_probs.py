"""The fused logits -> target_probs kernel (kernels/target_probs.py) against its torch reference
(kernels/reference.py: softmax_weights_reference, joint_renorm_reference, target_probs_reference),
against SGLang's composition (softmax, top-k renorm, top-p renorm, min-p) and against sglang
0.5.23's own `build_speculative_verify_target_probs` (its replacement, hooks/sglang_renorm.py).

exp2 is the one operation whose last bit differs between implementations, so: the kernel's weights
are within 2 ulp of the reference's, and its output is bit for bit the reference's renorm of the
kernel's own weights; end to end, the kept sets are the reference's and the values within a few
ulp. Under the Triton interpreter on CPU: small vocabularies, a few rows, both block shapes.

The public `target_probs` goes through the call plans (kernels/renorm_plan.py, `tp.PLAN_OP`): the
plan-free call's bits (``TPGUARD_RENORM_PLANS=0``), a plan per parameter kind, the plans' limits, no
torch work in the launches a plan records; on a GPU the recorded direct launches and plan graphs."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from renorm_setup import DEVICE, GPU_ALL, INTERPRET, SMALL, SMALL_TEXT

from tpguard import fingerprint as fp_host
from tpguard.config import launch_trim
from tpguard.kernels import direct_launch as dl
from tpguard.kernels import reference as ref
from tpguard.kernels import renorm_graph
from tpguard.kernels import renorm_plan as rp
from tpguard.kernels import target_probs as tp
from tpguard.kernels.renorm_config import default_config

DEFAULT_CONFIG = default_config()  # the process's config (TPGUARD_RENORM_CONFIG)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
CONFIGS = {"default": DEFAULT_CONFIG, "small": SMALL}


@pytest.fixture(autouse=True)
def _gpu_subset(request):
    if DEVICE == "cuda" and not GPU_ALL and "small" in request.node.name:
        pytest.skip("GPU run: default block shapes only (TPGUARD_RENORM_GPU_TESTS=all runs every test)")


def make_logits(rows: int, vocab: int, scale: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(dtype).to(DEVICE)


def on_device(v):
    return v.to(DEVICE) if isinstance(v, torch.Tensor) else v


def kernel_args(rows, top_k, top_p, min_p):
    """The launcher's parameters (int32 k tensors, float32 p tensors on the device)."""
    k = top_k.to(DEVICE, torch.int32) if isinstance(top_k, torch.Tensor) else top_k
    return k, on_device(top_p), on_device(min_p)


def ulp_gap(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((ref.bits(a).long() - ref.bits(b).long()).abs().max()) if a.numel() else 0


# exp2's last bit: numpy's (the interpreter) and torch's CPU exp2 agree within 2 ulp; the GPU's
# ex2.approx is looser, so a cutoff sitting between two weights that moved may keep one entry more or less
W_ULPS = 2 if DEVICE == "cpu" else 8


def assert_near_reference(out: torch.Tensor, expect: torch.Tensor) -> None:
    """End to end against the reference: the same kept sets on CPU (values within 4 ulp); on a GPU at
    most 2 entries per row on the other side of a cutoff and the kept values within 1e-5."""
    diff = (out > 0) != (expect > 0)
    if DEVICE == "cpu":
        assert not diff.any() and ulp_gap(out, expect) <= 4
        return
    assert int(diff.sum(1).max()) <= 2
    both = (out > 0) & (expect > 0) & ~diff.any(1, keepdim=True)
    torch.testing.assert_close(out[both], expect[both], rtol=1e-5, atol=0)


PARAMS = {
    "softmax": (None, None, None),
    "top_k": (40, None, None),
    "top_p": (None, 0.9, None),
    "top_k_top_p": (40, 0.8, None),
    "min_p": (None, None, 0.05),
    "all": (60, 0.9, 0.02),
    "top_p_min_p": (None, 0.95, 0.2),  # min-p decides some rows, top-p others
    "per_row": (torch.tensor([3, 10**6, 40, 7]), torch.tensor([0.9, 0.5, 1.0, 0.3]), torch.tensor([0.0, 0.1, 0.01, 0.5])),
}


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("cfg, vocab, dtype", [
    ("small", 1500, torch.float32), ("small", 257, torch.bfloat16), ("default", 4097, torch.float16),
])
def test_kernel_is_the_references_renorm_of_its_weights(params, cfg, vocab, dtype):
    rows = 4
    logits = make_logits(rows, vocab, 3.0, seed=vocab, dtype=dtype)
    logits[3, 5] = float("-inf")
    top_k, top_p, min_p = PARAMS[params]
    t = on_device(torch.tensor([0.7, 1.0, 1.3, 0.5]))
    c = tp.temperature_scale(t, rows, logits.device)  # the reference's; the kernel computes c from t
    w = tp.softmax_weights_triton(logits, t, config=CONFIGS[cfg])
    w_ref, bad = ref.softmax_weights_reference(logits, c)
    assert ulp_gap(w, w_ref) <= W_ULPS
    out = tp.target_probs_triton(logits, t, *kernel_args(rows, top_k, top_p, min_p), config=CONFIGS[cfg])
    assert out.dtype == torch.float32
    assert torch.equal(ref.bits(out), ref.bits(ref.joint_renorm_reference(w, bad, top_k, top_p, min_p)))
    assert_near_reference(out, ref.target_probs_reference(logits, c, top_k, top_p, min_p))


@pytest.mark.slow
def test_special_rows():
    vocab = 300
    x = make_logits(6, vocab, 2.0, seed=1).cpu()
    x[0, 7] = float("nan")  # NaN row
    x[1, 3] = float("inf")  # +inf: NaN row
    x[2] = float("-inf")  # nothing finite: NaN row
    x[3, ::2] = float("-inf")  # masked tokens: weight 0
    x[4] = torch.round(x[4])  # ties everywhere, ties at the cutoffs kept
    x[5] = 0.0  # every entry tied
    x = x.to(DEVICE)
    c = tp.temperature_scale(1.0, 6, x.device)
    for top_k, top_p, min_p in PARAMS.values():
        if isinstance(top_k, torch.Tensor):
            top_k, top_p, min_p = torch.tensor([3, 10**6, 40, 7, 5, 2]), torch.tensor([0.9, 0.5, 1.0, 0.3, 0.6, 0.5]), \
                torch.tensor([0.0, 0.1, 0.01, 0.5, 0.3, 1.0])
        out = tp.target_probs_triton(x, 1.0, *kernel_args(6, top_k, top_p, min_p), config=SMALL)
        w = tp.softmax_weights_triton(x, 1.0, config=SMALL)
        _, bad = ref.softmax_weights_reference(x, c)
        expect = ref.joint_renorm_reference(w, bad, top_k, top_p, min_p)
        assert torch.equal(torch.isnan(out), torch.isnan(expect)) and torch.isnan(out[:3]).all()
        assert torch.equal(ref.bits(torch.nan_to_num(out)), ref.bits(torch.nan_to_num(expect)))
        assert (out[3, ::2] == 0).all() and (out[5] > 0).all()  # a row of ties: every entry kept by any stage


def test_equals_sglangs_composition_up_to_rounding():
    """softmax(logits / T) -> top_k_renorm -> top_p_renorm -> min-p (SGLang's order) keeps the same
    entries; the values differ by the extra roundings of the intermediate renormalisations."""
    rows, vocab = 5, 2000
    logits = make_logits(rows, vocab, 3.0, seed=7)
    temperature = torch.tensor([0.6, 0.8, 1.0, 1.2, 2.0])
    k, p, mp = torch.tensor([5, 50, 2000, 300, 1]), torch.tensor([0.9, 0.5, 0.95, 1.0, 0.7]), 0.03
    out = tp.target_probs(logits, on_device(temperature), on_device(k), on_device(p), mp, backend="tpguard")
    probs = torch.softmax(logits.double() / on_device(temperature)[:, None].double(), dim=-1).float()
    staged = ref.min_p_renorm_reference(ref.top_p_renorm_reference(ref.top_k_renorm_reference(probs, k), p), mp)
    if DEVICE == "cpu":
        assert torch.equal(out > 0, staged > 0)
        torch.testing.assert_close(out, staged, rtol=2e-6, atol=1e-9)
    else:
        assert_near_reference(out, staged)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_min_p_decides_where_top_p_keeps_everything(cfg):
    """top-p off (None, or p >= 1) and min-p on rows whose mass below min-p's cutoff is lost in float64
    (1 + 0.61 + 298 x 8.8e-27): min-p's kept set, as the reference, not every positive entry."""
    logits = torch.full((3, 300), -60.0)
    logits[:, 5], logits[:, 9] = 0.0, -0.5  # weights 1 and 0.61: kept by min-p 0.5
    logits = logits.to(DEVICE)
    c = tp.temperature_scale(1.0, 3, "cpu")
    for top_p in (None, 1.0, torch.tensor([1.0, 1.5, 1.0])):
        for top_k in (None, 300):
            out = tp.target_probs_triton(logits, 1.0, *kernel_args(3, top_k, top_p, 0.5), config=CONFIGS[cfg]).cpu()
            assert (out > 0).nonzero()[:, 1].tolist() == [5, 9] * 3, (top_p, top_k)
            assert torch.equal(out > 0, ref.target_probs_reference(logits.cpu(), c, top_k, top_p, 0.5) > 0)


@pytest.mark.slow
def test_repeated_calls_batch_invariance_and_fingerprint():
    logits = make_logits(5, 700, 2.0, seed=3, dtype=torch.bfloat16)
    c = tp.temperature_scale(0.9, 5, logits.device)
    run = lambda x, **kw: tp.target_probs_triton(x, 0.9, 30, 0.9, 0.01, config=SMALL, **kw)
    first = run(logits)
    assert torch.equal(ref.bits(run(logits)), ref.bits(first))
    assert torch.equal(ref.bits(run(logits[2:4])), ref.bits(first[2:4]))
    assert torch.equal(ref.bits(run(torch.cat([logits[4:], logits[:2]]))[1:]), ref.bits(first[:2]))
    slot = torch.zeros((), dtype=torch.int64, device=DEVICE)
    out = run(logits, fingerprint_out=slot)
    assert torch.equal(ref.bits(out), ref.bits(first)) and fp_host.to_unsigned(int(slot)) == fp_host.fingerprint_tensor(out.cpu())
    assert c == tp.temperature_scale(torch.tensor(0.9), 1, logits.device).item()


@triton.jit
def _scale_kernel(t_ptr, c_ptr, n, t_val, HAS_T_ARR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    if HAS_T_ARR:
        c = tp.scale_of_temperature(tl.load(t_ptr + offs, mask=inside, other=1.0))
    else:
        c = tp.scale_of_temperature(t_val) + tl.zeros([BLOCK], tl.float32)
    tl.store(c_ptr + offs, c, mask=inside)


@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39 -> float32 inf
def test_kernel_scale_is_temperature_scale():
    """The stats kernel computes c = fp32(log2(e) / fp64(T)) from each row's temperature (no host-side
    tensor ops per call): bit for bit `temperature_scale`'s value (the reference's), for temperature
    tensors and scalars, over twelve decades and at the edges."""
    g = torch.Generator().manual_seed(11)
    t = torch.cat([torch.exp(torch.empty(4000).uniform_(-14.0, 14.0, generator=g)),
                   torch.tensor([0.5, 0.7, 0.8, 0.9, 1.0, 1.3, 2.0, 3.0, 1e-30, 3e38, float("inf"), 0.0])]).float()
    c = torch.empty_like(t, device=DEVICE)
    _scale_kernel[(1,)](t.to(DEVICE), c, t.numel(), 1.0, HAS_T_ARR=True, BLOCK=4096 * 2)
    assert torch.equal(ref.bits(c.cpu()), ref.bits(tp.temperature_scale(t, t.numel(), "cpu")))
    for value in (0.8, 0.7, 1.0, 1.7, 1e-3, 123.456, 1e39):  # 1e39: no float32, rounds to inf
        one = torch.empty(16, device=DEVICE)
        _scale_kernel[(1,)](one, one, 16, value, HAS_T_ARR=False, BLOCK=16)
        assert one[0].item() == tp.temperature_scale(value, 1, "cpu") == tp.temperature_scale(
            torch.tensor(value), 1, "cpu").item()


def test_public_api_backends_and_bad_input():
    logits = make_logits(3, 400, 2.0, seed=5)
    a = tp.target_probs(logits, 0.8, 20, 0.9, backend="tpguard")
    b = tp.target_probs(logits, 0.8, 20, 0.9, backend="torch")
    assert_near_reference(a, b)
    assert tp.target_probs(logits[:0], 1.0).shape == (0, 400)
    for bad, match in ((dict(temperature=0.0), "temperature must be in"), (dict(top_k=0), "top_k must be >= 1"),
                       (dict(top_p=1.5), "top_p must be in"), (dict(min_p=-0.1), "min_p must be in"),
                       (dict(temperature=torch.tensor([1.0, 2.0])), "temperature has 2 values for 3 rows")):
        with pytest.raises(ValueError, match=match):
            tp.target_probs(logits, **{"temperature": 1.0, **bad})
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        tp.target_probs(logits.double(), 1.0)
    with pytest.raises(ValueError, match="temperature values must be in"):
        tp.target_probs(logits, torch.tensor([1.0, 0.0, 2.0]))
    # numpy scalars act as the Python numbers they equal
    n = tp.target_probs(logits, np.float32(0.8), np.int64(20), np.float32(0.9), np.float64(0.05), backend="tpguard")
    assert torch.equal(n, tp.target_probs(logits, float(np.float32(0.8)), 20, float(np.float32(0.9)), 0.05,
                                          backend="tpguard"))


# --- the replacement of sglang's build_speculative_verify_target_probs ----------------------------

def _sampling_info(top_ks, top_ps, temperatures, need_top_k=True, need_top_p=True):
    pytest.importorskip("sglang.srt.speculative.dflash_utils", reason="sglang 0.5.23 is not installed here")
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    bs = len(top_ks)
    return SamplingBatchInfo(
        temperatures=torch.tensor(temperatures).reshape(bs, 1), top_ps=torch.tensor(top_ps),
        top_ks=torch.tensor(top_ks, dtype=torch.int32), min_ps=torch.zeros(bs), is_all_greedy=False,
        is_any_greedy=False, need_top_p_sampling=need_top_p, need_top_k_sampling=need_top_k,
        need_min_p_sampling=False, vocab_size=0, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("need_top_k, need_top_p", [(True, True), (True, False), (False, True)])
def test_verify_target_probs_matches_sglang_without_ties(need_top_k, need_top_p):
    dflash_utils = pytest.importorskip("sglang.srt.speculative.dflash_utils", reason="sglang 0.5.23 is not installed")

    from tpguard.hooks.sglang_renorm import verify_target_probs

    bs, n, vocab = 2, 3, 500
    info = _sampling_info([20, 500], [0.7, 0.9], [0.8, 1.1], need_top_k, need_top_p)
    logits = make_logits(bs * n, vocab, 3.0, seed=11).cpu()
    mine = verify_target_probs(next_token_logits=logits, sampling_info=info, draft_token_num=n, bs=bs)
    for sparse in (True, False):  # sglang's sparse (torch.topk) and dense paths
        theirs = dflash_utils.build_speculative_verify_target_probs(
            next_token_logits=logits, sampling_info=info, draft_token_num=n, bs=bs, use_sparse_topk=sparse)
        assert mine.shape == theirs.shape == (bs, n, vocab) and mine.dtype == theirs.dtype
        assert torch.equal(mine > 0, theirs > 0)
        torch.testing.assert_close(mine, theirs, rtol=2e-6, atol=1e-9)


@pytest.mark.slow
def test_verify_target_probs_one_tie_rule_on_both_steps():
    """A tie at the k-th value: sglang's sparse path keeps exactly k (by position), its dense path on
    CPU too; the replacement keeps every tied entry, on its sparse and dense arguments alike."""
    dflash_utils = pytest.importorskip("sglang.srt.speculative.dflash_utils", reason="sglang 0.5.23 is not installed")

    from tpguard.hooks.sglang_renorm import verify_target_probs
    from tpguard.kernels.renorm import TIE_RULE

    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]))
    info = _sampling_info([2], [0.99], [1.0])
    theirs = dflash_utils.build_speculative_verify_target_probs(
        next_token_logits=logits, sampling_info=info, draft_token_num=1, bs=1)
    assert int((theirs > 0).sum()) == 2  # exactly k
    for kw in ({}, {"use_sparse_topk": False}, {"max_top_k": 2, "uniform_top_k_value": 2}):
        mine = verify_target_probs(next_token_logits=logits, sampling_info=info, draft_token_num=1, bs=1, **kw)
        torch.testing.assert_close(mine.reshape(-1), torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0]))
    assert "ties at the cutoff are kept" in TIE_RULE
    # max_top_k caps k as sglang's sparse path does
    info = _sampling_info([4], [1.0], [1.0], need_top_p=False)
    capped = verify_target_probs(next_token_logits=logits, sampling_info=info, draft_token_num=1, bs=1, max_top_k=1)
    assert capped.reshape(-1).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.slow
def test_routing_exposes_the_replacement_with_its_output_hook():
    from tpguard.hooks import sglang_renorm

    try:  # sglang's verify modules in this process (CPU CI: its light set-up; a GPU image may lack sgl_kernel)
        importlib.import_module("sglang.srt.speculative.dflash_utils")
    except ImportError as e:
        pytest.skip(f"sglang's dflash_utils does not import here: {e}")
    seen = []
    routing = sglang_renorm.route("tpguard", on_output=seen.append)
    try:
        info = _sampling_info([5], [0.8], [1.0])
        out = routing.verify_target_probs(next_token_logits=make_logits(2, 100, 2.0, seed=2).cpu(),
                                          sampling_info=info, draft_token_num=2, bs=1)
        assert out.shape == (1, 2, 100) and len(seen) == 1 and seen[0].data_ptr() == out.data_ptr()
        lines = sglang_renorm.tie_rules(routing.backend)
        assert any("ties at the cutoff are kept" in line for line in lines)
    finally:
        routing.restore()


@pytest.mark.skipif(DEVICE != "cuda", reason="the benchmark's shapes on the GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_bench_shapes(dtype):
    rows, vocab = 8, 163840
    logits = torch.cat([make_logits(4, vocab, 1.0, 41, dtype), make_logits(4, vocab, 5.0, 42, dtype)])
    c = tp.temperature_scale(0.8, rows, logits.device)
    w = tp.softmax_weights_triton(logits, 0.8)
    w_ref, bad = ref.softmax_weights_reference(logits, c)
    assert ulp_gap(w, w_ref) <= W_ULPS
    for top_k, top_p, min_p in ((40, 0.9, None), (None, 0.9, None), (None, 0.95, 0.01), (1024, None, 0.05)):
        out = tp.target_probs_triton(logits, 0.8, top_k, top_p, min_p)
        assert torch.equal(ref.bits(out), ref.bits(ref.joint_renorm_reference(w, bad, top_k, top_p, min_p)))
        assert torch.equal(ref.bits(tp.target_probs_triton(logits, 0.8, top_k, top_p, min_p)), ref.bits(out))
        alone = tp.target_probs_triton(logits[5:6], 0.8, top_k, top_p, min_p)
        assert torch.equal(ref.bits(alone), ref.bits(out[5:6]))


# --- call plans (kernels/renorm_plan.py, tp.PLAN_OP) ----------------------------------------------

PLAN_KINDS = ("scalar", "tensor", "top_p", "mixed")
cpu_or_all = pytest.mark.skipif(DEVICE == "cuda" and not GPU_ALL, reason="GPU run: the plans' direct-launch "
                                "test only (TPGUARD_RENORM_GPU_TESTS=all runs every test)")


@pytest.fixture
def plans(monkeypatch):
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "8")
    monkeypatch.setenv("TPGUARD_RENORM_PLAN_MB", "256")
    rp.clear_plans()
    yield
    rp.clear_plans()


def plan_logits(vocab: int = 700) -> torch.Tensor:
    """4 rows: flat ones (bracket passes), a peaky one, a NaN row."""
    x = make_logits(4, vocab, 1.0, seed=21).cpu()
    x[2] *= 5
    x[3, 7] = float("nan")
    return x.to(DEVICE)


def plan_params(kind: str, other: bool = False) -> tuple:
    """(temperature, top_k, top_p, min_p) of a parameter kind as the public API takes them; `other`:
    other values of the same kinds."""
    def dev(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    if kind == "scalar":
        return (1.3, 7, 0.5, 0.1) if other else (0.8, 40, 0.9, 0.05)
    if kind == "tensor":
        return (dev([0.7, 1.0, 1.3, 0.5]), dev([40, 3, 10**6, 7], torch.int64), dev([0.9, 0.5, 1.0, 0.3]),
                dev([0.0, 0.1, 0.01, 0.5]))
    if kind == "top_p":  # no top-k: the bracket passes
        return (dev([0.6, 0.9, 1.1, 1.0]), None, dev([0.3, 0.95, 0.9, 0.5]) if other else dev([0.9, 0.8, 0.99, 0.5]),
                None)
    return (0.5, dev([5, 9, 300, 2], torch.int32), 0.7, None) if other else \
        (0.8, dev([40, 3, 10**6, 7], torch.int32), 0.9, None)  # mixed


def plan_free(monkeypatch, *args, **kwargs) -> torch.Tensor:
    """The public call with plans off (TPGUARD_RENORM_PLANS=0, read per call)."""
    limit = os.environ["TPGUARD_RENORM_PLANS"]
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "0")
    n = len(rp.plans())
    try:
        return tp.target_probs(*args, backend="tpguard", **kwargs)
    finally:
        monkeypatch.setenv("TPGUARD_RENORM_PLANS", limit)
        assert len(rp.plans()) == n  # nothing cached


def slot() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=DEVICE)


def test_a_plan_holds_the_scalar_temperature_the_kernel_gets(plans, monkeypatch):
    """A plan's recorded launches (GPU) substitute each call's scalars and refuse to record when a kernel
    got another value than the call's: the plan must hold the scalar temperature the stats kernel gets
    (the kernel rounds it to float32 itself)."""
    held, given = [], []
    run, stats = rp.run, tp._softmax_stats_kernel

    def plan_run(*args, **kwargs):
        held.append(kwargs["temperature"])
        return run(*args, **kwargs)

    class Stats:  # the real kernel, its scalar argument t_val noted
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                # (logits, w, vocab, n_chunks, n_groups, n_samples, cmax, cbad, t_ptr, t_val, ...)
                given.append(args[9])
                return stats[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(rp, "run", plan_run)
    monkeypatch.setattr(tp, "_softmax_stats_kernel", Stats())
    tp.target_probs(plan_logits(), 0.8, 40, 0.9, backend="tpguard")
    assert held and held == given[:1], (held, given)
    assert len(given) == 1  # one stats launch per call


@cpu_or_all
@pytest.mark.parametrize("kind, with_fp", [("scalar", False), ("tensor", True), ("top_p", True), ("mixed", False)])
def test_plan_gives_the_plan_free_bits(kind, with_fp, plans, monkeypatch):
    monkeypatch.setenv("TPGUARD_RENORM_CONFIG", SMALL_TEXT)
    x = plan_logits()
    params = plan_params(kind)
    fp_free, fp_plan = (slot(), slot()) if with_fp else (None, None)
    expect = plan_free(monkeypatch, x, *params, fingerprint_out=fp_free)
    outs = [tp.target_probs(x, *params, backend="tpguard", fingerprint_out=fp_plan) for _ in range(3)]
    ((key, plan),) = rp.plans()
    assert key[0] == "target_probs" and plan.spec is tp.PLAN_OP and isinstance(plan.ws, tp.FusedWorkspace)
    assert plan.state == ("off" if DEVICE == "cpu" else "on"), plan.refusal  # the interpreter: no recording
    for out in outs:
        assert torch.equal(ref.bits(out), ref.bits(expect)), kind
    assert len({out.data_ptr() for out in outs}) == len(outs)  # a new output per call
    if with_fp:
        assert int(fp_plan) == int(fp_free)
    plan.poison()  # nothing of a call depends on what the workspace held
    fp_plan = slot() if with_fp else None
    assert torch.equal(ref.bits(tp.target_probs(x, *params, backend="tpguard", fingerprint_out=fp_plan)),
                       ref.bits(expect))
    assert not with_fp or int(fp_plan) == int(fp_free)
    other = plan_params(kind, other=True)  # other values of the same kinds: the same plan
    assert torch.equal(ref.bits(tp.target_probs(x, *other, backend="tpguard", fingerprint_out=fp_plan)),
                       ref.bits(plan_free(monkeypatch, x, *other)))
    assert [p for _, p in rp.plans()] == [plan]


@cpu_or_all
def test_plans_per_parameter_kind(plans, monkeypatch):
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "16")
    x = plan_logits()
    t_rows = torch.tensor([0.7, 1.0, 1.3, 0.5], device=DEVICE)
    k_rows = torch.tensor([40, 3, 10**6, 7], device=DEVICE)
    mp_rows = torch.tensor([0.0, 0.1, 0.01, 0.5], device=DEVICE)
    cases = [  # temperature, top_k, top_p, min_p, fingerprint slot
        (0.8, 40, 0.9, None, None),
        (t_rows, 40, 0.9, None, None),  # temperature: a tensor
        (0.8, k_rows, 0.9, None, None),  # top-k: a tensor
        (0.8, None, 0.9, None, None),  # no top-k: the bracket passes
        (0.8, 10**6, 0.9, None, None),  # k >= vocab: the bracket passes too
        (0.8, 32, 0.9, None, None),  # k % 16 == 0: another Triton specialisation
        (0.8, 40, None, None, None),  # no top-p
        (0.8, 40, torch.full((4,), 0.9, device=DEVICE), None, None),  # top-p: a tensor
        (0.8, 40, 0.9, 0.05, None),  # min-p: a scalar
        (0.8, 40, 0.9, mp_rows, None),  # min-p: a tensor
        (0.8, 40, 0.9, None, slot()),  # fingerprint slot
    ]
    for t, k, p, mp, fp in cases:
        expect = plan_free(monkeypatch, x, t, k, p, mp)
        assert torch.equal(ref.bits(tp.target_probs(x, t, k, p, mp, backend="tpguard", fingerprint_out=fp)),
                           ref.bits(expect)), (t, k, p, mp)
    assert len(rp.plans()) == len(cases)
    assert all(key[0] == "target_probs" for key, _ in rp.plans())
    # what the launches do not depend on shares a plan: float values, an int of the same class
    tp.target_probs(x, 1.7, 7, 0.3, backend="tpguard")
    tp.target_probs(x, 0.8, 40, 0.9, 0.2, backend="tpguard")
    assert len(rp.plans()) == len(cases)
    # the renorms' plans live in the same cache, under their own op names
    from tpguard.kernels import renorm as tk

    tk.top_k_renorm(torch.softmax(x.nan_to_num(), -1), 40, backend="tpguard")
    assert len(rp.plans()) == len(cases) + 1 and rp.plans()[-1][0][0] == "top_k"


@cpu_or_all
def test_plan_limits_apply(plans, monkeypatch):
    x = plan_logits()
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "2")
    for rows in (1, 2, 3):
        tp.target_probs(x[:rows], 0.8, 40, 0.9, backend="tpguard")
    assert [key[1] for key, _ in rp.plans()] == [2, 3]  # rows 1 evicted
    tp.target_probs(x[:2], 0.8, 40, 0.9, backend="tpguard")  # used: now the most recent
    tp.target_probs(x, 0.8, 40, 0.9, backend="tpguard")
    assert [key[1] for key, _ in rp.plans()] == [2, 4]
    one = rp.plans()[-1][1].nbytes
    monkeypatch.setenv("TPGUARD_RENORM_PLAN_MB", repr(one / (1 << 20)))  # room for one such plan
    tp.target_probs(x[:3], 0.8, 40, 0.9, backend="tpguard")
    assert [key[1] for key, _ in rp.plans()] == [3] and rp.plan_bytes() <= one
    # the bracket passes' workspace, larger than the cap alone: used once, not kept
    out = tp.target_probs(x, 0.8, None, 0.9, backend="tpguard")
    assert torch.equal(ref.bits(out), ref.bits(plan_free(monkeypatch, x, 0.8, None, 0.9)))
    assert [key[1] for key, _ in rp.plans()] == [3]
    rp.clear_plans()
    assert rp.plans() == [] and rp.plan_bytes() == 0


@pytest.mark.skipif(not INTERPRET, reason="stubs the interpreter's launches")
def test_fused_op_does_no_other_torch_work(plans, monkeypatch):
    # a plan replays only Triton launches: a torch kernel per call (a zeros, a fill_, a copy_) would be
    # lost, so the recording refuses such a run. Here the op's host code alone, with the
    # interpreter's launches stubbed (as tests/test_renorm_plan.py does for the renorms).
    import triton.runtime.interpreter as interp

    monkeypatch.setattr(interp.InterpretedFunction, "__getitem__", lambda self, grid: (lambda *a, **k: None))
    x = plan_logits()
    for kind in PLAN_KINDS:
        for fp in (None, slot()):
            t, k, p, mp = plan_params(kind)
            k, p, mp = kernel_args(4, k, p, mp)
            rp.run(tp.PLAN_OP, x, k, p, SMALL, fp, min_p=mp, temperature=t)
            plan = rp.plans()[-1][1]
            work = dl._TorchWork()
            with work.mode:
                tp.PLAN_OP.launch([x, None, k, p, fp, mp, t], SMALL, plan.ws)
            assert work.seen == [], (kind, fp is not None, work.seen)


@pytest.mark.skipif(DEVICE != "cuda" or not dl.enabled(), reason="direct launches need CUDA")
def test_direct_launches_on_gpu(plans, monkeypatch):
    """The fused op's plans on a GPU (as tests/test_renorm_plan.py's test_direct_launches_on_gpu for
    the renorms): recorded launches, checked once, then direct launches (and a plan graph where one
    pays: <= TPGUARD_RENORM_GRAPH_ROWS rows and >= 3 launches) with the plan-free call's bits."""
    import triton

    cases = [(torch.float32, kind, with_fp) for kind in PLAN_KINDS for with_fp in (False, True)]
    cases += [(torch.bfloat16, "top_p", False), (torch.bfloat16, "scalar", True)]  # float32 out of bf16 in
    for dtype, kind, with_fp in cases:
        x = plan_logits(vocab=20000).to(dtype)
        params = plan_params(kind)
        fp, fp_free = (slot(), slot()) if with_fp else (None, None)
        expect = plan_free(monkeypatch, x, *params, fingerprint_out=fp_free)
        outs = [tp.target_probs(x, *params, backend="tpguard", fingerprint_out=fp) for _ in range(4)]
        for out in outs:
            assert torch.equal(ref.bits(out), ref.bits(expect)), (dtype, kind)
            assert out.dtype == torch.float32 and out.shape == x.shape
        assert len({out.data_ptr() for out in outs}) == len(outs)
        if with_fp:
            assert int(fp) == int(fp_free)
        plan = rp.plans()[-1][1]
        assert plan.spec is tp.PLAN_OP and plan.state == "on", (dtype, kind, plan.refusal)
        if renorm_graph.worth_graph(4, len(plan.direct.launches)):  # replays a graph from its third call
            assert plan.graphs is not None and plan.graphs.state == "on", (kind, plan.graphs and plan.graphs.refusal)
        other = plan_params(kind, other=True)  # new scalar values (without a slot: this plan's, or a new one)
        for _ in range(3):
            assert torch.equal(ref.bits(tp.target_probs(x, *other, backend="tpguard")),
                               ref.bits(plan_free(monkeypatch, x, *other))), (dtype, kind)
        # the trimmed templates: addresses, no tensors, no hook chains to call
        for launch in plan.direct.launches:
            assert not launch_trim() or not any(isinstance(a, torch.Tensor) for a in launch.template), launch.name
        if launch_trim() and triton.__version__ == "3.6.0":  # the GPU machine's: its C launch, called directly
            assert all(launch.run is not launch.compiled.run for launch in plan.direct.launches), dl.LAUNCHERS
    # one tensor as top-p and min-p, then two: each role its own slot
    rp.clear_plans()
    x = plan_logits(vocab=20000)
    p = torch.tensor([0.9, 0.05, 0.5, 0.2], device=DEVICE)
    mp = torch.tensor([0.1, 0.02, 0.3, 0.05], device=DEVICE)  # valid as a top-p too
    for top_p, min_p in ((p, p), (p, mp), (mp, p), (p, p)):
        expect = plan_free(monkeypatch, x, 0.8, None, top_p, min_p)
        for _ in range(2):
            assert torch.equal(ref.bits(tp.target_probs(x, 0.8, None, top_p, min_p, backend="tpguard")),
                               ref.bits(expect))
    ((_, plan),) = rp.plans()
    assert plan.state == "on", plan.refusal
