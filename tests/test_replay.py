"""`tpguard replay` on dumps the real harness wrote (gloo, 2 and 4 ranks, `--dump`): through
`tpguard launch` and torchrun for the emulated-atomic runs, through the ranks' own entry,
`python -m tpguard.launch`'s main(), in shared rank processes for the others (tests/multiproc.py).

Scenarios: the emulated-atomic renorm confirmed as the cause (torch and tpguard confirmed as
fixes); a fault planted in target_probs under a deterministic renorm (reproduced nothing
divergent: rank 0's bytes come back, rank 1's from no call); faults planted in the coins and each
decision, replayed through the coins' redraw and the accept step (DFlash chain and EAGLE tree);
dumps that lack what a re-run needs. Bad dumps are in test_replay_bad_input.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from multiproc import run_ranks

from tpguard.cli import main as cli_main
from tpguard.trace import read_trace

pytestmark = pytest.mark.slow  # six harness runs, for the module

CALLS = "12"
QUICK = ["--no-progress", "--quiet", "--timeout", "60", "--dump"]
DECISION_PLAN = [("coins", 1), ("accept_index", 2), ("accept_len", 3), ("bonus", 4), ("commit_lens", 5),
                 ("out_tokens", 6)]


def launch(trace: Path, *args: str) -> subprocess.CompletedProcess:
    """`tpguard launch --nproc-per-node 2 ...` (torch.distributed.run underneath)."""
    return subprocess.run([sys.executable, "-m", "tpguard.cli", "launch", "--nproc-per-node", "2", *args,
                           "--trace", str(trace), *QUICK], capture_output=True, text=True, timeout=300)


def torchrun(trace: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run ... -m tpguard.launch ...` itself."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tpguard.launch", *args, "--trace", str(trace), *QUICK],
                          capture_output=True, text=True, timeout=300)


def _rank_runs(rank, world, root, plan):
    """Each (name, argv) run through `python -m tpguard.launch`'s main(), in this rank process (its
    process group made by run_ranks): the exit codes."""
    from tpguard.launch.__main__ import main

    return {name: main([*args, "--trace", f"{root}/{name}", *QUICK]) for name, args in plan}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    cli = {
        "atomic": (launch, ["--steps", "2", "--renorm", "emulated-atomic", "--logits", "flat", "--top-p", "0.9"]),
        "atomic-eagle": (torchrun, ["--steps", "2", "--algo", "eagle", "--renorm", "emulated-atomic", "--logits",
                                    "flat", "--mixed-params", "--seed", "3"]),
    }
    # the torch-renorm runs share rank processes (a Python start with torch is most of a short run)
    two_ranks = [
        ("probs-fault", ["--steps", "3", "--renorm", "torch", "--on-divergence", "heal",
                         "--inject", "target_probs@1:1", "--inject", "bonus@2:1"]),
        ("decisions-eagle", ["--steps", "8", "--algo", "eagle", "--renorm", "torch", "--on-divergence",
                             "heal", "--top-k", "50", *[a for q, s in DECISION_PLAN for a in ("--inject", f"{q}@{s}:1")],
                             "--inject", "rng_state@7:1"]),
        ("decisions-only", ["--steps", "2", "--renorm", "torch", "--quantities", "decisions",
                            "--inject", "accept_len@1:1"]),
    ]
    four_ranks = [("four-ranks", ["--steps", "2", "--renorm", "torch", "--inject", "bonus@1:2"])]
    codes = {}
    for name, (how, args) in cli.items():
        p = how(root / name, *args)
        codes[name] = p.returncode
        assert p.returncode in (0, 1), (name, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    for world, plan in ((2, two_ranks), (4, four_ranks)):
        by_rank = run_ranks(_rank_runs, world, str(root), plan, timeout=240)
        assert all(r == by_rank[0] for r in by_rank), by_rank
        codes.update(by_rank[0])
    for name, code in codes.items():
        assert code in (0, 1), (name, code)  # 1: diverged (record), 0: every divergence healed
        assert any((root / name / "dumps").glob("*.rank1.safetensors")), name
    return root


def replay(capsys, *args):
    rc = cli_main(["replay", *map(str, args), "--calls", CALLS, "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def divergence_records(trace_dir: Path):
    return [r for p in sorted(trace_dir.glob("*.rank0.jsonl")) for r in read_trace(p) if r.type == "divergence"]


def tensors(j) -> dict:
    return {t["name"]: t for t in j["tensors"]}


def test_emulated_atomic_confirmed_as_cause_torch_and_tpguard_as_fixes(runs, capsys):
    rc, j, err = replay(capsys, runs / "atomic")
    first = divergence_records(runs / "atomic")[0]
    assert rc == 1 and j["verdict"] == "confirmed", j["summary"]
    assert (j["step"], j["site"], j["first_differing"]) == (first.step, first.site, "target_probs") == (0, "dflash.verify", "target_probs")
    t = tensors(j)
    for q in ("rng_state", "seq_lens", "draft_tokens", "target_logits"):
        assert t[q]["identical"], q
    probs = t["target_probs"]
    assert probs["groups"] == [[0], [1]] and probs["culprit_ranks"] == first.culprit_ranks == [1]
    d = probs["distances"][0]
    assert d["rows"] == first.rows  # the rows the live guard named, from the bytes
    assert 1 <= d["max_ulp"] <= 8 and 0 < d["max_abs"] < 1e-6
    run, *fixes = j["runs"]
    assert run["backend"] == "emulated-atomic" and run["role"] == "run" and run["differing"] >= 1
    assert run["calls"] == int(CALLS)
    assert {f["backend"]: (f["error"], f["differing"], f["calls"]) for f in fixes} == {
        "tpguard": (None, 0, int(CALLS)), "torch": (None, 0, int(CALLS))}
    assert "top_p_renorm_emulated_atomic on this input" in j["summary"] and "Fix: tpguard, torch" in j["summary"]
    assert j["context"]["renorm"] == {"name": "emulated-atomic", "source": "tpguard.kernels.emulated_atomic",
                                      "deterministic": False}
    # the decisions agree here; each rank's follow from its own probs and coins
    assert [(ds["ranks"], all(ds["follows"].values())) for ds in j["downstream"]] == [([0], True), ([1], True)]
    assert j["other_dumped_steps"] == [s.step for s in divergence_records(runs / "atomic")][1:]


def test_text_report_names_the_kernel_and_the_fixes(runs):
    p = subprocess.run([sys.executable, "-m", "tpguard.cli", "replay", str(runs / "atomic"), "--calls", CALLS],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("replay of run ") and "step 0, site dflash.verify" in lines[0]
    assert any(line.split() == ["target_logits", "identical", "on", "ranks", "0,", "1"] for line in lines)
    assert any(line.strip().startswith("target_probs  DIFFERS: rank 0; rank 1 (culprit 1)") for line in lines)
    assert any("max ulp" in line for line in lines)
    verdict = [line for line in lines if line.startswith("verdict: CONFIRMED: ")]
    assert len(verdict) == 1 and f"of {CALLS} calls differ from the first" in verdict[0]
    assert f"tpguard: 0 of {CALLS}; torch: 0 of {CALLS}" in verdict[0]
    assert p.stderr == "" and "Traceback" not in p.stdout


def test_eagle_mixed_params_every_renorm_stage_rerun(runs, capsys):
    rc, j, _ = replay(capsys, runs / "atomic-eagle")
    assert rc == 1 and j["verdict"] == "confirmed" and j["first_differing"] == "target_probs"
    ctx = j["context"]
    assert ctx["algo"] == "eagle" and ctx["tree_parents"][0] == -1 and len(ctx["tree_parents"]) == 4
    assert ctx["probs"]["stages"] == ["top_k", "top_p", "min_p"]  # the mixed menu asks for all three
    assert [k["label"] for k in j["kernels"]] == ["emulated-atomic top_k_renorm_emulated_atomic",
                                                 "emulated-atomic top_p_renorm_emulated_atomic",
                                                 "emulated-atomic min_p_renorm_emulated_atomic"]
    assert any(k["differing"] for k in j["kernels"])
    assert all(f["differing"] == 0 and f["error"] is None for f in j["runs"][1:])
    params = {p["name"]: p for p in j["params"]}
    assert set(params) == {"param.temperature", "param.top_k", "param.top_p", "param.min_p"}
    assert all(p["identical"] and p["shape"] == [8 * 4] for p in params.values())


def test_fault_in_target_probs_is_not_the_renorm(runs, capsys):
    # torch renorm, rank 1's largest entry of row 0 moved one ulp: the re-run gives rank 0's bytes
    # every call and rank 1's never: nothing divergent reproduced (exit 0).
    rc, j, _ = replay(capsys, runs / "probs-fault")
    assert rc == 0 and j["verdict"] == "deterministic" and j["step"] == 1
    d = tensors(j)["target_probs"]["distances"][0]
    assert (d["rows"], d["elements_differing"], d["max_ulp"]) == ([0], 1, 1)
    assert d["first_values"][1] == pytest.approx(d["first_values"][0], rel=1e-6)
    assert j["reproduced"] == {"0": True, "1": False}
    run = j["runs"][0]
    assert run["backend"] == "torch" and run["differing"] == 0 and run["reproduced_by"] == {"0": 1, "1": None}
    assert "rank 1's bytes come from no call" in j["summary"]


def test_planted_bonus_fault_replayed_through_the_dflash_chain(runs, capsys):
    rc, j, _ = replay(capsys, runs / "probs-fault", "--step", "2")
    assert rc == 0 and j["first_differing"] == "bonus" and j["stage"] == "accept"
    assert j["verdict"] == "deterministic" and j["reproduced"] == {"0": True, "1": False}
    assert "dflash chain" in j["stage_text"]
    assert j["runs"][0]["outputs_reproduced"]["1"]["bonus"] is None
    assert j["runs"][0]["outputs_reproduced"]["1"]["accept_len"] == 1  # its accept_len is the step's


@pytest.mark.parametrize("quantity,step", DECISION_PLAN)
def test_planted_decision_faults_replayed_through_the_eagle_tree(runs, capsys, quantity, step):
    rc, j, _ = replay(capsys, runs / "decisions-eagle", "--step", step)
    assert rc == 0, j["summary"]
    assert j["first_differing"] == quantity and j["verdict"] == "deterministic"
    assert j["stage"] == ("coins" if quantity == "coins" else "accept")
    assert j["reproduced"] == {"0": True, "1": False}
    d = tensors(j)[quantity]["distances"][0]
    assert d["elements_differing"] == 1
    if quantity == "coins":
        assert d["max_ulp"] == 1
        # rank 1's decisions follow from its own (changed) coins through the tree accept
        assert all(all(ds["follows"].values()) for ds in j["downstream"])
    else:
        assert d["max_abs"] == 1 and "eagle tree" in j["stage_text"]


def test_state_quantity_first_is_not_rerun(runs, capsys):
    rc, j, _ = replay(capsys, runs / "decisions-eagle", "--step", "7")
    assert rc == 0 and j["first_differing"] == "rng_state" and j["verdict"] == "not-rerun"
    assert j["runs"] == [] and "input of the verify step" in j["summary"]


def test_decisions_only_dumps_cannot_rerun_the_accept_step(runs, capsys):
    rc = cli_main(["replay", str(runs / "decisions-only"), "--calls", CALLS])
    out = capsys.readouterr()
    assert rc == 2
    assert "accept_len    DIFFERS" in out.out  # the diff is still printed
    assert out.err.strip().splitlines() == [
        "tpguard replay: the dumps lack target_probs (the run guarded --quantities decisions): "
        "the accept step cannot be re-run"]


def test_diagnose_hint_names_the_dumps_and_a_replay_command_that_runs(runs, capsys):
    from tpguard.replay import replay_hint

    first = divergence_records(runs / "probs-fault")[0]
    hint = replay_hint(runs / "probs-fault", first.run_id, first.step, first.site)
    assert [Path(p).name for p in hint["dumps"]] == [
        f"{first.run_id}.step1.dflash.verify.rank{r}.safetensors" for r in (0, 1)]
    assert first.dump == hint["dumps"][0]  # the path rank 0's divergence record names
    args = hint["command"].split()
    assert args[:3] == ["tpguard", "replay", str(runs / "probs-fault")]
    assert cli_main([*args[1:], "--calls", "2"]) == 0
    assert "verdict: DETERMINISTIC" in capsys.readouterr().out
    assert replay_hint(runs / "probs-fault", first.run_id, 0, first.site) is None  # step 0 was clean


def test_four_ranks_the_culprit_alone_is_not_reproduced(runs, capsys):
    rc, j, _ = replay(capsys, runs / "four-ranks")
    assert rc == 0 and j["world_size"] == 4 and j["first_differing"] == "bonus"
    bonus = tensors(j)["bonus"]
    assert bonus["groups"] == [[0, 1, 3], [2]] and bonus["culprit_ranks"] == [2]
    assert [d["rank"] for d in bonus["distances"]] == [2] and bonus["distances"][0]["reference_rank"] == 0
    assert j["reproduced"] == {"0": True, "1": True, "2": False, "3": True}
    assert "rank 2's bonus, out_tokens come from no call" in j["summary"]
