"""tpguard: find and fix tensor-parallel rank divergence in speculative decoding."""

from tpguard.fingerprint import fingerprint, fingerprint_device, fingerprint_rows
from tpguard.quantities import CANONICAL_ORDER, DECISION_QUANTITIES, DECISIONS_MODE

__version__ = "0.1.0"

__all__ = [
    "CANONICAL_ORDER",
    "DECISION_QUANTITIES",
    "DECISIONS_MODE",
    "fingerprint",
    "fingerprint_device",
    "fingerprint_rows",
]
