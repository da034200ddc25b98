"""The lanes' compiled entry (kernels/lane_entry.py), built with this machine's C compiler and driven on
CPU tensors: stand-ins take the place of the CUDA device, stream and capture calls and of Triton's C
launch (neither runs without a GPU), as tests/test_direct_launch.py's launcher does. Checked here: the
entry is found under the key `renorm_lane.lane_key` builds, each lane condition sends the call back
(None, nothing launched), the launcher gets the recorded arguments with the call's addresses and scalars
in their slots, and the plan cache's LRU order moves. On a GPU, tests/test_renorm_lane.py's
`test_lanes_on_gpu` runs the entries of real plans."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch

from tpguard.kernels import direct_launch as dl
from tpguard.kernels import lane_entry, renorm_lane

PROBS, OUT, K, P, FP = range(5)
VOCAB = 640


@pytest.fixture
def m():
    module = lane_entry.module()
    if module is None:
        pytest.skip(f"no compiled entry here: {lane_entry.FAILURE}")
    yield module
    module.setup(renorm_lane._ENTRIES, torch.Tensor)  # the lanes' own table again


class Stand:
    """The CUDA calls and the launcher an entry calls, with what they answer."""

    def __init__(self):
        self.device, self.stream, self.capture, self.launched = -1, 77, False, []
        self.lock, self.locked, self.fail = None, [], None  # the cache's lock (`make`), held at each launch

    def launch(self, *args):
        self.locked.append(self.lock.locked())
        if self.fail is not None:
            raise self.fail
        self.launched.append(args)

    def calls(self):
        return (lambda: self.device), (lambda index: self.stream), (lambda: self.capture)


def make(m, stand, op="top_k", k=40, p=None, fp=False, backend="tpguard", table=None):
    """An entry for calls like (probs [4, VOCAB], k, p), put in `table` under the Python lane key."""
    probs = torch.rand(4, VOCAB)
    table = {} if table is None else table
    plan = object()  # the plan the entry serves: the cache must still hold this one
    plans, lock = OrderedDict(a=1, plan=plan, b=3), threading.Lock()
    stand.lock = lock
    slots = {PROBS: 12, OUT: 14}
    kinds = {K: 0, P: 0}
    if k is not None:
        slots[K], kinds[K] = 15, 2 if isinstance(k, torch.Tensor) else 1
    if p is not None:
        slots[P], kinds[P] = 16, 2 if isinstance(p, torch.Tensor) else 1
    fps = torch.zeros((), dtype=torch.int64) if fp else None
    if fp:
        slots[FP] = 17
    args = tuple(f"arg{i}" for i in range(20))
    enter, exit_ = dl.launch_hooks()
    fields = lane_entry.fields(probs=probs, op=op, args=args, slots=slots, aligns={PROBS: 0, OUT: 0, K: 0, P: 0, FP: 0},
                               kinds=kinds, launcher=stand.launch, cuda_calls=stand.calls(),
                               stream=77, hook_owner=dl.hook_owner(), hooks=(enter, exit_), plans=plans,
                               plan_key="plan", lock=lock, plan=plan)
    key = renorm_lane.lane_key(op, probs, k, p, backend, fps, False)
    table[key] = m.entry(fields)
    m.setup(table, torch.Tensor)
    return probs, fps, plans


def call(m, op, probs, k, p, fp=None, backend="tpguard", validate=False):
    return m.call(op, probs, k, p, fp, backend, validate)


def test_the_entry_launches_with_the_calls_addresses_and_scalars(m):
    stand = Stand()
    probs, _, plans = make(m, stand)
    out = call(m, "top_k", probs, 41, None)
    assert out is not None and out.shape == probs.shape and out.dtype == probs.dtype
    (args,) = stand.launched
    assert args[12] == probs.data_ptr() and args[14] == out.data_ptr() and args[15] == 41
    assert all(args[i] == f"arg{i}" for i in range(20) if i not in (12, 14, 15))
    assert list(plans) == ["a", "b", "plan"]  # the LRU order: the plan is the most recent
    assert stand.locked == [True] and not stand.lock.locked()  # launched under the cache's lock, released after
    stand.fail = RuntimeError("launch failed")
    with pytest.raises(RuntimeError, match="launch failed"):  # the launcher's error, the lock released
        call(m, "top_k", probs, 41, None)
    assert not stand.lock.locked()


def test_tensor_parameters_and_a_slot(m):
    stand = Stand()
    k = torch.full((4,), 40, dtype=torch.int32)
    p = torch.full((4,), 0.9)
    probs, fp, _ = make(m, stand, op="top_k_top_p", k=k, p=p, fp=True)
    out = call(m, "top_k_top_p", probs, k, p, fp)
    assert out is not None
    (args,) = stand.launched
    assert (args[15], args[16], args[17]) == (k.data_ptr(), p.data_ptr(), fp.data_ptr())
    strided = torch.zeros(8, dtype=torch.int32)[::2]
    for bad_k, bad_p, bad_fp in ((k.long(), p, fp), (k, p.double(), fp), (k[:2], p, fp), (k, p, fp.int()),
                                 (k, p, torch.zeros(2, dtype=torch.int64)), (strided, p, fp)):
        assert call(m, "top_k_top_p", probs, bad_k, bad_p, bad_fp) is None
    assert call(m, "top_k_top_p", probs, k, p, fp, validate=True) is None  # values to validate: the full way
    assert len(stand.launched) == 1


def test_every_lane_condition_sends_the_call_back(m, monkeypatch):
    stand = Stand()
    probs, _, plans = make(m, stand)
    refused = [
        lambda: call(m, "top_k", probs.t().contiguous().t(), 40, None),  # not contiguous
        lambda: call(m, "top_k", probs, VOCAB, None),  # k >= vocab: other launches
        lambda: call(m, "top_k", probs, 0, None),  # k < 1: the full way's error or clamp
        lambda: call(m, "top_k", probs, 32, None),  # k % 16 == 0: another lane key
        lambda: call(m, "top_k", probs, 40.0, None),  # not an int
        lambda: call(m, "top_k", probs, True, None),
        lambda: call(m, "top_k", probs.double(), 40, None),  # another dtype: another key
        lambda: call(m, "top_k", probs[:3], 40, None),  # another shape
        lambda: call(m, "top_k", torch.nn.Parameter(probs), 40, None),  # not exactly a tensor
        lambda: call(m, "top_k", probs, 40, None, backend="torch"),
        lambda: call(m, "top_p", probs, 40, None),
        lambda: call(m, "top_k", probs, 40, None, fp=torch.zeros((), dtype=torch.int64)),
    ]
    for i, attempt in enumerate(refused):
        assert attempt() is None, i
    offset = torch.empty(4 * VOCAB + 1)[1:].view(4, VOCAB)  # 4 bytes off the recorded 16-byte alignment
    offset.copy_(probs)
    assert call(m, "top_k", offset, 40, None) is None
    for attr, value in (("device", 1), ("stream", 78), ("capture", True)):
        setattr(stand, attr, value)
        assert call(m, "top_k", probs, 40, None) is None, attr
        setattr(stand, attr, Stand().__dict__[attr])
    for knob, value in (("TPGUARD_RENORM_CONFIG", "chunk=4096"), ("TPGUARD_RENORM_PLANS", "0"),
                        ("TPGUARD_LANE_ENTRY", "0")):
        monkeypatch.setenv(knob, value)
        assert call(m, "top_k", probs, 40, None) is None, knob
        monkeypatch.delenv(knob)
    enter = dl.launch_hooks()[0]
    enter.add(lambda *_: None)  # a profiler's hook: Triton's launch from now on
    try:
        assert call(m, "top_k", probs, 40, None) is None
    finally:
        enter.calls.clear()
    assert not stand.launched
    plan = plans.pop("plan")  # evicted
    assert call(m, "top_k", probs, 40, None) is None and not stand.launched
    plans["plan"] = object()  # a new plan under the key: another workspace than the recorded arguments name
    assert call(m, "top_k", probs, 40, None) is None and not stand.launched
    plans["plan"] = plan
    assert call(m, "top_k", probs, 40, None) is not None and len(stand.launched) == 1
    assert not stand.lock.locked()


def test_min_p_range_and_float_parameters(m):
    stand = Stand()
    probs, _, _ = make(m, stand, op="min_p", k=None, p=0.1)
    for ok, value in ((True, 0.0), (True, 1.0), (False, 1.5), (False, float("nan")), (False, -0.1)):
        assert (call(m, "min_p", probs, None, value) is not None) == ok, value
    assert call(m, "min_p", probs, None, 1) is None  # an int: not the lane's float
    stand2 = Stand()
    probs, _, _ = make(m, stand2, op="top_p", k=None, p=0.9)
    assert call(m, "top_p", probs, None, 0.0) is None and call(m, "top_p", probs, None, 1.0) is not None


def test_no_table_no_entries(m):
    m.setup({}, torch.Tensor)
    assert m.call("top_k", torch.rand(2, 8), 4, None, None, "tpguard", False) is None
    with pytest.raises(TypeError):
        m.call("top_k")
    with pytest.raises(KeyError):
        m.entry({})


def test_entries_are_off_unless_the_knob_says_1(monkeypatch):
    monkeypatch.delenv("TPGUARD_LANE_ENTRY", raising=False)
    assert not lane_entry.enabled()
    for value, on in (("1", True), (" 1 ", True), ("0", False), ("", False), ("yes", False)):
        monkeypatch.setenv("TPGUARD_LANE_ENTRY", value)
        assert lane_entry.enabled() == on, value
