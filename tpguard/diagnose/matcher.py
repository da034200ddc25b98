"""Matcher: merge step records of all files by step and site, and apply the reading rule.

Reading rule (trace format v1): the first divergence is the smallest step at which any quantity
differs across ranks; within that step, the first differing quantity in causal order across all
sites. Comparison itself is `tpguard.divergence.first_divergence`, shared with the live guard.

Clean stretches are compared as raw byte blocks (see `_clean_block`); the rest is merged by
step from the files' cursors. Memory holds one step at a time plus a
small window of steps around the first divergence (for the HTML grid).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import orjson

from tpguard.diagnose.reader import BLOCK_LINES, RANKS_FIELD, STEP_NUMBER, STEP_PREFIX, FileCursor, TraceSet
from tpguard.divergence import Disagreement, causal_order, first_divergence
from tpguard.records import expand_fp

WINDOW_BEFORE = 5
WINDOW_AFTER = 15
CASCADE_LIMIT = 20


@dataclass
class StepView:
    """One step at one site: every rank's value of every quantity (None: not captured)."""

    step: int
    site: str
    by_quantity: dict[str, dict[int, str | None]]
    differing: list[str] = field(default_factory=list)
    first: Disagreement | None = None


@dataclass
class FirstDivergence:
    step: int
    site: str
    disagreement: Disagreement
    differing_at_step: list[str]  # all differing quantities at that step (all sites), causal order
    agreeing_before: list[str]  # quantities compared and equal before it in causal order
    not_captured: list[str]  # quantities null at that step


@dataclass
class Analysis:
    steps: int = 0  # distinct steps seen
    step_records: int = 0
    divergent_steps: int = 0
    first: FirstDivergence | None = None
    cascade: list[tuple[int, str, list[str]]] = field(default_factory=list)  # (step, site, quantities)
    cascade_counts: dict[str, int] = field(default_factory=dict)  # first differing quantity -> steps
    last_step_by_rank: dict[int, int | None] = field(default_factory=dict)
    window: list[StepView] = field(default_factory=list)  # steps around the first divergence


def _combine(records: list[tuple], warn) -> dict[str, dict[str, dict[int, str | None]]]:
    """site -> quantity -> rank -> value, from the records of one step."""
    sites: dict[str, dict[str, dict[int, str | None]]] = {}
    for rec in records:
        _, site, ranks, fp = rec
        by_q = sites.setdefault(site, {})
        for q, value in fp.items():
            cell = by_q.setdefault(q, {})
            for r, v in expand_fp(value, ranks).items():
                old = cell.get(r)
                if old is not None and v is not None and old != v:
                    warn(f"rank {r}'s {q} at step {records[0][0]} differs between two files; using the first")
                    continue
                if old is None:
                    cell[r] = v
    return sites


def _views(records: list[tuple], order: list[str], warn) -> list[StepView]:
    views = []
    for site, by_q in _combine(records, warn).items():
        first, differing = first_divergence(order, by_q)
        views.append(StepView(records[0][0], site, by_q, differing, first))
    return views


def _clean_block(cursors: list[FileCursor], n: int) -> list[bytes] | None:
    """Step numbers of the next n lines if they are clean in every file, else None.

    Clean: every line is a step record in tpguard's own layout with no per-rank lists, and the
    files' blocks are byte-identical once the `ranks` field is removed, i.e. every rank holds
    the same value of every quantity at every step of the block. Nothing is parsed."""
    blocks = [c.block(n) for c in cursors]
    first = blocks[0]
    if first.count(STEP_PREFIX) != n or first.count(b"}}\n") != n:
        return None  # another record type, another layout, or a torn line in the block
    stripped = RANKS_FIELD.sub(b"", first)
    if b"[" in stripped:  # a per-rank list in some fp: needs a real comparison
        return None
    for b in blocks[1:]:
        if RANKS_FIELD.sub(b"", b) != stripped:
            return None
    steps = STEP_NUMBER.findall(first)
    return steps if len(steps) == n else None


def _records_agree(records: list[tuple]) -> bool:
    """Cheap check for a parsed step: one site, one rank per record, identical string values."""
    _, site0, _, fp0 = records[0]
    if len(records) < 2 or any(type(v) is list for v in fp0.values()):
        return False
    return all(rec[1] == site0 and rec[3] == fp0 and len(rec[2]) == 1 for rec in records)


