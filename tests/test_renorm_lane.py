"""Plan lanes (kernels/renorm_lane.py): a repeated renorm call goes straight to its cached plan, and
only where the full way would have handed that plan the same values; every other call takes the full
way (checks, conversions, errors, the plan key). Under the interpreter the plans' launches are Triton's
(state off) and the lanes are the same code; on a GPU, `test_lanes_on_gpu` adds the direct launches,
another stream and a CUDA graph capture."""

from __future__ import annotations

import pytest
import torch
from renorm_setup import DEVICE, GPU_ALL, SMALL_TEXT

from tpguard.kernels import direct_launch as dl
from tpguard.kernels import flashinfer_api as fa
from tpguard.kernels import renorm as tk
from tpguard.kernels import renorm_lane, renorm_plan
from tpguard.kernels.reference import bits

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

VOCAB = 700
# calls of a new signature on the full way before its lane: a lane is made once its plan's launches are
# settled, on a GPU at the plan's second call (it records them), under the interpreter at its first (off)
WARM = 2 if DEVICE == "cuda" else 1


def call(op: str, x, k=40, p=None, backend: str = "tpguard", **kw):
    """The public renorm `op` (min-p's parameter is `p`)."""
    if op == "top_k":
        return tk.top_k_renorm(x, k, backend=backend, **kw)
    if op == "top_p":
        return tk.top_p_renorm(x, 0.9 if p is None else p, backend=backend, **kw)
    if op == "top_k_top_p":
        return tk.top_k_top_p_renorm(x, k, 0.9 if p is None else p, backend=backend, **kw)
    return tk.min_p_renorm(x, 0.05 if p is None else p, backend=backend, **kw)


@pytest.fixture(autouse=True)
def _small_plans(monkeypatch, request):
    if DEVICE == "cuda" and not GPU_ALL and request.node.name != "test_lanes_on_gpu":
        pytest.skip("GPU: the GPU lane test only (TPGUARD_RENORM_GPU_TESTS=all runs every test)")
    monkeypatch.setenv("TPGUARD_RENORM_CONFIG", SMALL_TEXT)  # several chunks at 700 entries
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "4")
    renorm_plan.clear_plans()
    yield
    renorm_plan.clear_plans()


@pytest.fixture
def full_way(monkeypatch):
    """The ops of the calls that took the full way to their plan (renorm_plan._run); each runs as before."""
    ops = []
    real = renorm_plan._run

    def counted(spec, *args):
        ops.append(spec.name)
        return real(spec, *args)

    monkeypatch.setattr(renorm_plan, "_run", counted)
    return ops


def batch(rows: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0, 5.0, 2.0, 1.0]).repeat(rows)[:rows, None]
    return torch.softmax(torch.randn(rows, VOCAB, generator=g, dtype=torch.float64) * scale, -1).float().to(DEVICE)


def warm(fn):
    """`fn()` until its lane is made (WARM calls); the last output."""
    for _ in range(WARM):
        out = fn()
    return out


def slot() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("op", [pytest.param(op, marks=[pytest.mark.slow] if op == "top_k_top_p" else [])
                                for op in renorm_plan.OPS])
def test_a_repeated_call_takes_its_lane(op, full_way):
    x = batch()
    first = warm(lambda: call(op, x))
    assert full_way == [op] * WARM and len(renorm_lane.lanes()) == 1
    for _ in range(2):
        out = call(op, x)
        assert torch.equal(bits(out), bits(first)) and out.data_ptr() != first.data_ptr()
    assert full_way == [op] * WARM  # both later calls took the lane
    torch.testing.assert_close(first, call(op, x, backend="torch"), rtol=0, atol=2e-7)


def test_the_drop_in_surface_takes_lanes_with_tensor_parameters_and_a_slot(full_way):
    # SGLang's call: int32 / float32 tensors of one value per row, a fingerprint slot
    x = batch()
    k = torch.tensor([40, 3, 40, VOCAB], dtype=torch.int32, device=DEVICE)
    fp1, fp2 = slot(), slot()
    first = warm(lambda: fa.top_k_renorm_probs(x, k, fingerprint_out=fp1))
    again = fa.top_k_renorm_probs(x, k, fingerprint_out=fp2)
    assert full_way == ["top_k"] * WARM
    assert torch.equal(bits(again), bits(first)) and int(fp2) == int(fp1) != 0
    k.fill_(5)  # refilled in place: read again by the kernels, not remembered
    fa.top_k_renorm_probs(x, k, fingerprint_out=fp2)
    assert full_way == ["top_k"] * WARM and int(fp2) != int(fp1)
    # a slot the full way refuses, with its own message (a kernel's launcher, which a lane would reach, has another)
    with pytest.raises(ValueError, match="^fingerprint_out: "):
        fa.top_k_renorm_probs(x, k, fingerprint_out=torch.zeros((), dtype=torch.int32, device=DEVICE))
    for _ in range(2):  # int64 k: converted on the full way each time (the lane takes int32 only)
        assert torch.equal(bits(fa.top_k_renorm_probs(x, k.long(), fingerprint_out=fp2)), bits(_top_k5(x)))
    assert full_way == ["top_k"] * (WARM + 2)
    assert torch.equal(bits(fa.top_k_renorm_probs(x, k)), bits(_top_k5(x)))
    assert full_way == ["top_k"] * (WARM + 3)  # no slot: another lane


