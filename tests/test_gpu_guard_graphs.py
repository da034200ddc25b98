"""GPU only (skipped without CUDA; run on the GPU machine, see docs/benchmarks.md): the
production guard's device work captured in a CUDA graph still fingerprints and compares."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("zero_copy", [False, True])
def test_graph_replay_fingerprints_follow_the_data_and_match_eager(zero_copy):
    from tpguard.bench.guard import make_tensors
    from tpguard.device_guard import DeviceStepGuard
    from tpguard.fingerprint import fingerprint_tensor, to_signed
    from tpguard.quantities import CANONICAL_ORDER

    dev = torch.device("cuda")
    t = make_tensors(4, 4, 50000, dev)
    guard = DeviceStepGuard(site="graph.test", run_id="g", watchdog=False)
    guard.prepare_graph(t, zero_copy=zero_copy)
    assert guard._graph["zero_copy"] == zero_copy  # the one-time check passed on this GPU
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        guard.device_check()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        guard.device_check()
    i = CANONICAL_ORDER.index("target_probs")

    def replay_fp():
        graph.replay()
        guard.collect()
        return int(guard._graph["host"][3 + i])

    before = replay_fp()
    assert before == to_signed(fingerprint_tensor(t["target_probs"]))
    x = t["target_probs"].view(-1)
    x[12345] = torch.nextafter(x[12345], torch.tensor(2.0, device=dev))  # plant one ulp in place
    after = replay_fp()
    assert after != before and after == to_signed(fingerprint_tensor(t["target_probs"]))
    steps = [int(guard._graph["host"][0]) for _ in range(1)]
    assert steps[0] >= 2  # the device step counter advanced on every replay
    guard.close()


def test_eager_checks_use_direct_launches():
    """After a few eager checked steps every recorded launch of the guard (fingerprint plan, the
    comparison, whose output shares one buffer with the gathered vector) is a direct launch: no
    refusal recorded (host time; results are Triton's either way)."""
    from tpguard.bench.guard import make_tensors
    from tpguard.device_guard import DeviceStepGuard
    from tpguard.kernels import direct_launch, guard_compare

    if not direct_launch.enabled():
        pytest.skip("direct launches switched off (TPGUARD_FAST_LAUNCH=0)")
    t = make_tensors(4, 4, 50000, torch.device("cuda"))
    guard = DeviceStepGuard(site="direct.test", run_id="d", watchdog=False)
    direct_launch.FAILURES.clear()
    for _ in range(4):
        for name, tensor in t.items():
            guard.record(name, tensor)
        assert guard.check() is None
    torch.cuda.synchronize()
    assert not direct_launch.FAILURES, direct_launch.FAILURES
    assert any(launch.ready for launch in guard_compare._LAUNCHES.values())
    guard.close()
