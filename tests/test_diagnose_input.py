"""`tpguard diagnose` on traces that must not read as one clean run: two runs sharing a run id,
records missing on some ranks, nothing compared, malformed records, `--html` over existing files,
compressed traces, any JSON layout at speed, and `python -m tpguard`.

Real files and the real command: exit codes are checked on `tpguard` subprocesses; the two-runs
case runs the TP harness on real gloo process groups (tests/multiproc.py)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multiproc import run_ranks
from tpguard.bench.diagnose import time_json_loads, write_synthetic_trace
from tpguard.diagnose import diagnose
from tpguard.records import Header, StepRecord
from tpguard.trace import TraceWriter

# the installed command; where tpguard is on the path but not installed (the GPU check), `python -m tpguard`
_SCRIPT = Path(sys.executable).with_name("tpguard")
TPGUARD = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "tpguard"]
SITE = "synthetic.verify"


def tpguard(*args, cwd=None, env=None, python_m=False):
    cmd = [sys.executable, "-m", "tpguard", *args] if python_m else [*TPGUARD, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, **(env or {})})


def one_line(p, code):
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    return p.stderr


def edit_lines(path: Path, edit) -> None:
    """Apply `edit` to the file's records (parsed), written back in the same layout."""
    text = path.read_text()
    spaced = '"type": ' in text.splitlines()[0]
    recs = [json.loads(line) for line in text.splitlines()]
    edit(recs)
    dump = json.dumps if spaced else (lambda o: json.dumps(o, separators=(",", ":")))
    path.write_text("".join(dump(r) + "\n" for r in recs))


# --- two runs that reuse one run id -------------------------------------------------------------

def _harness_runs(rank, world, runs, root):
    import torch

    from tpguard.launch.harness import run_harness
    from tpguard.launch.options import parse_options

    torch.set_num_threads(1)
    for name, argv in runs:
        opts = parse_options([*argv, "--steps", "3", "--renorm", "torch", "--run-id", "same", "--no-progress",
                              "--quiet", "--timeout", "20", "--trace", f"{root}/{name}"], world)
        run_harness(opts)


@pytest.mark.slow
def test_two_harness_runs_sharing_a_run_id_are_refused(tmp_path):
    """Two real harness runs with one --run-id: another seed, another algo. Mixing their files is
    exit 2 naming the header fields; each run alone reads as before."""
    run_ranks(_harness_runs, 2, [("a", ["--seed", "1"]), ("b", ["--seed", "2"]),
                                  ("c", ["--seed", "1", "--algo", "eagle"])], str(tmp_path), timeout=240)
    for name in "abc":
        assert tpguard("diagnose", str(tmp_path / name)).returncode == 0, name
    err = one_line(tpguard("diagnose", str(tmp_path / "a" / "same.rank0.jsonl"),
                           str(tmp_path / "b" / "same.rank1.jsonl")), 2)
    assert "config.seed 1 vs 2" in err and "two runs that reuse one run id" in err and "algo" not in err
    err = one_line(tpguard("diagnose", str(tmp_path / "a" / "same.rank0.jsonl"),
                           str(tmp_path / "c" / "same.rank1.jsonl"), "--json"), 2)
    assert "algo 'dflash' vs 'eagle'" in err and "config.seed" not in err


def _write_run(path: Path, rank: int, steps: int = 5, **header) -> Path:
    h = Header(run_id="x", world_size=header.pop("world_size", 2), ranks=[rank], **header)
    with TraceWriter(path, h) as w:
        for s in range(steps):
            w.write(StepRecord(run_id="x", step=s, site=SITE, ranks=[rank], fp={"coins": f"{s:016x}"}))
    return path


