"""tpguard: find and fix tensor-parallel rank divergence in speculative decoding.

Imports are lazy so that `tpguard diagnose` starts fast and never needs torch.
"""

from tpguard.quantities import CANONICAL_ORDER, DECISION_QUANTITIES, DECISIONS_MODE

__version__ = "0.1.0"

_LAZY = {
    "fingerprint": "tpguard.fingerprint",
    "fingerprint_device": "tpguard.fingerprint",
    "fingerprint_rows": "tpguard.fingerprint",
    "StepGuard": "tpguard.guard",
    "Divergence": "tpguard.divergence",
    "RankDivergenceError": "tpguard.errors",
    "RankTimeoutError": "tpguard.errors",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpguard' has no attribute {name!r}")


__all__ = ["CANONICAL_ORDER", "DECISION_QUANTITIES", "DECISIONS_MODE", *_LAZY]
