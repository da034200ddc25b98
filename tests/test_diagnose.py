"""`tpguard diagnose` on written traces: reading rule, merged/mixed files, bad input, HTML, JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tpguard.bench.diagnose import write_synthetic_trace
from tpguard.cli import main as cli_main
from tpguard.diagnose import diagnose
from tpguard.records import Header, StepRecord
from tpguard.trace import TraceWriter


def run_cli(args, capsys):
    rc = cli_main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def write_merged(path, run_id, steps):
    """steps: list of (step, site, fp) with fp in merged form (string or per-rank list)."""
    with TraceWriter(path, Header(run_id=run_id, world_size=2, ranks=[0, 1])) as w:
        for step, site, fp in steps:
            w.write(StepRecord(run_id=run_id, step=step, site=site, ranks=[0, 1], fp=fp))


def test_clean_and_diverged_exit_codes_and_json(tmp_path, capsys):
    clean = write_synthetic_trace(tmp_path / "clean", 50)
    rc, out, err = run_cli(["diagnose", *map(str, clean), "--json"], capsys)
    j = json.loads(out)
    assert rc == 0 and j["verdict"] == "clean" and j["first_divergence"] is None and j["steps"] == 50
    assert set(j) >= {"verdict", "steps", "ranks", "first_divergence", "last_step_by_rank", "cause", "fix", "warnings"}
    write_synthetic_trace(tmp_path / "bad", 9000, diverge_at=7000, quantity="coins", culprit=1)
    rc, out, err = run_cli(["diagnose", str(tmp_path / "bad"), "--json"], capsys)
    j = json.loads(out)
    assert rc == 1 and j["verdict"] == "diverged"
    f = j["first_divergence"]
    assert (f["step"], f["quantity"], f["culprit_ranks"], f["majority_ranks"]) == (7000, "coins", [1], [0])
    assert set(f) >= {"step", "site", "quantity", "culprit_ranks", "majority_ranks", "values"}
    assert j["divergent_steps"] == 2000 and j["last_step_by_rank"] == {"0": 8999, "1": 8999}
    assert "RNG" in j["cause"]
    rc, out, err = run_cli(["diagnose", str(tmp_path / "bad")], capsys)
    assert "DIVERGED at step 7000" in out and "cause:" in out and "fix:" in out


def test_reading_rule_across_sites_and_null_values(tmp_path):
    a, b = "00000000000000aa", "00000000000000bb"
    write_merged(tmp_path / "m.jsonl", "r", [
        (0, "sampler", {"target_probs": a, "out_tokens": a}),
        # step 1: sampler differs in out_tokens, dflash in target_probs: target_probs comes first
        (1, "sampler", {"target_probs": a, "out_tokens": [a, b]}),
        (1, "dflash.verify", {"target_logits": a, "target_probs": [a, b], "bonus": [None, b]}),
        # a value null on one rank and captured on the other differs (a rank's lost value is no agreement)
        (2, "dflash.verify", {"target_logits": [a, None], "target_probs": a}),
        (3, "dflash.verify", {"target_logits": None, "target_probs": a}),  # null on every rank: not compared
    ])
    j = diagnose([tmp_path / "m.jsonl"]).to_json()
    f = j["first_divergence"]
    assert (f["step"], f["site"], f["quantity"]) == (1, "dflash.verify", "target_probs")
    assert f["differing_at_step"] == ["target_probs", "bonus", "out_tokens"]
    assert j["divergent_steps"] == 2
    assert "renorm kernel non-determinism" in j["cause"]


def test_mixed_merged_and_per_rank_files(tmp_path):
    per_rank = write_synthetic_trace(tmp_path / "p", 30, ranks=3, diverge_at=12, quantity="bonus", culprit=2,
                                     run_id="mix")
    with TraceWriter(tmp_path / "mix.merged.jsonl", Header(run_id="mix", world_size=3, ranks=[0, 1, 2])):
        pass  # a merged file with only its header is fine
    j = diagnose([*per_rank[:2], tmp_path / "mix.merged.jsonl", per_rank[2]]).to_json()
    f = j["first_divergence"]
    assert (f["step"], f["quantity"], f["culprit_ranks"], f["majority_ranks"]) == (12, "bonus", [2], [0, 1])


def test_missing_rank_is_a_warning_and_one_rank_is_an_error(tmp_path, capsys):
    paths = write_synthetic_trace(tmp_path, 20, ranks=3)
    j = diagnose(paths[:2]).to_json()
    assert j["verdict"] == "clean" and any("rank(s) [2]" in w for w in j["warnings"])
    rc, out, err = run_cli(["diagnose", str(paths[0])], capsys)
    assert rc == 2 and "need two ranks" in err and err.count("\n") == 1


def test_rank_that_stopped_early_is_named(tmp_path):
    paths = write_synthetic_trace(tmp_path, 40)
    lines = paths[1].read_text().splitlines(keepends=True)
    paths[1].write_text("".join(lines[:21]))  # header + steps 0..19
    j = diagnose(paths).to_json()
    assert j["last_step_by_rank"] == {"0": 39, "1": 19} and j["stopped_early"] == [1]


@pytest.mark.parametrize("content,msg", [
    (b"\x00\xff\x13garbage\n", "not a tpguard trace"),
    (b"", "empty trace"),
    (b'{"type":"step","run_id":"r","step":0,"site":"s","ranks":[0],"fp":{}}\n', "no header"),
    (b'{"type":"header","schema":"tpguard.trace/7","run_id":"r","world_size":2,"ranks":[0]}\n', "unknown schema"),
    (b'[1,2,3]\n', "not a JSON object"),
])
def test_bad_traces_exit_2_with_one_line(tmp_path, capsys, content, msg):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    good = write_synthetic_trace(tmp_path / "g", 5)
    rc, out, err = run_cli(["diagnose", str(bad), str(good[0])], capsys)
    assert rc == 2 and msg in err and err.count("\n") == 1 and "Traceback" not in err


def test_corrupt_middle_line_is_an_error_torn_last_line_a_warning(tmp_path, capsys):
    paths = write_synthetic_trace(tmp_path, 10)
    with open(paths[1], "ab") as f:
        f.write(b'{"type":"step","run_id":"bench","step":10,"si')
    rc, out, err = run_cli(["diagnose", *map(str, paths), "--json"], capsys)
    j = json.loads(out)
    assert rc == 0 and any("torn last line" in w for w in j["warnings"])
    lines = paths[0].read_bytes().splitlines(keepends=True)
    lines[4] = b"{broken\n"
    paths[0].write_bytes(b"".join(lines))
    rc, out, err = run_cli(["diagnose", *map(str, paths)], capsys)
    assert rc == 2 and ":5: line is not JSON" in err


def test_two_runs_need_run_option(tmp_path, capsys):
    write_synthetic_trace(tmp_path, 5, run_id="first")
    write_synthetic_trace(tmp_path, 5, run_id="second", diverge_at=2)
    rc, out, err = run_cli(["diagnose", str(tmp_path)], capsys)
    assert rc == 2 and "choose one with --run" in err
    rc, out, err = run_cli(["diagnose", str(tmp_path), "--run", "second"], capsys)
    assert rc == 1
    rc, out, err = run_cli(["diagnose", str(tmp_path), "--run", "third"], capsys)
    assert rc == 2 and "not in these traces" in err


def test_timeout_event_is_reported(tmp_path):
    paths = write_synthetic_trace(tmp_path, 5, run_id="t")
    with open(paths[0], "ab") as f:
        f.write(json.dumps({"type": "event", "run_id": "t", "kind": "timeout", "step": 5, "site": "s",
                            "rank": 0, "message": "tpguard: rank(s) [1] did not reach step 5",
                            "missing_ranks": [1]}).encode() + b"\n")
    j = diagnose(paths).to_json()
    assert j["timeouts"][0]["missing_ranks"] == [1] and "stopped reaching the guard" in j["cause"]
    assert "rank(s) [1]" in j["cause"] and "rank(s) [1]'s own logs" in j["fix"]


@pytest.mark.parametrize("fields,named,died", [
    ({"dead_ranks": [1], "missing_ranks": [1]}, [1], True),
    ({"missing": [1]}, [1], False),  # the other spelling of the field
    ({"dead_ranks": "x", "missing": {"a": 1}}, None, False),  # garbage: ignored, never a crash
])
def test_timeout_event_names_the_dead_or_missing_rank(tmp_path, fields, named, died):
    paths = write_synthetic_trace(tmp_path, 5, run_id="t")
    paths[1].write_text("".join(paths[1].read_text().splitlines(keepends=True)[:4]))  # rank 1 stops at step 2
    with open(paths[0], "ab") as f:
        f.write(json.dumps({"type": "event", "run_id": "t", "kind": "timeout", "step": 5, "site": "s", "rank": 0,
                            "message": "tpguard: a rank did not reach step 5", **fields}).encode() + b"\n")
    j = diagnose(paths).to_json()
    t = j["timeouts"][0]
    assert (t["dead_ranks"] if died else t["missing_ranks"]) == named
    assert ("died (killed" in j["cause"]) == died
    assert "rank(s) [1]'s own logs" in j["fix"]  # from the event, else the rank that stopped early


def test_html_report_is_self_contained(tmp_path, capsys):
    write_synthetic_trace(tmp_path, 60, diverge_at=30, quantity="target_probs")
    page = tmp_path / "r.html"
    rc, out, err = run_cli(["diagnose", str(tmp_path), "--html", str(page)], capsys)
    html = page.read_text()
    assert rc == 1 and html.startswith("<!doctype html>")
    assert "http" not in html.replace("http-equiv", "")  # nothing fetched from the network
    assert "target_probs" in html and "class=\"c bad first\"" in html and "Cause." in html
    assert html.count("<td class=\"c") == 11 * (5 + 16)  # quantities x (5 before + divergent + 15 after)


def test_bad_cli_arguments_exit_2_without_traceback():
    for args in (["diagnose"], ["diagnose", "x", "--bogus"], ["nosuchcommand"]):
        p = subprocess.run([sys.executable, "-m", "tpguard.cli", *args], capture_output=True, text=True)
        assert p.returncode == 2 and p.stderr.startswith("tpguard: error:") and "Traceback" not in p.stderr


def test_bundled_h200_example_names_the_renorm():
    """The example shipped with the package: 30 steps of the NCCL harness on two H200s with
    flashinfer's default top-p renorm (docs/benchmarks.md)."""
    from importlib.resources import files

    folder = files("tpguard") / "examples"
    j = diagnose([str(folder)]).to_json()
    f = j["first_divergence"]
    assert (f["step"], f["quantity"], f["culprit_ranks"]) == (0, "target_probs", [1])
    assert "renorm kernel non-determinism" in j["cause"]