@pytest.mark.parametrize("other,named", [
    ({"world_size": 4}, "world_size 2 vs 4"),
    ({"created": "2026-01-01T12:00:00+00:00"}, "created '2026-01-01T10:00:00+00:00' vs '2026-01-01T12:00:00+00:00'"),
    ({"created": "2026-01-01T10:00:30+00:00"}, "created '2026-01-01T10:00:00+00:00' vs '2026-01-01T10:00:30+00:00'"),
    ({"config": {"seed": 0, "top_p": 0.5}}, "config.top_p 0.9 vs 0.5"),
])
def test_headers_that_differ_are_named(tmp_path, other, named):
    base = {"algo": "dflash", "created": "2026-01-01T10:00:00+00:00", "config": {"seed": 0, "top_p": 0.9}}
    a = _write_run(tmp_path / "a" / "x.rank0.jsonl", 0, **base)
    b = _write_run(tmp_path / "b" / "x.rank1.jsonl", 1, **{**base, **other})
    err = one_line(tpguard("diagnose", str(a), str(b)), 2)
    assert named in err and str(a) in err and str(b) in err
    # Seconds apart (ranks writing their headers after the run id is agreed): one run.
    c = _write_run(tmp_path / "c" / "x.rank1.jsonl", 1, **{**base, "created": "2026-01-01T10:00:03+00:00"})
    assert tpguard("diagnose", str(a), str(c)).returncode == 0


def test_one_file_holding_two_runs_of_one_run_id(tmp_path):
    a = _write_run(tmp_path / "a.jsonl", 0, config={"seed": 1})
    b = _write_run(tmp_path / "b.jsonl", 0, config={"seed": 2})
    c = _write_run(tmp_path / "x.rank1.jsonl", 1, config={"seed": 1})
    both = tmp_path / "x.rank0.jsonl"
    both.write_text(a.read_text() + b.read_text())  # concatenated files: the second header at line 7
    err = one_line(tpguard("diagnose", str(both), str(c)), 2)
    assert f"{both}:7:" in err and "config.seed 1 vs 2" in err


# --- records some ranks lack ---------------------------------------------------------------------

def _drop(path: Path, step: int, empty: bool = False) -> None:
    def edit(recs):
        i = next(i for i, r in enumerate(recs) if r.get("step") == step)
        if empty:
            recs[i]["fp"] = {}
        else:
            del recs[i]
    edit_lines(path, edit)


@pytest.mark.parametrize("empty", [False, True], ids=["lost-line", "empty-fp"])
def test_missing_record_before_the_first_divergence_is_a_finding(tmp_path, empty):
    """The truth is step 5 `bonus`; rank 1's step 5 is lost, so the first divergence seen moves to
    step 6. The lost record is named: the first divergence may lie there."""
    paths = write_synthetic_trace(tmp_path, 40, diverge_at=5, quantity="bonus")
    _drop(paths[1], 5, empty)
    p = tpguard("diagnose", str(tmp_path))
    assert p.returncode == 1
    assert "DIVERGED at step 6" in p.stdout
    assert "finding: rank 1 has no record of step 5, site synthetic.verify" in p.stdout
    j = json.loads(tpguard("diagnose", str(tmp_path), "--json").stdout)
    assert j["missing_records"]["listed"] == [{"rank": 1, "step": 5, "site": SITE}]
    assert j["missing_records"]["before_first_divergence"] == 1 and j["compared_steps"] == 39


def test_missing_records_after_the_first_divergence_are_counted(tmp_path):
    paths = write_synthetic_trace(tmp_path, 40, diverge_at=5)
    for step in (12, 20, 21):
        _drop(paths[1], step)
    j = json.loads(tpguard("diagnose", str(tmp_path), "--json").stdout)
    assert j["first_divergence"]["step"] == 5 and j["findings"] == []
    assert j["missing_records"]["after_first_divergence"] == {"1": 3}
    assert any("after the first divergence, 3 record(s) are missing" in w and "step 12" in w for w in j["warnings"])


def test_hole_in_a_long_clean_trace(tmp_path):
    """Compared in byte blocks: a record lost in the middle is still named, the rest compared."""
    paths = write_synthetic_trace(tmp_path, 6000, ranks=3)
    _drop(paths[2], 3000)
    _drop(paths[0], 4500, empty=True)
    p = tpguard("diagnose", str(tmp_path), "--json")
    j = json.loads(p.stdout)
    assert p.returncode == 0 and j["verdict"] == "clean" and j["compared_steps"] == 6000
    assert [(g["rank"], g["step"]) for g in j["missing_records"]["listed"]] == [(2, 3000), (0, 4500)]
    text = tpguard("diagnose", str(tmp_path)).stdout
    assert "finding: rank 2 has no record of step 3000, site synthetic.verify" in text


