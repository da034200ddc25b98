"""`tpguard bench guard`: what the production guard costs per verify step (GPU).

Run on one GPU (`python -m tpguard.bench.guard`) or on two with NCCL
(`torchrun --nproc-per-node 2 -m tpguard.bench.guard`). At the budget shape (256 verify rows x
163840 vocab, fp32) it prints, in one process, side by side:

1. GPU time of the guard's device work per checked step, from CUDA-graph replays (no launch
   gaps): full mode (all 11 quantities, logits and probs included) and decisions mode;
2. eager steps: a stand-in verify step (softmax + top-k/top-p renorm + accept) with the guard off,
   then on (DeviceStepGuard, full and decisions), as us per step and % of the step;
3. with 2 ranks: fused heal (one all-gather carrying rank 0's decisions) vs per-site rank-0
   broadcasts as SGLANG_SPEC_TP_SYNC=all does them (collectives per step, us per step).
"""

from __future__ import annotations

import json  # a result file, not a trace: the stdlib's encoder takes any float a timer gives (NaN too)
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpguard.bench.timing import time_graph, time_wall
from tpguard.quantities import CANONICAL_ORDER, DECISIONS_MODE


def make_tensors(bs: int, draft: int, vocab: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    rows = bs * draft
    logits = torch.randn(rows, vocab, device=device, generator=g)
    return {
        "rng_state": torch.randint(0, 255, (16,), dtype=torch.uint8, device=device, generator=g),
        "seq_lens": torch.randint(100, 4000, (bs,), device=device, generator=g),
        "draft_tokens": torch.randint(0, vocab, (bs, draft), device=device, generator=g),
        "target_logits": logits,
        "target_probs": torch.softmax(logits, -1),
        "coins": torch.rand(bs, draft, device=device, generator=g),
        "accept_index": torch.randint(0, draft, (bs, draft), dtype=torch.int32, device=device, generator=g),
        "accept_len": torch.randint(0, draft, (bs,), dtype=torch.int32, device=device, generator=g),
        "bonus": torch.randint(0, vocab, (bs,), device=device, generator=g),
        "commit_lens": torch.randint(1, draft, (bs,), dtype=torch.int32, device=device, generator=g),
        "out_tokens": torch.randint(0, vocab, (bs, draft), device=device, generator=g),
    }


def stand_in_verify(t: dict, top_p: float = 0.9, top_k: int = 40):
    """A verify step's sampling part without a model: softmax, top-k + top-p renorm, accept."""
    from tpguard.kernels.reference import top_k_top_p_renorm_reference

    try:
        from tpguard.kernels.renorm import top_k_top_p_renorm as renorm
    except Exception:
        renorm = top_k_top_p_renorm_reference
    probs = torch.softmax(t["target_logits"], -1)
    probs = renorm(probs, top_k, top_p)
    picked = probs.gather(1, t["draft_tokens"].reshape(-1, 1).clamp_max(probs.shape[1] - 1))
    return (picked.view_as(t["coins"]) > t["coins"]).int().cumprod(1).sum(1)


def _us(value) -> str:
    return "n/a" if value is None else f"{value:.1f} us"


@dataclass(frozen=True)
class Options:
    """`tpguard bench guard`'s options (declared in tpguard/cli.py)."""

    bs: int
    draft_tokens: int
    vocab: int
    iters: int
    json: str | None  # also write the results to this file
    profile: bool
    config: str  # KernelConfig overrides for the guard's fingerprints ("" none)
    heal_only: bool
    fused_probs: bool


def main(args: Options) -> int:
    if not torch.cuda.is_available():
        print("tpguard bench guard: needs a CUDA GPU (the guard's cost is a GPU number)")
        return 2
    if args.fused_probs:
        return fused_probs_main(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.heal_only and world < 2:
        print("tpguard bench guard: --heal-only needs 2+ ranks (torchrun --nproc-per-node 2 ...)")
        return 2
    if world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl")
    dev = torch.device("cuda", torch.cuda.current_device())
    t = make_tensors(args.bs, args.draft_tokens, args.vocab, dev)
    rows = args.bs * args.draft_tokens
    out: dict = {"shape": f"{rows} x {args.vocab} fp32", "world_size": world,
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    if not args.heal_only:
        _guard_costs(args, t, out, world)

    # 3. Fused heal vs per-site broadcasts (2 ranks).
    if world > 1:
        heal_section(args, t, out)

    if rank == 0 and args.heal_only:
        print_heal(out)
    elif rank == 0:
        from tpguard.kernels import direct_launch, fingerprint_plan

        off = out["step_off_us"]
        print(f"guard cost at {out['shape']}, {world} rank(s), {out['gpu']}, {out['config']}")
        print(f"  device work per checked step (graph replay): full {out['graph_full_us']:.1f} us, "
              f"decisions {out['graph_decisions_us']:.1f} us")
        print(f"  full with target_probs from the renorm write pass: {out['graph_full_fused_probs_us']:.1f} us "
              f"+ the write pass's extra (--fused-probs)")
        if out.get("graph_fused_guard_added_us") is not None:
            print(f"  one graph, top-p renorm + full guard with the fused slot: {out['graph_renorm_fused_guard_us']:.1f} "
                  f"us vs the renorm alone {out['graph_renorm_only_us']:.1f} us: guard adds "
                  f"{out['graph_fused_guard_added_us']:.1f} us")
        for mode in ("full", "decisions"):
            x8, added = out.get(f"graph_{mode}_x8_us"), out.get(f"graph_step_{mode}_added_us")
            print(f"  {mode} inside a graph: {_us(x8)} per check (8 checks in one graph); stand-in step "
                  f"{_us(out['graph_step_off_us'])} alone, {_us(out.get(f'graph_step_{mode}_us'))} with the "
                  f"guard: adds {_us(added)}")
            print(f"  {mode} with the zero-copy result (used: {out.get(f'zero_copy_{mode}_used')}): "
                  f"{_us(out.get(f'graph_{mode}_zero_copy_us'))} standalone, "
                  f"{_us(out.get(f'graph_{mode}_zero_copy_x8_us'))} per check inside a graph; the stand-in "
                  f"step with it: adds {_us(out.get(f'graph_step_{mode}_zero_copy_added_us'))}")
        print(f"  of which fingerprints: full {out['fingerprint_full_us']:.1f} us, "
              f"decisions {out['fingerprint_decisions_us']:.1f} us")
        for key in sorted(k for k in out if k.startswith("graph_full_us[")):
            value = out[key]
            print(f"  full mode, {key[len('graph_full_us'):]}: "
                  + (f"{value:.1f} us" if value is not None else "capture failed"))
        print(f"  host time per checked step (record + check, eager, no sync; a GPU-bound step "
              f"waits for the step before): full {out['host_full_us']:.0f} us, "
              f"decisions {out['host_decisions_us']:.0f} us with direct launches; "
              f"{out['host_full_triton_launch_us']:.0f} / {out['host_decisions_triton_launch_us']:.0f} us "
              f"with Triton's launches (fast launch: {direct_launch.enabled()})")
        states = [plan.fast_launch for plan in fingerprint_plan._PLAN_CACHE.values()]
        print(f"  direct-launch state of the cached fingerprint plans: "
              f"{ {s_: states.count(s_) for s_ in set(states)} }; refusals: {direct_launch.FAILURES or 'none'}")
        for mode in ("full", "decisions"):
            on = out[f"step_{mode}_us"]
            print(f"  eager stand-in verify step: off {off:.0f} us, {mode} on {on:.0f} us "
                  f"(+{on - off:.0f} us, {100 * (on - off) / off:.2f}% of this step)")
        if world > 1:
            print_heal(out)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if world > 1:
        dist.destroy_process_group()
    return 0


def _guard_costs(args: Options, t: dict, out: dict, world: int) -> None:
    """Sections 1 (graph-replayed device work) and 2 (eager steps, host time)."""
    from tpguard.device_guard import DeviceStepGuard

    # 1. GPU time of the guard's device work, from graph replays; the full set also with the
    #    long-row variants of fingerprint_many (KernelConfig.many_long, maxnreg).
    from tpguard.config import fingerprint_config_text, replace_from_text
    from tpguard.kernels import fingerprint_plan
    from tpguard.kernels.fingerprint_config import default_config

    # fingerprint_many's config is TPGUARD_FP_CONFIG's (read when a plan is made): --config adds to it
    if args.config:
        try:
            replace_from_text(default_config(), args.config, "--config")
        except ValueError as e:  # a usage error: one line, exit 2
            import typer

            raise typer.BadParameter(str(e).removeprefix("--config: "), param_hint="'--config'") from None
        os.environ["TPGUARD_FP_CONFIG"] = ",".join(filter(None, (fingerprint_config_text(), args.config)))
    out["config"] = str(default_config())
    base_text = fingerprint_config_text()
    for variant in ({"many_long": "table"}, {"many_long": "table", "maxnreg": 128},
                    {"many_long": "rows", "maxnreg": 128}):
        label = ",".join(f"{k}={v}" for k, v in variant.items())
        os.environ["TPGUARD_FP_CONFIG"] = ",".join(filter(None, (base_text, label)))
        guard = DeviceStepGuard(site="bench.variant", quantities=CANONICAL_ORDER, run_id="bench",
                                watchdog=False)
        guard.prepare_graph({n: t[n] for n in CANONICAL_ORDER}, zero_copy=False)
        out[f"graph_full_us[{label}]"] = time_graph(guard.device_check, args.iters, strict=False)
        guard.close()
    os.environ["TPGUARD_FP_CONFIG"] = base_text
    # full_fused_probs: target_probs' fingerprint comes from the renorm's write pass
    # (renorm_write_fp.py, its extra cost measured by --fused-probs), so the guard reads only
    # the logits among the vocab-sized tensors.
    fused_names = [n for n in CANONICAL_ORDER if n != "target_probs"]
    for mode, names in (("full", CANONICAL_ORDER), ("full_fused_probs", fused_names),
                        ("decisions", DECISIONS_MODE)):
        guard = DeviceStepGuard(site=f"bench.{mode}", quantities=CANONICAL_ORDER, run_id="bench",
                                watchdog=False)
        guard.prepare_graph({n: t[n] for n in names}, zero_copy=False)
        out[f"graph_{mode}_us"] = time_graph(guard.device_check, args.iters)
        guard.close()
    # The guard inside a step's graph, as SGLang replays it: the guard's nodes follow the step's
    # in one graph, so there is no graph launch of their own (a standalone replay above pays one,
    # a few us, which matters for the small decisions set). Two views: 8 checks back to back in
    # one graph (per check), and the stand-in verify step captured alone vs with the guard.
    out["graph_step_off_us"] = time_graph(lambda: stand_in_verify(t), args.iters, strict=False)
    for mode, names in (("full", CANONICAL_ORDER), ("decisions", DECISIONS_MODE)):
        for zero_copy in (False, True):  # the comparison's result copied, or written to the host directly
            sfx = "_zero_copy" if zero_copy else ""
            guard = DeviceStepGuard(site=f"bench.in_graph.{mode}{sfx}", quantities=CANONICAL_ORDER,
                                    run_id="bench", watchdog=False)
            guard.prepare_graph({n: t[n] for n in names}, zero_copy=zero_copy)
            if zero_copy:
                out[f"zero_copy_{mode}_used"] = guard._graph["zero_copy"]
                out[f"graph_{mode}_zero_copy_us"] = time_graph(guard.device_check, args.iters, strict=False)
            out[f"graph_{mode}{sfx}_x8_us"] = time_graph(guard.device_check, args.iters, per_replay=8,
                                                        strict=False)

            def step_and_guard(guard=guard):
                stand_in_verify(t)
                guard.device_check()

            on = time_graph(step_and_guard, args.iters, strict=False)
            out[f"graph_step_{mode}{sfx}_us"] = on
            if on is not None and out["graph_step_off_us"] is not None:
                out[f"graph_step_{mode}{sfx}_added_us"] = on - out["graph_step_off_us"]
            guard.close()
    # The whole fused path in one graph: tpguard's top-p renorm writing target_probs'
    # fingerprint into the guard's vector slot (prepare_graph(precomputed=...)), then the
    # guard; against the same renorm without it plus the plain full guard. The difference is
    # what the guard adds to a verify step that uses tpguard's renorm.
    from tpguard.kernels.renorm import top_p_renorm

    probs_in = torch.softmax(t["target_logits"], -1)
    guard = DeviceStepGuard(site="bench.fused_graph", quantities=CANONICAL_ORDER, run_id="bench",
                            watchdog=False)
    guard.prepare_graph({n: t[n] for n in fused_names}, precomputed=["target_probs"])
    slot = guard.fingerprint_slot("target_probs")

    def renorm_then_guard():
        top_p_renorm(probs_in, 0.9, validate=False, fingerprint_out=slot)
        guard.device_check()

    renorm_then_guard()  # compiles the renorm outside capture
    guard.collect()
    out["graph_renorm_only_us"] = time_graph(lambda: top_p_renorm(probs_in, 0.9, validate=False), args.iters,
                                             strict=False)
    out["graph_renorm_fused_guard_us"] = time_graph(renorm_then_guard, args.iters, strict=False)
    if out["graph_renorm_only_us"] is not None and out["graph_renorm_fused_guard_us"] is not None:
        out["graph_fused_guard_added_us"] = out["graph_renorm_fused_guard_us"] - out["graph_renorm_only_us"]
    guard.close()

    # The fingerprint pass alone, for the record.
    from tpguard.fingerprint import fingerprint_many

    out["fingerprint_full_us"] = time_graph(lambda: fingerprint_many([t[n] for n in CANONICAL_ORDER]), args.iters)
    out["fingerprint_decisions_us"] = time_graph(lambda: fingerprint_many([t[n] for n in DECISIONS_MODE]),
                                                 args.iters)

    # 2. Eager verify steps, guard off vs on; host time of the guard alone (record + check, no
    #    sync), with direct launches (the default) and with Triton's kernel[grid](...) launches.
    from tpguard.bench.timing import time_host
    from tpguard.kernels import guard_compare

    out["step_off_us"] = time_wall(lambda: stand_in_verify(t), args.iters)
    for fast in (True, False):
        os.environ["TPGUARD_FAST_LAUNCH"] = "1" if fast else "0"
        fingerprint_plan.clear_plans()
        guard_compare._LAUNCHES.clear()
        tag = "" if fast else "_triton_launch"
        for mode, names in (("full", CANONICAL_ORDER), ("decisions", DECISIONS_MODE)):
            guard = DeviceStepGuard(site=f"bench.eager.{mode}", run_id="bench", watchdog=False)

            def guard_only(guard=guard, names=names):
                for n in names:
                    guard.record(n, t[n])
                guard.check()

            def step(guard_only=guard_only):
                stand_in_verify(t)
                guard_only()

            if fast:
                out[f"step_{mode}_us"] = time_wall(step, args.iters)
            guard_only()
            torch.cuda.synchronize()
            out[f"host_{mode}{tag}_us"] = time_host(guard_only, args.iters)
            torch.cuda.synchronize()
            guard.drain()
            guard.close()
    # back to direct launches: plans made under Triton's launches would keep them (the profile and
    # the printed plan states below would then describe Triton's path: {'off': 2})
    os.environ["TPGUARD_FAST_LAUNCH"] = "1"
    fingerprint_plan.clear_plans()
    guard_compare._LAUNCHES.clear()

    if args.profile and world == 1:  # the profiled guard's all-gather would wait for the other ranks
        import cProfile
        import pstats

        guard = DeviceStepGuard(site="bench.profile", run_id="bench", watchdog=False)

        def guarded_only():
            for n in CANONICAL_ORDER:
                guard.record(n, t[n])
            guard.check()

        out["guard_only_eager_us"] = time_wall(guarded_only, args.iters)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(30):
            guarded_only()
        torch.cuda.synchronize()
        prof.disable()
        print("host profile of 30 eager guard-only steps (full set):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        guard.drain()
        guard.close()

def heal_section(args: Options, t: dict, out: dict) -> None:
    """Fused heal vs per-site rank-0 broadcasts, each eager (host clock, synchronised per call:
    what a caller waits) and from a graph; fused heal also as host time alone (no sync, the
    measure of host_decisions_us), and the plain decisions guard (no heal) timed the same ways,
    so heal's own share is a difference of like numbers; and the like-for-like alternative of
    a guarded engine without fused heal: the decisions guard followed by the 5 broadcasts."""
    from tpguard.bench.timing import time_host
    from tpguard.device_guard import DeviceStepGuard, decisions_capacity

    decisions = ["accept_index", "accept_len", "bonus", "commit_lens", "out_tokens"]

    def broadcasts():
        for n in decisions:  # one rank-0 broadcast per decision site, as SpecTpSync does
            dist.broadcast(t[n], src=0)

    out["broadcasts_per_step"] = len(decisions)
    out["broadcasts_eager_us"] = time_wall(broadcasts, args.iters)
    out["fused_heal_collectives_per_step"] = 1
    for label, heal in (("fused_heal", True), ("decisions_no_heal", False)):
        kw = dict(policy="heal", heal_capacity=decisions_capacity(args.bs, args.draft_tokens)) if heal else {}
        guard = DeviceStepGuard(site=f"bench.{label}", run_id="bench", watchdog=False, **kw)

        def guarded(guard=guard):
            for n in DECISIONS_MODE:
                guard.record(n, t[n])
            guard.check()

        out[f"{label}_eager_us"] = time_wall(guarded, args.iters)
        guarded()
        torch.cuda.synchronize()
        out[f"{label}_host_us"] = time_host(guarded, args.iters)
        torch.cuda.synchronize()
        guard.drain()
        guard.close()
        guard = DeviceStepGuard(site=f"bench.{label}.graph", run_id="bench", watchdog=False, **kw)
        guard.prepare_graph({n: t[n] for n in DECISIONS_MODE})
        out[f"{label}_graph_us"] = time_graph(guard.device_check, args.iters)
        if not heal:
            def check_then_broadcasts(guard=guard):
                guard.device_check()
                broadcasts()

            out["decisions_then_broadcasts_graph_us"] = time_graph(check_then_broadcasts, args.iters)
        guard.close()
        if not heal:
            guard = DeviceStepGuard(site="bench.then_broadcasts", run_id="bench", watchdog=False)

            def guarded_then_broadcasts(guard=guard):
                for n in DECISIONS_MODE:
                    guard.record(n, t[n])
                guard.check()
                broadcasts()

            out["decisions_then_broadcasts_eager_us"] = time_wall(guarded_then_broadcasts, args.iters)
            torch.cuda.synchronize()
            guard.drain()
            guard.close()
    out["broadcasts_graph_us"] = time_graph(broadcasts, args.iters)


def print_heal(out: dict) -> None:
    print(f"  heal: {out['broadcasts_per_step']} broadcasts {out['broadcasts_eager_us']:.0f} us eager "
          f"/ {out['broadcasts_graph_us']:.1f} us graph  vs  fused 1 all-gather "
          f"{out['fused_heal_eager_us']:.0f} us eager / {out['fused_heal_graph_us']:.1f} us graph")
    print(f"  heal's share: fused heal vs the decisions guard without heal: eager (synchronised) "
          f"{out['fused_heal_eager_us']:.0f} vs {out['decisions_no_heal_eager_us']:.0f} us, host alone "
          f"{out['fused_heal_host_us']:.0f} vs {out['decisions_no_heal_host_us']:.0f} us, graph "
          f"{out['fused_heal_graph_us']:.1f} vs {out['decisions_no_heal_graph_us']:.1f} us")
    print(f"  guarded either way: fused heal {out['fused_heal_eager_us']:.0f} us eager / "
          f"{out['fused_heal_graph_us']:.1f} us graph  vs  decisions guard + {out['broadcasts_per_step']} "
          f"broadcasts {out['decisions_then_broadcasts_eager_us']:.0f} us eager / "
          f"{out['decisions_then_broadcasts_graph_us']:.1f} us graph")


def fused_probs_main(args: Options) -> int:
    """`--fused-probs`: GPU time (graph replay) of the renorm's write pass at the budget shape,
    plain vs emitting target_probs' fingerprint (write + hash + finalize), vs the plain pass plus
    the standalone fingerprint of its output (what the guard otherwise pays), one rank."""
    import dataclasses

    from tpguard.fingerprint import fingerprint_rows_i64, to_unsigned
    from tpguard.kernels import fingerprint as kfp
    from tpguard.kernels.renorm_config import default_config
    from tpguard.kernels.renorm_passes import launch_write
    from tpguard.kernels.renorm_workspace import shapes_for, workspace_for
    from tpguard.kernels.renorm_write_fp import launch_write_fp

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = args.bs * args.draft_tokens
    g = torch.Generator(device=dev).manual_seed(0)
    probs = torch.softmax(torch.randn(rows, args.vocab, device=dev, generator=g), -1)
    cfg = default_config()
    s = shapes_for(rows, args.vocab, cfg)
    ws = workspace_for(s, cfg, dev, with_sample=False, with_bracket=False)
    # a cutoff near the median, the kept mass ~ half: about half the entries written as zeros
    thr = probs.median(dim=1).values
    ws.params.view(rows, 4).copy_(torch.stack([thr, torch.full_like(thr, 2.0), torch.zeros_like(thr),
                                               torch.ones_like(thr)], 1))
    ws.flag.zero_()
    out_plain = torch.empty_like(probs)
    out_fp = torch.empty_like(probs)
    vec = torch.zeros(8, dtype=torch.int64, device=dev)  # stands for the guard's vector
    rows_fp = torch.empty(rows, dtype=torch.int64, device=dev)

    launch_write(probs, out_plain, s, ws, cfg)
    launch_write_fp(probs, out_fp, s, ws, cfg, fp_out=vec[3], rows_out=rows_fp)
    same_out = torch.equal(out_plain.view(torch.int32), out_fp.view(torch.int32))
    same_fp = to_unsigned(int(vec[3])) == to_unsigned(int(kfp.fingerprint_triton(out_plain)))
    same_rows = torch.equal(rows_fp, fingerprint_rows_i64(out_plain))
    res = {"shape": f"{rows} x {args.vocab} fp32", "gpu": torch.cuda.get_device_name(),
           "bit_identical_out": same_out, "fingerprint_matches": same_fp, "row_fps_match": same_rows}
    res["write_us"] = time_graph(lambda: launch_write(probs, out_plain, s, ws, cfg), args.iters)
    for shifts in (0, 1, 3):  # KernelConfig.shifts bitmasks
        fcfg = dataclasses.replace(kfp.default_config(), shifts=shifts)
        res[f"write_fp_us[shifts={shifts}]"] = time_graph(
            lambda fcfg=fcfg: launch_write_fp(probs, out_fp, s, ws, cfg, fp_out=vec[3], fp_config=fcfg),
            args.iters)
    res["fingerprint_alone_us"] = time_graph(lambda: kfp.fingerprint_triton(out_plain), args.iters)

    def write_then_fp():
        launch_write(probs, out_plain, s, ws, cfg)
        vec[3:4].copy_(kfp.fingerprint_triton(out_plain).view(1))

    res["write_then_fingerprint_us"] = time_graph(write_then_fp, args.iters)
    w = res["write_us"]
    print(f"renorm write pass at {res['shape']}, {res['gpu']} (graph replay, us per call)")
    print(f"  checks: out bit-identical {same_out}, fingerprint {same_fp}, row fingerprints {same_rows}")
    print(f"  plain write:                 {w:.1f}")
    for shifts in (0, 1, 3):
        v = res[f"write_fp_us[shifts={shifts}]"]
        print(f"  write + fingerprint, shifts={shifts}: {v:.1f}  (+{v - w:.1f})")
    print(f"  write, then fingerprint:     {res['write_then_fingerprint_us']:.1f}  "
          f"(+{res['write_then_fingerprint_us'] - w:.1f}; fingerprint alone {res['fingerprint_alone_us']:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if (same_out and same_fp and same_rows) else 1


if __name__ == "__main__":
    import sys

    from tpguard.cli import main as cli_main

    raise SystemExit(cli_main(["bench", "guard", *sys.argv[1:]]))
