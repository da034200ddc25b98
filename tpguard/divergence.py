"""Comparing ranks' fingerprints: the first diverging quantity and its culprit ranks.

This is the one place where values are compared. The live guard calls `first_divergence` on the
values it gathered and reports what it finds as a `tpguard.records.DivergenceRecord`, the record
its trace holds; `tpguard diagnose` calls `site_divergence` on the records it reads back, which
adds one rule for values a trace lacks. On records where every rank captured the same quantities
(what the guard writes) both name the same quantity and ranks.

Rules (trace format v1): null values are never compared with each other; the culprits are the
ranks outside the largest group of equal values; on a tie, the ranks outside the group that holds
the lowest rank (rank 0 is the reference, as in a rank-0 broadcast). Read back (`site_divergence`),
a quantity that some ranks holding a record of the step and site captured and others did not
(null or absent) differs, those ranks among the culprits: a rank's lost or dropped value must not
read as agreement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Disagreement:
    """One quantity whose non-null values differ across ranks."""

    quantity: str
    values: dict[str, list[int]]  # fingerprint -> ranks holding it
    majority_ranks: list[int]
    culprit_ranks: list[int]


def split_majority(values: Mapping[str, Iterable[int]]) -> tuple[list[int], list[int]]:
    """(majority ranks, culprit ranks) of groups of equal values, with the spec's tie rule."""
    groups = [sorted(r) for r in values.values() if r]
    if not groups:
        return [], []
    largest = max(len(g) for g in groups)
    tied = [g for g in groups if len(g) == largest]
    majority = min(tied, key=lambda g: g[0])  # the tied group holding the lowest rank
    culprits = sorted(r for g in groups if g is not majority for r in g)
    return majority, culprits


def _groups(by_rank: Mapping[int, str | None]) -> dict[str, list[int]]:
    """Captured value -> the ranks holding it, in rank order (null values left out)."""
    values: dict[str, list[int]] = {}
    for rank in sorted(by_rank):
        v = by_rank[rank]
        if v is not None:
            values.setdefault(v, []).append(rank)
    return values


def compare(quantity: str, by_rank: Mapping[int, str | None]) -> Disagreement | None:
    """A Disagreement if at least two ranks captured the quantity and their values differ."""
    return _disagreement(quantity, _groups(by_rank))


def _disagreement(quantity: str, values: dict[str, list[int]]) -> Disagreement | None:
    if len(values) < 2:
        return None
    majority, culprits = split_majority(values)
    return Disagreement(quantity, values, majority, culprits)


def causal_order(order: Iterable[str], present: Iterable[str]) -> list[str]:
    """The run's order, then any quantity it does not list (sorted, so the result is stable)."""
    order = list(order)
    known = set(order)
    return order + sorted(q for q in present if q not in known)


def first_divergence(
    order: Iterable[str], by_quantity: Mapping[str, Mapping[int, str | None]], holders: set[int] | None = None
) -> tuple[Disagreement | None, list[str]]:
    """The first differing quantity in causal order, and the names of all differing ones.
    `holders` (`site_divergence`): ranks holding the record; those without a quantity that
    another rank captured differ too."""
    first: Disagreement | None = None
    differing: list[str] = []
    for q in causal_order(order, by_quantity):
        if q not in by_quantity:
            continue
        d = compare(q, by_quantity[q]) if holders is None else quantity_divergence(q, by_quantity[q], holders)
        if d is not None:
            differing.append(q)
            if first is None:
                first = d
    return first, differing


@dataclass(frozen=True)
class Uncaptured(Disagreement):
    """A quantity that some ranks holding the record captured and others did not: never equal
    (a rank's lost or dropped value must not read as agreement). Those ranks are culprits."""

    uncaptured_ranks: list[int] = field(default_factory=list)


def site_divergence(order: list[str], by_q: dict[str, dict[int, str | None]]) -> tuple[Disagreement | None, list[str]]:
    """`first_divergence` for one step and site read back, where a quantity captured on some ranks
    that hold the record and not on others differs too. Quantities no rank captured there are not
    compared (a site need not record every quantity)."""
    return first_divergence(order, by_q, record_holders(by_q))


def record_holders(by_q: dict[str, dict[int, str | None]]) -> set[int]:
    """Ranks holding a record of the step and site: a captured value of some quantity."""
    return {r for cell in by_q.values() for r, v in cell.items() if v is not None}


def quantity_divergence(q: str, cell: dict[int, str | None], holders: set[int]) -> Disagreement | None:
    """How the ranks' values of one quantity differ, if they do; ranks in `holders` that did not
    capture it differ when any rank did."""
    values = _groups(cell)
    captured = {r for ranks in values.values() for r in ranks}
    lacking = sorted(holders - captured) if captured else []
    if not lacking:
        return _disagreement(q, values)
    majority, culprits = split_majority(values)
    return Uncaptured(q, values, majority, sorted({*culprits, *lacking}), lacking)