def test_rank_that_stopped_early_is_a_warning_not_a_finding(tmp_path):
    paths = write_synthetic_trace(tmp_path, 30, ranks=3, diverge_at=20)
    edit_lines(paths[2], lambda recs: recs.__delitem__(slice(11, None)))  # steps 0..9
    j = json.loads(tpguard("diagnose", str(tmp_path), "--json").stdout)
    assert j["first_divergence"]["step"] == 20 and j["findings"] == [] and j["stopped_early"] == [2]
    assert j["missing_records"]["after_last_record"] == {"2": 20}


def _steps_with(path: Path, keep, site=None) -> None:
    def edit(recs):
        recs[1:] = [r for r in recs[1:] if keep(r["step"])]
        for r in recs[1:]:
            r["site"] = site or r["site"]
    edit_lines(path, edit)


@pytest.mark.parametrize("case", ["disjoint-steps", "disjoint-sites", "garbage-site", "empty-records"])
def test_nothing_compared_is_its_own_verdict(tmp_path, case):
    paths = write_synthetic_trace(tmp_path, 20)
    if case == "disjoint-steps":
        _steps_with(paths[0], lambda s: s < 10)
        _steps_with(paths[1], lambda s: s >= 10)
    elif case == "disjoint-sites":
        _steps_with(paths[1], lambda s: True, site="eagle.verify")
    elif case == "garbage-site":
        _steps_with(paths[1], lambda s: True, site="\x00\x7f\ufffdq#@!")
    else:
        edit_lines(paths[1], lambda recs: [r.update(fp={}) for r in recs[1:]])
    p = tpguard("diagnose", str(tmp_path))
    assert p.returncode == 7, (p.stdout, p.stderr)
    assert "NOTHING COMPARED" in p.stdout and "CLEAN" not in p.stdout
    j = json.loads(tpguard("diagnose", str(tmp_path), "--json").stdout)
    assert j["verdict"] == "nothing_compared" and j["compared_steps"] == 0
    html = tmp_path / "r.html"
    assert tpguard("diagnose", str(tmp_path), "--html", str(html)).returncode == 7
    assert "NOTHING COMPARED" in html.read_text()


# --- malformed records ---------------------------------------------------------------------------

def _set(field, value):
    def edit(recs):
        recs[1500][field] = value
    return edit


MALFORMED = {
    "not-hex": (lambda recs: recs[1500]["fp"].update(coins="zz" * 8), "fp['coins'] = 'zzzzzzzzzzzzzzzz' is not a fingerprint"),
    "short-hex": (lambda recs: recs[1500]["fp"].update(coins="abc"), "is not a fingerprint"),
    "negative-step": (_set("step", -3), "negative step -3"),
    "other-run-id": (_set("run_id", "other"), "step record of run 'other' under a header of run 'bench'"),
    "swapped": (lambda recs: recs.__setitem__(slice(1500, 1502), recs[1500:1502][::-1]), "lines out of order"),
    "duplicated": (lambda recs: recs.insert(1500, dict(recs[1500])), "a second record of step 1499"),
}


