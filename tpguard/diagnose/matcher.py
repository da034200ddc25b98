"""Matcher: merge step records of all files by step and site, and apply the reading rule.

Reading rule (trace format v1): the first divergence is the smallest step at which any quantity
differs across ranks; within that step, the first differing quantity in causal order across all
sites. Comparison itself is `tpguard.divergence.first_divergence`, shared with the live guard.

Clean stretches are compared as raw byte blocks (blocks.py); the rest is merged by step from the
files' cursors. Memory holds one step at a time plus a small window of steps around the first
divergence (for the HTML grid) and a bounded list of missing records.

A record (step, site) that some ranks hold and others lack hides whatever that rank's values
were: before the first divergence it may hide the true first divergence (a finding, named);
after it, it is counted; after a rank's last record, the rank stopped early (counted per rank).
A quantity that some ranks holding the record captured and others did not (null or absent) is
no such gap: the ranks did something different there, so it differs (`tpguard.divergence.Uncaptured`).
"""

from __future__ import annotations

import bisect
import re
from collections import deque
from dataclasses import dataclass, field

import orjson

from tpguard.diagnose.blocks import BlockChecker, CleanBlock, looks_like_step
from tpguard.diagnose.reader import BLOCK_LINES, FileCursor, TraceSet
from tpguard.divergence import Disagreement, causal_order, site_divergence
from tpguard.records import expand_fp

WINDOW_BEFORE = 5
WINDOW_AFTER = 15
CASCADE_LIMIT = 20
LISTED_GAPS = 20  # missing records named one by one; the rest are counted
SITES_SHOWN = 3
MAX_BACKOFF = 64  # parsed steps between block attempts while blocks keep failing
HEAD_STEP = re.compile(rb'"step": ?([0-9]{1,19}),')  # longer: out of range, for the parsed path to refuse


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
class Gap:
    """A record (step, site) other ranks hold and `rank` lacks (no line, or no captured value)."""

    rank: int
    step: int
    site: str


@dataclass
class Gaps:
    before: list[Gap] = field(default_factory=list)  # up to LISTED_GAPS, at or before the first divergence
    before_count: int = 0
    after_count: dict[int, int] = field(default_factory=dict)  # rank -> after the first divergence
    after_example: Gap | None = None
    tail: dict[int, int] = field(default_factory=dict)  # rank -> after the rank's last record


@dataclass
class RankCoverage:
    """What one rank recorded (records holding a captured value)."""

    records: int = 0
    first_step: int | None = None
    last_step: int | None = None
    sites: list[str] = field(default_factory=list)  # the first few

    def add(self, first: int, last: int, count: int, site: str | None) -> None:
        self.records += count
        if self.first_step is None:
            self.first_step = first
        self.last_step = last
        if site is not None and site not in self.sites and len(self.sites) < SITES_SHOWN:
            self.sites.append(site)


@dataclass
class Analysis:
    steps: int = 0  # distinct steps seen
    step_records: int = 0
    compared_steps: int = 0  # distinct steps where two or more ranks held a value of one quantity
    divergent_steps: int = 0
    first: FirstDivergence | None = None
    cascade: list[tuple[int, str, list[str]]] = field(default_factory=list)  # (step, site, quantities)
    cascade_counts: dict[str, int] = field(default_factory=dict)  # first differing quantity -> steps
    last_step_by_rank: dict[int, int | None] = field(default_factory=dict)
    window: list[StepView] = field(default_factory=list)  # steps around the first divergence
    gaps: Gaps = field(default_factory=Gaps)
    coverage: dict[int, RankCoverage] = field(default_factory=dict)


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
        first, differing = site_divergence(order, by_q)
        views.append(StepView(records[0][0], site, by_q, differing, first))
    return views


