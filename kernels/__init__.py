"""tpguard's kernels (folder kernels/, import name tpguard.kernels): the deterministic renorms
(front door kernels/renorm.py, docs/kernels.md) and the fingerprint kernels (kernels/fingerprint.py).

    from tpguard.kernels import top_p_renorm, fingerprint_triton

Importing the package loads nothing else (no torch, no triton): each public name below imports its
module on first use.
"""

import importlib

_EXPORTS = {
    # renorms (kernels/renorm.py)
    "top_k_renorm": "renorm",
    "top_p_renorm": "renorm",
    "top_k_top_p_renorm": "renorm",
    "min_p_renorm": "renorm",
    "clear_plans": "renorm",
    "TIE_RULE": "renorm",
    # fingerprints on the GPU (kernels/fingerprint.py; reference: kernels/fingerprint_reference.py;
    # the public API, any device: tpguard.fingerprint)
    "fingerprint_triton": "fingerprint",
    "fingerprint_rows_triton": "fingerprint",
    "fingerprint_many_triton": "fingerprint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # a submodule not imported yet: the import system imports it after this
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
