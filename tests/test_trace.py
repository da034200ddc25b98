"""Trace v1 writer and reader: exact format, string-or-list fp values, torn lines, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tpguard.errors import TraceError
from tpguard.records import (
    SCHEMA, DivergenceRecord, EventRecord, Header, StepRecord, compact_fp, expand_fp, from_json, to_json,
)
from tpguard.trace import TraceWriter, read_trace


def test_records_round_trip_and_spec_fields(tmp_path):
    h = Header(run_id="r", world_size=2, ranks=[0, 1], algo="dflash", config={"top_p": 0.9})
    s = StepRecord(run_id="r", step=3, site="dflash.verify", ranks=[0, 1],
                   fp={"seq_lens": "00000000000000ff", "coins": ["0000000000000001", "0000000000000002"],
                       "target_logits": None})
    d = DivergenceRecord(run_id="r", step=3, site="dflash.verify", quantity="coins",
                         values={"0000000000000001": [0], "0000000000000002": [1]}, culprit_ranks=[1])
    e = EventRecord(run_id="r", kind="fix", message="deterministic renorm on")
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, h) as w:
        for rec in (s, d, e):
            w.write(rec)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["schema"] == SCHEMA
    assert set(lines[0]) >= {"run_id", "world_size", "ranks", "quantities", "algo", "created", "versions", "config"}
    assert lines[1] == {"type": "step", "run_id": "r", "step": 3, "site": "dflash.verify", "ranks": [0, 1],
                        "fp": s.fp}
    assert set(lines[2]) >= {"type", "run_id", "step", "site", "quantity", "values", "culprit_ranks", "action", "dump"}
    assert lines[3]["kind"] == "fix"
    recs = list(read_trace(path))
    assert [r.type for r in recs] == ["header", "step", "divergence", "event"]
    assert recs[1].values_by_rank("coins") == {0: "0000000000000001", 1: "0000000000000002"}
    assert recs[1].values_by_rank("seq_lens") == {0: "00000000000000ff", 1: "00000000000000ff"}
    assert recs[1].values_by_rank("target_logits") == {0: None, 1: None}


def test_unknown_fields_are_kept_and_ignored():
    obj = {"type": "step", "run_id": "r", "step": 1, "site": "x", "ranks": [0], "fp": {}, "gpu": "h200"}
    rec = from_json(obj)
    assert rec.extra == {"gpu": "h200"}
    assert to_json(rec)["gpu"] == "h200"


def test_divergence_record_line_is_unchanged():
    """The guard's divergence lines, policy heal's `healed` and `note` included, read back to the
    same record and write out byte for byte as before; unset optional fields stay off the line."""
    import orjson

    head = (b'{"type":"divergence","run_id":"r","step":7,"site":"dflash.verify","quantity":"bonus",'
            b'"values":{"0000000000000001":[0],"0000000000000002":[1]},"culprit_ranks":[1],')
    healed = head + b'"action":"healed","dump":null,"majority_ranks":[0],"differing":["bonus"],"rows":[5],"healed":["bonus"]}'
    refused = head + (b'"action":"recorded","dump":null,"majority_ranks":[0],"differing":["bonus"],'
                      b'"note":"heal refused at this step (see the log); recorded"}')
    for line in (healed, refused):
        rec = from_json(orjson.loads(line))
        assert isinstance(rec, DivergenceRecord) and rec.extra == {} and orjson.dumps(to_json(rec)) == line
    assert from_json(orjson.loads(healed)).healed == ["bonus"] and from_json(orjson.loads(refused)).note.startswith("heal")
    bare = DivergenceRecord(run_id="r", step=1, site="s", quantity="coins", values={}, culprit_ranks=[1])
    assert not {"rows", "healed", "note", "switch"} & set(to_json(bare))


def test_compact_and_expand():
    assert compact_fp(["a", "a"]) == "a"
    assert compact_fp(["a", None]) == ["a", None]
    assert expand_fp(None, [2, 3]) == {2: None, 3: None}
    assert expand_fp(["a", None], [2, 3]) == {2: "a", 3: None}


@pytest.mark.parametrize("obj,msg", [
    ({"type": "header", "schema": "tpguard.trace/9", "run_id": "r", "world_size": 2, "ranks": [0]}, "unknown schema"),
    ({"type": "header", "run_id": "r", "world_size": 2, "ranks": [0]}, "without schema"),
    ({"type": "step", "run_id": "r", "step": "x", "site": "s", "ranks": [0], "fp": {}}, "non-integer step"),
    ({"type": "step", "run_id": "r", "step": 1, "site": "s", "ranks": [0, 1], "fp": {"q": ["a"]}}, "1 values for 2"),
    ({"type": "bogus"}, "unknown record type"),
    ([1, 2], "not a JSON object"),
])
def test_bad_records(obj, msg):
    with pytest.raises(TraceError, match=msg):
        from_json(obj)


def test_torn_last_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, Header(run_id="r", world_size=2, ranks=[0])) as w:
        w.write(StepRecord(run_id="r", step=0, site="s", ranks=[0], fp={"coins": "00000000000000aa"}))
    with open(path, "a") as f:
        f.write('{"type":"step","run_id":"r","st')
    warnings = []
    recs = list(read_trace(path, warn=warnings.append))
    assert len(recs) == 2 and "torn last line" in warnings[0]


def test_rotation_keeps_every_record(tmp_path):
    path = tmp_path / "t.jsonl"
    w = TraceWriter(path, Header(run_id="r", world_size=2, ranks=[0]), max_bytes=2000)
    for i in range(100):
        w.write(StepRecord(run_id="r", step=i, site="s", ranks=[0], fp={"coins": f"{i:016x}"}))
    w.close()
    files = sorted(tmp_path.glob("t.jsonl*"))
    assert len(files) > 3
    steps = sorted(r.step for f in files for r in read_trace(f) if r.type == "step")
    assert steps == list(range(100))


WRITER = r"""
import sys, time
from tpguard.records import Header, StepRecord
from tpguard.trace import TraceWriter
w = TraceWriter(sys.argv[1], Header(run_id="r", world_size=2, ranks=[0]))
i = 0
while True:
    w.write(StepRecord(run_id="r", step=i, site="s", ranks=[0], fp={"coins": "%016x" % i}))
    if i == 50:
        print("ready", flush=True)
    i += 1
    time.sleep(0.001)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_writer_keeps_every_completed_step(tmp_path, sig):
    path = tmp_path / "t.jsonl"
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.05)
    os.kill(p.pid, sig)
    p.wait(timeout=10)
    warnings = []
    steps = [r.step for r in read_trace(path, warn=warnings.append) if r.type == "step"]
    assert len(steps) > 50 and steps == list(range(len(steps)))


