"""StepGuard on real gloo process groups: planted divergences named by the guard and by
`tpguard diagnose` on the trace it wrote; ties; policies; timeouts; dumps; long clean runs."""

from __future__ import annotations

import os
import time

import pytest
import torch

from multiproc import run_ranks
from tpguard.diagnose import diagnose
from tpguard.quantities import CANONICAL_ORDER, DECISION_QUANTITIES


def make_step(step: int, rank: int, plants=()):
    """One synthetic verify step's tensors, identical on every rank unless a plant perturbs one."""
    g = torch.Generator().manual_seed(1000 + step)
    t = {
        "rng_state": g.get_state(),
        "seq_lens": torch.randint(10, 500, (4,), generator=g),
        "draft_tokens": torch.randint(0, 1000, (4, 4), generator=g),
        "target_logits": torch.randn(16, 257, generator=g),
        "coins": torch.rand(4, 4, generator=g),
        "accept_index": torch.randint(0, 4, (4, 4), generator=g, dtype=torch.int32),
        "accept_len": torch.randint(0, 4, (4,), generator=g, dtype=torch.int32),
        "bonus": torch.randint(0, 1000, (4,), generator=g),
        "commit_lens": torch.randint(1, 5, (4,), generator=g, dtype=torch.int32),
        "out_tokens": torch.randint(0, 1000, (4, 4), generator=g),
    }
    t["target_probs"] = torch.softmax(t["target_logits"], -1)
    for name, at_step, at_rank in plants:
        if at_step == step and at_rank == rank:
            x = t[name]
            if x.is_floating_point():
                x.view(-1)[3] = torch.nextafter(x.view(-1)[3], torch.tensor(2.0))
            else:
                x.view(-1)[1] += 1
    return t


def _run_guard(rank, world, steps, plants, policy, trace_dir, **kw):
    from tpguard.guard import StepGuard

    guard = StepGuard(site="synthetic.verify", policy=policy, trace=trace_dir, run_id="t1", **kw)
    found, decisions = [], []
    try:
        for s in range(steps):
            tensors = make_step(s, rank, plants)
            for name, tensor in tensors.items():
                guard.record(name, tensor)
            div = guard.check()
            if div is not None:
                found.append((div.step, div.quantity, div.culprit_ranks, div.majority_ranks, div.rows,
                              div.action, div.dump))
            decisions.append({q: tensors[q].tolist() for q in DECISION_QUANTITIES})
    finally:
        guard.close()
    return found, decisions


# (the inner loop's subset: rng_state (no rows), coins (rank 0 the culprit) and target_probs)
@pytest.mark.parametrize("quantity", [q if q in ("rng_state", "coins", "target_probs") else
                                      pytest.param(q, marks=pytest.mark.slow) for q in CANONICAL_ORDER])
def test_planted_divergence_named_by_guard_and_diagnose(tmp_path, quantity):
    culprit = 0 if quantity in ("coins", "bonus") else 1
    results = run_ranks(_run_guard, 2, 6, [(quantity, 3, culprit)], "record", str(tmp_path))
    (found0, _), (found1, _) = results
    assert found0 == found1
    assert len(found0) == 1
    step, q, culprits, majority, rows, action, _ = found0[0]
    # Two ranks always tie: the reference group is the one holding rank 0.
    assert (step, q, culprits, majority, action) == (3, quantity, [1], [0], "recorded")
    if quantity != "rng_state":
        assert rows is not None and len(rows) == 1
    report = diagnose([tmp_path]).to_json()
    first = report["first_divergence"]
    assert report["verdict"] == "diverged" and report["steps"] == 6
    assert (first["step"], first["quantity"], first["culprit_ranks"]) == (3, quantity, [1])


@pytest.mark.slow
def test_four_ranks_majority_and_ties(tmp_path):
    # rank 0 alone differs: majority {1,2,3}, culprit 0
    results = run_ranks(_run_guard, 4, 4, [("target_probs", 2, 0)], "record", str(tmp_path / "a"))
    assert all(r[0] == results[0][0] for r in results)
    assert results[0][0][0][:4] == (2, "target_probs", [0], [1, 2, 3])
    # two against two: tie, the group holding rank 0 is the reference
    plants = [("coins", 1, 2), ("coins", 1, 3)]
    results = run_ranks(_run_guard, 4, 3, plants, "record", str(tmp_path / "b"))
    assert results[0][0][0][:4] == (1, "coins", [2, 3], [0, 1])
    first = diagnose([tmp_path / "b"]).to_json()["first_divergence"]
    assert (first["quantity"], first["culprit_ranks"], first["majority_ranks"]) == ("coins", [2, 3], [0, 1])


def test_earliest_quantity_in_causal_order_wins(tmp_path):
    plants = [("out_tokens", 2, 1), ("target_logits", 2, 1), ("bonus", 2, 1)]
    results = run_ranks(_run_guard, 2, 3, plants, "record", str(tmp_path))
    assert results[0][0][0][1] == "target_logits"
    first = diagnose([tmp_path]).to_json()["first_divergence"]
    assert first["quantity"] == "target_logits"
    assert first["differing_at_step"] == ["target_logits", "bonus", "out_tokens"]


def test_heal_broadcasts_rank0_decisions(tmp_path):
    plants = [("bonus", 2, 1), ("accept_len", 4, 1)]
    (f0, d0), (f1, d1) = run_ranks(_run_guard, 2, 6, plants, "heal", str(tmp_path))
    assert [f[:2] for f in f0] == [(2, "bonus"), (4, "accept_len")]
    assert all(f[5] == "healed" for f in f0 + f1)
    assert d0 == d1  # after each check, rank 1 holds rank 0's decisions
    assert diagnose([tmp_path]).to_json()["guard_actions"] == {"healed": 2}


