"""The production guard (DeviceStepGuard) on gloo: lag of one step, fused heal, sampling,
metrics, bounded traces; and the on-device comparison kernel against its reference."""

from __future__ import annotations

import pytest
import torch

from multiproc import run_ranks
from test_guard import make_step
from tpguard.diagnose import diagnose
from tpguard.config import interpreting
from tpguard.quantities import DECISION_QUANTITIES


def _device_run(rank, world, steps, plants, policy, trace_dir, extra):
    from tpguard.device_guard import DeviceStepGuard, decisions_capacity
    from tpguard.errors import RankDivergenceError

    kw = dict(extra)
    if policy == "heal":
        kw["heal_capacity"] = decisions_capacity(4, 4)
    guard = DeviceStepGuard(site="synthetic.verify", policy=policy, trace=trace_dir, run_id="d1", **kw)
    seen, decisions, checked_steps = [], [], []
    try:
        for s in range(steps):
            tensors = make_step(s, rank, plants)
            for name, tensor in tensors.items():
                guard.record(name, tensor)
            if guard.wants(s):
                checked_steps.append(s)
            div = guard.check(s)
            if div is not None:
                seen.append((s, div.step, div.quantity, div.culprit_ranks, div.action))
            decisions.append({q: tensors[q].tolist() for q in DECISION_QUANTITIES})
        div = guard.drain()
        if div is not None:
            seen.append((steps, div.step, div.quantity, div.culprit_ranks, div.action))
    except RankDivergenceError as e:
        return ("aborted", s, e.divergence.step, e.divergence.quantity)
    finally:
        guard.close()
    metrics = None
    if extra.get("metrics"):
        from prometheus_client import REGISTRY

        metrics = (REGISTRY.get_sample_value("tpguard_checked_steps_total", {"site": "synthetic.verify"}),
                   REGISTRY.get_sample_value("tpguard_divergences_total",
                                             {"site": "synthetic.verify", "quantity": "coins"}))
    return seen, decisions, checked_steps, metrics


def test_detection_lags_exactly_one_step(tmp_path):
    plants = [("target_probs", 3, 1), ("coins", 7, 1)]
    (s0, _, _, _), (s1, _, _, _) = run_ranks(_device_run, 2, 9, plants, "record", str(tmp_path), {})
    assert s0 == s1 == [(4, 3, "target_probs", [1], "recorded"), (8, 7, "coins", [1], "recorded")]
    first = diagnose([tmp_path]).to_json()["first_divergence"]
    assert (first["step"], first["quantity"]) == (3, "target_probs")


def test_last_step_is_reported_by_drain(tmp_path):
    (s0, _, _, _), _ = run_ranks(_device_run, 2, 5, [("bonus", 4, 0)], "record", str(tmp_path), {})
    assert s0 == [(5, 4, "bonus", [1], "recorded")]


def test_abort_stops_all_ranks_at_the_next_step(tmp_path):
    results = run_ranks(_device_run, 2, 8, [("accept_len", 2, 1)], "abort", str(tmp_path), {})
    assert results == [("aborted", 3, 2, "accept_len")] * 2


def test_fused_heal_takes_rank0_decisions_every_step(tmp_path):
    plants = [("bonus", 2, 1), ("out_tokens", 5, 1)]
    (s0, d0, _, _), (s1, d1, _, _) = run_ranks(_device_run, 2, 8, plants, "heal", str(tmp_path), {})
    assert d0 == d1  # identical decisions on both ranks after every step
    assert [(x[1], x[2], x[4]) for x in s0] == [(2, "bonus", "healed"), (5, "out_tokens", "healed")]
    assert diagnose([tmp_path]).to_json()["guard_actions"] == {"healed": 2}


def test_random_sampling_picks_the_same_steps_on_every_rank(tmp_path):
    results = run_ranks(_device_run, 3, 60, [], "record", str(tmp_path), {"sample_one_in": 4})
    checked = [r[2] for r in results]
    assert checked[0] == checked[1] == checked[2]
    assert 5 <= len(checked[0]) <= 30 and checked[0] != list(range(0, 60, 4))


def test_metrics_move_as_divergences_are_planted(tmp_path):
    plants = [("coins", 1, 1), ("coins", 4, 1)]
    (s0, _, _, m0), _ = run_ranks(_device_run, 2, 6, plants, "record", str(tmp_path), {"metrics": True})
    checked, coins = m0
    assert checked == 6 and coins == 2


