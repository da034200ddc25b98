"""Cached per-call plans of the deterministic renorms and of the fused logits -> target probs op
(eager host time; docs/design-renorm.md, "Host time"; docs/kernels.md, "Call plans").

An eager renorm call is 4-6 Triton launches into a scratch workspace. A plan, cached per
(op, rows, vocab, dtype, RenormConfig, device, current stream, parameter kinds, fingerprint slot
or not), owns that workspace (allocated once) and, on a GPU, from its second call on, the launches
recorded once (kernels/direct_launch.py): a call then allocates `out` and calls ~6 launchers
directly with probs, out, the parameters and the fingerprint slot substituted.
An op is a `PlanOp` (its launches, its workspace, the kernel parameters its scalars arrive in): the
four renorms' are here (`OPS`); kernels/target_probs.py hands its own (logits in, float32 out, with
min-p and the temperature as two more parameters) to `run`.

* Same bits as a fresh workspace: every workspace buffer a kernel reads is written earlier in
  the same call (renorm_passes.Workspace), so nothing is zeroed per call (tests poison it).
* Never during CUDA graph capture: the call takes the fresh-workspace path (the graph's pool
  keeps that alive), and no plan is made or recorded there.
* Per stream: the key holds the current stream (two streams on one workspace would race); a
  plan's workspace is allocated on its stream, so the caching allocator hands it back only to
  work ordered after it.
* Scalar parameters: a float is substituted per call; an int (top-k) is too, but Triton bakes
  ``k == 1`` and ``k % 16 == 0`` into the kernel, so those (and ``k >= vocab``, which changes the
  launches) are part of the key. Tensors must keep the recorded 16-byte alignment (Triton
  specialises pointers on it), else that call takes Triton's launch with the plan's workspace.
* Graphs (up to ``TPGUARD_RENORM_GRAPH_ROWS`` rows, default 1024; calls of 3 or more launches): the
  recorded launches captured once into a CUDA graph the plan owns, replayed per call with the call's
  tensors as its pointer arguments (kernels/renorm_graph.py).
* Bounded: at most ``TPGUARD_RENORM_PLANS`` plans (default 16; 0 = no plans: a fresh workspace and
  Triton's launches per call) and ``TPGUARD_RENORM_PLAN_MB`` MiB of plan memory (default 256; a plan
  larger than that alone is used for its one call and dropped), least recently used evicted first;
  `clear_plans()`.
  ``TPGUARD_FAST_LAUNCH=0`` keeps the workspace cache but launches through Triton.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, fields, is_dataclass
from typing import Callable, Optional

import torch

from tpguard.config import renorm_plan_limits
from tpguard.kernels import direct_launch as dl
from tpguard.kernels import renorm_graph, renorm_lane, renorm_min_p, renorm_top_k, renorm_top_p, row_split
from tpguard.kernels.reference import bits
from tpguard.kernels.renorm_config import RenormConfig, default_config, op_config
from tpguard.kernels.renorm_graph import FP, K, OUT, P, PROBS, ROLES
from tpguard.kernels.renorm_workspace import shapes_for, workspace_for

# The limits (tpguard.config.renorm_plan_limits, read per call): 16 plans by default, as SGLang's verify
# calls two ops per step on bs x draft-token rows, and bs moves as requests come and go; a miss costs
# Triton's launch path (200-420 us of host time per call against 38-70 with a plan). Small plans are
# small (0.1-3 MiB at <= 8 rows); the byte cap (256 MiB by default) bounds the large ones.
OPS = ("top_k", "top_p", "top_k_top_p", "min_p")
# roles of a call's values (direct_launch.LaunchSet): the tensors and scalars a plan substitutes:
# PROBS, OUT, K, P, FP, MP, T (renorm_graph.ROLES; MP and T: the fused op's min-p and temperature)
_PLANS: OrderedDict = OrderedDict()
# One plan call at a time per process: the cache is shared, and recording swaps a compiled kernel's
# launcher for a recorder (a second thread launching that kernel meanwhile would be swallowed).
_LOCK = threading.Lock()


@dataclass(frozen=True)
class PlanOp:
    """What a plan needs of an op. `launch(values, cfg, ws, out=None)`: the op's Triton launches on a
    call's `values` (ROLES, OUT unused), into workspace `ws` (None: a fresh one) and `out` (None: a new
    tensor), returning the output; no torch work but allocations (the recording refuses any).
    `workspace(rows, vocab, cfg, device, values)`: the scratch a plan keeps (a dataclass whose fields
    are tensors or such dataclasses). `scalar_slots`: (role, kernel parameter name) of each role a
    scalar value arrives in. `out_dtype`: the output's (None: probs'). `row_split`: a call captured
    in a CUDA graph runs its rows in parts (kernels/row_split.py; needs `out`)."""

    name: str
    launch: Callable
    workspace: Callable
    scalar_slots: tuple
    out_dtype: Optional[torch.dtype] = None
    row_split: bool = False


def _op_module(op: str):
    return renorm_top_p if op == "top_p" else renorm_min_p if op == "min_p" else renorm_top_k


def _run_op(op: str, probs, k, p, cfg, fp, ws, out=None):
    m = _op_module(op)
    if op == "top_p":
        return m.top_p_renorm_triton(probs, p, cfg, fp, workspace=ws, out=out)
    if op == "min_p":
        return m.min_p_renorm_triton(probs, p, cfg, fp, workspace=ws, out=out)
    if op == "top_k":
        return m.top_k_renorm_triton(probs, k, cfg, fp, workspace=ws, out=out)
    return m.top_k_top_p_renorm_triton(probs, k, p, cfg, fp, workspace=ws, out=out)


def _launch_renorm(op: str, values, cfg, ws, out=None):
    return _run_op(op, values[PROBS], values[K], values[P], cfg, values[FP], ws, out)


def _renorm_workspace(op: str, rows: int, vocab: int, cfg: RenormConfig, device, values):
    flags = _op_module(op).workspace_flags(vocab, values[K], values[P])
    return workspace_for(shapes_for(rows, vocab, cfg), cfg, device, *flags)


# the renorms' table; min-p's parameter arrives in role P, as kernel parameter mp_val
RENORM_OPS = {op: PlanOp(op, functools.partial(_launch_renorm, op), functools.partial(_renorm_workspace, op),
                         ((K, "k_val"), (P, "mp_val" if op == "min_p" else "p_val")), row_split=True)
              for op in OPS}


def _part_config(cfg: RenormConfig, rows: int) -> RenormConfig:
    """The config of a split call's parts: PDL decided from the whole call's rows (RenormConfig.pdl_min_rows),
    so the parts launch the kernel variants the eager warm-up of that call compiled (no compile in a capture)."""
    if not cfg.pdl:
        return cfg
    return cfg.replace(pdl_min_rows=0) if rows >= cfg.pdl_min_rows else cfg.replace(pdl=0)


def plan_allowed(capturing: bool, max_plans: int | None = None) -> bool:
    """The capture rule: a plan (cached workspace, recorded launches) is used only outside CUDA
    graph capture, and only with plans switched on (`max_plans`, default TPGUARD_RENORM_PLANS)."""
    if max_plans is None:
        max_plans = renorm_plan_limits()[0]
    return max_plans > 0 and not capturing


def _capturing(probs: torch.Tensor) -> bool:
    return probs.is_cuda and dl.capturing()


def _kind(value, vocab: int, integer: bool):
    """What of a parameter the plan is keyed on: absent, a tensor's dtype, or for a scalar what
    the launches depend on (an int's Triton specialisation and k >= vocab; nothing of a float:
    substituted per call, as every float parameter of these kernels is fp32, never specialised)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.dtype
    if integer:
        return ("int",) + dl.int_class(value) + (value >= vocab,)
    return "float"


