"""Which steps a guard checks. Every rank must pick the same steps (the check is a collective),
so the choice depends only on the step number and a seed shared by all ranks."""

from __future__ import annotations

import xxhash


def should_check(step: int, every: int = 1, one_in: int = 0, seed: int = 0) -> bool:
    """Every `every`-th step; or, with `one_in` > 0, a pseudo-random 1-in-N of the steps
    (a hash of seed and step, the same on every rank and every run with that seed)."""
    if one_in > 0:
        return xxhash.xxh64_intdigest(step.to_bytes(8, "little", signed=True), seed=seed) % one_in == 0
    return step % max(1, every) == 0
