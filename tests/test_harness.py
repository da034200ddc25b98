"""The TP harness on real gloo process groups (2 and 4 ranks): injections named exactly, emulated
atomics vs deterministic renorm, heal, abort, the no-guard hang ended by the deadline, bad
arguments, `tpguard launch` and the demo (faults: tests/test_faults_harness.py).

Scenarios that only need results run several harness runs inside one set of rank processes
(tests/multiproc.py); exit-code scenarios start real rank processes (tpguard.launch.spawn: the
environment torchrun sets, one process per rank) or `tpguard launch` itself.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from multiproc import run_ranks
from tpguard.diagnose import diagnose
from tpguard.launch.spawn import spawn_ranks
from tpguard.quantities import CANONICAL_ORDER
from tpguard.trace import read_trace

QUICK = ["--no-progress", "--quiet", "--timeout", "20"]


def _scenarios(rank, world, scenarios, trace_root):
    """Run each (name, argv) harness scenario in this rank's process group; return the summaries."""
    import torch

    from tpguard.launch.harness import run_harness
    from tpguard.launch.options import parse_options

    torch.set_num_threads(1)
    out = {}
    for name, argv in scenarios:
        opts = parse_options([*argv, *QUICK, "--trace", f"{trace_root}/{name}"], world)
        out[name] = run_harness(opts).to_json()
    return out


def _divergences(trace_dir):
    recs = []
    for path in sorted(trace_dir.glob("*.rank0.jsonl")):
        recs += [r for r in read_trace(path) if r.type == "divergence"]
    return [(d.step, d.quantity, d.culprit_ranks, d.majority_ranks, d.action) for d in recs]


def _first(trace_dir):
    j = diagnose([trace_dir]).to_json()
    f = j["first_divergence"]
    return None if f is None else (f["step"], f["quantity"], f["culprit_ranks"])


@pytest.mark.slow
def test_every_injection_named_exactly_two_ranks(tmp_path):
    # One run per quantity (3 steps, injected at step 2), all inside one pair of rank processes.
    scenarios = [(q, ["--steps", "3", "--renorm", "torch", "--inject", f"{q}@2:{i % 2}"])
                 for i, q in enumerate(CANONICAL_ORDER)]
    results = run_ranks(_scenarios, 2, scenarios, str(tmp_path), timeout=240)
    for q, _ in scenarios:
        # Two ranks always tie: the culprit is rank 1 whichever rank was perturbed.
        assert _first(tmp_path / q) == (2, q, [1]), q
        for s in results:
            assert s[q]["first_divergence"]["step"] == 2 and s[q]["first_divergence"]["quantity"] == q
            assert s[q]["divergences"] == 1 and s[q]["exit_code"] == 1


@pytest.mark.slow
def test_every_injection_named_exactly_four_ranks_and_healed(tmp_path):
    # One eagle run, every quantity injected on a different rank at its own step; heal keeps the
    # ranks together, so each divergence stands alone and the outputs end identical.
    plan = [(q, 2 * i + 1, i % 4) for i, q in enumerate(CANONICAL_ORDER)]
    argv = ["--steps", str(2 * len(plan) + 1), "--algo", "eagle", "--renorm", "torch", "--mixed-params",
            "--on-divergence", "heal", *[a for q, s, r in plan for a in ("--inject", f"{q}@{s}:{r}")]]
    results = run_ranks(_scenarios, 4, [("all", argv)], str(tmp_path), timeout=240)
    got = _divergences(tmp_path / "all")
    want = [(s, q, [r], [x for x in range(4) if x != r], "healed") for q, s, r in plan]
    assert got == want
    assert _first(tmp_path / "all") == (1, plan[0][0], [0])
    for s in results:
        assert s["all"]["outputs_identical"] is True and s["all"]["exit_code"] == 0
        assert s["all"]["actions"] == {"healed": len(plan)}


@pytest.mark.slow
def test_emulated_atomic_diverges_deterministic_never_heal_reconverges(tmp_path):
    base = ["--steps", "8", "--logits", "flat", "--top-p", "0.9"]
    scenarios = []
    for seed in (0, 1):
        for renorm in ("emulated-atomic", "torch", "tpguard"):
            scenarios.append((f"{renorm}-{seed}", [*base, "--seed", str(seed), "--renorm", renorm]))
    scenarios.append(("heal", [*base, "--renorm", "emulated-atomic", "--logits", "mixed", "--top-k", "40",
                               "--on-divergence", "heal", "--inject", "bonus@3:1"]))
    results = run_ranks(_scenarios, 2, scenarios, str(tmp_path), timeout=240)
    r0 = results[0]
    for seed in (0, 1):
        atomic = r0[f"emulated-atomic-{seed}"]
        assert atomic["divergences"] >= 1 and atomic["divergent_quantities"].keys() == {"target_probs"}
        assert _first(tmp_path / f"emulated-atomic-{seed}")[1:] == ("target_probs", [1])
        for renorm in ("torch", "tpguard"):
            assert r0[f"{renorm}-{seed}"]["divergences"] == 0
            assert _first(tmp_path / f"{renorm}-{seed}") is None
    heal = r0["heal"]
    assert heal["outputs_identical"] is True and heal["exit_code"] == 0
    assert heal["actions"]["healed"] == heal["divergences"] >= 1 and heal["decision_flips"] >= 1