@pytest.mark.parametrize("layout", ["compact", "spaced"])
@pytest.mark.parametrize("where", ["one-rank", "every-rank"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_record_is_exit_2_with_file_and_line(tmp_path, case, where, layout):
    edit, text = MALFORMED[case]
    paths = write_synthetic_trace(tmp_path, 3000, diverge_at=2900, layout=layout)
    for p in (paths[-1:] if where == "one-rank" else paths):
        edit_lines(p, edit)
    bad = paths[-1] if where == "one-rank" else paths[0]
    line = 1502 if case in ("swapped", "duplicated") else 1501
    err = one_line(tpguard("diagnose", str(tmp_path)), 2)
    assert f"{bad}:{line}: " in err and text in err


# --- --html never overwrites what it must not ----------------------------------------------------

def test_html_never_overwrites_an_input_or_another_file(tmp_path):
    d = tmp_path / "runs"
    write_synthetic_trace(d, 30, diverge_at=10)
    with TraceWriter(d / "bench.merged.jsonl", Header(run_id="bench", world_size=2, ranks=[0, 1])):
        pass
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    # `tpguard diagnose --html *` in the trace directory: the shell makes the first trace the target.
    err = one_line(tpguard("diagnose", "--html", *sorted(before), cwd=d), 2)
    assert "--html bench.merged.jsonl: is a tpguard trace: not overwritten" in err
    err = one_line(tpguard("diagnose", str(d), "--html", str(d / "bench.rank1.jsonl")), 2)
    assert "one of the traces to read" in err
    notes = tmp_path / "notes.html"
    notes.write_text("<html>my own notes</html>")
    err = one_line(tpguard("diagnose", str(d), "--html", str(notes)), 2)
    assert "not a tpguard report" in err and notes.read_text() == "<html>my own notes</html>"
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_html_replaces_an_earlier_report(tmp_path):
    d = tmp_path / "runs"
    write_synthetic_trace(d, 30, diverge_at=10)
    page = tmp_path / "r.html"
    assert tpguard("diagnose", str(d), "--html", str(page)).returncode == 1
    first = page.read_text()
    assert '<meta name="generator" content="tpguard diagnose">' in first
    write_synthetic_trace(d, 30, diverge_at=20)
    assert tpguard("diagnose", str(d), "--html", str(page)).returncode == 1
    assert page.read_text() != first and "step <b>20</b>" in page.read_text()
    # A report from before the marker, and an empty file (nothing to lose), are replaced too.
    for old in ("<!doctype html><html><head><meta charset='utf-8'><title>tpguard diagnose</title><style>",
                ""):
        page.write_text(old)
        assert tpguard("diagnose", str(d), "--html", str(page)).returncode == 1
        assert "step <b>20</b>" in page.read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


# --- compressed traces ---------------------------------------------------------------------------

def _zstd_compress(src: Path, dst: Path) -> None:
    try:
        import zstandard
    except ImportError:
        if shutil.which("zstd") is None:
            pytest.skip("no zstd compressor here (neither the zstandard package nor the zstd tool)")
        subprocess.run(["zstd", "-q", "-f", str(src), "-o", str(dst)], check=True)
        return
    dst.write_bytes(zstandard.ZstdCompressor().compress(src.read_bytes()))


def _zstd_readable() -> bool:
    try:
        from compression import zstd  # noqa: F401
        return True
    except ImportError:
        pass
    try:
        import zstandard  # noqa: F401
        return True
    except ImportError:
        return False


def _rotate(paths: list[Path], at: int) -> None:
    """Steps before `at` into NAME.jsonl.1, the rest stays in NAME.jsonl (each with its header)."""
    for p in paths:
        lines = p.read_text().splitlines(keepends=True)
        p.with_name(p.name + ".1").write_text("".join(lines[:at + 1]))
        p.write_text(lines[0] + "".join(lines[at + 1:]))


@pytest.mark.skipif(not _zstd_readable(), reason="no zstd support in this Python (pip install zstandard)")
def test_rotated_compressed_segments_in_a_directory(tmp_path):
    paths = write_synthetic_trace(tmp_path, 6000, diverge_at=5000, quantity="coins")
    _rotate(paths, 3000)
    r0, r1 = paths
    with open(r0.with_name(r0.name + ".1"), "rb") as src, gzip.open(r0.with_name(r0.name + ".1.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    r0.with_name(r0.name + ".1").unlink()
    _zstd_compress(r1.with_name(r1.name + ".1"), r1.with_name(r1.name + ".1.zst"))
    r1.with_name(r1.name + ".1").unlink()
    _zstd_compress(r0, r0.with_name(r0.name + ".zst"))
    r0.unlink()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["bench.rank0.jsonl.1.gz", "bench.rank0.jsonl.zst", "bench.rank1.jsonl", "bench.rank1.jsonl.1.zst"]
    p = tpguard("diagnose", str(tmp_path), "--json")
    j = json.loads(p.stdout)
    assert p.returncode == 1 and j["steps"] == 6000 and j["compared_steps"] == 6000
    assert (j["first_divergence"]["step"], j["first_divergence"]["quantity"]) == (5000, "coins")
    assert j["warnings"] == []
    # Named one by one, and whatever the name says: the first bytes tell the compression.
    plain_named = tmp_path / "gzip-with-a-plain-name.jsonl"
    shutil.copy(tmp_path / "bench.rank0.jsonl.1.gz", plain_named)
    p = tpguard("diagnose", str(plain_named), str(tmp_path / "bench.rank1.jsonl.1.zst"), "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["steps"] == 3000


def test_cut_gzip_reads_up_to_its_last_line_and_says_so(tmp_path):
    paths = write_synthetic_trace(tmp_path, 4000, diverge_at=3000)
    data = gzip.compress(paths[1].read_bytes())
    paths[1].unlink()
    (tmp_path / "bench.rank1.jsonl.gz").write_bytes(data[:len(data) // 2])  # a rotation killed midway
    p = tpguard("diagnose", str(tmp_path), "--json")
    j = json.loads(p.stdout)
    assert p.returncode == 0 and 1000 < j["compared_steps"] < 3000
    assert any("compressed data ends early" in w for w in j["warnings"])
    assert j["stopped_early"] == [1]
    corrupt = bytearray(data)
    corrupt[len(data) // 2: len(data) // 2 + 64] = b"x" * 64
    (tmp_path / "bench.rank1.jsonl.gz").write_bytes(bytes(corrupt))
    assert "corrupt gzip data" in one_line(tpguard("diagnose", str(tmp_path)), 2)


def test_without_zstd_support_one_line_says_so(tmp_path):
    paths = write_synthetic_trace(tmp_path / "t", 10)
    _zstd_compress(paths[0], paths[0].with_name(paths[0].name + ".zst"))
    paths[0].unlink()
    block = tmp_path / "block"  # shadows the zstandard package and the standard library's zstd
    for name in ("zstandard", "compression"):
        (block / name).mkdir(parents=True)
        (block / name / "__init__.py").write_text("raise ImportError('not here')\n")
    err = one_line(tpguard("diagnose", str(tmp_path / "t"), env={"PYTHONPATH": str(block)}), 2)
    assert "no zstd support" in err and "bench.rank0.jsonl.zst" in err
    bz = tmp_path / "t" / "bench.rank0.jsonl"
    bz.write_bytes(b"BZh91AY&SY" + b"\0" * 40)
    assert "compressed with bzip2" in one_line(tpguard("diagnose", str(bz), str(paths[1])), 2)


# --- speed for any JSON layout -------------------------------------------------------------------

def _cpu_seconds(fn, repeat=3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["compact", "spaced", "other"])
def test_any_layout_reads_within_3x_of_json_loads(tmp_path, layout):
    """A trace as a standard `json.dumps` writes it (and any other valid layout) reads within 3x
    of a bare json.loads of its lines. CPU time of this process, best of three: the other
    processes on a loaded machine do not count."""
    paths = write_synthetic_trace(tmp_path, 20_000, diverge_at=19_990, layout="spaced" if layout == "spaced" else "compact")
    if layout == "other":  # keys reordered, spaces around every separator
        for p in paths:
            recs = [json.loads(line) for line in p.read_text().splitlines()]
            p.write_text("".join(json.dumps(dict(reversed(list(r.items()))), separators=(" , ", " : ")) + "\n"
                                 for r in recs))
    t_json = _cpu_seconds(lambda: time_json_loads(paths))
    t_diag = _cpu_seconds(lambda: diagnose(paths))
    assert diagnose(paths).to_json()["first_divergence"]["step"] == 19_990
    assert t_diag < 3 * t_json, (layout, t_diag, t_json)


def test_bench_diagnose_covers_both_layouts():
    p = tpguard("bench", "diagnose", "--steps", "2000")
    assert p.returncode == 0, p.stderr
    for layout in ("compact", "spaced"):
        assert f"{layout}: 2 ranks x 2000 steps" in p.stdout
    assert p.stdout.count("json.loads of every line") == 2 and p.stdout.count("x json.loads") == 2


# --- python -m tpguard ---------------------------------------------------------------------------

@pytest.mark.slow
def test_python_m_tpguard_is_the_tpguard_command(tmp_path):
    write_synthetic_trace(tmp_path, 30, diverge_at=10)
    for args in (["diagnose", str(tmp_path)], ["diagnose", str(tmp_path), "--json"], ["diagnose"],
                 ["diagnose", str(tmp_path / "nothing-here")], ["nosuchcommand"], ["--help"]):
        a, b = tpguard(*args), tpguard(*args, python_m=True)
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr), args
    assert tpguard("diagnose", str(tmp_path), python_m=True).returncode == 1
    assert "Usage: tpguard" in tpguard("--help", python_m=True).stdout


# --- a quantity some ranks recorded and others did not -------------------------------------------

def _uncapture(path: Path, quantity: str, how: str, steps=lambda s: True) -> None:
    """Rank's value of `quantity` null, its key deleted, or the key renamed, at the chosen steps."""
    def edit(recs):
        for r in recs[1:]:
            if r.get("type") != "step" or not steps(r["step"]):
                continue
            if how == "null":
                r["fp"][quantity] = None
            else:
                value = r["fp"].pop(quantity)
                if how == "renamed":
                    r["fp"][quantity + "_x"] = value
    edit_lines(path, edit)


@pytest.mark.parametrize("how", ["null", "deleted", "renamed"])
@pytest.mark.parametrize("culprit", [0, 1])
def test_quantity_recorded_on_one_rank_only_is_a_divergence(tmp_path, how, culprit):
    """The truth: target_probs differs from step 10 on (as in a run with a non-deterministic
    renorm). One rank's values of it are lost from step 10: that must not read as CLEAN."""
    paths = write_synthetic_trace(tmp_path, 40)
    _uncapture(paths[culprit], "target_probs", how, steps=lambda s: s >= 10)
    p = tpguard("diagnose", str(tmp_path))
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "DIVERGED at step 10, site synthetic.verify: first differing quantity 'target_probs'" in p.stdout
    assert f"    not captured      ranks [{culprit}]\n" in p.stdout and "CLEAN" not in p.stdout
    j = json.loads(tpguard("diagnose", str(tmp_path), "--json").stdout)
    f = j["first_divergence"]
    assert f["culprit_ranks"] == [culprit] and f["majority_ranks"] == [1 - culprit]
    assert f["uncaptured_ranks"] == [culprit] and "renorm" not in j["cause"] and "not record" in j["cause"]
    # Not captured on every rank: nothing to compare, as before.
    _uncapture(paths[1 - culprit], "target_probs", how, steps=lambda s: s >= 10)
    assert tpguard("diagnose", str(tmp_path)).returncode == 0


def test_quantity_missing_on_one_of_three_ranks_names_that_rank(tmp_path):
    paths = write_synthetic_trace(tmp_path, 20, ranks=3)
    _uncapture(paths[2], "coins", "deleted", steps=lambda s: s == 7)
    j = json.loads(tpguard("diagnose", str(tmp_path), "--json").stdout)
    f = j["first_divergence"]
    assert (f["step"], f["quantity"], f["culprit_ranks"], f["majority_ranks"]) == (7, "coins", [2], [0, 1])


def test_unknown_quantity_on_one_rank_only_is_not_ignored(tmp_path):
    """A record holding only a quantity the run does not list: compared like any other (after the
    listed ones), so the run's own quantities, captured on the other rank, show as not captured."""
    paths = write_synthetic_trace(tmp_path, 20)
    edit_lines(paths[1], lambda recs: recs[6]["fp"].clear() or recs[6]["fp"].update(bogus_q="0123456789abcdef"))
    j = json.loads(tpguard("diagnose", str(tmp_path), "--json").stdout)
    f = j["first_divergence"]
    assert j["verdict"] == "diverged" and (f["step"], f["quantity"], f["culprit_ranks"]) == (5, "rng_state", [1])
    assert "bogus_q" in f["differing_at_step"]


# --- a second header inside a file ---------------------------------------------------------------

def test_files_of_two_ranks_concatenated_are_refused_with_file_and_line(tmp_path):
    paths = write_synthetic_trace(tmp_path / "t", 30)
    both = tmp_path / "all.jsonl"
    both.write_bytes(paths[0].read_bytes() + paths[1].read_bytes())
    err = one_line(tpguard("diagnose", str(both)), 2)
    assert f"{both}:32: " in err and "rank(s) [1]" in err and "only rank" not in err


def test_another_runs_trace_appended_is_refused(tmp_path):
    ok = write_synthetic_trace(tmp_path / "ok", 30, run_id="ok")
    div = write_synthetic_trace(tmp_path / "div", 30, run_id="div", diverge_at=3)
    mixed = tmp_path / "mixed" / "ok.rank1.jsonl"
    mixed.parent.mkdir()
    shutil.copy(ok[0], mixed.parent)
    mixed.write_bytes(ok[1].read_bytes() + div[1].read_bytes())
    err = one_line(tpguard("diagnose", str(mixed.parent)), 2)
    assert f"{mixed}:32: " in err and "'div'" in err
    # A divergence or event record of another run, alone: refused the same way.
    edit_lines(ok[1], lambda recs: recs.insert(5, {"type": "event", "run_id": "div", "kind": "timeout", "message": "x"}))
    err = one_line(tpguard("diagnose", str(tmp_path / "ok")), 2)
    assert f"{ok[1]}:6: " in err and "'div'" in err
    # Rotated segments of one rank joined with cat (the same header again): read as one trace.
    ok = write_synthetic_trace(tmp_path / "seg", 30, run_id="ok", diverge_at=20)
    lines = ok[1].read_text().splitlines(keepends=True)
    ok[1].write_text("".join(lines[:16] + lines[:1] + lines[16:]))
    j = json.loads(tpguard("diagnose", str(tmp_path / "seg"), "--json").stdout)
    assert j["first_divergence"]["step"] == 20 and j["compared_steps"] == 30


# --- counts from a file that size memory or a message --------------------------------------------

def _world_size(paths, n):
    for p in paths:
        edit_lines(p, lambda recs: recs[0].update(world_size=n))


def test_huge_world_size_is_refused(tmp_path):
    paths = write_synthetic_trace(tmp_path, 10)
    _world_size(paths, 65537)
    err = one_line(tpguard("diagnose", str(tmp_path)), 2)
    assert str(paths[0]) in err and "world_size 65537" in err and "65536" in err and len(err) < 500


def test_rank_lists_in_messages_are_cut_short(tmp_path):
    paths = write_synthetic_trace(tmp_path, 10)
    _world_size(paths, 65536)
    p = tpguard("diagnose", str(tmp_path))
    assert p.returncode == 0 and max(map(len, p.stdout.splitlines())) < 500
    assert "no trace for rank(s) [2, 3, 4, 5, 6, 7, 8, 9, ... 65535] (65534 ranks)" in p.stdout
    paths[1].unlink()
    err = one_line(tpguard("diagnose", str(tmp_path)), 2)
    assert len(err) < 500 and "(65535 ranks)" in err


# --- a file in a trace directory that is not a regular file --------------------------------------

@pytest.mark.parametrize("kind", ["dev-zero-link", "fifo"])
def test_not_a_regular_file_in_a_directory_is_named(tmp_path, kind):
    def replace(path):
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to("/dev/zero")

    why = "a FIFO" if kind == "fifo" else "/dev/zero"
    paths = write_synthetic_trace(tmp_path / "two", 10)
    replace(paths[1])
    err = one_line(tpguard("diagnose", str(tmp_path / "two")), 2)
    assert f"{paths[1]}: not a regular file" in err and why in err and "skipped" in err
    # Next to two usable ranks: read, with a warning naming it.
    paths = write_synthetic_trace(tmp_path / "three", 10, ranks=3)
    replace(paths[1])
    p = tpguard("diagnose", str(tmp_path / "three"))
    assert p.returncode == 0, p.stderr
    assert any(f"{paths[1]}: not a regular file" in line and why in line for line in p.stdout.splitlines())


# --- steps out of range ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", [str(2 ** 63), str(10 ** 30), "9" * 5000], ids=["2^63", "1e30", "5000-digits"])
@pytest.mark.parametrize("where", ["last-line", "middle-every-rank"])
def test_step_out_of_range_is_refused(tmp_path, value, where):
    paths = write_synthetic_trace(tmp_path, 3000)
    targets = paths[1:] if where == "last-line" else paths
    at = 3000 if where == "last-line" else 1501
    for p in targets:
        lines = p.read_text().splitlines(keepends=True)
        lines[at] = lines[at].replace(f'"step":{at - 1},', f'"step":{value},')
        p.write_text("".join(lines))
    err = one_line(tpguard("diagnose", str(tmp_path)), 2)
    assert f"{targets[0]}:{at + 1}: " in err and "out of range" in err and len(err) < 500
