"""Bad input to every user-facing entry point: one line on stderr, a documented exit code, never a
traceback, and nothing already recorded lost. In-process and CPU only (seconds in all)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from tpguard.bench.diagnose import write_synthetic_trace
from tpguard.cli import main as cli_main
from tpguard.config import GuardConfig
from tpguard.commands.demo import run_demo
from tpguard.launch.options import OptionsError, check_paths, parse_options
from tpguard.records import Header, StepRecord
from tpguard.trace import TraceWriter


def run_cli(args, capsys):
    rc = cli_main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(rc, err, code=2, text=""):
    assert rc == code and err.count("\n") == 1 and "Traceback" not in err and text in err, (rc, err)


def bad_line(tmp_path, line: dict | str, ranks=2, steps=8, at=3):
    """Rank 0's trace with its line `at` (0: the header) replaced; returns every rank's path."""
    paths = write_synthetic_trace(tmp_path, steps, ranks=ranks, diverge_at=5)
    lines = paths[0].read_text().splitlines(keepends=True)
    if at == 0 and isinstance(line, dict):
        line = {**json.loads(lines[0]), **line}
    lines[at] = (json.dumps(line) if isinstance(line, dict) else line) + "\n"
    paths[0].write_text("".join(lines))
    return [str(p) for p in paths]


STEP = {"type": "step", "run_id": "bench", "step": 2, "site": "synthetic.verify", "ranks": [0]}


@pytest.mark.parametrize("header,text", [
    ({"run_id": 5}, "bad run_id"),
    ({"run_id": None}, "bad run_id"),
    ({"quantities": "abc"}, "bad quantities"),
    ({"algo": 5}, "bad algo"),
    ({"world_size": True}, "bad world_size"),
    ({"ranks": [True]}, "bad ranks"),
    ({"ranks": [0, 0]}, "rank twice"),
])
def test_header_with_wrong_types(tmp_path, capsys, header, text):
    paths = bad_line(tmp_path, header, at=0)
    for extra in ([], ["--json"], ["--html", str(tmp_path / "r.html")]):
        rc, out, err = run_cli(["diagnose", *paths, *extra], capsys)
        one_line_error(rc, err, text=text)
        assert paths[0] in err  # the message names the file


def test_header_with_null_quantities_means_the_canonical_order(tmp_path, capsys):
    rc, out, err = run_cli(["diagnose", *bad_line(tmp_path, {"quantities": None}, at=0), "--json"], capsys)
    assert rc == 1 and json.loads(out)["first_divergence"]["step"] == 5


@pytest.mark.parametrize("fields,text", [
    ({"site": ["x"], "fp": {}}, "site is not a string"),
    ({"site": None, "fp": {}}, "site is not a string"),
    ({"ranks": ["0"], "fp": {}}, "bad ranks"),
    ({"ranks": [7], "fp": {}}, "bad ranks"),
    ({"fp": {"coins": 5}}, "neither a fingerprint"),
    ({"fp": {"coins": {"a": 1}}}, "neither a fingerprint"),
    ({"fp": {"coins": [[1]]}}, "not a fingerprint string"),
])
def test_step_record_with_wrong_types(tmp_path, capsys, fields, text):
    paths = bad_line(tmp_path, {**STEP, **fields})
    for extra in ([], ["--json"], ["--html", str(tmp_path / "r.html")]):
        rc, out, err = run_cli(["diagnose", *paths, *extra], capsys)
        one_line_error(rc, err, text=text)


def test_divergence_and_event_records_with_wrong_types_are_ignored(tmp_path, capsys):
    paths = write_synthetic_trace(tmp_path, 8, diverge_at=5)
    with open(paths[0], "a") as f:
        f.write(json.dumps({"type": "divergence", "run_id": "bench", "step": 5, "site": "synthetic.verify",
                            "quantity": "target_probs", "values": {}, "culprit_ranks": [1],
                            "action": ["x"], "rows": "y"}) + "\n")
        f.write(json.dumps({"type": "event", "run_id": "bench", "kind": "timeout", "step": "x"}) + "\n")
    rc, out, err = run_cli(["diagnose", *map(str, paths), "--json", "--html", str(tmp_path / "r.html")], capsys)
    j = json.loads(out)
    assert rc == 1 and err == "" and j["first_divergence"]["step"] == 5
    assert sum("wrong type" in w for w in j["warnings"]) == 2


def test_html_to_an_unwritable_place(tmp_path, capsys):
    paths = [str(p) for p in write_synthetic_trace(tmp_path, 8, diverge_at=5)]
    for target, text in [(tmp_path / "no" / "such" / "r.html", "does not exist"), (tmp_path, "is a directory")]:
        rc, out, err = run_cli(["diagnose", *paths, "--html", str(target)], capsys)
        one_line_error(rc, err, text=text)


def test_paths_globs_duplicates_and_rotated_segments(tmp_path, capsys):
    paths = write_synthetic_trace(tmp_path / "t", 30, diverge_at=5)
    rc, out, err = run_cli(["diagnose", str(tmp_path / "t" / "*.jsonl"), "--json"], capsys)  # quoted glob
    assert rc == 1 and json.loads(out)["steps"] == 30
    rc, out, err = run_cli(["diagnose", str(tmp_path / "t" / "*.nothing")], capsys)
    one_line_error(rc, err, text="no file matches")
    # A file named twice (itself and its directory) is read once.
    rc, out, err = run_cli(["diagnose", str(tmp_path / "t"), str(paths[0]), "--json"], capsys)
    assert rc == 1 and json.loads(out)["steps"] == 30
    # Rotated segments (NAME.jsonl.1) are part of a directory: steps 0..14 live only there.
    for p in paths:
        lines = p.read_text().splitlines(keepends=True)
        p.with_name(p.name + ".1").write_text("".join(lines[:16]))
        p.write_text(lines[0] + "".join(lines[16:]))
    rc, out, err = run_cli(["diagnose", str(tmp_path / "t"), "--json"], capsys)
    j = json.loads(out)
    assert rc == 1 and j["steps"] == 30 and j["first_divergence"]["step"] == 5


def test_empty_or_torn_header_file_is_skipped_among_others(tmp_path, capsys):
    paths = write_synthetic_trace(tmp_path, 10, ranks=3, diverge_at=5)
    for content in (b"", b'{"type":"header","sch'):  # a rank killed before or during its first line
        paths[2].write_bytes(content)
        rc, out, err = run_cli(["diagnose", str(tmp_path), "--json"], capsys)
        j = json.loads(out)
        assert rc == 1 and j["first_divergence"]["step"] == 5
        assert any("empty trace" in w for w in j["warnings"]) and any("rank(s) [2]" in w for w in j["warnings"])
    for p in paths:
        p.write_bytes(b"")
    rc, out, err = run_cli(["diagnose", str(tmp_path)], capsys)
    one_line_error(rc, err, text="empty")


def test_bad_last_line_ending_in_newline_is_torn_not_fatal(tmp_path, capsys):
    paths = write_synthetic_trace(tmp_path, 10, diverge_at=5)
    with open(paths[0], "ab") as f:
        f.write(b'{"type":"step","run_id":"bench","st\n')
    rc, out, err = run_cli(["diagnose", *map(str, paths), "--json"], capsys)
    j = json.loads(out)
    assert rc == 1 and j["first_divergence"]["step"] == 5 and any("torn last line" in w for w in j["warnings"])


def test_nothing_compared_is_said(tmp_path, capsys):
    paths = write_synthetic_trace(tmp_path, 10)
    paths[0].write_text(paths[0].read_text().splitlines(keepends=True)[0])  # header only
    rc, out, err = run_cli(["diagnose", *map(str, paths), "--json"], capsys)
    j = json.loads(out)
    assert rc == 7 and j["verdict"] == "nothing_compared" and j["compared_steps"] == 0
    assert any("rank 0 recorded no captured value" in w for w in j["warnings"])


def test_unexpected_error_is_one_line_exit_5(tmp_path, capsys, monkeypatch):
    import tpguard.diagnose as diagnose_pkg

    def broken(*a, **k):
        raise KeyError("boom")

    monkeypatch.delenv("TPGUARD_DEBUG", raising=False)
    monkeypatch.setattr(diagnose_pkg, "diagnose", broken)
    rc, out, err = run_cli(["diagnose", str(tmp_path)], capsys)
    one_line_error(rc, err, code=5, text="internal error: KeyError")


def test_writer_never_truncates_an_existing_trace(tmp_path, caplog):
    path = tmp_path / "r.rank0.jsonl"
    h = Header(run_id="r", world_size=2, ranks=[0])
    with TraceWriter(path, h) as w:
        w.write(StepRecord(run_id="r", step=0, site="s", ranks=[0], fp={"coins": "a" * 16}))
    first = path.read_text()
    with caplog.at_level(logging.WARNING, logger="tpguard.trace"), TraceWriter(path, h):
        pass  # the same run id again (a restart)
    assert (tmp_path / "r.rank0.jsonl.prev1").read_text() == first and "kept it" in caplog.text
    # Rotation does not overwrite a segment already there either.
    (tmp_path / "s.jsonl.1").write_text("old segment\n")
    w = TraceWriter(tmp_path / "s.jsonl", h, max_bytes=1)
    w.write(StepRecord(run_id="r", step=0, site="s", ranks=[0], fp={}))
    w.write(StepRecord(run_id="r", step=1, site="s", ranks=[0], fp={}))
    w.close()
    assert (tmp_path / "s.jsonl.1").read_text() == "old segment\n" and (tmp_path / "s.jsonl.2").exists()


@pytest.mark.parametrize("env,text", [
    ({"TPGUARD_EVERY": "abc"}, "TPGUARD_EVERY must be an integer"),
    ({"TPGUARD_TIMEOUT": "nan"}, "TPGUARD_TIMEOUT must be a finite"),
    ({"TPGUARD_MAX_TRACE_MB": "inf"}, "TPGUARD_MAX_TRACE_MB must be a finite"),  # was an OverflowError
    ({"TPGUARD_MAX_TRACE_MB": "-1"}, "TPGUARD_MAX_TRACE_MB must be >= 0"),
    ({"TPGUARD_CLEAN_EVERY": "0"}, "TPGUARD_CLEAN_EVERY must be >= 1"),
    ({"TPGUARD_SAMPLE": "-3"}, "TPGUARD_SAMPLE must be >= 0"),
    ({"TPGUARD_DUMP": "maybe"}, "TPGUARD_DUMP must be one of"),
    ({"TPGUARD_RUN_ID": "../../etc/x"}, "TPGUARD_RUN_ID must be"),
])
def test_bad_environment_is_one_value_error(env, text):
    with pytest.raises(ValueError, match=text) as e:
        GuardConfig.from_env({"TPGUARD": "on", **env})
    assert "\n" not in str(e.value) and str(e.value).startswith("tpguard: bad environment: ")


def test_empty_environment_values_mean_the_default():
    c = GuardConfig.from_env({"TPGUARD": "on", "TPGUARD_EVERY": "", "TPGUARD_TIMEOUT": " ", "TPGUARD_DUMP": ""})
    assert (c.every, c.timeout_s, c.dump) == (1, 60.0, False)


def test_env_set_restores_the_knob_as_it_was(monkeypatch):
    """tpguard.config.env_set: the value inside, the one before (or unset) after, an exception included."""
    from tpguard.config import env_set, env_value

    name = "TPGUARD_TEST_ENV_SET"
    monkeypatch.delenv(name, raising=False)
    with env_set(name, "1"):
        assert env_value(name) == "1"
    assert name not in os.environ
    monkeypatch.setenv(name, "before")
    with pytest.raises(RuntimeError):
        with env_set(name, "0"):
            assert env_value(name) == "0"
            raise RuntimeError
    assert os.environ[name] == "before"


def test_env_value_reads_what_os_environ_holds_now(monkeypatch):
    """The knobs' fast read (tpguard.config.env_value) sees every change, as os.environ.get does, and
    the renorm plan limits read through it stay per call, with bad values one ValueError."""
    from tpguard.config import env_value, renorm_plan_limits

    name = "TPGUARD_TEST_ENV_VALUE"
    monkeypatch.delenv(name, raising=False)
    assert env_value(name) == "" and env_value(name, "d") == "d" == os.environ.get(name, "d")
    for value in ("", " x ", "é ü", "1"):
        monkeypatch.setenv(name, value)
        assert env_value(name, "d") == value == os.environ.get(name, "d")
    os.environ[name] = "direct"  # not through monkeypatch: os.environ's own assignment
    try:
        assert env_value(name) == "direct"
    finally:
        del os.environ[name]
    assert env_value(name, "gone") == "gone"
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "3")
    monkeypatch.setenv("TPGUARD_RENORM_PLAN_MB", "1.5")
    assert renorm_plan_limits() == (3, 3 << 19)
    monkeypatch.delenv("TPGUARD_RENORM_PLAN_MB")
    assert renorm_plan_limits() == (3, 256 << 20)
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "many")
    with pytest.raises(ValueError, match="TPGUARD_RENORM_PLANS must be an integer"):
        renorm_plan_limits()


def test_plugin_register_survives_garbage_environment(monkeypatch, caplog):
    from tpguard.hooks import sglang_plugin

    monkeypatch.setenv("TPGUARD", "on")
    monkeypatch.setenv("TPGUARD_MAX_TRACE_MB", "1e999")
    with caplog.at_level(logging.ERROR, logger="tpguard.sglang"):
        sglang_plugin.register()  # logs one line, sglang runs unguarded; never raises
    assert "TPGUARD_MAX_TRACE_MB" in caplog.text and "NOT active" in caplog.text


@pytest.mark.parametrize("args,text", [
    (["--timeout", "inf"], "--timeout must be > 0 seconds and finite"),
    (["--temperature", "inf"], "--temperature must be > 0 and finite"),
    (["--run-id", ""], "--run-id must be"),
    (["--run-id", "../x"], "--run-id must be"),
])
def test_harness_options(args, text):
    with pytest.raises(OptionsError, match=text):
        parse_options(args, world_size=2)


def test_harness_paths(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for args, text in [(["--trace", str(tmp_path / "file")], "not a directory"),
                       (["--summary-json", str(tmp_path / "no" / "s.json")], "does not exist"),
                       (["--summary-json", str(tmp_path)], "is a directory")]:
        with pytest.raises(OptionsError, match=text):
            check_paths(parse_options(args, world_size=2))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "mine.rank0.jsonl").write_text("x")
    with pytest.raises(OptionsError, match="already holds a trace of run 'mine'"):
        check_paths(parse_options(["--trace", str(tmp_path / "t"), "--run-id", "mine"], world_size=2))
    rc, out, err = run_cli(["launch", "--nproc-per-node", "2", "--trace", str(tmp_path / "file")], capsys)
    one_line_error(rc, err, text="--trace")


def test_cli_arguments(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for args, text in [(["determinism", "--device", "bogus"], "--device"), (["determinism", "--rows", "-1"], "--rows"),
                       (["audit", "--vocab", "-5"], "--vocab"),  # `audit`: the command's hidden earlier name
                       (["serve", "--trace-dir", str(tmp_path / "file"), "--", "true"], "not a directory"),
                       (["demo", "--steps", "x"], "valid int"), (["demo", "--timeout", "inf"], "--timeout"),
                       (["demo", "--out", str(tmp_path / "file")], "not a directory")]:
        rc, out, err = run_cli(args, capsys)
        one_line_error(rc, err, text=text)


def test_demo_out_holding_an_earlier_demo(tmp_path, capsys):
    (tmp_path / "1-atomic-abort").mkdir()
    (tmp_path / "1-atomic-abort" / "x.rank0.jsonl").write_text("kept\n")
    assert run_demo(out=str(tmp_path)) == 2
    assert "already holds" in capsys.readouterr().err
    assert (tmp_path / "1-atomic-abort" / "x.rank0.jsonl").read_text() == "kept\n"


@pytest.mark.parametrize("args,text", [
    (["bench", "diagnose", "--steps", "0"], "--steps"), (["bench", "diagnose", "--bogus"], "No such option"),
    (["bench", "guard", "--bs", "x"], "valid int"), (["bench", "kernels", "--rows", "x"], "Invalid value"),
    (["bench", "kernels", "--vocabs", "1,x"], "comma-separated int"), (["bench", "fingerprint", "--bogus"], "No such option"),
    (["bench", "fingerprint", "--shapes", "some"], "not one of all | main"),
])
def test_bench_arguments(args, text, capsys):
    rc, out, err = run_cli(args, capsys)  # rejected before any benchmark work
    one_line_error(rc, err, text=text)


def test_kernel_config_text():
    from tpguard.config import replace_from_text
    from tpguard.kernels.fingerprint import KernelConfig

    cfg = replace_from_text(KernelConfig(), "maxnreg=none, many_long=rows,shifts=2", "--config")
    assert (cfg.maxnreg, cfg.many_long, cfg.shifts) == (None, "rows", 2)
    for text, msg in (("shifts=x", "shifts='x': expected int"), ("nope=1", "unknown field 'nope'")):
        with pytest.raises(ValueError, match=msg):
            replace_from_text(KernelConfig(), text, "--config")