def plan_key(op, probs: torch.Tensor, k, p, cfg: RenormConfig, fp, mp=None, t=None) -> tuple:
    """`op`: a renorm's name or a `PlanOp`; `mp`, `t`: the fused op's min-p and temperature."""
    rows, vocab = probs.shape
    stream = dl.current_stream() if probs.is_cuda else None
    return (getattr(op, "name", op), rows, vocab, probs.dtype, cfg, probs.device, stream, _kind(k, vocab, True),
            _kind(p, vocab, False), fp is not None, _kind(mp, vocab, False), _kind(t, vocab, False))


def _tensors(ws):
    """The tensors of a workspace (a dataclass; fields that are dataclasses are walked too)."""
    for f in fields(ws):
        v = getattr(ws, f.name)
        if isinstance(v, torch.Tensor):
            yield v
        elif is_dataclass(v):
            yield from _tensors(v)


def _storage_bytes(tensors, seen: set) -> int:
    n = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                n += st.nbytes()
    return n


class RenormPlan:
    """One cached call shape: its workspace and (GPU) its recorded launches."""

    # ordinary tensors even when made under inference mode: the one-time check fills them in place,
    # maybe outside it
    @torch.inference_mode(False)
    def __init__(self, spec: PlanOp, rows: int, vocab: int, cfg: RenormConfig, device: torch.device, values):
        """`values`: the first call's (ROLES); the plan serves calls of its key (`plan_key`)."""
        self.spec, self.op, self.cfg, self.device = spec, spec.name, cfg, device
        self.ws = spec.workspace(rows, vocab, cfg, device, values)
        self._seen: set = set()
        self.nbytes = _storage_bytes(_tensors(self.ws), self._seen)
        self.direct: dl.LaunchSet | None = None
        # "untested": launches recorded at the second call; "on"; "off" (CPU, interpreter, refused)
        self.state = "untested" if (dl.enabled() and device.type == "cuda") else "off"
        self.refusal = ""
        self.calls = 0
        self.graphs: renorm_graph.PlanGraphs | None = None  # replays (renorm_graph.py)
        self.graphs_tried = False  # made once per plan, or refused for good
        self.rows = rows
        # a fingerprint slot with more rows than one finalize program hashes takes a torch copy
        # after the launches (renorm_write_fp.launch_write_fp): Triton's launches there
        if values[FP] is not None and self.state == "untested":
            from tpguard.kernels import fingerprint_config

            if rows > fingerprint_config.default_config().finalize_rows:
                self.state, self.refusal = "off", "fingerprint slot with rows > finalize_rows"

    def __call__(self, values: list):
        """The call's output; `values`: its roles (ROLES, OUT None)."""
        if self.state == "on":
            if not self.graphs_tried:  # decided once per plan
                self.graphs_tried = True
                if renorm_graph.worth_graph(self.rows, len(self.direct.launches)):
                    self._new_graphs(values)
            out_dtype = self.spec.out_dtype  # no dtype= keyword where it is None: ~0.2 us per call
            values[OUT] = torch.empty_like(values[PROBS]) if out_dtype is None else \
                torch.empty_like(values[PROBS], dtype=out_dtype)
            graphs = self.graphs
            if graphs is None:
                if self.direct.launch_if_accepted(values):
                    return values[OUT]
            elif self.direct.accepts(values):
                if not graphs(values):
                    if graphs.state == "off":  # refused for good (PlanGraphs.refusal)
                        self.graphs = None
                    self.direct(values)
                return values[OUT]
            values[OUT] = None
        elif self.state == "untested":
            self.calls += 1
            if self.calls >= 2:  # a plan used once (a passing shape) never pays for the set-up
                return self._record(values)
        return self.spec.launch(values, self.cfg, self.ws)

    def _new_graphs(self, values: list) -> None:
        """The plan's graphs (renorm_graph.py; they hold no buffer of the batch), or none for good."""
        try:
            self.graphs = renorm_graph.PlanGraphs(self.op, self.direct, values[PROBS].device)
        except Exception as e:  # noqa: BLE001 - the direct launches serve
            dl.FAILURES[f"renorm graph {self.op}"] = f"{type(e).__name__}: {e}"[:300]

    def poison(self) -> None:
        """Garbage in every workspace buffer (NaN floats, zero ints): a later call must not
        depend on it (tests; the direct launches' one-time check)."""
        for t in _tensors(self.ws):
            t.fill_(float("nan") if t.dtype.is_floating_point else 0)

    def _record(self, values: list):
        """Triton's launches (the caller's result), recorded; then, once per compiled variant per
        process, a direct run from a poisoned workspace that must give the same bits."""
        values = distinct_roles(values)
        out = None
        try:
            with dl.capture_launches() as (captured, torch_ops):
                out = self.spec.launch(values, self.cfg, self.ws)
            scalars = {name: role for role, name in self.spec.scalar_slots
                       if values[role] is not None and not isinstance(values[role], torch.Tensor)}
            recorded = list(values)
            recorded[OUT] = out
            launches = dl.LaunchSet.record(captured, torch_ops, recorded, ROLES, scalars)
        except Exception as e:  # noqa: BLE001 - the recording failed: Triton's launches, as before
            launches = f"{type(e).__name__}: {e}"[:300]
        captured = None
        if isinstance(launches, str):
            self.state, self.refusal = "off", launches
            dl.FAILURES[f"renorm {self.op}"] = launches
            return out if out is not None else self.spec.launch(values, self.cfg, self.ws)
        fp = values[FP]

        def rerun() -> bool:
            self.poison()
            direct = list(values)
            direct[OUT], direct[FP] = torch.full_like(out, float("nan")), renorm_graph.aligned_like(fp)
            if fp is not None:
                direct[FP].copy_(fp).bitwise_not_()  # a finalize that wrote nothing shows
            if not launches.accepts(direct):
                raise RuntimeError("the check's own tensors are refused (alignment)")
            launches(direct)
            same = torch.equal(bits(direct[OUT]), bits(out))
            return same and (fp is None or torch.equal(direct[FP].view(1), fp.view(1)))

        if dl.validate_once(launches, rerun):
            self.direct, self.state = launches, "on"
            self.nbytes += _storage_bytes((a for x in launches.launches for a in x.keep), self._seen)
        else:
            self.state, self.refusal = "off", dl.FAILURES.get(launches.names, "validation failed")
        return out


