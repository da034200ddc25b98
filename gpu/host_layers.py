"""Host time of an eager renorm call, layer by layer (no sync in the loops): the public call (a repeated
call takes its lane straight to the plan, kernels/renorm_lane.py: in Python, and with TPGUARD_LANE_ENTRY=1
through its compiled entry where it has one, kernels/lane_entry.py), run_op (the full way, no lane), the
plan cache (renorm_plan.run), the plan's own call, its direct launches, one launch (and Triton's C
launcher alone, its arguments built beforehand: mostly the driver's call), and the pieces
of the cache lookup; flashinfer's default beside it (docs/design-renorm.md, "Host time").

    python gpu/host_layers.py

CPU (``--cpu``, under ``TRITON_INTERPRET=1``): tpguard's own Python in front of the plan's call, every
plan's call swapped for a no-op (no kernel runs): the public call, the drop-in surface with a tensor
parameter (as the SGLang plugin calls it), run_op, the plan cache and the lookup's pieces, us per call
(the best of 5 rounds of N calls).

    TRITON_INTERPRET=1 python gpu/host_layers.py --cpu
"""

from __future__ import annotations

import sys
import time

import torch
from tpguard.config import env_set
from tpguard.kernels import direct_launch as dl
from tpguard.kernels import flashinfer_api
from tpguard.kernels import renorm as tk
from tpguard.kernels import renorm_lane, renorm_plan
from tpguard.kernels.renorm_config import default_config

from tpguard.bench.kernels import flashinfer_sampling
from tpguard.bench.timing import time_host

N = 2000
CELLS = ((1, 32000, "top_k"), (64, 32000, "top_k"), (256, 32000, "top_k"), (1, 32000, "top_p"),
         (64, 32000, "top_p"))


def host(fn, n: int = N) -> float:
    for _ in range(5):
        fn()
    return time_host(fn, n)


def python_only(fn, n: int = N) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def served_by() -> str:
    """Whether the one plan's lane has a compiled entry, and if not what its plan is (the drop-in's rows)."""
    if renorm_lane.entries():
        return " (its entry)"
    plans = renorm_plan.plans()
    if len(plans) != 1:
        return f" (no entry; {len(plans)} plans)"
    plan = plans[0][1]
    launches = None if plan.direct is None else len(plan.direct.launches)
    return f" (no entry; plan {plan.state} {plan.refusal[:60]}, graphs {plan.graphs is not None}, launches {launches})"