def test_fingerprint_definitions_recorded_and_mixed_ones_warned(tmp_path):
    """Headers name the fingerprint definition (the guard's and the SGLang plugin's); files of one
    run hashed with different definitions, or some without the record (before tpguard.fp/2), get a
    warning: their values differ even for equal tensors."""
    from tpguard.fingerprint import FORMAT_VERSION
    from tpguard.guard import default_versions
    from tpguard.hooks.sglang_compat import versions

    assert default_versions()["fingerprint"] == versions()["fingerprint"] == FORMAT_VERSION == "tpguard.fp/2"
    a = "00000000000000aa"

    def write(name, fp_version):
        header = Header(run_id="v", world_size=2, ranks=[int(name[-1])],
                        versions={} if fp_version is None else {"fingerprint": fp_version})
        with TraceWriter(tmp_path / name, header) as w:
            w.write(StepRecord(run_id="v", step=0, site="s", ranks=[int(name[-1])], fp={"seq_lens": a}))
        return tmp_path / name

    same = diagnose([write("a0", FORMAT_VERSION), write("a1", FORMAT_VERSION)]).to_json()
    assert not any("fingerprint definitions" in w for w in same["warnings"])
    for other in (None, "tpguard.fp/1"):
        j = diagnose([write("b0", FORMAT_VERSION), write("b1", other)]).to_json()
        assert any("different fingerprint definitions" in w for w in j["warnings"]), j["warnings"]


def test_exit_codes_are_one_documented_table():
    """docs/exit-codes.md lists every exit code of tpguard/errors.py once, and the diagnose page
    links it."""
    from pathlib import Path

    import tpguard.errors as errors

    docs = Path(__file__).resolve().parents[1] / "docs"
    table = (docs / "exit-codes.md").read_text()
    codes = {name: value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert len(codes) == 10
    for name, value in codes.items():
        assert table.count(f"| {value} | `{name}` |") == 1, name
    assert "(exit-codes.md)" in (docs / "diagnose.md").read_text()
