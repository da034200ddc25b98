"""Reporter: the diagnosis as a JSON object (`--json`) and as text for people."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpguard.diagnose.matcher import Analysis, Gap
from tpguard.diagnose.reader import TraceSet, show, show_ranks
from tpguard.diagnose.rules import explain
from tpguard.replay.hint import replay_hint

FINDINGS_SHOWN = 10
MESSAGE_SHOWN = 2000  # an event's free-text message, as read from a trace


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

    @property
    def verdict(self) -> str:
        """'diverged', 'clean', or 'nothing_compared': no step and site held a value of one
        quantity on two or more ranks (disjoint steps or sites, empty records)."""
        if self.diverged:
            return "diverged"
        return "clean" if self.analysis.compared_steps else "nothing_compared"

    def findings(self) -> list[str]:
        """Records missing on some ranks at or before the first divergence (or anywhere, when
        none was seen): each may hide the true first divergence."""
        g = self.analysis.gaps
        where = ("it lies before the first divergence, which may be there instead" if self.diverged
                 else "not compared there")
        out = [f"{_gap(x)} ({where})" for x in g.before[:FINDINGS_SHOWN]]
        if g.before_count > len(out):
            out.append(f"... and {g.before_count - len(out)} more record(s) missing on some ranks"
                       + (" before the first divergence" if self.diverged else ""))
        return out

    def to_json(self) -> dict:
        a, ts = self.analysis, self.ts
        first = None
        if a.first is not None:
            d = a.first.disagreement
            first = {
                "step": a.first.step, "site": a.first.site, "quantity": d.quantity,
                "culprit_ranks": d.culprit_ranks, "majority_ranks": d.majority_ranks,
                "values": d.values, "uncaptured_ranks": getattr(d, "uncaptured_ranks", []),
                "differing_at_step": a.first.differing_at_step,
                "agreeing_before": a.first.agreeing_before, "not_captured": a.first.not_captured,
                "rows": _rows_for(ts, a.first.step, a.first.site, d.quantity),
                "replay": replay_hint(ts.files[0].path.parent, ts.run_id, a.first.step, a.first.site),
            }
        g = a.gaps
        return {
            "verdict": self.verdict,
            "run_id": ts.run_id,
            "algo": ts.algo,
            "world_size": ts.world_size,
            "steps": a.steps,
            "compared_steps": a.compared_steps,
            "divergent_steps": a.divergent_steps,
            "ranks": ts.ranks,
            "first_divergence": first,
            "cascade": [{"step": s, "site": site, "quantities": qs} for s, site, qs in a.cascade],
            "cascade_counts": a.cascade_counts,
            "last_step_by_rank": {str(r): s for r, s in a.last_step_by_rank.items()},
            "stopped_early": stopped_early(a.last_step_by_rank),
            "findings": self.findings(),
            "missing_records": {
                "before_first_divergence": g.before_count,
                "listed": [{"rank": x.rank, "step": x.step, "site": x.site} for x in g.before],
                "after_first_divergence": {str(r): n for r, n in sorted(g.after_count.items())},
                "after_last_record": {str(r): n for r, n in sorted(g.tail.items())},
            },
            "coverage": {str(r): {"records": c.records, "first_step": c.first_step, "last_step": c.last_step,
                                  "sites": c.sites} for r, c in sorted(a.coverage.items())},
            "timeouts": self.timeouts,
            "switches": switches(ts),
            "guard_actions": _actions(ts),
            "cause": self.cause,
            "fix": self.fix,
            "warnings": ts.warnings,
        }


def build(ts: TraceSet, a: Analysis) -> Diagnosis:
    diag = Diagnosis(ts, a)
    g = a.gaps
    if g.after_count:
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in sorted(g.after_count.items()))
        ts.warn(f"after the first divergence, {sum(g.after_count.values())} record(s) are missing on some ranks "
                f"({per_rank}; the first: {_gap(g.after_example)}); not compared")
    for r, n in sorted(g.tail.items()):
        ts.warn(f"rank {r} has no record of the last {n} record(s) other ranks made (it stopped early)"
                if a.coverage.get(r) and a.coverage[r].records else
                f"rank {r} recorded no captured value at all ({n} record(s) of other ranks not compared)")
    if a.first is not None:
        rule = explain(a.first)
        diag.cause, diag.fix = rule.cause, rule.fix
    diag.timeouts = [_timeout(ev) for ev in ts.events
                     if ev.kind == "timeout" or _field(ev, "dead_ranks") is not None]
    if diag.timeouts and a.first is None:
        dead = sorted({r for t in diag.timeouts for r in t["dead_ranks"] or []})
        missing = sorted({r for t in diag.timeouts for r in t["missing_ranks"] or []} - set(dead))
        early = stopped_early(a.last_step_by_rank)
        if dead:
            diag.cause = (f"rank(s) {show_ranks(dead)} died (killed by a signal or crashed) before a divergence "
                          "was seen" + (f"; rank(s) {show_ranks(missing)} stopped answering" if missing else ""))
            named = dead
        elif missing:
            diag.cause = (f"rank(s) {show_ranks(missing)} stopped reaching the guard (hung or died) before a "
                          "divergence was seen")
            named = missing
        else:
            diag.cause = "a rank stopped reaching the guard (it hung or died) before a divergence was seen"
            named = early
        who = f"rank(s) {show_ranks(named)}'s" if named else "the ranks'"
        diag.fix = (f"look at {who} own logs (a signal, an out-of-memory kill, an exception, a hang); a "
                    "divergence in an unguarded site or before the guard was enabled can wedge a later collective")
    return diag


def _rank_list(value) -> list[int] | None:
    """A list of ranks from an event's optional field (other writers may put anything there)."""
    if isinstance(value, list) and all(type(r) is int for r in value):
        return sorted(value)
    return None


