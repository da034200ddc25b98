"""One rank's run of the harness: workload -> state collective -> verify pipeline -> guard -> commit.

`run_harness(opts)` needs an initialised default process group (torchrun, `tpguard launch`, or a
test's spawned processes) and returns this rank's `RunSummary`; `summary.exit_code` is the
process's exit code. Per step:

1. the state collective: one broadcast per prefix-cache block this rank matched or inserted,
   then the forward's all-reduce, on its own process group, deadline-bounded;
2. the verify pipeline, each quantity recorded with the guard (on checked steps);
3. `guard.check(step)`: record, heal (decisions overwritten in place) or abort (every rank raises);
4. the commit of out_tokens[:commit_lens] into the workload state.

At the end, one all-gather of each rank's output fingerprint says whether the outputs agree.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tpguard.errors import EXIT_INTERNAL, EXIT_RANK_DIED, RankDivergenceError, RankTimeoutError, TPGuardError
from tpguard.fingerprint import format_fp, to_signed
from tpguard.launch.inject import Injector
from tpguard.launch.model import SyntheticModel
from tpguard.launch.options import HarnessOptions
from tpguard.launch.pipeline import VerifyPipeline
from tpguard.launch.progress import StepProgress
from tpguard.launch.state_collective import HarnessTimeoutError, StartupTimeoutError, StateCollective
from tpguard.launch.summary import RunSummary, warmup_steps
from tpguard.launch.tree import for_algo
from tpguard.launch.workload import SamplingParams, Workload
from tpguard.quantities import DECISION_QUANTITIES
from tpguard.renorm_registry import get_backend
from tpguard.watchdog import Liveness, base_store, bounded, peer_lost, set_liveness, stale_after


def agree_run_id(run_id: str | None, timeout_s: float) -> str:
    """Rank 0's run id on every rank (tpguard.guard.agree_on_run_id), or the one given."""
    from tpguard.errors import RankTimeoutError
    from tpguard.guard import GroupInfo, agree_on_run_id

    try:
        return agree_on_run_id(GroupInfo(None), run_id, timeout_s)
    except RankTimeoutError:
        raise StartupTimeoutError(f"tpguard: not every rank reached the harness's start within {timeout_s:g} s "
                                  f"(world size {dist.get_world_size()})") from None


def _no_record(name, tensor) -> None:
    return None


def _make_guard(opts: HarnessOptions, run_id: str, renorm_desc: str):
    if opts.no_guard:
        return None
    from tpguard.dump import dumps_dir
    from tpguard.guard import StepGuard

    config = {**opts.config(), "renorm_backend": renorm_desc}
    dump_dir = dumps_dir(opts.trace) if opts.dump else None
    return StepGuard(group=None, site=f"{opts.algo}.verify", quantities=opts.guarded_quantities,
                     policy=opts.on_divergence, trace=opts.trace, merged=opts.merged, timeout_s=opts.timeout,
                     dump_dir=dump_dir, algo=opts.algo, run_id=run_id, every=opts.every, config=config)


def dump_context(opts: HarnessOptions, tree, renorm, pipeline: VerifyPipeline, inp):
    """What `tpguard replay` needs to re-run this step (tpguard/dump.py)."""
    from tpguard.dump import make_context, sampling_params

    params = sampling_params(inp.temperature, inp.top_k, inp.top_p, inp.min_p, tree.nodes)
    return make_context(opts.algo, tree_parents=tree.parent, renorm_name=renorm.name, renorm_source=renorm.source,
                        deterministic=renorm.deterministic, params=params,
                        coins_shapes=[(len(inp.seq_lens), tree.nodes + 1)],
                        threshold_single=pipeline.threshold_single, threshold_acc=pipeline.threshold_acc,
                        device=opts.device)


def tally(summary: RunSummary, div) -> None:
    """A guard listener: count a divergence (every rank sees the same ones) into the summary."""
    summary.divergences += 1
    summary.divergent_quantities[div.quantity] = summary.divergent_quantities.get(div.quantity, 0) + 1
    summary.actions[div.action] = summary.actions.get(div.action, 0) + 1
    if any(q in DECISION_QUANTITIES for q in div.differing):
        summary.decision_flips += 1
    if summary.first_divergence is None:
        summary.first_divergence = {"step": div.step, "quantity": div.quantity, "culprit_ranks": div.culprit_ranks,
                                    "majority_ranks": div.majority_ranks, "rows": div.rows}


