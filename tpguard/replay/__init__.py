"""`tpguard replay`: re-run a divergent step from its dumps.

reader (find and check every rank's dump; validate: its replay context and sampling parameters)
-> diff (tensor by tensor, causal order) -> rerun (a stage, many calls) -> confirm (which stage,
the verdict) -> report (text, JSON, exit code); hint (what `tpguard diagnose` prints next to a
divergence). Imported lazily: `tpguard diagnose` loads only `hint`, which needs no torch.
"""

from __future__ import annotations

_EXPORTS = {"replay": "confirm", "DEFAULT_CALLS": "confirm", "MAX_CALLS": "confirm", "Replay": "report",
            "render_text": "report", "ReplayInputError": "reader", "replay_hint": "hint"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tpguard.replay' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"tpguard.replay.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
