"""`tpguard replay` on dumps it cannot use: one line on stderr, exit code 2, never a traceback.

Torn and garbage files, a missing rank (with and without the partial file a dying rank leaves),
dumps of two runs mixed, renamed files, the same rank twice, dumps without the world size or
without a replay context (what the SGLang plugin wrote before it passed one), a replay context or
sampling parameters of the wrong type or range, a FIFO or device where a dump should be, bad
arguments.
The dumps come from the real harness (2 ranks, `--dump`): `python -m tpguard.launch`'s main() in
two rank processes that make both runs (tests/multiproc.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tpguard.cli import main as cli_main

pytestmark = pytest.mark.slow  # two harness runs, for the module


def _two_runs(rank, world, root):
    """Runs a and b, one after the other in this rank process (its process group made by run_ranks)."""
    from tpguard.launch.__main__ import main

    common = ["--steps", "2", "--renorm", "torch", "--dump", "--no-progress", "--quiet", "--timeout", "60"]
    return [main([*common, "--inject", inject, "--trace", f"{root}/{name}"])
            for name, inject in (("a", "target_probs@1:1"), ("b", "accept_len@1:1"))]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Two runs' dumps: target_probs planted at step 1 (run a), accept_len at step 1 (run b)."""
    root = tmp_path_factory.mktemp("replay-bad")
    assert run_ranks(_two_runs, 2, str(root), timeout=240) == [[1, 1], [1, 1]]  # 1: diverged (record)
    return root


def files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "dumps").glob("*.safetensors"))


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite(path: Path, drop=(), **meta) -> None:
    """Save `path` again with its metadata changed (keys in `drop` removed, `meta` set)."""
    with safe_open(str(path), framework="pt") as f:
        old = dict(f.metadata())
    tensors = load_file(str(path))
    new = {k: v for k, v in old.items() if k not in drop}
    new.update(meta)
    save_file(tensors, str(path), metadata=new)


def bad(capsys, *args) -> str:
    rc = cli_main(["replay", "--calls", "2", *map(str, args)])
    out = capsys.readouterr()
    assert rc == 2, (rc, out.out[-1500:], out.err)
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpguard"), out.err
    assert "Traceback" not in out.out + out.err
    return lines[0]


def test_the_good_dumps_replay(dumps, capsys):
    assert cli_main(["replay", str(dumps / "a"), "--calls", "2"]) == 0
    assert cli_main(["replay", str(dumps / "b"), "--calls", "2"]) == 0
    capsys.readouterr()