def distinct_roles(values: list) -> list:
    """`values` with a tensor passed in two roles (the fused op's top-p and min-p may be one tensor)
    as two objects over the same memory: the recording finds a role's arguments by identity, and a
    later call may pass two tensors there."""
    seen, out = set(), list(values)
    for r, v in enumerate(out):
        if isinstance(v, torch.Tensor):
            if id(v) in seen:
                out[r] = v.detach()
            seen.add(id(out[r]))
    return out


def _evict(newest, max_plans: int, max_bytes: int) -> None:
    """Least recently used plans out until the limits hold; a plan over the byte cap alone goes (and
    with any plan, every lane: renorm_lane.py)."""
    n = len(_PLANS)
    if newest.nbytes > max_bytes:
        for key, plan in list(_PLANS.items()):
            if plan is newest:
                del _PLANS[key]
    total = sum(plan.nbytes for plan in _PLANS.values())
    while _PLANS and (len(_PLANS) > max_plans or total > max_bytes):
        _, plan = _PLANS.popitem(last=False)
        total -= plan.nbytes
    if len(_PLANS) != n:
        renorm_lane.clear()


def _scalars(probs: torch.Tensor, top_k, top_p) -> tuple:
    """Scalar parameters as the kernels get them: k clamped to [1, vocab], p a float."""
    if type(top_k) is int:
        top_k = min(max(top_k, 1), probs.shape[1])
    elif top_k is not None and not isinstance(top_k, torch.Tensor):
        top_k = int(min(max(int(top_k), 1), probs.shape[1]))
    return top_k, _float(top_p)