class _Walk:
    """State of one pass over the trace (kept small: a window of steps, counters)."""

    def __init__(self, ts: TraceSet):
        self.ts = ts
        self.a = Analysis()
        self.order = ts.quantities
        self.last: dict[int, int | None] = {r: None for r in ts.ranks}
        self.before: deque[list[tuple]] = deque(maxlen=WINDOW_BEFORE)  # records of the last clean steps
        self.after_left = 0
        self.prev_step: int | None = None

    def clean_block(self, cursors: list[FileCursor], steps: list[bytes], n: int) -> None:
        a = self.a
        distinct = len(set(steps))
        if self.prev_step is not None and int(steps[0]) == self.prev_step:
            distinct -= 1
        a.steps += distinct
        a.step_records += n * len(cursors)
        last = int(steps[-1])
        self.prev_step = last
        for c in cursors:
            for r in c.file.header.ranks:
                self.last[r] = last
            c.last_step = last
        if a.first is None:  # keep the block's last steps, parsed, for the window before
            tail = max(1, n - 4 * WINDOW_BEFORE)
            records = [c._step_fields(orjson.loads(raw)) for c in cursors for raw in c.buf[c.pos + tail:c.pos + n]]
            for step in sorted({rec[0] for rec in records}):
                self.before.append([rec for rec in records if rec[0] == step])
        for c in cursors:
            c.skip(n)

    def step(self, step: int, records: list[tuple]) -> None:
        a = self.a
        if self.prev_step != step:
            a.steps += 1
        self.prev_step = step
        a.step_records += len(records)
        for rec in records:
            for r in rec[2]:
                self.last[r] = step
        if self.after_left == 0 and _records_agree(records):
            if a.first is None:
                self.before.append(records)
            return
        views = _views(records, self.order, self.ts.warn)
        divergent = [v for v in views if v.first is not None]
        if self.after_left > 0:
            a.window.extend(views)
            self.after_left -= 1
        if not divergent:
            if a.first is None:
                self.before.append(records)
            return
        a.divergent_steps += 1
        if a.first is None:
            a.first = _first_of_step(self.order, step, views)
            a.window = [v for recs in self.before for v in _views(recs, self.order, self.ts.warn)] + views
            self.after_left = WINDOW_AFTER
        else:
            for v in divergent:
                if len(a.cascade) < CASCADE_LIMIT:
                    a.cascade.append((step, v.site, v.differing))
            q = min((v.first.quantity for v in divergent), key=lambda q: _rank_in(self.order, q))
            a.cascade_counts[q] = a.cascade_counts.get(q, 0) + 1


def analyse(ts: TraceSet) -> Analysis:
    """One pass: clean stretches in byte blocks, everything else one parsed step at a time."""
    walk = _Walk(ts)
    cursors = ts.cursors()
    slow_steps = 0  # parsed steps to do before the next block attempt (backs off on misses)
    backoff = 1
    while True:
        if slow_steps <= 0 and walk.after_left == 0 and all(c.in_run for c in cursors):
            n = min(c.fill(BLOCK_LINES) for c in cursors)
            steps = None
            while n >= 8 and steps is None:  # the longest clean prefix, halving on a miss
                steps = _clean_block(cursors, n)
                if steps is None:
                    n //= 2
            if steps is not None:
                walk.clean_block(cursors, steps, n)
                backoff = 1
                continue
            slow_steps, backoff = backoff, min(backoff * 2, 64)
        heads = [(c, c.head()) for c in cursors]
        live = [(c, h) for c, h in heads if h is not None]
        if not live:
            break
        step = min(h[0] for _, h in live)
        records = []
        for c, h in live:
            while h is not None and h[0] == step:
                records.append(c.pop())
                h = c.head()
        walk.step(step, records)
        slow_steps -= 1
    walk.a.last_step_by_rank = walk.last
    return walk.a


def _rank_in(order: list[str], q: str) -> tuple[int, str]:
    return (order.index(q), q) if q in order else (len(order), q)


def _first_of_step(order: list[str], step: int, views: list[StepView]) -> FirstDivergence:
    """Across all sites of the step: the first differing quantity in causal order."""
    divergent = [v for v in views if v.first is not None]
    best = min(divergent, key=lambda v: _rank_in(order, v.first.quantity))
    every_q = causal_order(order, {q for v in views for q in v.by_quantity})
    differing = [q for q in every_q if any(q in v.differing for v in views)]
    agreeing, null = [], []
    for q in every_q:
        if _rank_in(order, q) >= _rank_in(order, best.first.quantity):
            break
        cells = [v.by_quantity[q] for v in views if q in v.by_quantity]
        if cells and any(sum(x is not None for x in c.values()) >= 2 for c in cells):
            agreeing.append(q)
        else:
            null.append(q)
    return FirstDivergence(step=step, site=best.site, disagreement=best.first,
                           differing_at_step=differing, agreeing_before=agreeing, not_captured=null)
