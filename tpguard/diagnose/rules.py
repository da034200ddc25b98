"""Cause and fix of a first divergence: one rule table (documented in docs/diagnose.md).

A rule matches on the first differing quantity and, optionally, on which earlier quantities were
compared and agreed (vs. not captured). The first matching rule wins; keep specific rules first.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpguard.diagnose.matcher import FirstDivergence

FIX_RENORM = (
    "use deterministic renormalisation on every rank: TPGUARD_RENORM=deterministic (tpguard's "
    "deterministic kernels; flashinfer is_deterministic=True), or keep the ranks in agreement with a "
    "rank-0 broadcast of the decisions: TPGUARD_ON_DIVERGENCE=heal or SGLANG_SPEC_TP_SYNC=all"
)
FIX_BROADCAST = (
    "broadcast rank 0's decisions so the ranks stay in agreement (TPGUARD_ON_DIVERGENCE=heal, "
    "SGLANG_SPEC_TP_SYNC=all), then find the source with a guard on the earlier quantities"
)


@dataclass(frozen=True)
class Rule:
    quantity: str
    cause: str
    fix: str
    needs_agreeing: tuple[str, ...] = ()  # these must have been compared and equal


RULES: tuple[Rule, ...] = (
    Rule("rng_state",
         "RNG desync: the generator state used for the step's draws differs across ranks (ranks "
         "seeded differently, or one rank drew a different number of random numbers earlier)",
         "seed every TP rank's sampling generator identically and make every rank draw the same "
         "samples; or broadcast the coins/decisions from rank 0 (SGLANG_SPEC_TP_SYNC=rng or heal)"),
    Rule("seq_lens",
         "state drift from an earlier step or from outside the verify step: the requests' lengths "
         "entering the step already differ (an earlier accept/commit decision differed on one rank, "
         "or the scheduler built different batches)",
         "look at earlier steps and other sites (check every step: TPGUARD_EVERY=1); keep the ranks "
         "in agreement with a rank-0 broadcast of the decisions (heal)"),
    Rule("draft_tokens",
         "state drift from an earlier step or a non-deterministic draft model: the draft tokens "
         "entering verification already differ",
         "look at earlier steps (an earlier bonus/out_tokens divergence feeds the draft); broadcast "
         "the draft tokens or the decisions from rank 0 (SGLANG_SPEC_TP_SYNC=all / heal)"),
    Rule("target_logits",
         "model-forward or all-reduce non-determinism: the target logits differ on identical inputs "
         "(non-deterministic all-reduce, split-K or attention kernels, or batch-dependent kernels)",
         "run the target with deterministic inference (--enable-deterministic-inference, a fixed "
         "all-reduce algorithm), or broadcast the decisions from rank 0 (heal)"),
    Rule("target_probs",
         "renorm kernel non-determinism: top-k/top-p/min-p renormalisation gave different bytes on "
         "identical logits (flashinfer's default top_p_renorm_probs, AIR radix for rows > 2048, and "
         "top_k_renorm_probs, multi-CTA radix, add floats with atomicAdd)",
         FIX_RENORM, needs_agreeing=("target_logits",)),
    Rule("target_probs",
         "target probabilities differ (target_logits were not captured here, so renorm kernel "
         "non-determinism cannot be told from a logits difference)",
         "capture target_logits too (full mode); if they agree, " + FIX_RENORM),
    Rule("coins",
         "RNG desync in the draws: the coins differ although the generator state agreed (different "
         "shapes or number of draws, or a draw that is not deterministic)",
         "draw the coins identically on every rank (same shapes, same generator, same order) or "
         "broadcast them from rank 0"),
    Rule("accept_index",
         "accept kernel non-determinism: the accept decision differs although target_probs and "
         "coins agreed",
         "run the verify kernel in deterministic mode and broadcast the accept decisions from rank 0 "
         "(SGLANG_SPEC_TP_SYNC=all or heal)", needs_agreeing=("target_probs", "coins")),
    Rule("accept_len",
         "accept kernel non-determinism: the accept decision differs although target_probs and "
         "coins agreed",
         "run the verify kernel in deterministic mode and broadcast the accept decisions from rank 0 "
         "(SGLANG_SPEC_TP_SYNC=all or heal)", needs_agreeing=("target_probs", "coins")),
    Rule("accept_index",
         "the accept decision differs; target_probs or coins were not captured here, so the renorm "
         "kernel, the RNG and the accept kernel cannot be told apart",
         "capture target_probs and coins (full mode); " + FIX_BROADCAST),
    Rule("accept_len",
         "the accept decision differs; target_probs or coins were not captured here, so the renorm "
         "kernel, the RNG and the accept kernel cannot be told apart",
         "capture target_probs and coins (full mode); " + FIX_BROADCAST),
    Rule("bonus",
         "bonus-token sampling non-determinism: the final sample from relu(q - p) differs although "
         "everything before it agreed",
         "sample the bonus token deterministically, or broadcast it from rank 0 (heal)"),
    Rule("commit_lens",
         "commit bookkeeping differs after identical accept decisions (post-accept state update)",
         "check the commit path (e.g. max-new-tokens/stop handling per rank); " + FIX_BROADCAST),
    Rule("out_tokens",
         "output tokens differ after identical accept decisions (post-accept state update or "
         "a token-id mapping that differs per rank)",
         "check the commit path; " + FIX_BROADCAST),
)

UNCAPTURED = Rule(
    "*",
    "some ranks did not record this quantity at this step and site while the others did (null or "
    "absent in their records): the ranks ran different code paths there (a branch or hook taken on "
    "some ranks only), or a writer dropped the value; whether the values differ is unknown",
    "look at what the rank(s) without the value ran at that step (their logs, the hook that records "
    "the quantity at that site): a capture that depends on the rank hides divergences from the guard; "
    "then diagnose again")

GENERIC = Rule("*", "a quantity outside the canonical set differs first",
               "read the run's own documentation for that quantity; " + FIX_BROADCAST)


def explain(first: FirstDivergence) -> Rule:
    d = first.disagreement
    if getattr(d, "uncaptured_ranks", None) and len(d.values) == 1:  # only the capture differs
        return UNCAPTURED
    q = d.quantity
    agreeing = set(first.agreeing_before)
    for rule in RULES:
        if rule.quantity == q and all(n in agreeing for n in rule.needs_agreeing):
            return rule
    return GENERIC