def _float(value):
    """A scalar float parameter as the kernels get it (a Python float); None or a tensor as it is."""
    return value if value is None or type(value) is float or isinstance(value, torch.Tensor) else float(value)


def run(op, probs: torch.Tensor, top_k=None, top_p=None, config: RenormConfig | None = None,
        fingerprint_out: torch.Tensor | None = None, *, min_p=None, temperature=None, lane_key=None) -> torch.Tensor:
    """The Triton op `op` (a renorm's name, one of OPS, or a `PlanOp`: kernels/target_probs.py's)
    through its cached plan; the fresh-workspace path during CUDA graph capture, with plans off,
    and for empty batches. `top_k`: an int (clamped to [1, vocab]) or an int32 [rows] tensor;
    `top_p` (also min-p's parameter for the renorm min_p), the fused op's `min_p` and `temperature`:
    floats or float32 [rows] tensors; all on probs' device (renorm.py and
    target_probs.py prepare them). `lane_key`: the call's (renorm_lane.lane_key), under which
    a lane to the plan is made once its launches are settled (with the config read per call only)."""
    spec = RENORM_OPS[op] if isinstance(op, str) else op
    base = config or default_config()
    if config is not None or not isinstance(op, str):
        lane_key = None
    guard = dl.device_guard(probs.device)  # the launches, the stream in the key: probs' device
    if not isinstance(guard, torch.cuda.device):  # nothing to switch (entering a no-op guard costs two calls)
        return _run(spec, probs, top_k, top_p, base, fingerprint_out, min_p, temperature, lane_key)
    with guard:  # a lane serves only calls on the current device: none made here
        return _run(spec, probs, top_k, top_p, base, fingerprint_out, min_p, temperature, None)


