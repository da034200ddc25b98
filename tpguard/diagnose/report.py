"""Reporter: the diagnosis as a JSON object (`--json`) and as text for people."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpguard.diagnose.matcher import Analysis
from tpguard.diagnose.reader import TraceSet
from tpguard.diagnose.rules import explain
from tpguard.replay.hint import replay_hint


@dataclass
class Diagnosis:
    ts: TraceSet
    analysis: Analysis
    cause: str | None = None
    fix: str | None = None
    timeouts: list[dict] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return self.analysis.first is not None

    def to_json(self) -> dict:
        a, ts = self.analysis, self.ts
        first = None
        if a.first is not None:
            d = a.first.disagreement
            first = {
                "step": a.first.step, "site": a.first.site, "quantity": d.quantity,
                "culprit_ranks": d.culprit_ranks, "majority_ranks": d.majority_ranks,
                "values": d.values, "differing_at_step": a.first.differing_at_step,
                "agreeing_before": a.first.agreeing_before, "not_captured": a.first.not_captured,
                "rows": _rows_for(ts, a.first.step, a.first.site, d.quantity),
                "replay": replay_hint(ts.files[0].path.parent, ts.run_id, a.first.step, a.first.site),
            }
        return {
            "verdict": "diverged" if self.diverged else "clean",
            "run_id": ts.run_id,
            "algo": ts.algo,
            "world_size": ts.world_size,
            "steps": a.steps,
            "divergent_steps": a.divergent_steps,
            "ranks": ts.ranks,
            "first_divergence": first,
            "cascade": [{"step": s, "site": site, "quantities": qs} for s, site, qs in a.cascade],
            "cascade_counts": a.cascade_counts,
            "last_step_by_rank": {str(r): s for r, s in a.last_step_by_rank.items()},
            "stopped_early": stopped_early(a.last_step_by_rank),
            "timeouts": self.timeouts,
            "guard_actions": _actions(ts),
            "cause": self.cause,
            "fix": self.fix,
            "warnings": ts.warnings,
        }


def build(ts: TraceSet, a: Analysis) -> Diagnosis:
    diag = Diagnosis(ts, a)
    recorded = [r for r, s in a.last_step_by_rank.items() if s is not None]
    if len(recorded) < 2:  # "clean" would mean nothing here: say so
        ts.warn(f"only rank(s) {recorded} recorded any step: nothing was compared across ranks")
    if a.first is not None:
        rule = explain(a.first)
        diag.cause, diag.fix = rule.cause, rule.fix
    diag.timeouts = [
        {"step": ev.step, "site": ev.site, "rank": ev.rank, "message": ev.message,
         "missing_ranks": ev.extra.get("missing_ranks")}
        for ev in ts.events if ev.kind == "timeout"
    ]
    if diag.timeouts and a.first is None:
        diag.cause = "a rank stopped reaching the guard (it hung or died before a divergence was seen)"
        diag.fix = ("look at the named rank's own logs; a divergence in an unguarded site or before the "
                    "guard was enabled can wedge a later collective")
    return diag


def stopped_early(last: dict[int, int | None]) -> list[int]:
    known = [s for s in last.values() if s is not None]
    if not known:
        return []
    end = max(known)
    return sorted(r for r, s in last.items() if s is None or s < end)


def _rows_for(ts: TraceSet, step: int, site: str, quantity: str) -> list[int] | None:
    for d in ts.divergences:
        if d.step == step and d.site == site and d.quantity == quantity and d.rows is not None:
            return d.rows
    return None


def _actions(ts: TraceSet) -> dict[str, int]:
    out: dict[str, int] = {}
    seen = set()
    for d in ts.divergences:
        key = (d.step, d.site)
        if key in seen:  # every rank writes the same divergence record
            continue
        seen.add(key)
        out[d.action] = out.get(d.action, 0) + 1
    return out


def render_text(diag: Diagnosis) -> str:
    j = diag.to_json()
    lines = [f"run {j['run_id']}: {len(j['ranks'])} of {j['world_size']} ranks, algo {j['algo']}, "
             f"{j['steps']} steps"]
    f = j["first_divergence"]
    if f is None:
        lines.append("CLEAN: no quantity differs across ranks at any step")
    else:
        culprit = ", ".join(map(str, f["culprit_ranks"]))
        majority = ", ".join(map(str, f["majority_ranks"]))
        lines.append(f"DIVERGED at step {f['step']}, site {f['site']}: first differing quantity "
                     f"{f['quantity']!r}")
        lines.append(f"  culprit rank(s): {culprit}   majority/reference rank(s): {majority}")
        for fp, ranks in f["values"].items():
            lines.append(f"    {fp}  ranks {ranks}")
        if f["rows"]:
            lines.append(f"  diverging rows of {f['quantity']}: {f['rows']}")
        if f["replay"]:  # the dumps of that step (--dump / TPGUARD_DUMP=1): re-run it
            lines.append(f"  dumps: {', '.join(f['replay']['dumps'])}\n  replay: {f['replay']['command']}")
        if f["agreeing_before"]:
            lines.append(f"  agreed before it: {', '.join(f['agreeing_before'])}")
        if f["not_captured"]:
            lines.append(f"  not captured: {', '.join(f['not_captured'])}")
        if len(f["differing_at_step"]) > 1:
            lines.append(f"  also differing at step {f['step']}: "
                         f"{', '.join(q for q in f['differing_at_step'] if q != f['quantity'])}")
        after = j["divergent_steps"] - 1
        if after:
            counts = ", ".join(f"{q} first at {n}" for q, n in j["cascade_counts"].items())
            lines.append(f"  after it: {after} more divergent step(s) ({counts})")
            for c in j["cascade"][:5]:
                lines.append(f"    step {c['step']} {c['site']}: {', '.join(c['quantities'])}")
        if j["guard_actions"]:
            lines.append("  guard actions: " + ", ".join(f"{k} {v}" for k, v in j["guard_actions"].items()))
    last = ", ".join(f"rank {r}: {s if s is not None else 'none'}" for r, s in j["last_step_by_rank"].items())
    lines.append(f"last step by rank: {last}")
    if j["stopped_early"]:
        lines.append(f"  rank(s) {j['stopped_early']} stopped before the others")
    for msg in dict.fromkeys(t["message"] for t in j["timeouts"]):  # every waiting rank writes one
        lines.append(f"timeout: {msg}")
    if diag.cause:
        lines.append(f"cause: {diag.cause}")
        lines.append(f"fix: {diag.fix}")
    for w in j["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
