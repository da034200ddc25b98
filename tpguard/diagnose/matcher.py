"""Matcher: merge step records of all files by step and site, and apply the reading rule.

Reading rule (trace format v1): the first divergence is the smallest step at which any quantity
differs across ranks; within that step, the first differing quantity in causal order across all
sites. Comparison itself is `tpguard.divergence.first_divergence`, shared with the live guard.

Streams are merged with a k-way heap merge on step, so memory holds one step at a time plus a
small window of steps around the first divergence (for the HTML grid).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from tpguard.diagnose.reader import TraceSet
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
    for _, site, ranks, fp in records:
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


def _all_equal_fast(records: list[tuple]) -> bool:
    """Clean-step shortcut: one site, string-valued fp objects identical on every record."""
    site0, fp0 = records[0][1], records[0][3]
    for _, site, _, fp in records:
        if site != site0 or fp != fp0:
            return False
    return not any(isinstance(v, list) for v in fp0.values())


def analyse(ts: TraceSet) -> Analysis:
    a = Analysis()
    last: dict[int, int | None] = {r: None for r in ts.ranks}
    order = ts.quantities
    merged = heapq.merge(*ts.step_streams(), key=lambda rec: rec[0])
    before: deque[StepView] = deque(maxlen=WINDOW_BEFORE)
    after_left = 0
    for step, group in itertools.groupby(merged, key=lambda rec: rec[0]):
        records = list(group)
        a.steps += 1
        a.step_records += len(records)
        for rec in records:
            for r in rec[2]:
                last[r] = step
        needs_window = a.first is None or after_left > 0
        if _all_equal_fast(records) and not needs_window:
            continue
        views = []
        for site, by_q in _combine(records, ts.warn).items():
            first, differing = first_divergence(order, by_q)
            views.append(StepView(step, site, by_q, differing, first))
        divergent = [v for v in views if v.first is not None]
        if a.first is not None and after_left > 0:
            a.window.extend(views)
            after_left -= 1
        if not divergent:
            if a.first is None:
                before.extend(views)
            continue
        a.divergent_steps += 1
        if a.first is None:
            a.first = _first_of_step(order, step, views)
            a.window = list(before) + views
            after_left = WINDOW_AFTER
        else:
            for v in divergent:
                if len(a.cascade) < CASCADE_LIMIT:
                    a.cascade.append((step, v.site, v.differing))
            q = min((v.first.quantity for v in divergent), key=lambda q: _rank_in(order, q))
            a.cascade_counts[q] = a.cascade_counts.get(q, 0) + 1
    a.last_step_by_rank = last
    return a


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