def _run(spec: PlanOp, probs: torch.Tensor, top_k, top_p, base: RenormConfig, fingerprint_out, min_p,
         temperature, lane_key) -> torch.Tensor:
    rows, vocab = probs.shape
    cfg = op_config(base, spec.name, rows, vocab)
    top_k, top_p = _scalars(probs, top_k, top_p)  # every path below, plans or not, gets them so
    min_p, temperature = _float(min_p), _float(temperature)
    capturing = _capturing(probs)
    # a captured call's rows in parts on side streams (kernels/row_split.py); the streams are made
    # by an eager call (the warm-up before a capture), never during a capture
    parts = row_split.parts_for(rows, cfg.graph_row_split) \
        if spec.row_split and probs.is_cuda and fingerprint_out is None else 1
    streams = row_split.side_streams(probs.device, parts, create=not capturing) if parts > 1 else None
    if capturing and streams:
        part_cfg = _part_config(cfg, rows)
        return row_split.run_split(lambda x, k, p, out: spec.launch([x, None, k, p, None, None, None], part_cfg,
                                                                    None, out),
                                   probs, (top_k, top_p), parts, streams)
    max_plans, max_bytes = renorm_plan_limits()
    if rows == 0 or not plan_allowed(capturing, max_plans):
        return spec.launch([probs, None, top_k, top_p, fingerprint_out, min_p, temperature], cfg, None)
    key = plan_key(spec, probs, top_k, top_p, cfg, fingerprint_out, min_p, temperature)
    values = [probs, None, top_k, top_p, fingerprint_out, min_p, temperature]
    with _LOCK:
        plan = _PLANS.get(key)
        if plan is None:
            plan = RenormPlan(spec, rows, vocab, cfg, probs.device, values)
            _PLANS[key] = plan
            nbytes = -1
        else:
            _PLANS.move_to_end(key)
            nbytes = plan.nbytes
        out = plan(values)
        if plan.nbytes != nbytes:  # a new plan, or one that just recorded its launches
            _evict(plan, max_plans, max_bytes)
        if lane_key is not None and plan.state != "untested" and _PLANS.get(key) is plan:
            renorm_lane.add(lane_key, renorm_lane.Lane(plan, key, _PLANS, _LOCK, base, default_config, probs),
                            probs, top_k, top_p, fingerprint_out)
    return out


def clear_plans() -> None:
    """Drop every cached plan (their workspaces go back to torch's caching allocator)."""
    with _LOCK:
        _PLANS.clear()
        renorm_lane.clear()


def plans() -> list:
    """(key, plan) of the cached plans, least recently used first (benchmarks, tests)."""
    return list(_PLANS.items())


def plan_bytes() -> int:
    return sum(plan.nbytes for plan in _PLANS.values())


__all__ = ["OPS", "RENORM_OPS", "PlanOp", "RenormPlan", "clear_plans", "distinct_roles", "plan_allowed",
           "plan_bytes", "plan_key", "plans", "run"]