SIGTERM_INSIDE_WRITE = r"""
import os, signal, sys, time
from tpguard.records import Header, StepRecord
from tpguard.trace import TraceWriter
w = TraceWriter(sys.argv[1], Header(run_id="r", world_size=2, ranks=[0]))
for i in range(3):
    w.write(StepRecord(run_id="r", step=i, site="s", ranks=[0], fp={"coins": "%016x" % i}))
with w._lock:  # where a write() is when SIGTERM lands in it
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
"""


def test_sigterm_inside_a_write_still_kills(tmp_path):
    """CI caught this once: the SIGTERM flush waited for the lock the interrupted write held."""
    path = tmp_path / "t.jsonl"
    p = subprocess.run([sys.executable, "-c", SIGTERM_INSIDE_WRITE, str(path)], timeout=20)
    assert p.returncode == -signal.SIGTERM
    assert [r.step for r in read_trace(path) if r.type == "step"] == [0, 1, 2]


_FILL_UNTIL_FULL = """
import resource, sys
from tpguard.errors import TraceWriteError
from tpguard.records import Header, StepRecord
from tpguard.trace import TraceWriter
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
w = TraceWriter(sys.argv[1], Header(run_id="full", world_size=2, ranks=[0]))
try:
    for step in range(100000):
        w.write(StepRecord(run_id="full", step=step, site="s", ranks=[0], fp={"coins": "%016x" % step}))
except TraceWriteError as e:
    print(e)
"""


def test_a_write_that_does_not_fit_is_cut_back_to_whole_lines(tmp_path):
    """A file size limit (RLIMIT_FSIZE: Python ignores SIGXFSZ, so the write fails with EFBIG),
    as a full disk would: the partly written line is cut off, the error is one line naming the
    last step the file holds, and the file reads without a warning."""
    path, limit = tmp_path / "full.jsonl", 5000
    p = subprocess.run([sys.executable, "-c", _FILL_UNTIL_FULL, str(path), str(limit)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not p.stderr, p.stderr
    line = p.stdout.strip()
    assert line.startswith(f"tpguard: cannot write the trace {path}: File too large (EFBIG); "
                           "it holds every record up to step "), line
    warnings = []
    steps = [r.step for r in read_trace(path, warnings.append) if r.type == "step"]
    assert not warnings and steps == list(range(len(steps))) and len(steps) > 10
    assert line.endswith(f"up to step {steps[-1]}")
    data = path.read_bytes()
    assert data.endswith(b"\n") and len(data) <= limit and len(data) > limit - 200