def apply_switch(sw, pipeline: VerifyPipeline, opts: HarnessOptions, summary: RunSummary) -> str:
    """Policy fix (tpguard.fix): every rank switches the cause off here, at the same step."""
    from tpguard import fix

    if sw.kind == fix.RENORM:
        before = pipeline.renorm.describe()
        pipeline.renorm = get_backend("deterministic", opts.device)
        summary.renorm = f"{before}, then {pipeline.renorm.describe()} from step {sw.step + 1}"
        done = f"renorm {before} -> {pipeline.renorm.describe()}"
    else:
        pipeline.broadcast_decisions = True
        done = "rank 0's accept decisions and bonus broadcast every step"
    summary.switches.append({"step": sw.step, "from_step": sw.step + 1, "what": sw.kind, "why": sw.why})
    return done


def run_harness(opts: HarnessOptions) -> RunSummary:
    """This rank's run; its pulse runs meanwhile, and it leaves a note saying how it ended (the
    other ranks and `tpguard launch` read it). An exception that ends the rank is marked with
    `tpguard_noted` when that note says so (the launcher then prints it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    run_id = agree_run_id(opts.run_id, opts.timeout)
    live = start_liveness(run_id, rank, world, opts.timeout)
    try:
        summary = _run(opts, run_id, live)
    except BaseException as e:  # this rank cannot go on: say so before its connections close
        noted = live.leave("crashed", crash_code(e), str(e) if isinstance(e, TPGuardError) else f"{type(e).__name__}: {e}")
        try:
            e.tpguard_noted = noted
        except AttributeError:
            pass
        raise
    finally:
        set_liveness(None)
    live.leave("ended", summary.exit_code, summary.message or "")
    return summary


def _run(opts: HarnessOptions, run_id: str, live: Liveness) -> RunSummary:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg_backend = str(dist.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
    renorm = get_backend(opts.renorm, opts.device)
    state_group = dist.new_group(backend=pg_backend)
    guard = _make_guard(opts, run_id, renorm.describe())

    tree = for_algo(opts.algo, opts.draft_tokens)
    model = SyntheticModel(opts.vocab, tree, opts.logits)
    workload = Workload(opts.bs, opts.vocab, opts.seed, opts.cache_block,
                        SamplingParams(opts.temperature, opts.top_p, opts.top_k, opts.min_p), opts.mixed_params)
    injector = Injector(opts.inject, rank, opts.vocab, tree.spec_tokens, tree.nodes, opts.bs)
    pipeline = VerifyPipeline(model, tree, renorm, injector, device, opts.seed)
    # the renorm's write pass fingerprints target_probs only when the guard records them
    pipeline.fingerprint_probs = "target_probs" in opts.guarded_quantities
    collective = StateCollective(state_group, rank, world, run_id, opts.timeout, pg_backend)
    step_inputs = {}  # this step's StepInputs, for a dump's per-row sampling parameters
    if guard is not None and opts.dump:
        guard.dump_context = lambda _step: dump_context(opts, tree, renorm, pipeline, step_inputs["now"])

    summary = RunSummary(run_id=run_id, world_size=world, backend=pg_backend, device=str(device), algo=opts.algo,
                         logits=opts.logits, renorm=renorm.describe(), policy=opts.on_divergence,
                         guard=guard is not None, steps_planned=opts.steps, injected=[str(i) for i in opts.inject],
                         warmup_planned=warmup_steps(opts.warmup_steps, opts.steps))
    if guard is not None:
        guard.listeners.append(lambda div: tally(summary, div))
        if opts.on_divergence == "fix":
            guard.switchers.append(lambda sw: apply_switch(sw, pipeline, opts, summary))
        own = getattr(guard, "_own_trace", None)
        summary.trace_files = [str(w.path) for w in (own, guard.merged_trace) if w is not None]

    guarded = set(opts.guarded_quantities)

    def record(name, tensor) -> None:  # --quantities decisions: the vocab-sized tensors are skipped
        if name in guarded:
            guard.record(name, tensor)

    progress = StepProgress(opts.steps, opts.progress if rank == 0 else False)
    step = 0
    try:
        for step in range(opts.steps):
            live.step = step
            t0 = time.perf_counter()
            try:
                collective.run(step, workload.take_blocks())
                checking = guard is not None and guard.wants(step)
                step_inputs["now"] = workload.inputs()
                outs = pipeline.run(step, step_inputs["now"], record if checking else _no_record)
                if guard is not None:
                    try:
                        guard.check(step)
                    except RuntimeError as e:  # the heal broadcasts or the rows' all-gathers
                        if not peer_lost(e):
                            raise
                        raise collective.timeout_error("the guard's collectives", step, peer_left=True) from None
                workload.commit(outs.out_tokens.cpu().numpy(), outs.commit_lens.cpu().numpy())
                summary.steps_done = step + 1
            except RankDivergenceError:  # the aborted step counts (a timed-out one would only add the wait)
                summary.time_step(step, time.perf_counter() - t0, _guard_seconds(guard))
                raise
            summary.time_step(step, time.perf_counter() - t0, _guard_seconds(guard))
            progress.advance(summary.divergences)
        progress.close()
        fp = workload.output_fingerprint()
        gathered = collective.all_gather_final([summary.steps_done, to_signed(fp), workload.committed_tokens],
                                               step=opts.steps)
        fps = [format_fp(int(v)) for v in gathered[:, 1].tolist()]
        summary.output_fingerprints = {str(r): v for r, v in enumerate(fps)}
        summary.outputs_identical = len(set(fps)) == 1 and len(set(gathered[:, 0].tolist())) == 1
    except RankDivergenceError as e:
        summary.ended, summary.message = "aborted", str(e)
    except (RankTimeoutError, HarnessTimeoutError) as e:
        summary.ended, summary.message = "timeout", str(e)
        if guard is not None and isinstance(e, HarnessTimeoutError):
            guard.event("timeout", str(e), missing_ranks=e.culprits, dead_ranks=sorted(e.dead), step_reached=step,
                        positions={str(r): p for r, p in e.positions.items()})
        collective.leave()
    finally:
        progress.close()
        summary.committed_tokens = workload.committed_tokens
        summary.state_collectives = collective.collectives
        summary.guard_seconds = _guard_seconds(guard) - summary.warmup_guard_seconds
        if guard is not None:
            guard.close()
        if summary.ended == "completed":
            dist.destroy_process_group(state_group)
    if rank == 0 and opts.summary_json:
        summary.write_json(opts.summary_json)
    return summary


def start_liveness(run_id: str, rank: int, world: int, timeout_s: float) -> Liveness:
    """This rank's pulse (tpguard.watchdog.Liveness), the one the guard's and the harness's
    timeouts consult; rank 0 also posts the run id for `tpguard launch`'s final line."""
    store = base_store()
    host = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
    live = Liveness(store, run_id, rank, world, stale_after(timeout_s), store_host=host).start()
    set_liveness(live)
    if rank == 0 and store is not None:
        bounded(lambda: store.set(RUN_ID_KEY, run_id), 1.0)
    return live


RUN_ID_KEY = "tpguard/run_id"


def _guard_seconds(guard) -> float:
    return guard.guard_seconds if guard is not None else 0.0


def crash_code(e: BaseException) -> int:
    """The exit code of a rank ended by `e`: tpguard's own errors carry theirs; the machine
    failing the rank (OSError: a full disk, a file size limit) is 6; anything else is a bug, 5."""
    if isinstance(e, TPGuardError):
        return e.exit_code
    return EXIT_RANK_DIED if isinstance(e, OSError) else EXIT_INTERNAL


def device_for_rank(opts: HarnessOptions) -> None:
    """Pin this rank's GPU: local rank modulo the visible devices (ranks may share one)."""
    if opts.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
