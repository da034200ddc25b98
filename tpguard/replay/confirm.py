"""Replay one divergent step: diff the ranks' dumps, re-run the stage that produced the first
differing quantity on the inputs every rank agreed on, and say whether that confirms the cause.

* target_probs differs first: the renorm stage (temperature, softmax, top-k/top-p/min-p with the
  recorded per-row parameters) on the agreed target_logits, `calls` times with the run's backend
  and with each deterministic backend available here; then, the run's backend one renorm at a
  time, to name the kernel;
* coins differ first: the coins redrawn from the agreed rng_state;
* a decision differs first (accept_index, accept_len, bonus, commit_lens, out_tokens): the accept
  step on the agreed draft_tokens, target_probs and coins;
* after target_probs or coins: each rank's accept step on its own inputs, to show whether its
  recorded decisions follow from them;
* a state quantity or target_logits differs first: nothing in the step made it; nothing re-run.

Verdicts (exit codes in report.py): ``confirmed``: the re-run stage gives different results on
identical input (the cause, shown); ``deterministic``: it gives one result every call (the
divergence came from elsewhere; which ranks' bytes it gives is said); ``identical``: no recorded
tensor differs; ``not-rerun``: the first difference is not made by a stage replay can run;
``cannot-rerun``: the dumps lack what the stage needs, or its backend cannot run here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpguard.dump import PARAM_NAMES, PARAM_PREFIX
from tpguard.quantities import STATE_QUANTITIES
from tpguard.replay.diff import TensorDiff, diff_step, first_differing
from tpguard.replay.reader import ReplayInputError, StepDumps, open_step
from tpguard.replay.report import Replay
from tpguard.replay import rerun
from tpguard.replay.rerun import DECISIONS, Repeat, StageUnavailable

DEFAULT_CALLS = 100
MAX_CALLS = 10000  # each call re-runs the stage on the whole batch: enough to find rare orders, still bounded
RUN_SUFFIX = " (the run's backend)"


def choose_device(requested: str | None, context: dict | None) -> str:
    run_device = str((context or {}).get("device", "cpu"))
    if requested is None:
        requested = "cuda" if run_device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    if requested not in ("cpu", "cuda"):
        raise ReplayInputError(f"--device must be cpu or cuda, got {requested!r}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ReplayInputError("--device cuda: no CUDA device here")
    return requested


def replay(paths: list[str | Path], run: str | None = None, step: int | None = None, site: str | None = None,
           device: str | None = None, calls: int = DEFAULT_CALLS) -> Replay:
    if not 1 <= calls <= MAX_CALLS:
        raise ReplayInputError(f"--calls must be in [1, {MAX_CALLS}], got {calls}")
    dumps = open_step(paths, run, step, site)
    dev = choose_device(device, dumps.context)
    diffs, params = diff_step(dumps)
    rp = Replay(dumps, dev, calls, diffs, params, first_differing(diffs))
    ctx = dumps.context
    run_device = str((ctx or {}).get("device", dev))
    if run_device.split(":")[0] != dev:
        rp.notes.append(f"the run used {run_device}, this replay {dev}: re-run bytes may differ from the "
                        "recorded ones (replay on the run's device to compare bytes)")
    for p in params:
        if not p.identical:
            rp.notes.append(f"the ranks' {p.name} differ: the re-run uses {_ranks(p.majority)}'s")
    q = rp.first.name if rp.first else None
    if q is None:
        rp.verdict = "identical"
        rp.summary = "every recorded tensor is byte-identical on every rank: nothing to re-run"
    elif q == "target_probs":
        _renorm(rp)
    elif q == "coins":
        _coins(rp)
    elif q in DECISIONS:
        _accept(rp)
    elif q in STATE_QUANTITIES:
        rp.verdict = "not-rerun"
        rp.summary = (f"{q} is an input of the verify step: it differed before the step began (an earlier "
                      "step's commit, the scheduler); nothing in this step made it")
    elif q == "target_logits":
        rp.verdict = "not-rerun"
        rp.summary = ("target_logits come from the forward pass, which the dump does not hold: "
                      "nothing re-run (check the model's collectives and kernels on the culprit rank)")
    else:
        rp.verdict = "not-rerun"
        rp.summary = f"replay does not re-run the stage that makes {q}"
    if rp.runs:
        _version_notes(rp)
    return rp


def _version_notes(rp: Replay) -> None:
    """Bytes are comparable with the run's only on the same software and device: say what differs."""
    from tpguard.dump import runtime_versions

    then = (rp.dumps.context or {}).get("versions") or {}
    now = runtime_versions(rp.device)
    keys = ("tpguard", "torch", "triton", "flashinfer", "cuda", "device_name")
    changed = [f"{k} {then[k]} there, {now[k]} here" for k in keys if k in then and k in now and then[k] != now[k]]
    if changed:
        rp.notes.append(f"the run's versions differ from this machine's ({'; '.join(changed)}): "
                        "re-run bytes may differ from the recorded ones")


