"""Rank 0's end-of-run summary: what ran, what diverged, what the policy did, what it cost.

Exit codes (docs/harness.md): 0 ran to the end with identical outputs and no divergence left
standing (none seen, or all healed); 1 divergences were recorded or outputs differ; 2 bad
arguments; 3 the guard aborted every rank at a divergent step; 4 a wait timed out (ranks named).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

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
    seconds: float = 0.0
    steps_timed: int = 0  # steps done, plus the one an abort or a timeout ended
    guard_seconds: float = 0.0
    outputs_identical: bool | None = None
    output_fingerprints: dict[str, str] = field(default_factory=dict)
    committed_tokens: int = 0
    state_collectives: int = 0
    trace_files: list[str] = field(default_factory=list)

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / max(self.steps_timed, 1)

    @property
    def guard_ms_per_step(self) -> float:
        return 1e3 * self.guard_seconds / max(self.steps_timed, 1)

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
        d.update(ms_per_step=round(self.ms_per_step, 3), guard_ms_per_step=round(self.guard_ms_per_step, 3),
                 exit_code=self.exit_code)
        return d

    def write_json(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)


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
        lines.append(f"  time per step:    {s.ms_per_step:.2f} ms ({s.guard_ms_per_step:.2f} ms guard, "
                     f"{s.ms_per_step - s.guard_ms_per_step:.2f} ms without it)")
    else:
        lines.append(f"  time per step:    {s.ms_per_step:.2f} ms (no guard)")
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
