"""Offline analysis of traces: reader -> matcher -> rules -> reporter."""

from __future__ import annotations

from pathlib import Path

from tpguard.diagnose.matcher import analyse
from tpguard.diagnose.reader import open_trace_set
from tpguard.diagnose.report import Diagnosis, build, render_text


def diagnose(paths: list[str | Path], run: str | None = None) -> Diagnosis:
    """Read the traces, find the first divergence by the spec's reading rule, explain it."""
    ts = open_trace_set(paths, run=run)
    return build(ts, analyse(ts))


__all__ = ["Diagnosis", "diagnose", "render_text"]