def layers(x: torch.Tensor, op: str, fs) -> list[tuple[str, float]]:
    k, p = (40, None) if op == "top_k" else (None, 0.9)
    public = (lambda: tk.top_k_renorm(x, 40, validate=False)) if op == "top_k" else \
        (lambda: tk.top_p_renorm(x, 0.9, validate=False))
    rows = x.shape[0]  # SGLang's parameters: int32 / float32 tensors of one value per row, through the drop-in
    kt, pt = torch.full((rows,), 40, dtype=torch.int32, device=x.device), torch.full((rows,), 0.9, device=x.device)
    drop_in = (lambda: flashinfer_api.top_k_renorm_probs(x, kt)) if op == "top_k" else \
        (lambda: flashinfer_api.top_p_renorm_probs(x, pt))
    # the lane in Python, then through the compiled entry where its plan has one: new plans for each (an entry
    # is made by a lane once, and one made under a value of the knob refuses every call once it changes)
    renorm_plan.clear_plans()
    with env_set("TPGUARD_LANE_ENTRY", "0"):
        python_lane = host(public)
    renorm_plan.clear_plans()
    with env_set("TPGUARD_LANE_ENTRY", "1"):
        compiled = host(public)
    renorm_plan.clear_plans()
    out = [("public call, TPGUARD_LANE_ENTRY=0", python_lane), ("public call, TPGUARD_LANE_ENTRY=1", compiled),
           ("run_op", host(lambda: tk.run_op(op, x, k, p))),
           ("renorm_plan.run", host(lambda: renorm_plan.run(op, x, k, p)))]
    plan = next(plan for key, plan in renorm_plan.plans() if key[0] == op and key[1] == x.shape[0])
    values = [x, None, k, p, None, None, None]
    out.append((f"plan call (state {plan.state}, graphs {plan.graphs is not None})", host(lambda: plan(list(values)))))
    # the lookup's own Python: the plan's call swapped for a no-op on this one plan (one that returns a
    # tensor: a lane takes None for "the full way")
    real = type(plan).__call__
    type(plan).__call__ = lambda self, v: v[0] if self is plan else real(self, v)
    try:
        out.append(("plan cache lookup alone", python_only(lambda: renorm_plan.run(op, x, k, p))))
        with env_set("TPGUARD_LANE_ENTRY", "0"):  # the lane's Python (an entry would launch the real kernel)
            out.append(("public call's lane alone", python_only(public)))
    finally:
        type(plan).__call__ = real
    if plan.direct is not None:
        direct = list(values)
        direct[1] = torch.empty_like(x)
        stream = dl.current_stream()
        first = plan.direct.launches[0]
        args = first.template.copy()  # the launcher's arguments as `launch` builds them, built once here
        args[3] = stream
        for i, role, as_ptr in first.slots:
            args[i] = direct[role].data_ptr() if as_ptr else direct[role]
        args = tuple(args)
        out += [(f"direct launches ({len(plan.direct.launches)})", host(lambda: plan.direct(direct))),
                ("one launch", host(lambda: first.launch(stream, direct))),
                ("one launch, its arguments prebuilt (the launcher alone)", host(lambda: first.run(*args))),
                ("accepts", python_only(lambda: plan.direct.accepts(direct)))]
    cfg = default_config()
    out += [("empty_like", host(lambda: torch.empty_like(x))), ("default_config", python_only(default_config)),
            ("plan limits", python_only(renorm_plan.renorm_plan_limits)),
            ("current_stream", python_only(dl.current_stream)), ("capturing", python_only(dl.capturing)),
            ("device_guard", python_only(lambda: dl.device_guard(x.device))),
            ("plan_key", python_only(lambda: renorm_plan.plan_key(op, x, k, p, cfg, None)))]
    # last: its plan (a tensor parameter's) must not be the one the layers above pick
    for knob in ("0", "1"):  # new plans for each (above)
        renorm_plan.clear_plans()
        with env_set("TPGUARD_LANE_ENTRY", knob):
            us = host(drop_in)
        out.append((f"drop-in surface, a tensor parameter, TPGUARD_LANE_ENTRY={knob}{served_by()}", us))
    if fs is not None:
        theirs = (lambda: fs.top_k_renorm_probs(x, 40)) if op == "top_k" else (lambda: fs.top_p_renorm_probs(x, 0.9))
        out.append(("flashinfer default", host(theirs)))
    return out


def cpu_layers(op: str) -> list[tuple[str, float]]:
    x = torch.softmax(torch.randn(1, 32000), -1)
    k, p = (40, None) if op == "top_k" else (None, 0.9)
    public = (lambda: tk.top_k_renorm(x, 40, backend="tpguard")) if op == "top_k" else \
        (lambda: tk.top_p_renorm(x, 0.9, backend="tpguard"))
    # SGLang's parameters: an int32 / float32 tensor of one value per row, through the drop-in surface
    kt, pt = torch.full((1,), 40, dtype=torch.int32), torch.full((1,), 0.9)
    drop_in = (lambda: flashinfer_api.top_k_renorm_probs(x, kt)) if op == "top_k" else \
        (lambda: flashinfer_api.top_p_renorm_probs(x, pt))
    cfg = default_config()
    calls = [("public call", public), ("drop-in surface, a tensor parameter", drop_in),
             ("run_op", lambda: tk.run_op(op, x, k, p, backend="tpguard")),
             ("renorm_plan.run", lambda: renorm_plan.run(op, x, k, p)), ("default_config", default_config),
             ("plan limits", renorm_plan.renorm_plan_limits),
             ("plan_key", lambda: renorm_plan.plan_key(op, x, k, p, cfg, None))]
    real = renorm_plan.RenormPlan.__call__
    renorm_plan.RenormPlan.__call__ = lambda self, values: values[0]
    try:
        return [(name, min(python_only(fn) for _ in range(5))) for name, fn in calls]
    finally:
        renorm_plan.RenormPlan.__call__ = real


def main() -> int:
    if "--cpu" in sys.argv[1:]:
        for op in ("top_k", "top_p"):
            print(f"\n{op} 1 x 32000 on the CPU, plan calls stubbed, us of Python per call")
            for name, us in cpu_layers(op):
                print(f"  {name:45s} {us:6.2f}")
        return 0
    if not torch.cuda.is_available():
        print("host_layers: no CUDA device here (on the CPU: TRITON_INTERPRET=1 python gpu/host_layers.py --cpu)",
              file=sys.stderr)
        return 2
    fs = flashinfer_sampling()
    for rows, vocab, op in CELLS:
        print(f"\n{op} {rows} x {vocab}, us per call")
        for name, us in layers(torch.softmax(torch.randn(rows, vocab, device="cuda"), -1), op, fs):
            print(f"  {name:45s} {us:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
