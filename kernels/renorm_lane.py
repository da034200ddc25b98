"""Plan lanes: an eager renorm call's short way to its cached plan (host time; docs/kernels.md, "Call plans").

Before a plan's own call, an eager renorm call checks and converts its arguments (renorm_args.py),
picks its backend, reads the config and the plan limits, builds the plan key and looks the plan up
(renorm_plan.run): ~7 us of Python per call on a CPU, more on a GPU host, in front of a plan call
that may launch one kernel. A lane remembers where that way ended for one call signature (op,
backend, probs' shape, dtype and device, each parameter's kind, a fingerprint slot or not): a call
that finds its lane and meets its conditions calls the plan at once, with the values the full way
would have handed it. Every other call takes the full way, which checks, converts, clamps or raises
as documented, and makes the lane where one may serve.

A lane's conditions, checked on every call (each is something the full way checks or keys its plan on):

* probs contiguous; on CUDA its device the current one, the current stream the plan's, no capture;
  on the CPU the interpreter still on;
* top_k an int in [1, vocab) (its Triton specialisation is in the lane key), top_p a float in (0, 1]
  (min-p's in [0, 1]), or a parameter tensor already in the kernels' form (int32 / float32, [rows],
  contiguous, on probs' device) where its values are not validated (``validate=False``; the drop-in
  surface never validates them);
* a fingerprint slot: a 1-element int64 tensor on probs' device;
* the renorm config read now the one the lane was made under, and plans still on.

Lanes are made only for plans whose launches are settled (recorded and checked, or off), so a call
through a lane neither records nor grows its plan; an eviction or `clear_plans` drops every lane.
Triton-free: the public API consults it before anything else (renorm.py, flashinfer_api.py).
"""

from __future__ import annotations

import torch

from tpguard.config import interpreting, renorm_plan_limits
from tpguard.kernels.cuda_state import capturing, current_device, current_stream
from tpguard.kernels.renorm_args import tensor_ready

_LANES: dict = {}  # lane key -> Lane; written under renorm_plan's lock, read without one
_ENTRIES: dict = {}  # lane key -> a lane's compiled entry (lane_entry.py), read by the compiled `call`


def _no_entry(op, probs, top_k, top_p, fingerprint_out, backend, validate):
    return None


# `compiled_call(op, probs, top_k, top_p, fingerprint_out, backend, validate)`: the call through its lane's
# compiled entry, or None; the public API asks it first. lane_entry's C function once an entry exists.
compiled_call = _no_entry


def lane_key(op: str, probs, top_k, top_p, backend: str, fingerprint_out, validate: bool) -> tuple | None:
    """The lane key of a call, or None where no lane may serve it (a tensor parameter whose values are
    to be validated, a parameter that is neither an int, a float, a tensor nor absent, probs not a tensor)."""
    if probs.__class__ is not torch.Tensor:
        return None
    kc = top_k.__class__
    if kc is int:
        kc = (top_k == 1, top_k % 16 == 0)  # what Triton bakes into a kernel about an int (direct_launch.int_class)
    elif kc is torch.Tensor:
        if validate:
            return None
    elif top_k is not None:
        return None
    pc = top_p.__class__
    if pc is torch.Tensor:
        if validate:
            return None
    elif pc is not float and top_p is not None:
        return None
    return op, backend, probs.shape, probs.dtype, probs.device, kc, pc, fingerprint_out is None


