"""The harness's verify pipeline in one process: accept vs a line-by-line transcription of
sglang's kernel, injections, workload determinism, options (no process group needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpguard.launch.accept import bonus_tokens, output_tokens, verify_target_only
from tpguard.launch.inject import Injector
from tpguard.launch.model import SyntheticModel
from tpguard.launch.options import Injection, OptionsError, parse_options
from tpguard.launch.pipeline import VerifyPipeline
from tpguard.renorm_registry import get_backend
from tpguard.launch.tree import chain, eagle_tree
from tpguard.launch.workload import SamplingParams, Workload
from tpguard.quantities import CANONICAL_ORDER


def kernel_transcription(candidates, tree, coins, final_coins, probs, thr_single=1.0, thr_acc=1.0):
    """TreeSpeculativeSamplingTargetOnly (sgl_kernel/speculative/sampling.cuh), one block per request,
    scalar Python; the final sample uses torch's sum/cumsum so that float rounding matches."""
    bs, n = candidates.shape
    vocab = probs.shape[-1]
    spec = tree.spec_tokens
    predicts = np.zeros(bs * n, dtype=np.int64)
    accept_index = np.full((bs, spec), -1, dtype=np.int64)
    accept_len = np.zeros(bs, dtype=np.int64)
    for bx in range(bs):
        draft_probs = np.zeros((n, vocab), dtype=np.float32)
        prob_acc = np.float32(0)
        cur_row = 0
        coin = coins[bx, 0]
        last = bx * n
        accept_index[bx, 0] = last
        num = 0
        cur = 0
        for _ in range(1, spec):
            cur = tree.next_token[cur]
            while cur != -1:
                tok = candidates[bx, cur]
                p = probs[bx, cur_row, tok]
                prob_acc = np.float32(prob_acc + p)
                if p > 0 and (coin < prob_acc / np.float32(thr_acc) or p >= thr_single):
                    prob_acc = np.float32(0)
                    cur_row = cur
                    coin = coins[bx, cur]
                    predicts[last] = tok
                    num += 1
                    accept_index[bx, num] = bx * n + cur
                    last = bx * n + cur
                    break
                draft_probs[cur_row, tok] = probs[bx, cur_row, tok]
                cur = tree.next_sibling[cur]
            if cur == -1:
                break
        accept_len[bx] = num
        q = probs[bx, cur_row].copy()
        if num != spec - 1:
            q = np.maximum(q - draft_probs[cur_row], 0)
        qt = torch.from_numpy(q)
        u = np.float32(final_coins[bx]) * np.float32(qt.sum().item())
        cdf = qt.cumsum(0).numpy()
        over = np.nonzero(cdf > u)[0]
        if len(over):
            sampled = int(over[0])
        else:
            valid = np.nonzero(q > 0)[0]
            sampled = int(valid[-1]) if len(valid) else vocab - 1
        predicts[last] = sampled
    return predicts, accept_index, accept_len


