"""`tpguard replay DIR [--run ID] [--step N] [--site S] [--device cpu|cuda] [--calls N] [--json]`."""

from __future__ import annotations

import sys

import orjson

from tpguard.errors import EXIT_BAD_INPUT, TPGuardError


def run_replay(paths: list[str], run: str | None = None, step: int | None = None, site: str | None = None,
               device: str | None = None, calls: int = 100, as_json: bool = False) -> int:
    from tpguard.optional import missing
    from tpguard.replay import render_text, replay

    problem = missing("safetensors", "dumps")
    if problem:
        print(f"tpguard replay: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        rp = replay(paths, run=run, step=step, site=site, device=device, calls=calls)
    except TPGuardError as e:
        print(f"tpguard replay: {e}", file=sys.stderr)
        return e.exit_code
    if as_json:
        print(orjson.dumps(rp.to_json(), option=orjson.OPT_NON_STR_KEYS).decode(), flush=True)
    else:
        print(render_text(rp), flush=True)
    if rp.verdict == "cannot-rerun":  # the report is printed; the reason is the last line on stderr too
        print(f"tpguard replay: {rp.summary}", file=sys.stderr)
    return rp.exit_code