@pytest.mark.slow
def test_bounded_trace_keeps_every_divergence(tmp_path):
    plants = [("coins", s, 1) for s in (10, 150, 290)]
    run_ranks(_device_run, 2, 300, plants, "record", str(tmp_path),
              {"clean_every": 50, "max_trace_bytes": 2500})
    files = sorted(tmp_path.glob("*.jsonl*"))
    assert len(files) > 2  # rotated
    from tpguard.trace import read_trace

    divergences = sorted({r.step for f in files for r in read_trace(f) if r.type == "divergence"})
    steps = sorted({r.step for f in files if "rank0" in f.name for r in read_trace(f) if r.type == "step"})
    assert divergences == [10, 150, 290]
    assert sorted(set(steps)) == [0, 10, 50, 100, 150, 200, 250, 290], str(sorted(set(steps)))
    report = diagnose(files).to_json()
    assert report["first_divergence"]["step"] == 10 and report["divergent_steps"] == 3


# The comparison kernels on CPU tensors need the interpreter; gpu/check.sh exports TRITON_INTERPRET=0 (there
# tests/test_gpu_guard_graphs.py runs them on the GPU).
needs_interpreter = pytest.mark.skipif(not interpreting(),
                                       reason="TRITON_INTERPRET=0 in the environment: Triton kernels on CPU tensors")


def test_compare_reads_the_guard_vector_layout():
    """The comparison kernels (which import nothing above kernels/) read the guard's vector header."""
    from tpguard.guard import _HDR
    from tpguard.kernels.guard_compare import HDR

    assert HDR == _HDR


@needs_interpreter
@pytest.mark.parametrize("world,q", [(2, 11), (4, 11), (3, 5)])
def test_compare_kernel_matches_reference(world, q):
    from tpguard.kernels.guard_compare import _compare_kernel, compare_gathered_torch

    g = torch.Generator().manual_seed(world * 100 + q)
    for trial in range(6):
        gathered = torch.zeros(world, 3 + 2 * q, dtype=torch.int64)
        values = torch.randint(-5, 5, (q,), generator=g)
        gathered[:, 3:3 + q] = values
        gathered[:, 2] = torch.randint(0, 1 << q, (world,), generator=g)
        r = int(torch.randint(0, world, (1,), generator=g))
        gathered[r, 3 + trial % q] += 1
        ref = compare_gathered_torch(gathered, q)
        out = torch.full((q + 1,), -1, dtype=torch.int64)
        _compare_kernel[(1,)](gathered, out, world, gathered.shape[1], q, BW=4, BQ=16)
        assert out.tolist() == ref.tolist()


@needs_interpreter
@pytest.mark.parametrize("world,q,extra", [(2, 11, 0), (4, 11, 7), (3, 5, 2)])
def test_compare_to_host_kernel_writes_result_layout(world, q, extra):
    """The zero-copy comparison (CUDA graphs: no copy node): the first `cols` columns of each
    gathered row and the flags, where compare + copy put them; nothing else touched."""
    from tpguard.kernels.guard_compare import _compare_to_host_kernel, compare_gathered_torch

    length = 3 + 2 * q + extra
    cols = 3 + 2 * q
    g = torch.Generator().manual_seed(world + q)
    gathered = torch.randint(-9, 9, (world, length), generator=g)
    gathered[:, 2] = (1 << q) - 1
    gathered[:, 3:3 + q] = 4
    gathered[world - 1, 3 + q - 1] = 5
    host = torch.full((world * length + q + 1,), -77, dtype=torch.int64)
    _compare_to_host_kernel[(1,)](gathered, host, world, length, q, cols, BW=4, BQ=16,
                                  BC=triton_next_pow2(cols))
    got = host[: world * length].view(world, length)
    assert torch.equal(got[:, :cols], gathered[:, :cols]) and bool((got[:, cols:] == -77).all())
    assert host[world * length:].tolist() == compare_gathered_torch(gathered, q).tolist()
    assert host[world * length + q - 1] == 1 and host[-1] == 1


