"""Comparing ranks' fingerprints: the first diverging quantity and its culprit ranks.

This is the one place where values are compared; the live guard and `tpguard diagnose` both
call `first_divergence`, so they always name the same quantity and ranks. The guard reports what
it finds as a `tpguard.records.DivergenceRecord`, the record its trace holds.

Rules (trace format v1): null values are never compared; the culprits are the ranks outside the
largest group of equal values; on a tie, the ranks outside the group that holds the lowest rank
(rank 0 is the reference, as in a rank-0 broadcast).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


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


def compare(quantity: str, by_rank: Mapping[int, str | None]) -> Disagreement | None:
    """A Disagreement if at least two ranks captured the quantity and their values differ."""
    values: dict[str, list[int]] = {}
    for rank in sorted(by_rank):
        v = by_rank[rank]
        if v is not None:
            values.setdefault(v, []).append(rank)
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
    order: Iterable[str], by_quantity: Mapping[str, Mapping[int, str | None]]
) -> tuple[Disagreement | None, list[str]]:
    """The first differing quantity in causal order, and the names of all differing ones."""
    first: Disagreement | None = None
    differing: list[str] = []
    for q in causal_order(order, by_quantity):
        if q not in by_quantity:
            continue
        d = compare(q, by_quantity[q])
        if d is not None:
            differing.append(q)
            if first is None:
                first = d
    return first, differing