def _records_agree(records: list[tuple]) -> bool:
    """Cheap check for a parsed step: one site, one rank per record, identical values, at least
    one captured (values are validated strings, so truthy exactly when captured)."""
    _, site0, _, fp0 = records[0]
    if len(records) < 2 or list in map(type, fp0.values()) or not any(fp0.values()):
        return False
    return all(rec[1] == site0 and rec[3] == fp0 and len(rec[2]) == 1 for rec in records)


@dataclass
class _Pending:
    """Gaps of a rank since its last record: holes if it records again, else its tail."""

    early: list[Gap] = field(default_factory=list)
    early_count: int = 0
    late_count: int = 0
    late_example: Gap | None = None


class _Walk:
    """State of one pass over the trace (kept small: a window of steps, counters)."""

    def __init__(self, ts: TraceSet):
        self.ts = ts
        self.a = Analysis(coverage={r: RankCoverage() for r in ts.ranks})
        self.order = ts.quantities
        self.all_ranks = frozenset(ts.ranks)
        self.last: dict[int, int | None] = {r: None for r in ts.ranks}
        self.before: deque[list[tuple]] = deque(maxlen=WINDOW_BEFORE)  # records of the last clean steps
        self.after_left = 0
        self.prev_step: int | None = None
        self.prev_compared: int | None = None
        self.pending: dict[int, _Pending] = {}

    # -- missing records ----------------------------------------------------------------------

    def _missing(self, rank: int, step: int, site: str, count: int = 1) -> None:
        p = self.pending.setdefault(rank, _Pending())
        first = self.a.first
        if first is None or first.step == step:
            p.early_count += count
            if len(p.early) < LISTED_GAPS:
                p.early.append(Gap(rank, step, site))
        else:
            p.late_count += count
            p.late_example = p.late_example or Gap(rank, step, site)

    def _recorded(self, rank: int) -> None:
        """The rank recorded again: its gaps so far are holes, not a tail."""
        p = self.pending.pop(rank, None)
        if p is None:
            return
        g = self.a.gaps
        g.before.extend(p.early[:LISTED_GAPS - len(g.before)])
        g.before_count += p.early_count
        if p.late_count:
            g.after_count[rank] = g.after_count.get(rank, 0) + p.late_count
            g.after_example = g.after_example or p.late_example

    def finish(self) -> Analysis:
        for r, p in sorted(self.pending.items()):
            self.a.gaps.tail[r] = p.early_count + p.late_count
        self.a.gaps.before.sort(key=lambda g: (g.step, g.rank))
        self.a.last_step_by_rank = self.last
        return self.a

    # -- steps --------------------------------------------------------------------------------

    def _count_step(self, step: int, compared: bool) -> None:
        if self.prev_step != step:
            self.a.steps += 1
            self.prev_step = step
        if compared and self.prev_compared != step:
            self.a.compared_steps += 1
            self.prev_compared = step

    def clean_block(self, cursors: list[FileCursor], block: CleanBlock, n: int) -> None:
        a = self.a
        steps = block.steps
        distinct = len(set(steps))
        a.steps += distinct - (steps[0] == self.prev_step)
        self.prev_step = steps[-1]
        if len(block.covered) >= 2:  # one rank alone (the others stopped early) is read, not compared
            a.compared_steps += distinct - (steps[0] == self.prev_compared)
            self.prev_compared = steps[-1]
        a.step_records += n * len(cursors)
        for r in self.all_ranks - block.covered:
            self._missing(r, steps[0], block.first_site, count=n)
        for r in block.covered:
            self.last[r] = steps[-1]
            cov = a.coverage.get(r)
            if cov is not None:
                cov.add(steps[0], steps[-1], n, block.first_site)
            self._recorded(r)
        if a.first is None:  # keep the block's last steps, parsed, for the window before
            tail = max(0, n - 4 * WINDOW_BEFORE)
            records = [c.step_fields(orjson.loads(raw), 1 + tail + i)
                       for c in cursors for i, raw in enumerate(c.buf[c.pos + tail:c.pos + n])]
            for step in sorted({rec[0] for rec in records})[-WINDOW_BEFORE:]:
                self.before.append([rec for rec in records if rec[0] == step])
        for c in cursors:
            c.skip(n)
            c.last_step, c.last_sites = steps[-1], set(block.last_sites)

    def step(self, step: int, records: list[tuple]) -> None:
        a = self.a
        a.step_records += len(records)
        for rec in records:
            for r in rec[2]:
                self.last[r] = step
        if self.after_left == 0 and _records_agree(records):
            present = {rec[2][0] for rec in records}
            self._count_step(step, len(present) >= 2)
            self._account(step, {records[0][1]: present})
            if a.first is None:
                self.before.append(records)
            return
        views = _views(records, self.order, self.ts.warn)
        site_ranks = {v.site: {r for cell in v.by_quantity.values() for r, x in cell.items() if x is not None}
                      for v in views}
        divergent = [v for v in views if v.first is not None]
        compared = bool(divergent) or any(sum(x is not None for x in cell.values()) >= 2
                                          for v in views for cell in v.by_quantity.values())
        self._count_step(step, compared)
        if self.after_left > 0:
            a.window.extend(views)
            self.after_left -= 1
        if divergent:
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
        elif a.first is None:
            self.before.append(records)
        self._account(step, site_ranks)

    def _account(self, step: int, site_ranks: dict[str, set[int]]) -> None:
        """Coverage and missing records of one step (after its divergence, if any, is known)."""
        present: set[int] = set()
        for site, ranks in site_ranks.items():
            if not ranks:
                continue
            present |= ranks
            for r in ranks:
                cov = self.a.coverage.get(r)
                if cov is not None:
                    cov.add(step, step, 1, site)
            for r in self.all_ranks - ranks:
                self._missing(r, step, site)
        for r in present:
            self._recorded(r)