def _top_k5(x):
    return tk.top_k_renorm(x, 5, backend="torch")


def test_calls_outside_a_lanes_conditions_take_the_full_way(full_way, monkeypatch):
    x = batch()
    want = warm(lambda: call("min_p", x))
    assert len(full_way) == WARM and len(renorm_lane.lanes()) == 1
    odd = torch.empty(VOCAB, 4, device=DEVICE).t()  # not contiguous
    odd.copy_(x)
    assert torch.equal(bits(call("min_p", odd)), bits(want)) and len(full_way) == WARM + 1
    for bad in (1.5, float("nan"), -0.1):  # the public API's one-line errors, lane or not
        with pytest.raises(ValueError, match="min_p"):
            call("min_p", x, p=bad)
    with pytest.raises(ValueError, match="fingerprint_out"):
        call("min_p", x, fingerprint_out=torch.zeros((), dtype=torch.int32, device=DEVICE))
    # a tensor parameter: validated values take the full way (a host sync); another dtype is converted there
    p64 = torch.full((4,), 0.05, dtype=torch.float64, device=DEVICE)
    n = len(full_way)
    for validate in (True, False, False, False):
        assert torch.equal(bits(call("min_p", x, p=p64, validate=validate)), bits(want))
    assert len(full_way) == n + 4
    monkeypatch.setenv("TPGUARD_RENORM_CONFIG", SMALL_TEXT + ",min_p_groups=4")  # read per call: a new plan
    assert torch.equal(bits(call("min_p", x)), bits(want)) and len(full_way) == n + 5
    assert len(renorm_plan.plans()) == 3
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "0")  # plans switched off: no lane serves
    assert torch.equal(bits(call("min_p", x)), bits(want)) and len(full_way) == n + 6
    if DEVICE == "cpu":  # the interpreter switched off: backend "tpguard" refuses a CPU tensor, lane or not
        monkeypatch.delenv("TPGUARD_RENORM_PLANS")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs a CUDA tensor"):
            call("min_p", x)


def test_a_top_k_lane_keeps_tritons_int_specialisation(full_way):
    x = batch(rows=2)
    want = {k: tk.top_k_renorm(x, k, backend="torch") for k in (7, 32, 1, VOCAB)}
    warm(lambda: call("top_k", x, k=40))
    assert torch.equal(bits(call("top_k", x, k=7)), bits(want[7]))  # the class of 40: its lane
    assert full_way == ["top_k"] * WARM
    for k in (32, 1, VOCAB):  # k % 16 == 0, k == 1, k >= vocab: other launches, each the full way
        torch.testing.assert_close(call("top_k", x, k=k), want[k], rtol=0, atol=2e-7)
    assert full_way == ["top_k"] * (WARM + 3) and len(renorm_plan.plans()) == 4
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        call("top_k", x, k=0)


def test_evictions_and_clear_plans_drop_the_lanes(full_way, monkeypatch):
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "1")
    x = batch()
    warm(lambda: call("min_p", x))
    (first,) = renorm_lane.lanes()
    call("min_p", x[:2])  # a second plan evicts the first, and every lane goes with it
    assert first not in renorm_lane.lanes()
    warm(lambda: call("min_p", x[:2]))
    assert [k[2] for k in renorm_lane.lanes()] == [torch.Size([2, VOCAB])]
    call("min_p", x)
    assert len(full_way) == 2 * WARM + 1
    renorm_plan.clear_plans()
    assert renorm_lane.lanes() == {}