@pytest.mark.parametrize("tree", [chain(5), eagle_tree(7), eagle_tree(4)], ids=["chain5", "eagle7", "eagle4"])
def test_accept_matches_kernel_transcription(tree):
    g = torch.Generator().manual_seed(7)
    bs, n, vocab = 64, tree.nodes, 50
    logits = torch.randn(bs, n, vocab, generator=g) * 3
    logits[:, :, vocab // 2:] -= 100  # half the vocab with no mass (p == 0 paths)
    probs = torch.softmax(logits, -1)
    best = probs.argmax(-1)
    candidates = torch.randint(0, vocab, (bs, n), generator=g)
    take = torch.rand(bs, n, generator=g) < 0.7  # drafts mostly agree with the target's peak
    parents = torch.tensor([0] + [tree.parent[k] for k in range(1, n)])
    candidates = torch.where(take, best[:, parents], candidates)
    coins = torch.rand(bs, n, generator=g)
    final = torch.rand(bs, generator=g)
    got = verify_target_only(candidates, tree, coins, final, probs)
    want = kernel_transcription(candidates.numpy(), tree, coins.numpy(), final.numpy(), probs.numpy())
    assert torch.equal(got.accept_len.long(), torch.from_numpy(want[2]))
    assert torch.equal(got.accept_index.long(), torch.from_numpy(want[1]))
    used = want[1][want[1] >= 0]
    assert torch.equal(got.predicts.long()[used], torch.from_numpy(want[0][used]))
    assert 0 < got.accept_len.float().mean() < tree.spec_tokens - 1  # both outcomes exercised
    bonus = bonus_tokens(got.predicts, got.accept_index, got.accept_len)
    out = output_tokens(candidates, got.accept_index, got.accept_len, bonus)
    for i in range(bs):
        a = int(got.accept_len[i])
        nodes = [int(x) - i * n for x in got.accept_index[i, 1:a + 1]]
        assert out[i, :a].tolist() == [int(candidates[i, k]) for k in nodes]
        assert int(out[i, a]) == int(bonus[i]) == int(want[0][want[1][i, a]])


def _pipeline(renorm="torch", logits="mixed", inject=(), rank=0, algo="dflash"):
    tree = chain(4) if algo == "dflash" else eagle_tree(4)
    model = SyntheticModel(512, tree, logits)
    inj = Injector(list(inject), rank, 512, tree.spec_tokens, tree.nodes, 4)
    return VerifyPipeline(model, tree, get_backend(renorm, "cpu"), inj, torch.device("cpu"), seed=3)


def _run_steps(pipe, steps, params=SamplingParams(1.0, 0.9, 0, 0.0), mixed=False):
    wl = Workload(4, 512, 3, 4, params, mixed)
    recorded = []
    for s in range(steps):
        rec = {}
        out = pipe.run(s, wl.inputs(), lambda name, t: rec.__setitem__(name, t.clone()))
        recorded.append(rec)
        wl.commit(out.out_tokens.numpy(), out.commit_lens.numpy())
    return recorded, wl


def test_pipeline_records_every_quantity_in_causal_order_and_is_deterministic():
    a, wa = _run_steps(_pipeline(), 6, SamplingParams(0.8, 0.9, 20, 0.05), mixed=True)
    b, wb = _run_steps(_pipeline(), 6, SamplingParams(0.8, 0.9, 20, 0.05), mixed=True)
    assert list(a[0]) == list(CANONICAL_ORDER)
    for ra, rb in zip(a, b):
        assert all(torch.equal(ra[q], rb[q]) for q in CANONICAL_ORDER)
    assert wa.output_fingerprint() == wb.output_fingerprint()
    assert wa.committed_tokens > 6 * 4  # some drafts were accepted


@pytest.mark.parametrize("quantity", CANONICAL_ORDER)
def test_injection_is_minimal_and_first_in_causal_order(quantity):
    clean, _ = _run_steps(_pipeline(algo="eagle"), 3)
    hit, _ = _run_steps(_pipeline(algo="eagle", inject=[Injection(quantity, 2, 0)]), 3)
    assert all(torch.equal(clean[s][q], hit[s][q]) for s in (0, 1) for q in CANONICAL_ORDER)
    order = list(CANONICAL_ORDER)
    differing = [q for q in order if not torch.equal(clean[2][q], hit[2][q])]
    assert differing[0] == quantity
    before, after = clean[2][quantity], hit[2][quantity]
    if quantity != "rng_state":  # a generator state moves as a whole
        changed = (before != after).nonzero()
        assert len(changed) == 1
        i = tuple(changed[0].tolist())
        if before.is_floating_point():
            assert after[i] == torch.nextafter(before[i], torch.tensor(float("inf")))
        else:
            assert abs(int(after[i]) - int(before[i])) == 1


def test_emulated_atomic_differs_between_calls_and_reference_does_not():
    probs = torch.softmax(torch.randn(32, 4096, generator=torch.Generator().manual_seed(1)), -1)
    p = torch.full((32,), 0.9)
    atomic = get_backend("emulated-atomic", "cpu")
    ref = get_backend("torch", "cpu")
    assert any(not torch.equal(atomic.top_p(probs, p), atomic.top_p(probs, p)) for _ in range(5))
    assert all(torch.equal(ref.top_p(probs, p), ref.top_p(probs, p)) for _ in range(5))


@pytest.mark.parametrize("argv,world,needle", [
    (["--inject", "logits@1:1"], 2, "unknown quantity 'logits'"),
    (["--inject", "bonus@1"], 2, "expected QUANTITY@STEP:RANK"),
    (["--steps", "5", "--inject", "bonus@5:1"], 2, "step 5 is out of range [0, 5)"),
    (["--inject", "bonus@1:2"], 2, "rank 2 >= world size 2"),
    (["--inject", "coins@1:7"], 4, "rank 7 >= world size 4"),
    ([], 1, "world size >= 2"),
    (["--top-p", "1.5"], 2, "--top-p must be in (0, 1]"),
    (["--temperature", "0"], 2, "--temperature must be > 0"),
    (["--top-k", "5000"], 2, "--top-k must be in [0, vocab)"),
    (["--steps", "0"], 2, "--steps must be >= 1"),
    (["--draft-tokens", "1"], 2, "--draft-tokens must be in [2, 64]"),
    (["--dump"], 2, "--dump needs --trace"),
    (["--renorm", "flashinfer"], 2, "runs on GPUs only"),
    (["--quantities", "decisions", "--inject", "target_probs@1:1"], 2, "not recorded with --quantities decisions"),
    (["--every", "2", "--inject", "coins@3:1"], 2, "not a checked step with --every 2"),
    (["--no-guard", "--on-divergence", "heal"], 2, "needs the guard"),
    (["--bogus"], 2, "No such option: --bogus"),
    (["--steps", "x"], 2, "valid int"),
    (["--algo", "medusa"], 2, "'medusa' is not one of dflash | eagle"),
])
def test_bad_options_are_one_line_errors(argv, world, needle):
    with pytest.raises(OptionsError) as e:
        parse_options(argv, world)
    assert needle in str(e.value) and "\n" not in str(e.value)
