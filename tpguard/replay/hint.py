"""What `tpguard diagnose` prints next to a divergence: the dumps of that step and the replay command."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from tpguard.dump import dump_name, dumps_dir


def step_dumps(trace_dir: str | os.PathLike, run_id: str, step: int, site: str) -> list[Path]:
    """The dump files of (run, step, site) under the trace directory, by rank (only those there)."""
    folder = dumps_dir(trace_dir)
    prefix = dump_name(run_id, step, site, 0).rsplit(".rank", 1)[0] + ".rank"
    found = []
    for p in folder.glob(f"{prefix}*.safetensors") if folder.is_dir() else []:
        rank = p.name[len(prefix):-len(".safetensors")]
        if rank.isdigit():
            found.append((int(rank), p))
    return [p for _, p in sorted(found)]


def replay_hint(trace_dir: str | os.PathLike, run_id: str, step: int, site: str) -> dict | None:
    """{"dumps": [paths], "command": "tpguard replay ..."} for a divergent step with dumps, else None."""
    files = step_dumps(trace_dir, run_id, step, site)
    if not files:
        return None
    cmd = ["tpguard", "replay", str(trace_dir), "--run", run_id, "--step", str(step), "--site", site]
    return {"dumps": [str(p) for p in files], "command": shlex.join(cmd)}