def _field(ev, name: str):
    """An optional field of an event: beyond the record type (in `extra`) or, where a writer's
    EventRecord declares it, an attribute."""
    return ev.extra.get(name, getattr(ev, name, None))


def _timeout(ev) -> dict:
    missing = _rank_list(_field(ev, "missing_ranks"))
    if missing is None:
        missing = _rank_list(_field(ev, "missing"))
    return {"kind": ev.kind, "step": ev.step, "site": ev.site, "rank": ev.rank, "message": ev.message,
            "missing_ranks": missing, "dead_ranks": _rank_list(_field(ev, "dead_ranks"))}


def switches(ts: TraceSet) -> list[dict]:
    """Policy fix's switches (`switch` events), once per step and site (every rank writes one)."""
    out, seen = [], set()
    for ev in ts.events:
        if ev.kind != "switch" or (ev.step, ev.site) in seen:
            continue
        seen.add((ev.step, ev.site))
        out.append({"step": ev.step, "site": ev.site, "what": _field(ev, "what"),
                    "from_step": _field(ev, "from_step"), "why": _field(ev, "why"), "message": ev.message})
    return sorted(out, key=lambda x: (x["step"] if type(x["step"]) is int else -1, str(x["site"])))


def _plain(ranks: list[int]) -> str:
    """Ranks for a line of text: '0, 1', or cut short when long."""
    text = show_ranks(ranks)
    return text[1:-1] if text.endswith("]") else text


def _gap(g: Gap) -> str:
    return f"rank {g.rank} has no record of step {g.step}, site {show(g.site)}"


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
    if j["verdict"] == "nothing_compared":
        lines.append("NOTHING COMPARED: no step and site holds a value of one quantity on two or more ranks "
                     "(ranks with disjoint steps or sites, or records without captured values)")
        for r, c in j["coverage"].items():
            if c["records"]:
                sites = ", ".join(show(s) for s in c["sites"])
                lines.append(f"  rank {r}: {c['records']} record(s), steps {c['first_step']}-{c['last_step']}, "
                             f"site(s) {sites}")
            else:
                lines.append(f"  rank {r}: no record with a captured value")
    elif f is None:
        lines.append(f"CLEAN: no quantity differs across ranks at any of the {j['compared_steps']} step(s) compared")
    else:
        culprit, majority = _plain(f["culprit_ranks"]), _plain(f["majority_ranks"])
        lines.append(f"DIVERGED at step {f['step']}, site {show(f['site'])}: first differing quantity "
                     f"{show(f['quantity'])!r}")
        lines.append(f"  culprit rank(s): {culprit}   majority/reference rank(s): {majority}")
        for fp, ranks in f["values"].items():
            lines.append(f"    {fp}  ranks {show_ranks(ranks)}")
        if f["uncaptured_ranks"]:  # they hold a record of this step and site, without this quantity
            lines.append(f"    {'not captured':16}  ranks {show_ranks(f['uncaptured_ranks'])}")
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
        lines += [f"finding: {x}" for x in j["findings"]]
        after = j["divergent_steps"] - 1
        if after:
            counts = ", ".join(f"{q} first at {n}" for q, n in j["cascade_counts"].items())
            lines.append(f"  after it: {after} more divergent step(s) ({counts})")
            for c in j["cascade"][:5]:
                lines.append(f"    step {c['step']} {c['site']}: {', '.join(c['quantities'])}")
        if j["guard_actions"]:
            lines.append("  guard actions: " + ", ".join(f"{k} {v}" for k, v in j["guard_actions"].items()))
    if f is None and j["verdict"] != "nothing_compared":
        lines += [f"finding: {x}" for x in j["findings"]]
    last_steps = [f"rank {r}: {s if s is not None else 'none'}" for r, s in j["last_step_by_rank"].items()]
    if len(last_steps) > 10:  # one line whatever the world size
        last_steps[8:-1] = ["..."]
        last_steps[-1] += f" ({len(j['last_step_by_rank'])} ranks)"
    last = ", ".join(last_steps)
    lines.append(f"last step by rank: {last}")
    if j["stopped_early"]:
        lines.append(f"  rank(s) {show_ranks(j['stopped_early'])} stopped before the others")
    for kind, msg in dict.fromkeys((t["kind"], t["message"]) for t in j["timeouts"]):  # each waiting rank writes one
        lines.append(f"{show(str(kind))}: {show(str(msg), MESSAGE_SHOWN)}")
    for sw in j["switches"]:
        lines.append(f"switched at step {sw['step']}, site {show(sw['site'])}: {sw['message']}")
    if diag.cause:
        lines.append(f"cause: {diag.cause}")
        lines.append(f"fix: {diag.fix}")
    for w in j["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
