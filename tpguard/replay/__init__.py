"""`tpguard replay`: re-run a divergent step from its dumps: reader -> diff -> rerun -> confirm -> report."""

from __future__ import annotations

from tpguard.replay.confirm import DEFAULT_CALLS, replay
from tpguard.replay.hint import replay_hint
from tpguard.replay.reader import ReplayInputError
from tpguard.replay.report import Replay, render_text

__all__ = ["DEFAULT_CALLS", "Replay", "ReplayInputError", "render_text", "replay", "replay_hint"]
