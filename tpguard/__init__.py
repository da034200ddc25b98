"""tpguard: find and fix tensor-parallel rank divergence in speculative decoding.

Imports are lazy so that `tpguard diagnose` starts fast and never needs torch.
"""

import os as _os

from tpguard.quantities import CANONICAL_ORDER, DECISION_QUANTITIES, DECISIONS_MODE

# A source checkout used without installing (PYTHONPATH=repo, e.g. on a GPU box): resolve
# tpguard.kernels / tpguard.hooks / tpguard.launch to the top-level folders, as pyproject's
# package mapping does for installs.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
        _os.path.join(_root, "kernels", "fingerprint.py")):
    __path__.append(_root)  # noqa: F821 - the package's own search path

__version__ = "0.1.0"

_LAZY = {
    "fingerprint_tensor": "tpguard.fingerprint",
    "fingerprint_device": "tpguard.fingerprint",
    "fingerprint_rows": "tpguard.fingerprint",
    "StepGuard": "tpguard.guard",
    "DivergenceRecord": "tpguard.records",
    "RankDivergenceError": "tpguard.errors",
    "RankTimeoutError": "tpguard.errors",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpguard' has no attribute {name!r}")


__all__ = ["CANONICAL_ORDER", "DECISION_QUANTITIES", "DECISIONS_MODE", *_LAZY]
