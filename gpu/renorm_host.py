"""Host time of eager renorm calls (and of the fused logits -> target probs op), with the call plans
(kernels/renorm_plan.py) on and off (docs/design-renorm.md, "Host time").

CPU (development machine): tpguard's own Python per call, without the kernels: the Triton
interpreter's launches are replaced by no-ops, so what is timed is the API checks, the plan
lookup (or the fresh workspace), the block shapes and the argument handling around the 5-6
launches. Plans on, under the interpreter, means the cached workspace only (no direct launches).

    TRITON_INTERPRET=1 python gpu/renorm_host.py [--vocab 163840] [--calls 2000]

GPU (``--gpu``, no TRITON_INTERPRET): host time per eager call (no sync in the loop) of each op
at each batch size, plans off (Triton's launches into a fresh workspace), on with the launch
templates as Triton hands them (``TPGUARD_LAUNCH_TRIM=0``) and on (cached workspace + trimmed
direct launches: addresses, no hook chains, Triton 3.6's C launch) and replaying the plan's own CUDA
graph (kernels/renorm_graph.py, at every batch size and launch count here whatever the defaults say),
the plans' state and memory, a check that both give the same
bits (and the same fingerprint slot), and that a CUDA graph captured with plans on replays
those bits (capture takes the fresh-workspace path).

    python gpu/renorm_host.py --gpu [--vocab 163840] [--batch-sizes 1,8,64,256] [--calls 200]
"""

from __future__ import annotations

import os
import sys
import time


def _calls(renorm, x, fp=None):
    """The four renorms on `x`, and the fused logits -> target probs op (kernels/target_probs.py) with
    `x` taken for logits, a temperature per row and top-k 40 + top-p 0.9 (the bench grid's fused cell)."""
    import torch

    from tpguard.kernels.target_probs import target_probs

    t = torch.full((x.shape[0],), 0.8, device=x.device)
    return {"top_p": lambda: renorm.top_p_renorm(x, 0.9, backend="tpguard", fingerprint_out=fp),
            "top_k": lambda: renorm.top_k_renorm(x, 40, backend="tpguard", fingerprint_out=fp),
            "top_k_top_p": lambda: renorm.top_k_top_p_renorm(x, 40, 0.9, backend="tpguard", fingerprint_out=fp),
            "min_p": lambda: renorm.min_p_renorm(x, 0.1, backend="tpguard", fingerprint_out=fp),
            "target_probs": lambda: target_probs(x, t, 40, 0.9, backend="tpguard", validate=False,
                                                 fingerprint_out=fp)}


def _plans_on() -> int:
    """TPGUARD_RENORM_PLANS as the process has it (4 where it says 0: this script switches them)."""
    from tpguard.config import renorm_plan_limits

    return renorm_plan_limits()[0] or 4


def _set_env(name: str, value) -> None:
    """The plan knobs are read per call (tpguard.config): the script sets them in the environment."""
    os.environ[name] = str(value)