def _ranks(rs) -> str:
    rs = list(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


def _missing(dumps: StepDumps, names) -> list[str]:
    return [n for n in names if not all(d.has(n) for d in dumps.ranks.values())]


def _cannot(rp: Replay, why: str) -> None:
    rp.verdict = "cannot-rerun"
    rp.summary = why


def _diff(rp: Replay, name: str) -> TensorDiff | None:
    return next((t for t in rp.diffs if t.name == name), None)


def _recorded(rp: Replay, names, group_of: TensorDiff) -> dict[int, dict[str, torch.Tensor]]:
    """Each rank group's recorded values (the group's lowest rank), on the replay's device."""
    out = {}
    for g in group_of.groups:
        d = rp.dumps.ranks[g[0]]
        out[g[0]] = {n: d.tensor(n).to(rp.device) for n in names if d.has(n)}
    return out


def _differing_rows(recorded: dict[int, dict[str, torch.Tensor]], name: str) -> list[int]:
    tensors = [v[name] for v in recorded.values()]
    ref = tensors[0]
    rows = torch.zeros(ref.shape[0], dtype=torch.bool, device=ref.device)
    for t in tensors[1:]:
        if t.shape == ref.shape and t.dtype == ref.dtype:
            rows |= ~rerun.row_bytes_equal(t, ref)
    return rows.nonzero().flatten().tolist()


def _note_reproduced(rp: Replay, rep: Repeat) -> None:
    if rep.error is None:
        rp.reproduced = {str(r): rep.reproduced_by.get(str(r)) is not None for g in rp.first.groups for r in g}


def _group_ranks(t: TensorDiff) -> dict[int, list[int]]:
    return {g[0]: g for g in t.groups}


def _expand(rep: Repeat, groups: dict[int, list[int]]) -> None:
    """Reproduction is computed per group of identical ranks; report it for every rank."""
    for attr in ("reproduced_by", "rows_reproduced", "outputs_reproduced"):
        per = getattr(rep, attr)
        setattr(rep, attr, {str(r): per[str(lead)] for lead, g in groups.items() for r in g if str(lead) in per})


# --- target_probs: the renorm stage -----------------------------------------------------------

def _renorm(rp: Replay) -> None:
    dumps, ctx = rp.dumps, rp.dumps.context
    if not ctx or not ctx.get("probs") or not ctx.get("renorm", {}).get("name"):
        return _cannot(rp, "the dumps do not record how target_probs was made (sampling parameters, renorm "
                           "backend): written by a tpguard without replay support, or by a writer that "
                           "passes no context (tpguard/dump.py: make_context)")
    path = ctx["probs"].get("path", "dense")
    if path != "dense":
        return _cannot(rp, f"target_probs came from the {path!r} path, which replay does not re-run")
    need = ["target_logits"] + [PARAM_PREFIX + n for n in PARAM_NAMES]
    missing = _missing(dumps, need)
    if missing:
        return _cannot(rp, f"the dumps lack {', '.join(missing)}: the renorm stage cannot be re-run")
    logits_diff = _diff(rp, "target_logits")
    if logits_diff is not None and not logits_diff.identical:
        return _cannot(rp, "target_logits differ across ranks: no agreed input to re-run the renorm on")
    stages = list(ctx["probs"].get("stages", []))
    ref = dumps.ranks[rp.first.majority[0]]
    param_majority = {p.name: p.majority[0] for p in rp.params}
    logits = ref.tensor("target_logits").to(rp.device)
    params = {n: dumps.ranks[param_majority.get(PARAM_PREFIX + n, ref.rank)].tensor(PARAM_PREFIX + n).to(rp.device)
              for n in PARAM_NAMES}
    recorded = _recorded(rp, ["target_probs"], rp.first)
    rows = _differing_rows(recorded, "target_probs")
    groups = _group_ranks(rp.first)
    shape = recorded[rp.first.majority[0]]["target_probs"].shape

    def fit(t):
        return t.reshape(shape) if t.numel() == shape.numel() else t

    run_name = ctx["renorm"]["name"]
    chain = " -> ".join(stages) if stages else "no renorm"
    rp.stage = "renorm"
    rp.stage_text = (f"re-run of target_probs (temperature, softmax, {chain}; the recorded per-row parameters) "
                     f"on the agreed target_logits, {rp.calls} calls per backend:")
    names = [run_name] + [n for n in _deterministic_backends(rp.device) if n != run_name]
    backends = {}
    for name in names:
        role = "run" if name == run_name else "deterministic"
        try:
            backend = backends[name] = rerun.renorm_backend(name, rp.device)
        except StageUnavailable as e:
            rp.runs.append(Repeat(_backend_label(name, name == run_name), name, role, error=str(e)))
            continue

        def stage(b=backend):  # in the recorded layout (SGLang's DFlash records [bs, nodes, vocab])
            return {"target_probs": fit(rerun.target_probs(logits, params, stages, b))}

        rep = rerun.repeat(_backend_label(name, name == run_name, backend), name, role, stage, rp.calls,
                           recorded, "target_probs", rows)
        _expand(rep, groups)
        rp.runs.append(rep)
    run_rep = rp.runs[0]
    if run_rep.error is None and run_rep.differing and len(stages) > 1 and run_name in backends:
        b = backends[run_name]
        for i, kind in enumerate(stages):
            prefix = rerun.target_probs(logits, params, stages, b, upto=i)
            param = rerun.stage_param(kind, params, logits.shape[1])
            last = i == len(stages) - 1

            def one(kind=kind, prefix=prefix, param=param):
                return {"target_probs": fit(b.call(kind, prefix, param))}

            # The last renorm's output is target_probs: compared with the ranks' bytes when its
            # input is the one every call of the earlier stages gives.
            compare = last and not any(k.differing for k in rp.kernels)
            rep = rerun.repeat(rerun.kernel_label(b, kind), run_name, "stage" if compare else "kernel", one,
                               rp.calls, recorded if compare else {}, "target_probs" if compare else None,
                               rows if compare else None)
            if compare:
                _expand(rep, groups)
            rp.kernels.append(rep)
    _downstream(rp)
    _renorm_verdict(rp, run_rep, stages)


def _deterministic_backends(device: str) -> list[str]:
    from tpguard.renorm_registry import deterministic_names

    return deterministic_names(device)


def _backend_label(name: str, is_run: bool, backend=None) -> str:
    label = name
    if backend is not None and backend.source and name == "tpguard" and "torch reference" in backend.source:
        label += " (its torch reference on CPU)"
    return label + (RUN_SUFFIX if is_run else "")


def _reproduced_text(reps: list[Repeat], groups: list[list[int]]) -> str:
    culprits = [r for g in groups[1:] for r in g]
    parts = []
    for r in culprits:
        whole = next((rep for rep in reps if rep.reproduced_by.get(str(r)) is not None), None)
        if whole is not None:
            parts.append(f"the bytes rank {r} recorded are reproduced by call {whole.reproduced_by[str(r)]}"
                         + (f" of {whole.label}" if whole is not reps[0] else ""))
        elif _rows_reproduced(r, reps):
            parts.append(f"rank {r}'s differing rows are each reproduced by some call")
        else:
            parts.append(f"rank {r}'s bytes are reproduced by no call in {reps[0].calls} (more --calls may find them)")
    return "; ".join(parts)


def _rows_reproduced(rank: int, reps: list[Repeat]) -> bool:
    """Whether every differing row of `rank` came out of some call of one of `reps`."""
    rows = [rep.rows_reproduced.get(str(rank)) or {} for rep in reps]
    names = set().union(*rows)
    return bool(names) and all(any(r.get(n) is not None for r in rows) for n in names)


def _renorm_verdict(rp: Replay, run_rep: Repeat, stages: list[str]) -> None:
    groups = rp.first.groups
    fixes = [r for r in rp.runs[1:] if r.error is None]
    fix_text = "; ".join(f"{r.backend}: {r.differing} of {r.calls}" for r in fixes)
    if run_rep.error is not None:
        rp.verdict = "cannot-rerun"
        rp.summary = (f"the run's backend {run_rep.backend} cannot run here ({run_rep.error}): replay where it "
                      "runs to confirm the cause; "
                      + (f"deterministic backends here: {fix_text} calls differ" if fixes else "nothing re-run"))
        return
    # The last renorm alone, on an input the earlier stages give every time, is the same
    # computation as the whole stage: its calls count as reproductions too.
    last = rp.kernels[-1] if rp.kernels and rp.kernels[-1].role == "stage" else None
    evidence = [x for x in (last, run_rep) if x is not None]
    rp.reproduced = {str(r): any(x.reproduced_by.get(str(r)) is not None for x in evidence)
                     or _rows_reproduced(r, evidence) for g in groups for r in g}
    if run_rep.differing:
        rp.verdict = "confirmed"
        head = evidence[0]
        label = head.label.removesuffix(RUN_SUFFIX)
        if head is run_rep and len(stages) == 1:  # name the kernel: the stage is one renorm call
            label = rerun.kernel_label(rerun.renorm_backend(run_rep.backend, rp.device), stages[0])
        text = f"{label} on this input: {head.differing} of {head.calls} calls differ from the first"
        if fix_text:
            text += f"; {fix_text}"
        text += f"; {_reproduced_text(evidence, groups)}"
        bad = [r.backend for r in fixes if r.differing]
        good = [r.backend for r in fixes if not r.differing]
        if good:
            text += f". Fix: {', '.join(good)} (deterministic on this input)"
        if bad:
            text += f". NOT a fix here: {', '.join(bad)}"
        rp.summary = text
        return
    rp.verdict = "deterministic"
    got = run_rep.ranks_reproduced()
    text = f"{run_rep.label} gives the same bytes in all {run_rep.calls} calls"
    if got:
        text += f": {_ranks(got)}'s"
        others = [r for g in groups for r in g if r not in got]
        if others:
            text += (f"; {_ranks(others)}'s bytes come from no call: the renorm does not explain them "
                     "(a fault after it, or an input the dump does not hold)")
    elif run_rep.matches_agreed_rows is False:
        text += ", but not even the rows every rank agreed on: the re-run differs from the run (device or versions)"
    else:
        text += ", none of the ranks' bytes"
    rp.summary = text


# --- coins: redrawn from rng_state ------------------------------------------------------------

def _coins(rp: Replay) -> None:
    dumps, ctx = rp.dumps, rp.dumps.context or {}
    draw = ctx.get("coins") or {}
    shapes = draw.get("shapes")
    if not shapes:
        return _cannot(rp, "the dumps do not record how the coins were drawn (context.coins): cannot redraw them")
    if _missing(dumps, ["rng_state"]):
        return _cannot(rp, "the dumps lack rng_state: the coins cannot be redrawn")
    rng = _diff(rp, "rng_state")
    if rng is not None and not rng.identical:
        return _cannot(rp, "rng_state differs across ranks: no agreed input to redraw the coins from")
    state = dumps.ranks[rp.first.majority[0]].tensor("rng_state")
    recorded = _recorded(rp, ["coins"], rp.first)
    rp.stage = "coins"
    shape = recorded[rp.first.majority[0]]["coins"].shape
    draws = " then ".join(f"{draw.get('draw', 'torch.rand')} {list(s)}" for s in shapes)
    rp.stage_text = f"re-run of coins: {draws} from the agreed rng_state, {rp.calls} calls:"
    rep = rerun.repeat("coins from rng_state", "torch.rand", "run",
                       lambda: {"coins": rerun.redraw_coins(state, shapes, rp.device).reshape(shape)},
                       rp.calls, recorded)
    _expand(rep, _group_ranks(rp.first))
    rp.runs.append(rep)
    _note_reproduced(rp, rep)
    _downstream(rp)
    if rep.error:
        return _cannot(rp, f"the coins cannot be redrawn here: {rep.error}")
    if rep.differing:
        rp.verdict = "confirmed"
        rp.summary = f"the generator gives different coins from one state: {rep.differing} of {rep.calls} calls differ"
        return
    rp.verdict = "deterministic"
    got = rep.ranks_reproduced()
    others = [r for g in rp.first.groups for r in g if r not in got]
    rp.summary = (f"the coins redrawn from rng_state are the same in all {rep.calls} calls"
                  + (f" and are {_ranks(got)}'s" if got else ", and no rank's")
                  + (f"; {_ranks(others)}'s coins come from no draw: changed after they were drawn" if others else ""))


# --- decisions: the accept step ---------------------------------------------------------------

ACCEPT_INPUTS = ("draft_tokens", "target_probs", "coins")


def _accept_args(rp: Replay) -> tuple[list[int], str, float, float] | str:
    ctx = rp.dumps.context or {}
    parents, algo = ctx.get("tree_parents"), ctx.get("algo")
    if not parents or algo not in ("dflash", "eagle"):
        return "the dumps do not record the draft tree and algorithm (context.tree_parents, algo)"
    acc = ctx.get("accept") or {}
    return parents, algo, float(acc.get("threshold_single", 1.0)), float(acc.get("threshold_acc", 1.0))


def _accept(rp: Replay) -> None:
    dumps = rp.dumps
    args = _accept_args(rp)
    if isinstance(args, str):
        return _cannot(rp, args + ": the accept step cannot be re-run")
    missing = _missing(dumps, ACCEPT_INPUTS)
    if missing:
        why = " (the run guarded --quantities decisions)" if "target_probs" in missing else ""
        return _cannot(rp, f"the dumps lack {', '.join(missing)}{why}: the accept step cannot be re-run")
    for name in ACCEPT_INPUTS:
        t = _diff(rp, name)
        if t is not None and not t.identical:
            return _cannot(rp, f"{name} differs across ranks: no agreed input to re-run the accept step on")
    parents, algo, ts, ta = args
    ref = dumps.ranks[rp.first.majority[0]]
    inputs = {n: ref.tensor(n).to(rp.device) for n in ACCEPT_INPUTS}
    names = [q for q in DECISIONS if all(d.has(q) for d in dumps.ranks.values())]
    recorded = _recorded(rp, names, rp.first)
    kind = "chain" if algo == "dflash" else "tree"
    rp.stage = "accept"
    rp.stage_text = (f"re-run of the accept step ({algo} {kind}, {len(parents)} nodes) on the agreed draft_tokens, "
                     f"target_probs and coins, {rp.calls} calls:")

    def stage():
        out = rerun.accept_step(inputs["draft_tokens"], inputs["target_probs"], inputs["coins"], parents, algo, ts, ta)
        return {k: v for k, v in out.items() if k in names}

    rep = rerun.repeat(f"accept step ({algo})", "launch/accept.py", "run", stage, rp.calls, recorded)
    _expand(rep, _group_ranks(rp.first))
    rp.runs.append(rep)
    _note_reproduced(rp, rep)
    if rep.error:
        return _cannot(rp, f"the accept step cannot be re-run on these dumps: {rep.error}")
    if rep.differing:
        rp.verdict = "confirmed"
        rp.summary = f"the accept step gives different decisions on one input: {rep.differing} of {rep.calls} calls differ"
        return
    rp.verdict = "deterministic"
    got = rep.ranks_reproduced()
    q = rp.first.name
    others = [r for g in rp.first.groups for r in g if r not in got]
    text = f"the accept step gives the same decisions in all {rep.calls} calls"
    text += f": {_ranks(got)}'s" if got else ", no rank's"
    if others:
        wrong = sorted({k for r in others for k, c in rep.outputs_reproduced.get(str(r), {}).items() if c is None})
        text += (f"; {_ranks(others)}'s {', '.join(wrong) or q} come from no call: changed after the accept step "
                 "(a fault, a bug, an injection), not by it")
    rp.summary = text


def _downstream(rp: Replay) -> None:
    """After target_probs or coins: does each rank's accept step on its own recorded inputs give
    its own recorded decisions (the flip follows from the earlier difference)?"""
    dumps = rp.dumps
    args = _accept_args(rp)
    names = [q for q in DECISIONS if all(d.has(q) for d in dumps.ranks.values())]
    if isinstance(args, str) or _missing(dumps, ACCEPT_INPUTS) or not names:
        return
    parents, algo, ts, ta = args
    leaders = _group_ranks(rp.first)
    for lead, ranks in leaders.items():
        d = dumps.ranks[lead]
        entry = {"rank": lead, "ranks": ranks}
        try:
            inp = {n: d.tensor(n).to(rp.device) for n in ACCEPT_INPUTS}
            out = rerun.accept_step(inp["draft_tokens"], inp["target_probs"], inp["coins"], parents, algo, ts, ta)
            entry["follows"] = {q: rerun.same_bytes(out[q], d.tensor(q).to(rp.device)) for q in names}
        except StageUnavailable as e:
            entry["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - inputs the accept step cannot take: said, not raised
            entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        rp.downstream.append(entry)
    flips = [q for q in names if (t := _diff(rp, q)) is not None and not t.identical]
    if flips and all(e.get("follows") and all(e["follows"].values()) for e in rp.downstream):
        rp.notes.append(f"the decisions that differ ({', '.join(flips)}) follow from each rank's own "
                        f"{rp.first.name}: the accept step gives every rank its recorded decisions")