def test_zero_copy_is_cuda_only():
    from tpguard.device_guard import DeviceStepGuard
    from tpguard.kernels.guard_compare import zero_copy_works

    assert not zero_copy_works(torch.device("cpu"))
    guard = DeviceStepGuard(site="zc.cpu", run_id="z", watchdog=False, device="cpu")
    guard.prepare_graph(make_step(0, 0), zero_copy=True)
    assert guard._graph["zero_copy"] is False  # the copy path, as without it
    guard.device_check()
    assert guard.collect() is None
    guard.close()


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_capturable_half_writes_fingerprints_and_step_in_place():
    """device_check() (the half a CUDA graph captures), one process: fingerprints land in the
    vector's slots, the step counter lives in the vector and advances once per call."""
    from tpguard.device_guard import DeviceStepGuard
    from tpguard.fingerprint import fingerprint_tensor, to_signed
    from tpguard.guard import _HDR

    guard = DeviceStepGuard(site="graph.cpu", run_id="g", watchdog=False, device="cpu")
    tensors = make_step(0, 0)
    guard.prepare_graph(tensors)
    i = guard.index["target_probs"]
    for step in range(2):
        guard.device_check()
        assert guard.collect() is None
        host = guard._graph["host"]
        assert int(host[0]) == step + 1  # prepare_graph's warm-up call was step 0
        assert int(host[_HDR + i]) == to_signed(fingerprint_tensor(tensors["target_probs"]))
        assert int(host[_HDR + len(guard.quantities) + i]) == tensors["target_probs"].numel()
        tensors["target_probs"].view(-1)[5] += 1.0  # in place: the next call must see it
    guard.close()


def test_graph_path_takes_a_producer_written_fingerprint():
    """prepare_graph(precomputed=...): the producer (the renorm's write pass, via
    fingerprint_out=) writes target_probs' fingerprint into the vector's slot; device_check
    hashes the rest and compares as usual, without reading the probabilities."""
    from tpguard.device_guard import DeviceStepGuard
    from tpguard.fingerprint import fingerprint_tensor, to_signed
    from tpguard.guard import _HDR
    from tpguard.kernels.renorm import top_p_renorm

    tensors = make_step(0, 0)
    g = torch.Generator().manual_seed(1)
    probs_in = torch.softmax(torch.randn(tensors["target_probs"].shape, generator=g), -1)
    guard = DeviceStepGuard(site="graph.cpu", run_id="g", watchdog=False, device="cpu")
    guard.prepare_graph(tensors, precomputed=["target_probs"])
    i = guard.index["target_probs"]
    for step in range(2):
        out = top_p_renorm(probs_in, 0.9, backend="torch",
                           fingerprint_out=guard.fingerprint_slot("target_probs"))
        guard.device_check()
        assert guard.collect() is None
        host = guard._graph["host"]
        assert int(host[_HDR + i]) == to_signed(fingerprint_tensor(out))
        assert int(host[2]) >> i & 1  # present in the mask
        probs_in.view(-1)[7] += 0.25  # the next step's output differs: so must the slot
    with pytest.raises(ValueError, match="not given as precomputed"):
        guard.fingerprint_slot("coins")
    with pytest.raises(ValueError, match="not guarded"):
        guard.prepare_graph(tensors, precomputed=["no_such_quantity"])
    guard.close()


def _graph_half_heal(rank, world):
    """The capturable half (prepare_graph + device_check, eagerly: no CUDA graph on CPU) over
    gloo with fused heal: rank 1's planted bonus is reported and replaced by rank 0's value."""
    from tpguard.device_guard import DeviceStepGuard, decisions_capacity

    t = make_step(0, 0)
    want = t["bonus"].clone()  # rank 0's value (make_step is identical on every rank)
    decisions = {n: t[n] for n in ("seq_lens", "coins", "accept_index", "accept_len", "bonus",
                                   "commit_lens", "out_tokens")}
    guard = DeviceStepGuard(site="graph.heal", policy="heal", run_id="gh", watchdog=False, device="cpu",
                            heal_capacity=decisions_capacity(4, 4))
    guard.prepare_graph(decisions)
    guard.device_check()
    clean = guard.collect()
    if rank == 1:
        t["bonus"][2] += 1  # in place, as a captured graph's static buffer would change
    guard.device_check()
    div = guard.collect()
    guard.close()
    return (clean is None, None if div is None else (div.quantity, div.culprit_ranks, div.action),
            t["bonus"].tolist() == want.tolist())


def test_graph_half_heal_takes_rank0_values_over_gloo():
    r0, r1 = run_ranks(_graph_half_heal, 2)
    assert r0 == r1 == (True, ("bonus", [1], "healed"), True)
