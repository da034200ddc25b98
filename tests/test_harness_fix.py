"""Policy fix in the TP harness (2 and 4 gloo ranks): the first divergence is healed and its cause
switched off on every rank at the same step; no later step diverges; outputs identical."""

from __future__ import annotations

import json

import pytest

from multiproc import run_ranks
from tpguard.diagnose import diagnose

QUICK = ["--no-progress", "--quiet", "--timeout", "30"]
ATOMIC = ["--steps", "12", "--logits", "flat", "--top-p", "0.9", "--renorm", "emulated-atomic"]


def _runs(rank, world, scenarios, trace_root):
    import torch

    from tpguard.launch.harness import run_harness
    from tpguard.launch.options import parse_options

    torch.set_num_threads(1)
    return {name: run_harness(parse_options([*argv, *QUICK, "--trace", f"{trace_root}/{name}"], world)).to_json()
            for name, argv in scenarios}


def _switch_events(trace_dir, world):
    out = []
    for rank in range(world):
        (path,) = trace_dir.glob(f"*.rank{rank}.jsonl")
        out.append([r for r in map(json.loads, path.read_text().splitlines())
                    if r["type"] == "event" and r["kind"] == "switch"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_renorm_switched_in_lockstep_then_clean(tmp_path, world):
    scenarios = [("record", ATOMIC), ("fix", [*ATOMIC, "--on-divergence", "fix"])]
    results = run_ranks(_runs, world, scenarios, str(tmp_path), timeout=300)
    assert results[0]["record"]["divergences"] >= 3  # without the switch the cause keeps coming back
    summaries = [r["fix"] for r in results]
    (sw,) = summaries[0]["switches"]
    assert all(s["switches"] == [sw] for s in summaries) and sw["what"] == "renorm"
    assert all(s["divergences"] == 1 and s["divergent_quantities"] == {"target_probs": 1} for s in summaries)
    assert summaries[0]["first_divergence"]["step"] == sw["step"] and sw["step"] < 10
    assert all(s["outputs_identical"] and s["exit_code"] == 0 for s in summaries)
    events = _switch_events(tmp_path / "fix", world)
    assert all(len(e) == 1 and e[0]["step"] == sw["step"] and e[0]["what"] == "renorm" for e in events)
    j = diagnose([tmp_path / "fix"]).to_json()
    assert j["divergent_steps"] == 1 and [s["step"] for s in j["switches"]] == [sw["step"]]


@pytest.mark.slow
def test_decision_cause_switches_the_broadcast_on(tmp_path):
    scenarios = [("fix", ["--steps", "8", "--renorm", "torch", "--inject", "accept_len@2:1",
                          "--on-divergence", "fix"])]
    results = run_ranks(_runs, 2, scenarios, str(tmp_path), timeout=240)
    s0, s1 = results[0]["fix"], results[1]["fix"]
    assert s0["switches"] == s1["switches"] and [x["what"] for x in s0["switches"]] == ["broadcast"]
    assert s0["switches"][0]["step"] == 2 and s0["divergences"] == 1
    assert s0["outputs_identical"] and s0["exit_code"] == 0
