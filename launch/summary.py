"""Rank 0's end-of-run summary: what ran, what diverged, what the policy did, what it cost.

Exit codes (docs/harness.md): 0 ran to the end with identical outputs and no divergence left
standing (none seen, or all healed); 1 divergences were recorded or outputs differ; 2 bad
arguments; 3 the guard aborted every rank at a divergent step; 4 a wait timed out (ranks named).

Time per step is the steady state: the first `--warmup-steps` steps (Triton compilation, CUDA
graph capture, caches) are timed apart, each one listed, so that a slow start neither hides nor
inflates the per-step cost.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import orjson

from tpguard.errors import EXIT_ABORTED, EXIT_DIVERGED, EXIT_OK, EXIT_TIMEOUT


@dataclass
class RunSummary:
    run_id: str
    world_size: int
    backend: str
    device: str
    algo: str
    logits: str
    renorm: str
    policy: str
    guard: bool
    steps_planned: int
    steps_done: int = 0
    ended: str = "completed"  # completed | aborted | timeout
    message: str | None = None
    divergences: int = 0
    divergent_quantities: dict[str, int] = field(default_factory=dict)  # first quantity -> steps
    decision_flips: int = 0  # divergent steps where a decision (accept_*, bonus, commit, out) differed
    first_divergence: dict | None = None  # {"step", "quantity", "culprit_ranks", "majority_ranks", "rows"}
    actions: dict[str, int] = field(default_factory=dict)
    injected: list[str] = field(default_factory=list)
    seconds: float = 0.0  # steady state: the steps after the warm-up
    steps_timed: int = 0  # steady-state steps done, plus the one an abort ended
    guard_seconds: float = 0.0  # the guard's share of `seconds`
    warmup_planned: int = 0  # the first steps timed apart (--warmup-steps, at most half the steps)
    warmup_steps: int = 0  # warm-up steps done
    warmup_seconds: float = 0.0
    warmup_guard_seconds: float = 0.0
    warmup_step_ms: list[float] = field(default_factory=list)
    outputs_identical: bool | None = None
    output_fingerprints: dict[str, str] = field(default_factory=dict)
    committed_tokens: int = 0
    state_collectives: int = 0
    trace_files: list[str] = field(default_factory=list)
    switches: list[dict] = field(default_factory=list)  # policy fix: {"step", "from_step", "what", "why"}

    def time_step(self, step: int, seconds: float, guard_seconds_so_far: float) -> None:
        """Count one step's wall time, as warm-up or steady state (`guard_seconds_so_far`: the
        guard's running total, which splits its time at the end of the warm-up)."""
        if step < self.warmup_planned:
            self.warmup_steps += 1
            self.warmup_seconds += seconds
            self.warmup_step_ms.append(round(1e3 * seconds, 3))
            self.warmup_guard_seconds = guard_seconds_so_far
        else:
            self.seconds += seconds
            self.steps_timed += 1

    @property
    def ms_per_step(self) -> float | None:
        """Steady state; None when the run ended within its warm-up."""
        return 1e3 * self.seconds / self.steps_timed if self.steps_timed else None

    @property
    def guard_ms_per_step(self) -> float | None:
        return 1e3 * self.guard_seconds / self.steps_timed if self.steps_timed else None

    @property
    def warmup_ms_per_step(self) -> float | None:
        return 1e3 * self.warmup_seconds / self.warmup_steps if self.warmup_steps else None

    @property
    def exit_code(self) -> int:
        if self.ended == "aborted":
            return EXIT_ABORTED
        if self.ended == "timeout":
            return EXIT_TIMEOUT
        unhealed = self.divergences - self.actions.get("healed", 0)
        if unhealed > 0 or self.outputs_identical is False:
            return EXIT_DIVERGED
        return EXIT_OK

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(ms_per_step=_round(self.ms_per_step), guard_ms_per_step=_round(self.guard_ms_per_step),
                 warmup_ms_per_step=_round(self.warmup_ms_per_step), exit_code=self.exit_code)
        return d

    def write_json(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        os.replace(tmp, path)


def warmup_steps(requested: int, steps: int) -> int:
    """--warmup-steps, at most half the run's steps (so a short run still has a steady state)."""
    return max(0, min(requested, steps // 2))


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _timing(s: RunSummary) -> list[str]:
    lines = []
    if s.ms_per_step is None:
        lines.append("  time per step:    n/a (the run ended within its warm-up)")
    elif s.guard:
        lines.append(f"  time per step:    {s.ms_per_step:.2f} ms ({s.guard_ms_per_step:.2f} ms guard, "
                     f"{s.ms_per_step - s.guard_ms_per_step:.2f} ms without it), steady state over "
                     f"{s.steps_timed} step(s)")
    else:
        lines.append(f"  time per step:    {s.ms_per_step:.2f} ms (no guard), steady state over {s.steps_timed} step(s)")
    if s.warmup_steps:
        each = ", ".join(f"{ms:.1f}" for ms in s.warmup_step_ms)
        lines.append(f"  warm-up:          {s.warmup_steps} step(s), {1e3 * s.warmup_seconds:.1f} ms in all "
                     f"({each} ms; compilation, caches)")
    return lines


def _first(d: dict | None) -> str:
    if d is None:
        return "none"
    rows = f", rows {d['rows']}" if d.get("rows") else ""
    return (f"step {d['step']}, {d['quantity']}, culprit rank(s) {d['culprit_ranks']} "
            f"(majority {d['majority_ranks']}{rows})")


def format_text(s: RunSummary) -> str:
    lines = [f"tpguard harness summary (run {s.run_id}): {s.world_size} ranks, {s.backend} on {s.device}, "
             f"{s.algo}, logits {s.logits}, renorm {s.renorm}, "
             + (f"guard on, policy {s.policy}" if s.guard else "guard off")]
    ended = {"completed": "ran to the end", "aborted": "aborted by the guard", "timeout": "ended by a timeout"}
    at = "" if s.ended == "completed" else f" at step {s.steps_done}"
    lines.append(f"  steps:            {s.steps_done} of {s.steps_planned} completed ({ended[s.ended]}{at})")
    if s.injected:
        lines.append(f"  injected:         {', '.join(s.injected)}")
    if s.guard:
        by_q = ", ".join(f"{q} x{n}" for q, n in s.divergent_quantities.items())
        lines.append(f"  divergences:      {s.divergences}" + (f" (first differing quantity: {by_q}; "
                                                                  f"{s.decision_flips} flipped a decision)" if by_q else ""))
        lines.append(f"  first divergence: {_first(s.first_divergence)}")
        acts = ", ".join(f"{k} {v}" for k, v in s.actions.items() if v) or "none"
        lines.append(f"  policy actions:   {acts}")
        for sw in s.switches:
            lines.append(f"  switched:         at step {sw['step']}: {sw['what']} from step {sw['from_step']} on "
                         f"({sw['why']})")
    lines += _timing(s)
    if s.outputs_identical is None:
        lines.append("  outputs:          not compared (the run did not reach its end together)")
    else:
        fps = ", ".join(f"rank {r}: {v}" for r, v in s.output_fingerprints.items())
        lines.append(f"  outputs:          {'IDENTICAL' if s.outputs_identical else 'DIFFERENT'} on all ranks "
                     f"({s.committed_tokens} tokens committed on rank 0; {fps})")
    if s.message:
        lines.append(f"  {s.message}")
    for path in s.trace_files:
        lines.append(f"  trace:            {path}")
    return "\n".join(lines)