def cpu(args) -> int:
    import cProfile
    import pstats

    import torch
    import triton.runtime.interpreter as interp

    interp.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)  # no kernel runs
    from tpguard.kernels import renorm

    x = torch.softmax(torch.randn(1, args.vocab), -1)
    calls = _calls(renorm, x)
    for plans in (0, _plans_on()):
        _set_env("TPGUARD_RENORM_PLANS", plans)
        renorm.clear_plans()
        for name, fn in calls.items():
            for _ in range(20):
                fn()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            print(f"plans {'on ' if plans else 'off'} {name}: {(time.perf_counter() - t0) / args.calls * 1e6:.1f} us "
                  "of Python per call (launches stubbed)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            calls["top_p"]()
        prof.disable()
        stats = pstats.Stats(prof)
        print(f"plans {'on ' if plans else 'off'} top_p: {stats.total_calls / 200:.0f} Python function calls per call")
    return 0


def gpu(args) -> int:
    import torch

    from tpguard.bench.timing import capture, time_host
    from tpguard.config import renorm_graph_rows, renorm_plan_limits
    from tpguard.kernels import direct_launch, renorm, renorm_graph, renorm_plan

    if not torch.cuda.is_available():
        print("renorm_host --gpu: no CUDA device here")
        return 0
    on = _plans_on()
    direct = "on" if direct_launch.enabled() else "OFF"
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{torch.cuda.get_device_name()}, vocab {args.vocab}, {args.calls} calls; plans on = "
          f"{on} plans, {renorm_plan_limits()[1] >> 20} MiB; direct launches {direct}")
    bad = 0
    graph_rows0, min_launches0 = renorm_graph_rows(), renorm_graph.GRAPH_MIN_LAUNCHES
    for rows in args.batch_sizes:
        g = torch.Generator(device="cuda").manual_seed(rows)
        x = torch.softmax(torch.randn(rows, args.vocab, device="cuda", generator=g), -1)
        for with_fp in (False, True):
            fp = torch.zeros((), dtype=torch.int64, device="cuda") if with_fp else None
            for name, fn in _calls(renorm, x, fp).items():
                res = {}
                # plans off; plans with templates as Triton hands them; plans with trimmed templates;
                # plans replaying their own CUDA graph (renorm_graph.py)
                for mode, plans, trim, graph_rows in (("off", 0, True, 0), ("as-is", on, False, 0),
                                                      ("on", on, True, 0), ("graph", on, True, rows)):
                    _set_env("TPGUARD_RENORM_PLANS", plans)
                    _set_env("TPGUARD_LAUNCH_TRIM", int(trim))  # read at record time
                    _set_env("TPGUARD_RENORM_GRAPH_ROWS", graph_rows)
                    renorm_graph.GRAPH_MIN_LAUNCHES = 0 if graph_rows else min_launches0
                    renorm.clear_plans()
                    for _ in range(4):  # compile, plan, record + check, graph capture + check
                        out = fn()
                    torch.cuda.synchronize()
                    res[mode] = (out, int(fp) if with_fp else None, time_host(fn, args.calls))
                    if plans and not graph_rows:
                        state = [(p.state, p.refusal, p.nbytes) for _, p in renorm_plan.plans()]
                    if graph_rows:
                        pg = [p.graphs for _, p in renorm_plan.plans() if p.graphs is not None]
                        g_state = f"{pg[-1].state} {pg[-1].refusal}".strip() if pg else "no graph"
                _set_env("TPGUARD_LAUNCH_TRIM", 1)
                _set_env("TPGUARD_RENORM_GRAPH_ROWS", graph_rows0)
                renorm_graph.GRAPH_MIN_LAUNCHES = min_launches0
                o0, f0, t0 = res["off"]
                same = all(torch.equal(o0.view(torch.int32), o.view(torch.int32)) and f0 == f
                           for o, f, _ in res.values())
                bad += not same
                st = state[-1] if state else ("none", "", 0)
                t_as, t1, t_g = res["as-is"][2], res["on"][2], res["graph"][2]
                print(f"{rows:4d} x {args.vocab} {name:12s} fp={'y' if with_fp else 'n'}: host us/call plans off "
                      f"{t0:7.1f}  on, untrimmed {t_as:7.1f}  on {t1:7.1f}  ({t0 - t1:+.1f}, trims {t_as - t1:+.1f})  "
                      f"graph {t_g:7.1f} ({g_state})  bits {'same' if same else 'DIFFER'}  plan {st[0]} "
                      f"{st[2] / 2**20:.2f} MiB {st[1]}")
        # capture with plans on: the fresh-workspace path; replays give the eager bits
        _set_env("TPGUARD_RENORM_PLANS", on)
        renorm.clear_plans()
        fn = _calls(renorm, x)["top_p"]
        expect = fn()
        holder = {}
        graph = capture(lambda: holder.__setitem__("out", fn()))
        n_plans = len(renorm_plan.plans())
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(holder["out"].view(torch.int32), expect.view(torch.int32))
        bad += not same
        print(f"{rows:4d} x {args.vocab} top_p in a CUDA graph (plans on): replay bits "
              f"{'same' if same else 'DIFFER'}, plans made {n_plans} (1: the eager and warm-up calls' plan)")
    print("recorded launches by launcher (c: Triton 3.6's C launch called directly):", direct_launch.LAUNCHERS)
    if direct_launch.FAILURES:
        print("direct launch refused:", direct_launch.FAILURES)
    print("all bits equal" if not bad else f"{bad} CHECKS DIFFER")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="gpu/renorm_host.py")
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--calls", type=int, default=None, help="timed calls per case (CPU 2000, GPU 200)")
    ap.add_argument("--gpu", action="store_true", help="time the real launches on a CUDA device")
    ap.add_argument("--batch-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 64, 256])
    args = ap.parse_args(argv)
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if args.gpu:
        if interpreting:
            print("renorm_host --gpu: run without TRITON_INTERPRET=1")
            return 2
        args.calls = args.calls or 200
        return gpu(args)
    if not interpreting:
        print("renorm_host: run with TRITON_INTERPRET=1 (the launches it stubs are the interpreter's), or --gpu")
        return 2
    args.calls = args.calls or 2000
    return cpu(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