def test_lane_keys():
    x = batch()
    key = renorm_lane.lane_key("top_k", x, 40, None, "tpguard", None, True)
    assert key == ("top_k", "tpguard", x.shape, x.dtype, x.device, (False, False), type(None), True)
    assert renorm_lane.lane_key("top_k", x, 32, None, "tpguard", None, True)[5] == (False, True)
    k = torch.full((4,), 40, dtype=torch.int32)
    assert renorm_lane.lane_key("top_k", x, k, None, "tpguard", None, True) is None  # values to validate
    assert renorm_lane.lane_key("top_k", x, k, None, "tpguard", None, False)[5] is torch.Tensor
    import numpy as np

    for args in ((x.numpy() if DEVICE == "cpu" else [], 40, None), (x, np.int64(40), None), (x, None, 1)):
        assert renorm_lane.lane_key("top_k_top_p", *args, "tpguard", None, False) is None


def test_a_lane_is_made_only_for_the_values_its_plan_was_handed(full_way):
    # top-p through the drop-in surface casts float64 to float32 before its plan: no lane under float64
    x64 = batch().double()
    for _ in range(2):
        fa.top_p_renorm_probs(x64, 0.9)
    assert len(full_way) == 2 and renorm_lane.lanes() == {}


@pytest.mark.skipif(DEVICE != "cuda" or not dl.enabled(), reason="direct launches need CUDA")
def test_lanes_on_gpu(full_way, monkeypatch):
    from tpguard.kernels import lane_entry

    monkeypatch.setenv("TPGUARD_LANE_ENTRY", "1")  # the compiled entries too (kernels/lane_entry.py)
    # room for every plan below (two per op: its stream's and the side stream's): an eviction drops every lane
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "16")
    in_python = []  # calls a lane served in Python (not its compiled entry)
    real = renorm_lane.Lane.__call__

    def counted(self, *args):
        in_python.append(1)
        return real(self, *args)

    monkeypatch.setattr(renorm_lane.Lane, "__call__", counted)
    x = torch.softmax(torch.randn(8, 32000, device="cuda") * 3, -1)
    kt = torch.full((8,), 40, dtype=torch.int32, device="cuda")
    # (name, call, whether its plan is the one-launch top-k, which takes a compiled entry: lane_entry.py)
    ops = (("top_k", lambda: tk.top_k_renorm(x, 40), True), ("top_p", lambda: tk.top_p_renorm(x, 0.9), False),
           ("drop-in top_k", lambda: fa.top_k_renorm_probs(x, kt), True))
    for name, fn, one_launch in ops:
        full_way.clear()
        first = fn()  # the plan made
        assert torch.equal(bits(fn()), bits(first)), name  # its launches recorded; the lane made
        n = len(full_way)
        before = set(renorm_lane.entries())
        in_python.clear()
        # the lane in Python: the plan's first direct call settles its graphs, then the lane makes its entry
        assert torch.equal(bits(fn()), bits(first)) and len(full_way) == n and len(in_python) == 1, name
        made = set(renorm_lane.entries()) - before
        assert len(made) == int(one_launch), (name, lane_entry.FAILURE)
        in_python.clear()
        for _ in range(2):  # through the entry where one was made: the same bits, a fresh output each call
            again = fn()
            assert torch.equal(bits(again), bits(first)) and again.data_ptr() != first.data_ptr(), name
        assert len(full_way) == n and len(in_python) == (0 if one_launch else 2), name
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # another stream: its own plan, the full way
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(bits(out), bits(first)) and len(full_way) == n + 1, name
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a capture: the full way's fresh workspace, never a plan's
            captured = fn()
        graph.replay()
        assert torch.equal(bits(captured), bits(first)) and len(full_way) == n + 2, name
        if one_launch:  # the knob off: the entry refuses, the call takes its lane in Python
            monkeypatch.setenv("TPGUARD_LANE_ENTRY", "0")
            in_python.clear()
            assert torch.equal(bits(fn()), bits(first)) and len(full_way) == n + 2 and in_python, name
            monkeypatch.setenv("TPGUARD_LANE_ENTRY", "1")
    plan = next(p for _, p in renorm_plan.plans() if p.op == "top_k")
    assert plan.state == "on", plan.refusal


def test_threads_evicting_each_others_plans_keep_their_results(monkeypatch):
    # one plan at a time: each thread's call evicts the other's plan and drops every lane, while the other
    # may hold a lane it found just before (its call then takes the full way, or the plan it still holds)
    import threading

    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "1")
    xs = [batch(rows=r, seed=r) for r in (2, 3)]
    want = [call("min_p", x, backend="torch") for x in xs]
    bad = []

    def work(i):
        try:
            for _ in range(6):
                out = call("min_p", xs[i])
                if not torch.allclose(out, want[i], rtol=0, atol=2e-7):
                    bad.append(i)
        except Exception as e:  # noqa: BLE001 - a thread's exception would not reach the test
            bad.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and len(renorm_plan.plans()) == 1
