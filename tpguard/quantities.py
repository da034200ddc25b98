"""The quantities tpguard fingerprints, in causal order (trace format v1, "Quantities").

A later quantity is computed from earlier ones, so the first one that differs across ranks
is the closest to the cause. Everything that orders, names or groups quantities reads this file.
"""

from __future__ import annotations

CANONICAL_ORDER: tuple[str, ...] = (
    "rng_state",  # generator state used for the step's random draws
    "seq_lens",  # per-request prefix/sequence lengths entering the step
    "draft_tokens",  # draft/candidate token ids being verified
    "target_logits",  # target-model logits at the verify positions
    "target_probs",  # after temperature, softmax and top-k/top-p/min-p renormalisation
    "coins",  # uniform samples for acceptance and the bonus sample
    "accept_index",  # accepted positions (tree) or predicted tokens
    "accept_len",  # accepted draft tokens per request
    "bonus",  # bonus token per request
    "commit_lens",  # tokens committed per request
    "out_tokens",  # tokens appended to the outputs
)

# What a rank-0 broadcast ("heal") overwrites so that ranks continue in agreement.
DECISION_QUANTITIES: tuple[str, ...] = (
    "accept_index",
    "accept_len",
    "bonus",
    "commit_lens",
    "out_tokens",
)

# "decisions" guard mode: everything except the two vocab-sized float tensors.
DECISIONS_MODE: tuple[str, ...] = tuple(
    q for q in CANONICAL_ORDER if q not in ("target_logits", "target_probs")
)

# Inputs to the verify step: a difference here started earlier or outside the step.
STATE_QUANTITIES: tuple[str, ...] = ("rng_state", "seq_lens", "draft_tokens")


def validate_order(quantities: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """A run's quantity order: non-empty, no duplicates. Unknown names are allowed."""
    order = tuple(quantities)
    if not order:
        raise ValueError("quantities must not be empty")
    dupes = sorted({q for q in order if order.count(q) > 1})
    if dupes:
        raise ValueError(f"duplicate quantities: {dupes}")
    return order
