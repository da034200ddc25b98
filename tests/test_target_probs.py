"""The fused logits -> target_probs kernel (kernels/target_probs.py) against its torch reference
(kernels/reference.py: softmax_weights_reference, joint_renorm_reference, target_probs_reference),
against SGLang's composition (softmax, top-k renorm, top-p renorm, min-p) and against sglang
0.5.23's own `build_speculative_verify_target_probs` (its replacement, hooks/sglang_renorm.py).

exp2 is the one operation whose last bit differs between implementations, so: the kernel's weights
are within 2 ulp of the reference's, and its output is bit for bit the reference's renorm of the
kernel's own weights; end to end, the kept sets are the reference's and the values within a few
ulp. Under the Triton interpreter on CPU: small vocabularies, a few rows, both block shapes."""

from __future__ import annotations

import pytest
import torch
from renorm_setup import DEVICE, GPU_ALL, SMALL

from tpguard import fingerprint as fp_host
from tpguard.kernels import reference as ref
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
    c = tp.temperature_scale(torch.tensor([0.7, 1.0, 1.3, 0.5]), rows, logits.device)
    w = tp.softmax_weights_triton(logits, c, config=CONFIGS[cfg])
    w_ref, bad = ref.softmax_weights_reference(logits, c)
    assert ulp_gap(w, w_ref) <= W_ULPS
    out = tp.target_probs_triton(logits, c, *kernel_args(rows, top_k, top_p, min_p), config=CONFIGS[cfg])
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
        out = tp.target_probs_triton(x, c, *kernel_args(6, top_k, top_p, min_p), config=SMALL)
        w = tp.softmax_weights_triton(x, c, config=SMALL)
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


@pytest.mark.slow
def test_repeated_calls_batch_invariance_and_fingerprint():
    logits = make_logits(5, 700, 2.0, seed=3, dtype=torch.bfloat16)
    c = tp.temperature_scale(0.9, 5, logits.device)
    run = lambda x, **kw: tp.target_probs_triton(x, tp.temperature_scale(0.9, x.shape[0], x.device), 30, 0.9, 0.01,
                                                 config=SMALL, **kw)
    first = run(logits)
    assert torch.equal(ref.bits(run(logits)), ref.bits(first))
    assert torch.equal(ref.bits(run(logits[2:4])), ref.bits(first[2:4]))
    assert torch.equal(ref.bits(run(torch.cat([logits[4:], logits[:2]]))[1:]), ref.bits(first[:2]))
    slot = torch.zeros((), dtype=torch.int64, device=DEVICE)
    out = run(logits, fingerprint_out=slot)
    assert torch.equal(ref.bits(out), ref.bits(first)) and fp_host.to_unsigned(int(slot)) == fp_host.fingerprint(out.cpu())
    assert c == tp.temperature_scale(torch.tensor(0.9), 1, logits.device).item()


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
    w = tp.softmax_weights_triton(logits, c)
    w_ref, bad = ref.softmax_weights_reference(logits, c)
    assert ulp_gap(w, w_ref) <= W_ULPS
    for top_k, top_p, min_p in ((40, 0.9, None), (None, 0.9, None), (None, 0.95, 0.01), (1024, None, 0.05)):
        out = tp.target_probs_triton(logits, c, top_k, top_p, min_p)
        assert torch.equal(ref.bits(out), ref.bits(ref.joint_renorm_reference(w, bad, top_k, top_p, min_p)))
        assert torch.equal(ref.bits(tp.target_probs_triton(logits, c, top_k, top_p, min_p)), ref.bits(out))
        alone = tp.target_probs_triton(logits[5:6], tp.temperature_scale(0.8, 1, logits.device), top_k, top_p, min_p)
        assert torch.equal(ref.bits(alone), ref.bits(out[5:6]))
