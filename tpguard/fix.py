"""Policy ``fix``: heal the divergent step, then switch its cause off, in lockstep on every rank.

Every rank holds the same gathered vector, so every rank reaches the same `Switch` at the same
step. The cause comes from the first differing quantity and what agreed before it (the same
reading as `tpguard diagnose`'s rule table, tpguard/diagnose/rules.py):

* ``renorm``: target_probs differ first while target_logits agree (renorm kernel non-determinism):
  from the next step on the renorm runs on tpguard's deterministic kernels, for every site of the
  process;
* ``broadcast``: the RNG state, the coins or a decision differ first (and no renorm cause): from
  the next step on rank 0's decisions are broadcast at that site every step (SGLang's own
  `SpecTpSync` broadcast where the site has one, tpguard's where it has none);
* None: anything else (state that drifted earlier, model-forward non-determinism): no switch
  applies; the step is healed and later divergences are healed too.

Whoever owns the renorm and the decisions applies a switch (the plugin's runtime, the harness):
they register with `StepGuard.switchers`. Each kind switches once per guard.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from tpguard.quantities import DECISION_QUANTITIES

logger = logging.getLogger("tpguard")

RENORM = "renorm"
BROADCAST = "broadcast"
BROADCAST_CAUSES = ("rng_state", "coins", "cap_trim_lens", *DECISION_QUANTITIES)


@dataclass(frozen=True)
class Switch:
    kind: str  # RENORM | BROADCAST
    site: str
    step: int  # the divergent step; the switch holds from step + 1 on
    why: str

    @property
    def what(self) -> str:
        if self.kind == RENORM:
            return "renorm -> tpguard's deterministic kernels (every site)"
        return f"rank-0 broadcast of the decisions at {self.site}"


def agreed(by_quantity: Mapping[str, Mapping[int, str | None]], name: str) -> bool:
    """`name` was captured by at least two ranks, all with the same value."""
    values = [v for v in by_quantity.get(name, {}).values() if v is not None]
    return len(values) >= 2 and len(set(values)) == 1


def choose(quantity: str, site: str, step: int,
           by_quantity: Mapping[str, Mapping[int, str | None]]) -> Switch | None:
    """The switch for a divergence whose first differing quantity is `quantity`, or None."""
    if quantity == "target_probs" and agreed(by_quantity, "target_logits"):
        return Switch(RENORM, site, step, "target_probs differ on agreeing target_logits: renorm kernel "
                                          "non-determinism")
    if quantity in BROADCAST_CAUSES:
        return Switch(BROADCAST, site, step, f"{quantity} differs first (no renorm cause): the ranks' "
                                             "draws or decisions disagree")
    return None


def no_switch_reason(quantity: str) -> str:
    return (f"{quantity} differs first: no switch applies (state from an earlier step or the model "
            "forward); the step is healed, and so are later ones")