def _try_block(checker: BlockChecker, cursors: list[FileCursor], hint: int) -> tuple[CleanBlock, list, int] | None:
    """The longest clean block (tried at `hint` lines, then growing from 8) of the files whose
    next record is at the smallest step; it ends before the step where any other file resumes
    (a later rotated segment, a rank whose records start later)."""
    live = [c for c in cursors if c.fill(BLOCK_LINES) > 0]
    heads = []
    for c in live:
        line = c.buf[c.pos]
        m = HEAD_STEP.search(line) if looks_like_step(line) else None
        if m is None:
            return None
        heads.append(int(m.group(1)))
    if not heads:
        return None
    lo = min(heads)
    part = [c for c, h in zip(live, heads) if h == lo]
    resume = min((h for h in heads if h > lo), default=None)
    n = min(min(len(c.buf) - c.pos for c in part), hint)
    block = checker.check(part, n)
    if block is None:
        best, size = None, 8
        while size < n:
            found = checker.check(part, size)
            if found is None:
                break
            best, size = (found, size), size * 2
        if best is None:
            return None
        block, n = best
    if resume is not None and block.steps[-1] >= resume:
        n = bisect.bisect_left(block.steps, resume)
        block = checker.check(part, n) if n else None
        if block is None:
            return None
    return block, part, n


def analyse(ts: TraceSet) -> Analysis:
    """One pass: clean stretches in byte blocks, everything else one parsed step at a time."""
    walk = _Walk(ts)
    checker = BlockChecker(ts.run_id)
    cursors = ts.cursors()
    slow_steps = 0  # parsed steps to do before the next block attempt (backs off on misses)
    backoff, hint = 1, 8
    while True:
        if slow_steps <= 0 and walk.after_left == 0:
            found = _try_block(checker, cursors, hint)
            if found is not None:
                block, live, n = found
                walk.clean_block(live, block, n)
                backoff, hint = 1, min(2 * n, BLOCK_LINES)
                continue
            slow_steps, backoff, hint = backoff, min(backoff * 2, MAX_BACKOFF), 8
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
    return walk.finish()


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