def test_abort_stops_every_rank_with_exit_3(tmp_path):
    res = spawn_ranks(["--steps", "6", "--renorm", "torch", "--on-divergence", "abort", "--inject", "coins@2:3",
                       "--trace", str(tmp_path), *QUICK], 4, timeout=120, capture=True)
    assert res.exit_codes == [3, 3, 3, 3], res.outputs
    for out in res.outputs[1:]:
        assert "ranks diverged at step 2" in out and "'coins'" in out and "culprit rank(s) [3]" in out
    assert _divergences(tmp_path) == [(2, "coins", [3], [0, 1, 2], "aborted")]


@pytest.mark.slow
def test_no_guard_divergence_hangs_and_the_deadline_names_the_rank(tmp_path):
    res = spawn_ranks(["--steps", "40", "--renorm", "torch", "--inject", "bonus@5:1", "--no-guard",
                       "--no-progress", "--timeout", "3"], 2, timeout=120, capture=True)
    assert res.exit_codes == [4, 4], res.outputs
    assert "ranks [1] disagree with rank 0" in res.outputs[1]
    assert "Traceback" not in res.outputs[0] + res.outputs[1]


@pytest.mark.slow
def test_with_the_guard_the_divergence_is_named_before_the_hang(tmp_path):
    res = spawn_ranks(["--steps", "40", "--renorm", "torch", "--inject", "bonus@5:1", "--trace", str(tmp_path),
                       "--no-progress", "--timeout", "3"], 2, timeout=120, capture=True)
    assert res.exit_codes == [4, 4], res.outputs
    j = diagnose([tmp_path]).to_json()
    assert (j["first_divergence"]["step"], j["first_divergence"]["quantity"]) == (5, "bonus")
    assert j["first_divergence"]["culprit_ranks"] == [1]
    assert j["timeouts"] and j["timeouts"][0]["missing_ranks"] == [1]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("args,needle", [
    (["-m", "tpguard.cli", "launch", "--nproc-per-node", "2", "--steps", "5", "--inject", "bonus@9:1"],
     "step 9 is out of range"),
    (["-m", "tpguard.cli", "launch", "--nproc-per-node", "2", "--inject", "bonus@1:2"], "rank 2 >= world size 2"),
    (["-m", "tpguard.cli", "launch", "--nproc-per-node", "1"], "--nproc-per-node must be >= 2"),
    (["-m", "tpguard.cli", "launch", "--inject", "nonsense@1:1"], "unknown quantity 'nonsense'"),
    (["-m", "tpguard.launch", "--steps", "3"], "world size >= 2"),
])
def test_bad_arguments_exit_2_with_one_line(args, needle):
    p = _cli(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr


def test_launcher_hands_its_ranks_the_options_it_parsed():
    """`tpguard launch` parses the harness options once and passes them on to every rank's
    `python -m tpguard.launch` as a command line that parses back to the same options."""
    from tpguard.launch.options import HarnessOptions, parse_options, to_argv

    argv = ["--steps", "7", "--top-p", "0.3", "--temperature", "1e-3", "--inject", "bonus@3:1", "--inject",
            "coins@2:0", "--no-progress", "--merged", "--trace", "-odd dir", "--renorm", "torch", "--run-id", "r.1"]
    opts = parse_options(argv, world_size=2)
    assert parse_options(to_argv(opts), world_size=2) == opts
    assert to_argv(HarnessOptions()) == [] and parse_options([]) == HarnessOptions()


@pytest.mark.slow
def test_tpguard_launch_returns_the_workers_exit_code(tmp_path):
    p = _cli("-m", "tpguard.cli", "launch", "--nproc-per-node", "2", "--steps", "4", "--logits", "flat",
             "--renorm", "emulated-atomic", "--on-divergence", "abort", "--no-progress", "--trace", str(tmp_path))
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert "aborted by the guard at step 0" in p.stdout
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_demo_runs_and_tells_the_story(capsys):
    from tpguard.commands.demo import run_demo

    assert run_demo(steps=6, timeout=3) == 0
    out = capsys.readouterr().out
    for needle in ("caught and named at once", "DIVERGED at step 0", "first differing quantity 'target_probs'",
                   "switched at that step on both ranks, no divergence after it", "outputs identical on both ranks",
                   "exit code 4",
                   "demo done"):
        assert needle in out, needle
