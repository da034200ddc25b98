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

import argparse
import json
import os

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tpguard bench guard")
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None, help="also write results to this file")
    ap.add_argument("--profile", action="store_true", help="also print where the host time of an "
                    "eager guarded step goes (cProfile)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tpguard bench guard: needs a CUDA GPU (the guard's cost is a GPU number)")
        return 2
    from tpguard.device_guard import DeviceStepGuard, decisions_capacity

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl")
    dev = torch.device("cuda", torch.cuda.current_device())
    t = make_tensors(args.bs, args.draft_tokens, args.vocab, dev)
    rows = args.bs * args.draft_tokens
    out: dict = {"shape": f"{rows} x {args.vocab} fp32", "world_size": world,
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    # 1. GPU time of the guard's device work, from graph replays.
    for mode, names in (("full", CANONICAL_ORDER), ("decisions", DECISIONS_MODE)):
        guard = DeviceStepGuard(site=f"bench.{mode}", quantities=CANONICAL_ORDER, run_id="bench",
                                watchdog=False)
        guard.prepare_graph({n: t[n] for n in names})
        out[f"graph_{mode}_us"] = time_graph(guard.device_check, args.iters)
        guard.close()
    # The fingerprint pass alone, for the record.
    from tpguard.kernels.fingerprint import fingerprint_many

    out["fingerprint_full_us"] = time_graph(lambda: fingerprint_many([t[n] for n in CANONICAL_ORDER]), args.iters)
    out["fingerprint_decisions_us"] = time_graph(lambda: fingerprint_many([t[n] for n in DECISIONS_MODE]),
                                                 args.iters)

    # 2. Eager verify steps, guard off vs on.
    out["step_off_us"] = time_wall(lambda: stand_in_verify(t), args.iters)
    for mode, names in (("full", CANONICAL_ORDER), ("decisions", DECISIONS_MODE)):
        guard = DeviceStepGuard(site=f"bench.eager.{mode}", run_id="bench", watchdog=False)

        def step(guard=guard, names=names):
            stand_in_verify(t)
            for n in names:
                guard.record(n, t[n])
            guard.check()

        out[f"step_{mode}_us"] = time_wall(step, args.iters)
        guard.drain()
        guard.close()

    if args.profile and rank == 0:
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

    # 3. Fused heal vs per-site broadcasts (2 ranks).
    if world > 1:
        decisions = ["accept_index", "accept_len", "bonus", "commit_lens", "out_tokens"]

        def broadcasts():
            for n in decisions:  # one rank-0 broadcast per decision site, as SpecTpSync does
                dist.broadcast(t[n], src=0)

        guard = DeviceStepGuard(site="bench.heal", policy="heal", run_id="bench", watchdog=False,
                                heal_capacity=decisions_capacity(args.bs, args.draft_tokens))

        def fused():
            for n in DECISIONS_MODE:
                guard.record(n, t[n])
            guard.check()

        out["broadcasts_per_step"] = len(decisions)
        out["broadcasts_eager_us"] = time_wall(broadcasts, args.iters)
        out["fused_heal_collectives_per_step"] = 1
        out["fused_heal_eager_us"] = time_wall(fused, args.iters)
        guard.drain()
        guard.close()
        guard = DeviceStepGuard(site="bench.heal.graph", policy="heal", run_id="bench", watchdog=False,
                                heal_capacity=decisions_capacity(args.bs, args.draft_tokens))
        guard.prepare_graph({n: t[n] for n in DECISIONS_MODE})
        out["fused_heal_graph_us"] = time_graph(guard.device_check, args.iters)
        out["broadcasts_graph_us"] = time_graph(broadcasts, args.iters)
        guard.close()

    if rank == 0:
        off = out["step_off_us"]
        print(f"guard cost at {out['shape']}, {world} rank(s), {out['gpu']}")
        print(f"  device work per checked step (graph replay): full {out['graph_full_us']:.1f} us, "
              f"decisions {out['graph_decisions_us']:.1f} us")
        print(f"  of which fingerprints: full {out['fingerprint_full_us']:.1f} us, "
              f"decisions {out['fingerprint_decisions_us']:.1f} us")
        for mode in ("full", "decisions"):
            on = out[f"step_{mode}_us"]
            print(f"  eager stand-in verify step: off {off:.0f} us, {mode} on {on:.0f} us "
                  f"(+{on - off:.0f} us, {100 * (on - off) / off:.2f}% of this step)")
        if world > 1:
            print(f"  heal: {out['broadcasts_per_step']} broadcasts {out['broadcasts_eager_us']:.0f} us eager "
                  f"/ {out['broadcasts_graph_us']:.1f} us graph  vs  fused 1 all-gather "
                  f"{out['fused_heal_eager_us']:.0f} us eager / {out['fused_heal_graph_us']:.1f} us graph")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