def _abort_run(rank, world, trace_dir):
    from tpguard.errors import RankDivergenceError

    try:
        _run_guard(rank, world, 6, [("accept_index", 3, 1)], "abort", trace_dir)
    except RankDivergenceError as e:
        return ("aborted", e.divergence.step, e.divergence.quantity, str(e))
    return ("finished",)


def test_abort_stops_every_rank_at_the_same_step(tmp_path):
    results = run_ranks(_abort_run, 2, str(tmp_path))
    for r in results:
        assert r[:3] == ("aborted", 3, "accept_index")
        assert "step 3" in r[3] and "culprit rank(s) [1]" in r[3]
    report = diagnose([tmp_path]).to_json()
    assert report["guard_actions"] == {"aborted": 1}
    assert report["last_step_by_rank"] == {"0": 3, "1": 3}


def _stalling_rank(rank, world, trace_dir, stall_after):
    from tpguard.errors import RankTimeoutError
    from tpguard.guard import StepGuard

    guard = StepGuard(site="synthetic.verify", trace=trace_dir, run_id="t2", timeout_s=2.0)
    ended = trace_dir + ".rank0-ended"  # beside the trace, not in it
    t0 = time.monotonic()
    try:
        for s in range(10):
            if rank == 1 and s == stall_after:
                # stops reaching the guard (a hang elsewhere) until rank 0 has ended (at most 6 s)
                stalled = time.monotonic()
                while not os.path.exists(ended) and time.monotonic() - stalled < 6:
                    time.sleep(0.05)
                return ("stalled",)
            for name, tensor in make_step(s, rank).items():
                guard.record(name, tensor)
            guard.check()
    except RankTimeoutError as e:
        return ("timeout", e.step, e.missing, e.last_step_by_rank, str(e), time.monotonic() - t0)
    finally:
        guard.close()
        if rank == 0:
            open(ended, "w").close()
    return ("finished",)


@pytest.mark.slow
def test_rank_that_stops_is_named_after_the_timeout(tmp_path):
    results = run_ranks(_stalling_rank, 2, str(tmp_path), 4, timeout=60)
    assert results[1] == ("stalled",)
    kind, step, missing, last, msg, elapsed = results[0]
    assert (kind, step, missing) == ("timeout", 4, [1])
    assert last == {0: 4, 1: 3}
    assert elapsed < 10  # nobody waited forever
    assert "rank(s) [1] did not reach step 4" in msg
    report = diagnose([tmp_path]).to_json()
    assert report["verdict"] == "clean"
    assert report["timeouts"] and report["timeouts"][0]["missing_ranks"] == [1]
    assert report["last_step_by_rank"] == {"0": 3, "1": 3}


def _run_guard_dump(rank, world, trace_dir, dump_dir):
    return _run_guard(rank, world, 3, [("target_probs", 1, 1)], "record", trace_dir, dump_dir=dump_dir)


def test_dump_on_divergence(tmp_path):
    from safetensors.torch import load_file

    results = run_ranks(_run_guard_dump, 2, str(tmp_path), str(tmp_path / "dumps"))
    dumps = [r[0][0][6] for r in results]
    assert all(d and d.endswith(".safetensors") for d in dumps)
    t0, t1 = load_file(dumps[0]), load_file(dumps[1])
    assert set(t0) == set(CANONICAL_ORDER)
    diff = (t0["target_probs"] != t1["target_probs"]).nonzero().tolist()
    assert diff == [[0, 3]]


def _clean_steps(rank, world, n, trace_dir):
    from tpguard.guard import StepGuard

    guard = StepGuard(site="synthetic.verify", trace=trace_dir, run_id="t3",
                      quantities=("seq_lens", "coins", "accept_len", "out_tokens"))
    g = torch.Generator().manual_seed(7)
    divergences = 0
    for _ in range(n):
        guard.record("seq_lens", torch.randint(0, 100, (8,), generator=g))
        guard.record("coins", torch.rand(8, 4, generator=g))
        guard.record("accept_len", torch.randint(0, 4, (8,), generator=g))
        guard.record("out_tokens", torch.randint(0, 1000, (8, 4), generator=g))
        divergences += guard.check() is not None
    guard.close()
    return divergences


@pytest.mark.slow
def test_ten_thousand_clean_steps(tmp_path):
    assert run_ranks(_clean_steps, 2, 10_000, str(tmp_path), timeout=300) == [0, 0]
    report = diagnose([tmp_path]).to_json()
    assert report["verdict"] == "clean" and report["steps"] == 10_000


def test_single_process_guard_without_distributed(tmp_path):
    from tpguard.guard import StepGuard

    guard = StepGuard(trace=str(tmp_path), run_id="solo")
    for name, tensor in make_step(0, 0).items():
        guard.record(name, tensor)
    assert guard.check() is None
    guard.close()
    with pytest.raises(ValueError, match="unknown quantity"):
        guard.record("nope", torch.zeros(1))


def _precomputed_fingerprints(rank, world):
    from tpguard.guard import StepGuard

    guard = StepGuard(site="synthetic.verify", run_id="t4", quantities=("target_probs", "out_tokens"))
    found = []
    for s in range(3):
        # e.g. emitted by a renorm kernel's write pass: only the value travels
        guard.record_fingerprint("target_probs", 0xABC + (rank if s == 1 else 0), numel=16)
        guard.record("out_tokens", torch.arange(4))
        div = guard.check()
        found.append(None if div is None else (div.step, div.quantity, div.culprit_ranks))
    guard.close()
    return found


def test_precomputed_fingerprints_are_compared():
    assert run_ranks(_precomputed_fingerprints, 2) == [[None, (1, "target_probs", [1]), None]] * 2