class Lane:
    """One call signature's way to its plan (`renorm_plan.RenormPlan`)."""

    __slots__ = ("plan", "plan_key", "plans", "lock", "config", "default_config", "vocab", "cuda", "device_index",
                 "stream", "min_p", "key", "entry_tried")

    def __init__(self, plan, plan_key: tuple, plans, lock, config, default_config, probs: torch.Tensor):
        """`plans`, `lock`: renorm_plan's cache and its lock; `config`: the `default_config()` the plan was
        made under (its key holds that config as the op runs it)."""
        self.plan, self.plan_key, self.plans, self.lock = plan, plan_key, plans, lock
        self.config, self.default_config = config, default_config
        self.vocab = probs.shape[1]
        self.cuda = probs.is_cuda
        self.device_index = probs.device.index
        self.stream = plan_key[6]  # renorm_plan.plan_key: the current stream of a CUDA call
        self.min_p = plan.op == "min_p"
        self.key = None  # its lane key (`add`)
        self.entry_tried = not self.cuda  # a compiled entry is made once, on the GPU (lane_entry.for_plan)

    def admits(self, probs: torch.Tensor, top_k, top_p, fingerprint_out) -> bool:
        """The call meets the lane's conditions (the module's docstring)."""
        if self.cuda:
            if current_device() != self.device_index or current_stream() != self.stream or capturing():
                return False
        elif not interpreting():
            return False
        if not probs.is_contiguous():
            return False
        if top_k is not None:
            if top_k.__class__ is int:
                if not 0 < top_k < self.vocab:
                    return False
            elif not tensor_ready(top_k, probs, torch.int32):
                return False
        if top_p is not None:
            if top_p.__class__ is float:
                if not (0.0 <= top_p <= 1.0 if self.min_p else 0.0 < top_p <= 1.0):  # NaN fails both
                    return False
            elif not tensor_ready(top_p, probs, torch.float32):
                return False
        if fingerprint_out is not None and (fingerprint_out.__class__ is not torch.Tensor
                                            or fingerprint_out.dtype != torch.int64 or fingerprint_out.numel() != 1
                                            or fingerprint_out.device != probs.device):
            return False
        return self.default_config() is self.config and renorm_plan_limits()[0] > 0

    def __call__(self, probs: torch.Tensor, top_k, top_p, fingerprint_out):
        """The plan's output, or None where the call must take the full way."""
        if not self.admits(probs, top_k, top_p, fingerprint_out):
            return None
        with self.lock:
            try:
                self.plans.move_to_end(self.plan_key)  # the cache's LRU order, as the full way keeps it
            except KeyError:  # evicted after this call found the lane (evictions drop the lanes)
                return None
            values = [probs, None, top_k, top_p, fingerprint_out, None, None]
            out = self.plan(values)
            if not self.entry_tried and self.plan.graphs_tried:  # the plan's graphs decided: it is settled
                self.entry_tried = True
                _add_entry(self, values)
            return out


def _add_entry(lane: Lane, values: list) -> None:
    """The lane's compiled entry where its plan is one direct launch through Triton's C launch."""
    global compiled_call
    from tpguard.kernels import lane_entry

    entry = lane_entry.for_plan(lane.plan, lane.plan_key, lane.plans, lane.lock, values)
    if entry is None or _LANES.get(lane.key) is not lane:
        return
    module = lane_entry.module()
    module.setup(_ENTRIES, torch.Tensor)
    _ENTRIES[lane.key] = entry
    compiled_call = module.call


def through_lane(op: str, probs, top_k, top_p, backend: str, fingerprint_out, validate: bool) -> tuple:
    """(the output, None) of a call its lane serves (its compiled entry first), else (None, its lane key, for
    the full way to make the lane under). The public API and the drop-in surface begin with it."""
    out = compiled_call(op, probs, top_k, top_p, fingerprint_out, backend, validate)
    if out is not None:
        return out, None
    key = lane_key(op, probs, top_k, top_p, backend, fingerprint_out, validate)
    return call(key, probs, top_k, top_p, fingerprint_out), key


def call(key: tuple | None, probs: torch.Tensor, top_k, top_p, fingerprint_out):
    """The call through the lane of `key` (`lane_key`): its output, or None (no lane, or a condition
    not met: take the full way)."""
    lane = _LANES.get(key) if key is not None else None
    return None if lane is None else lane(probs, top_k, top_p, fingerprint_out)


def add(key: tuple, lane: Lane, probs: torch.Tensor, top_k, top_p, fingerprint_out) -> bool:
    """Keep `lane` under `key` if the call that made it (the values its plan was handed) meets the lane's
    own conditions and key: then every call the lane admits is one the full way would hand the same plan.
    The caller holds renorm_plan's lock."""
    if key[0] != lane.plan.op or key[2:5] != (probs.shape, probs.dtype, probs.device) \
            or not lane.admits(probs, top_k, top_p, fingerprint_out):
        return False
    lane.key = key
    _LANES[key] = lane
    _ENTRIES.pop(key, None)  # a compiled entry belongs to the lane it was made for
    return True


def clear() -> None:
    """Drop every lane and compiled entry (renorm_plan: on any eviction and on `clear_plans`)."""
    _LANES.clear()
    _ENTRIES.clear()


def lanes() -> dict:
    """A copy of the lanes (tests, benchmarks)."""
    return dict(_LANES)


def entries() -> dict:
    """A copy of the compiled entries by lane key (tests, benchmarks)."""
    return dict(_ENTRIES)


__all__ = ["Lane", "add", "call", "clear", "compiled_call", "entries", "lane_key", "lanes", "through_lane"]
