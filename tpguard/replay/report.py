"""Reporter: the replay as a JSON object (`--json`) and as text for people, and its exit code."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpguard.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK
from tpguard.replay.diff import TensorDiff
from tpguard.replay.reader import StepDumps
from tpguard.replay.rerun import Repeat

# verdict -> exit code: 1 the re-run stage shows the divergence (confirmed), 0 it reproduces
# nothing divergent (or nothing could differ), 2 the dumps lack what the re-run needs.
VERDICT_EXIT = {"confirmed": EXIT_DIVERGED, "deterministic": EXIT_OK, "identical": EXIT_OK,
                "not-rerun": EXIT_OK, "cannot-rerun": EXIT_BAD_INPUT}


@dataclass
class Replay:
    dumps: StepDumps
    device: str
    calls: int
    diffs: list[TensorDiff]
    params: list[TensorDiff]
    first: TensorDiff | None
    stage: str | None = None  # renorm | coins | accept
    stage_text: str = ""  # what was re-run, on which inputs
    runs: list[Repeat] = field(default_factory=list)  # the run's backend first, then the fixes
    kernels: list[Repeat] = field(default_factory=list)  # the run's backend, one renorm stage at a time
    downstream: list[dict] = field(default_factory=list)  # each rank's decisions from its own inputs
    verdict: str = "identical"
    reproduced: dict[str, bool] = field(default_factory=dict)  # rank -> its recorded bytes came out of a call
    summary: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return VERDICT_EXIT[self.verdict]

    def to_json(self) -> dict:
        d = self.dumps
        return {
            "run_id": d.run_id, "step": d.step, "site": d.site, "world_size": d.world_size,
            "files": {str(r): str(x.path) for r, x in sorted(d.ranks.items())},
            "other_dumped_steps": d.other_steps, "device": self.device, "calls": self.calls,
            "context": d.context,
            "first_differing": self.first.name if self.first else None,
            "tensors": [t.to_json() for t in self.diffs],
            "params": [t.to_json() for t in self.params],
            "stage": self.stage, "stage_text": self.stage_text,
            "runs": [r.to_json() for r in self.runs],
            "kernels": [r.to_json() for r in self.kernels],
            "downstream": self.downstream,
            "reproduced": self.reproduced, "verdict": self.verdict, "exit_code": self.exit_code, "summary": self.summary,
            "notes": self.notes,
        }


def _ranks(rs) -> str:
    rs = list(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


def _num(v) -> str:
    return f"{v:.9g}" if isinstance(v, float) else str(v)


def _rows(rows: list[int], total: int, n: int) -> str:
    shown = ", ".join(map(str, rows[:12])) + (", ..." if n > 12 else "")
    return f"{n} of {total} row(s) ({shown})"


def render_tensor(t: TensorDiff, detail: bool) -> list[str]:
    name = f"  {t.name:<14}"
    if t.identical:
        missing = f" (not recorded on {_ranks(t.not_recorded)})" if t.not_recorded else ""
        return [f"{name}identical on {_ranks(t.ranks)}{missing}"]
    groups = "; ".join(_ranks(g) for g in t.groups)
    lines = [f"{name}DIFFERS: {groups} (culprit {', '.join(map(str, t.culprits))})"]
    for d in t.distances:
        who = f"      rank {d.rank} vs rank {d.reference_rank}: "
        if d.problem:
            lines.append(who + d.problem)
            continue
        if not detail:
            lines.append(who + _rows(d.rows, d.rows_total, d.rows_differing))
            continue
        lines.append(who + f"{_rows(d.rows, d.rows_total, d.rows_differing)}, {d.elements_differing} element(s)")
        if d.first_index is not None:
            a, b = d.first_values
            lines.append(f"        first element {d.first_index}: {_num(a)} vs {_num(b)}")
        dist = []
        if d.max_abs is not None:
            dist.append(f"max abs {_num(d.max_abs)}")
        if d.max_ulp is not None:
            dist.append(f"max ulp {d.max_ulp}")
        if d.nan_mismatches:
            dist.append(f"{d.nan_mismatches} NaN mismatch(es)")
        if dist:
            lines.append("        " + ", ".join(dist))
    return lines


def _reproduction(rep: Repeat) -> str:
    parts = []
    for r, call in rep.reproduced_by.items():
        if call is not None:
            parts.append(f"rank {r}'s bytes by call {call}")
            continue
        rows = rep.rows_reproduced.get(r) or {}
        found = {row: c for row, c in rows.items() if c is not None}
        if rows and len(found) == len(rows):
            parts.append(f"rank {r}'s differing rows each by some call (rows "
                         + ", ".join(f"{row}: call {c}" for row, c in list(found.items())[:6])
                         + (", ..." if len(found) > 6 else "") + ")")
        elif rows and found:
            parts.append(f"rank {r}: {len(found)} of its {len(rows)} differing rows")
        else:
            parts.append(f"rank {r}'s bytes by no call")
    return "; ".join(parts)


def render_repeat(rep: Repeat, calls: int) -> str:
    if rep.error:
        return f"  {rep.label}: not run here: {rep.error}"
    text = f"  {rep.label}: {rep.differing} of {rep.calls} calls differ from the first"
    if rep.role == "kernel":
        return text
    if rep.role == "deterministic":  # another backend: its bytes need not be any rank's
        got = rep.ranks_reproduced()
        return text + (f"; gives {_ranks(got)}'s bytes" if got else "")
    text += f"; reproduced: {_reproduction(rep)}"
    if rep.matches_agreed_rows is False:
        text += " (and some rows every rank agreed on came out of no call)"
    return text


def render_text(rp: Replay) -> str:
    d = rp.dumps
    lines = [f"replay of run {d.run_id}, step {d.step}, site {d.site}: {d.world_size} ranks' dumps, "
             f"re-run on {rp.device} ({rp.calls} calls)"]
    lines.append("recorded tensors, in causal order:")
    for t in rp.diffs:
        lines += render_tensor(t, detail=t is rp.first)
    differing_params = [p for p in rp.params if not p.identical]
    if rp.params:
        if differing_params:
            for p in differing_params:
                lines += render_tensor(p, detail=True)
        else:
            lines.append(f"  sampling parameters ({', '.join(p.name for p in rp.params)}): identical")
    if rp.stage_text:
        lines.append(rp.stage_text)
    for rep in rp.runs:
        lines.append(render_repeat(rep, rp.calls))
    if rp.kernels:
        lines.append("  the run's backend, one stage at a time on that stage's input:")
        for rep in rp.kernels:
            lines.append("  " + render_repeat(rep, rp.calls) + " on this input")
    for ds in rp.downstream:
        if ds.get("error"):
            lines.append(f"  decisions of rank {ds['rank']} from its own inputs: not re-run: {ds['error']}")
            continue
        follows = [q for q, ok in ds["follows"].items() if ok]
        not_follows = [q for q, ok in ds["follows"].items() if not ok]
        text = f"  {_ranks(ds['ranks'])}: the accept step on its own recorded inputs gives its recorded "
        text += ", ".join(follows) if follows else "none of its decisions"
        if not_follows:
            text += f"; not its {', '.join(not_follows)}"
        lines.append(text)
    lines.append(f"verdict: {rp.verdict.upper()}: {rp.summary}")
    for n in rp.notes:
        lines.append(f"note: {n}")
    if d.other_steps:
        steps = ", ".join(map(str, d.other_steps[:10])) + (", ..." if len(d.other_steps) > 10 else "")
        lines.append(f"other dumped steps of this run: {steps} (--step N)")
    return "\n".join(lines)