def test_torn_file(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    f = files(d)[1]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    assert "torn dump" in bad(capsys, d) and f.name in bad(capsys, d)


def test_file_cut_inside_its_header_and_garbage(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    f = files(d)[1]
    f.write_bytes(f.read_bytes()[:200])
    assert "torn or not a dump" in bad(capsys, d)
    f.write_text("not a dump\n")
    assert "torn or not a dump" in bad(capsys, d)
    f.write_bytes(b"")
    assert "torn or not a dump" in bad(capsys, d)


def test_missing_rank_and_the_partial_file_of_a_rank_that_died(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    f = files(d)[1]
    f.unlink()
    msg = bad(capsys, d)
    assert "rank(s) [1] have no dump" in msg and "world size 2, found rank(s) [0]" in msg
    f.with_name(f.name + ".tmp").write_bytes(b"\0" * 100)
    assert "the rank stopped while writing" in bad(capsys, d)


def test_mixed_runs(dumps, tmp_path, capsys):
    d = tmp_path / "mixed" / "dumps"
    d.mkdir(parents=True)
    a0, _ = files(dumps / "a")
    _, b1 = files(dumps / "b")
    shutil.copy(a0, d)
    shutil.copy(b1, d)
    assert "choose one with --run" in bad(capsys, d.parent)
    run_a = a0.name.split(".step")[0]
    assert "rank(s) [1] have no dump" in bad(capsys, d.parent, "--run", run_a)
    # the other run's file renamed to pass for this run's rank 1: its metadata says otherwise
    shutil.copy(b1, d / a0.name.replace(".rank0.", ".rank1."))
    assert "renamed or mixed dumps" in bad(capsys, d.parent, "--run", run_a)


def test_two_paths_holding_the_same_rank(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    other = tmp_path / "copy"
    other.mkdir()
    shutil.copy(files(d)[0], other)
    assert "two dumps of rank 0" in bad(capsys, d, other)


def test_renamed_step(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    for f in files(d):
        f.rename(f.with_name(f.name.replace(".step1.", ".step5.")))
    assert "renamed or mixed dumps" in bad(capsys, d)


def test_world_size_disagreement_and_a_stray_rank(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    rewrite(files(d)[1], world_size="3")
    assert "disagree on the world size" in bad(capsys, d)
    d2 = copy_run(dumps / "a", tmp_path / "b")
    f0 = files(d2)[0]
    stray = f0.with_name(f0.name.replace(".rank0.", ".rank2."))
    shutil.copy(f0, stray)
    rewrite(stray, rank="2")
    assert "rank(s) [2] in a run of world size 2" in bad(capsys, d2)


def test_world_size_from_the_trace_when_the_dumps_lack_it(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    for f in files(d):
        rewrite(f, drop=("world_size",))
    assert cli_main(["replay", str(d), "--calls", "2"]) == 0  # the trace header says 2
    capsys.readouterr()
    for t in d.glob("*.jsonl"):
        t.unlink()
    assert "cannot tell how many ranks" in bad(capsys, d)


def test_dumps_without_a_replay_context(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    for f in files(d):
        rewrite(f, drop=("context",))
    rc = cli_main(["replay", str(d), "--calls", "2", "--json"])
    out = capsys.readouterr()
    assert rc == 2 and json.loads(out.out)["verdict"] == "cannot-rerun"
    assert "do not record how target_probs was made" in out.err and len(out.err.strip().splitlines()) == 1


def test_a_foreign_safetensors_file(tmp_path, capsys):
    d = tmp_path / "dumps"
    d.mkdir()
    save_file({"x": torch.zeros(3)}, str(d / "weights.safetensors"))
    assert "not a tpguard dump" in bad(capsys, tmp_path)


def test_no_dumps_and_bad_arguments(dumps, tmp_path, capsys):
    assert "no dumps under" in bad(capsys, tmp_path)
    assert "no such file or directory" in bad(capsys, tmp_path / "nope")
    assert "has no dump of step 7" in bad(capsys, dumps / "a", "--step", "7")
    assert "no dumps of run 'nope'" in bad(capsys, dumps / "a", "--run", "nope")
    assert "has no dump of site 'x.verify'" in bad(capsys, dumps / "a", "--site", "x.verify")
    assert "--calls" in bad(capsys, dumps / "a", "--calls", "0")
    assert "--device" in bad(capsys, dumps / "a", "--device", "tpu")
    assert "--step" in bad(capsys, dumps / "a", "--step", "-1")
    if not torch.cuda.is_available():
        assert "no CUDA device here" in bad(capsys, dumps / "a", "--device", "cuda")


def test_the_runs_backend_cannot_run_here(dumps, tmp_path, capsys):
    # a dump of a GPU run with flashinfer's default renorm, replayed where flashinfer cannot run
    from tpguard.renorm_registry import available

    if torch.cuda.is_available() and available("flashinfer", "cuda"):
        pytest.skip("flashinfer runs here")
    d = copy_run(dumps / "a", tmp_path / "a")
    for f in files(d):
        with safe_open(str(f), framework="pt") as fh:
            ctx = json.loads(fh.metadata()["context"])
        ctx.update(device="cuda", renorm={"name": "flashinfer", "source": "flashinfer.sampling", "deterministic": False})
        rewrite(f, context=json.dumps(ctx))
    rc = cli_main(["replay", str(d), "--calls", "2", "--json"])
    out = capsys.readouterr()
    j = json.loads(out.out)
    assert rc == 2 and j["verdict"] == "cannot-rerun"
    assert j["runs"][0]["backend"] == "flashinfer" and j["runs"][0]["error"]
    assert [(r["backend"], r["differing"]) for r in j["runs"][1:]] == [("tpguard", 0), ("torch", 0)]
    assert any("the run used cuda, this replay cpu" in n for n in j["notes"])
    assert len(out.err.strip().splitlines()) == 1 and "flashinfer cannot run here" in out.err


def set_context(path: Path, edit) -> None:
    """Rewrite the dump's replay context with `edit(ctx)` applied (Python's json writes NaN as NaN)."""
    with safe_open(str(path), framework="pt") as f:
        ctx = json.loads(f.metadata()["context"])
    edit(ctx)
    rewrite(path, context=json.dumps(ctx))


def set_param(path: Path, name: str, value) -> None:
    """Every row of the sampling parameter `name` set to `value`, the metadata kept."""
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, str(path), metadata=meta)


def _ctx_edit(section, key, value):
    def edit(ctx):
        if key is None:
            ctx[section] = value
        else:
            ctx[section][key] = value
    return edit


# Run a's dumps: target_probs differs first (the renorm re-run, then each rank's accept step), the
# harness's top_p 0.9, so stages ["top_p"]. Before these were checked: exit 5 (a "tpguard bug"), an
# exit 0 verdict on parameters no run can have, or a backend said to be unable to run.
BAD_CONTEXTS = {
    "renorm null": (_ctx_edit("renorm", None, None), "context.renorm"),
    "threshold a string": (_ctx_edit("accept", "threshold_single", "x"), "context.accept.threshold_single"),
    "threshold NaN": (_ctx_edit("accept", "threshold_single", math.nan), "context.accept.threshold_single"),
    "threshold out of range": (_ctx_edit("accept", "threshold_acc", 7), "context.accept.threshold_acc"),
    "unknown stage": (_ctx_edit("probs", "stages", ["top_z"]), "unknown renorm stage 'top_z'"),
    "stages out of order": (_ctx_edit("probs", "stages", ["top_p", "top_k"]), "context.probs.stages"),
    "no stages for top_p 0.9": (_ctx_edit("probs", "stages", []), "param.top_p"),
    "a parent after its node": (_ctx_edit("tree_parents", None, [-1, 2, 0, 1]), "context.tree_parents"),
    "coins larger than recorded": (_ctx_edit("coins", "shapes", [[10 ** 12]]), "context.coins.shapes"),
    "versions not an object": (_ctx_edit("versions", None, "x"), "context.versions"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTEXTS))
def test_a_bad_replay_context_is_a_bad_dump(dumps, tmp_path, capsys, case):
    edit, field = BAD_CONTEXTS[case]
    d = copy_run(dumps / "a", tmp_path / "a")
    for f in files(d):
        set_context(f, edit)
    msg = bad(capsys, d)
    assert msg.startswith("tpguard replay: bad dump ") and field in msg, msg


BAD_PARAMS = {
    "temperature 0": ("param.temperature", 0.0),
    "temperature NaN": ("param.temperature", math.nan),
    "top_p -3": ("param.top_p", -3.0),
    "top_p 0": ("param.top_p", 0.0),
    "top_k -1": ("param.top_k", -1),
    "min_p 2": ("param.min_p", 2.0),
}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_invalid_sampling_parameters_are_a_bad_dump_not_a_verdict(dumps, tmp_path, capsys, case):
    name, value = BAD_PARAMS[case]
    d = copy_run(dumps / "a", tmp_path / "a")
    for f in files(d):
        set_param(f, name, value)
    msg = bad(capsys, d)
    assert msg.startswith("tpguard replay: bad dump ") and name in msg, msg


def test_a_fifo_among_the_dumps_is_named_not_opened(dumps, tmp_path):
    # opening a FIFO blocks until a writer comes: a subprocess, so a hang fails the test
    d = copy_run(dumps / "a", tmp_path / "a")
    f = files(d)[1]
    f.unlink()
    os.mkfifo(f)
    p = subprocess.run([sys.executable, "-m", "tpguard", "replay", str(d), "--calls", "2"], capture_output=True,
                       text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr)
    assert f.name in lines[0] and "not a regular file (a FIFO)" in lines[0], lines[0]


def test_a_device_or_fifo_given_as_the_dump(tmp_path, capsys):
    assert "/dev/null: not a regular file (a character device)" in bad(capsys, "/dev/null")
    os.mkfifo(tmp_path / "x.safetensors")
    assert "not a regular file (a FIFO)" in bad(capsys, tmp_path / "x.safetensors")


def test_truncated_files_say_their_size(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    f = files(d)[1]
    whole = f.read_bytes()
    for size in (4, 200):
        f.write_bytes(whole[:size])
        msg = bad(capsys, d).split(f.name)[-1]  # the test's folder is named "...truncated..." too
        assert f"{size} bytes" in msg and "truncated" in msg, msg
    f.write_text("not a dump\n")
    assert "not a safetensors file" in bad(capsys, d)


def test_metadata_that_is_not_json_names_its_field(dumps, tmp_path, capsys):
    d = copy_run(dumps / "a", tmp_path / "a")
    rewrite(files(d)[1], context="{nope")
    msg = bad(capsys, d)
    assert "bad dump" in msg and "context is not JSON" in msg, msg
    d2 = copy_run(dumps / "a", tmp_path / "b")
    rewrite(files(d2)[0], quantities='["a", 1]')
    assert "quantities" in bad(capsys, d2)


def test_calls_has_a_maximum(tmp_path, capsys):
    # checked before any dump is read
    for calls in ("10001", "99999999999999999999999"):
        msg = bad(capsys, tmp_path / "nope", "--calls", calls)
        assert "--calls" in msg and "10000" in msg, msg
