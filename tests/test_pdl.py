"""Programmatic dependent launches (kernels/pdl.py): `RenormConfig.pdl` 1 and 2 give the same output
bits and fingerprint slots as plain launches, eagerly (through the call plans' direct launches too)
and replayed from a CUDA graph; off under the interpreter, on CPU tensors and below pdl_min_rows rows.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from renorm_setup import DEVICE, SMALL, mixed_batch

from tpguard.kernels import pdl, renorm_plan as rp
from tpguard.kernels.renorm_config import default_config, op_config, pdl_args, pdl_mode
from tpguard.kernels.renorm_workspace import shapes_for

DEFAULT_CONFIG = default_config()  # the process's config (TPGUARD_RENORM_CONFIG)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN rows


def test_pdl_flags_and_launch_options():
    """Off under the interpreter and on CPU tensors whatever the config says; on an sm_90+ GPU the
    dependent launches carry the PDL attribute, the first launch of a call does not, and calls of fewer than pdl_min_rows rows launch plainly."""
    s = shapes_for(256, 4096, DEFAULT_CONFIG)
    small = shapes_for(DEFAULT_CONFIG.pdl_min_rows - 1, 4096, DEFAULT_CONFIG)
    assert DEFAULT_CONFIG.pdl == 1 and pdl_mode(DEFAULT_CONFIG, s, torch.device("cpu")) == 0
    if DEVICE == "cpu":
        assert not pdl.enabled(1) and pdl.launch_options(1) == {} and pdl.first(1) == pdl.dependent(1) == pdl.OFF
        return
    dev = torch.device(DEVICE, torch.cuda.current_device())
    if not pdl.supported(dev):
        pytest.skip("GPU before sm_90: no programmatic dependent launch")
    assert pdl.enabled(1) and pdl.launch_options(1) == {"launch_pdl": True}
    assert (pdl.first(1), pdl.dependent(1)) == (pdl.FIRST, pdl.DEPENDENT)
    assert pdl_mode(DEFAULT_CONFIG, s, dev) == 1 and pdl_mode(DEFAULT_CONFIG, small, dev) == 0
    assert pdl_mode(DEFAULT_CONFIG.replace(pdl=0), s, dev) == 0
    assert not pdl.enabled(0) and pdl.launch_options(0) == {}
    # the write pass alone (bench, tests) is a sequence's first launch; inside a call a dependent
    assert pdl_args(DEFAULT_CONFIG, s, dev, first=True) == {"PDL": pdl.FIRST}
    assert pdl_args(DEFAULT_CONFIG, s, dev) == {"PDL": pdl.DEPENDENT, "launch_pdl": True}


def test_split_parts_launch_as_the_whole_call():
    """A captured call's row parts take PDL from the whole call's rows (the variants its eager warm-up
    compiled), not from their own: 2 x 100 rows of a 200-row call launch with PDL, 2 x 50 of 100 without."""
    cfg = DEFAULT_CONFIG
    assert rp._part_config(cfg, 200) == cfg.replace(pdl_min_rows=0)
    assert rp._part_config(cfg, 100) == cfg.replace(pdl=0)
    assert rp._part_config(cfg.replace(pdl=0), 200) == cfg.replace(pdl=0)
    assert pdl_args(cfg, shapes_for(200, 4096, cfg), torch.device("cpu")) == {"PDL": pdl.OFF}


def test_top_k_on_long_rows_takes_pdl_from_fewer_rows():
    """op_config: top-k (alone or with top-p) on rows of more than 32768 entries takes PDL from
    top_k_pdl_min_rows (64) rows, every other op, shorter rows and other batch sizes keep the config;
    the call plan is keyed on (and its row parts launch from) that config. On an sm_90+ GPU a 64-row
    top-k call's recorded launches carry the PDL attribute after the first."""
    cfg = DEFAULT_CONFIG.replace(pdl=1, pdl_min_rows=128, top_k_pdl_min_rows=64)
    long, short = 163840, 32000
    for op in ("top_k", "top_k_top_p"):
        for rows in (64, 100, 127):
            got = op_config(cfg, op, rows, long)
            assert got == cfg.replace(pdl_min_rows=64) and got is op_config(cfg, op, rows, long)  # one object
            assert rp._part_config(got, rows) == cfg.replace(pdl_min_rows=0)  # the parts launch with PDL too
        for rows, vocab in ((63, long), (128, long), (1024, long), (64, short), (100, 32768)):
            assert op_config(cfg, op, rows, vocab) is cfg, (op, rows, vocab)
        assert op_config(cfg.replace(pdl=0), op, 64, long).pdl_min_rows == 128
        assert op_config(cfg.replace(top_k_pdl_min_rows=0), op, 64, long).pdl_min_rows == 128
    for op in ("top_p", "min_p"):
        assert op_config(cfg, op, 64, long) is cfg
    assert op_config(cfg, "top_k", 64, 32769) == cfg.replace(pdl_min_rows=64)
    assert op_config(cfg, "target_probs", 64, long) is cfg  # the fused logits -> target probs op keeps it too
    if DEVICE == "cpu":
        return
    dev = torch.device(DEVICE, torch.cuda.current_device())
    if not pdl.supported(dev):
        pytest.skip("GPU before sm_90: no programmatic dependent launch")
    x = mixed_batch(64, long)
    rp.clear_plans()
    want = rp._run_op("top_k", x, 40, None, cfg.replace(pdl=0), None, None)
    for _ in range(3):
        assert torch.equal(rp.run("top_k", x, 40, None, cfg).view(torch.int32), want.view(torch.int32))
    (key, plan), = rp.plans()
    assert cfg.replace(pdl_min_rows=64) in key and plan.state == "on", plan.refusal
    attrs = [bool(getattr(d.compiled.metadata, "launch_pdl", False)) for d in plan.direct.launches]
    assert attrs == [False, True, True], attrs


@pytest.mark.slow
@pytest.mark.parametrize("op", rp.OPS)
def test_pdl_same_bits(op):
    """Every op, scalar and per-row parameters, with and without the fingerprint slot: pdl=1 gives
    the plain launches' bits (CPU: the option is accepted and changes nothing); pdl=2 is refused."""
    vocab = 163840 if DEVICE == "cuda" else 700
    rows = 24 if DEVICE == "cuda" else 5
    cfg = (DEFAULT_CONFIG if DEVICE == "cuda" else SMALL).replace(graph_row_split=1, pdl=0)
    x = mixed_batch(rows, vocab)
    k = 40 if op in ("top_k", "top_k_top_p") else None
    # per-row k (some >= vocab: top-k + top-p's bracket passes) and p
    k_rows = None if k is None else torch.tensor([40, 3, vocab, 1000] * (rows // 4) + [40] * (rows % 4),
                                                 dtype=torch.int32, device=DEVICE)
    p = {"top_p": 0.9, "top_k_top_p": 0.9, "min_p": 0.05}.get(op)
    p_rows = None if p is None else torch.rand(rows, device=DEVICE) * 0.5 + (0.45 if op != "min_p" else 0.0)
    for kk, pp in ((k, p), (k_rows, p_rows)):
        want = rp._run_op(op, x, kk, pp, cfg, None, None)
        slot_want = torch.zeros((), dtype=torch.int64, device=DEVICE)
        rp._run_op(op, x, kk, pp, cfg, slot_want, None)
        on = cfg.replace(pdl=1, pdl_min_rows=1)
        rp.clear_plans()
        # plans: Triton's launches, then recorded direct launches (CUDA); on CPU a plan stays off and
        # its second call (the plan's workspace reused) is the path of every later one
        for i in range(3 if DEVICE == "cuda" else 2):
            got = rp.run(op, x, kk, pp, on)
            slot = torch.zeros((), dtype=torch.int64, device=DEVICE)
            got_fp = rp.run(op, x, kk, pp, on, fingerprint_out=slot)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (op, i)
            assert torch.equal(got_fp.view(torch.int32), want.view(torch.int32)), (op, i)
            assert int(slot) == int(slot_want), (op, i)
        if DEVICE == "cuda":
            assert all(plan.state == "on" for _, plan in rp.plans()), [plan.refusal for _, plan in rp.plans()]
            for _, plan in rp.plans():  # the direct launches are PDL launches after the first
                attrs = [bool(getattr(dl.compiled.metadata, "launch_pdl", False)) for dl in plan.direct.launches]
                assert attrs[0] is False and all(attrs[1:]) and len(attrs) >= 3, (op, attrs)
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                rp.run(op, x, kk, pp, on)
                rp.run(op, x, kk, pp, on, fingerprint_out=torch.zeros((), dtype=torch.int64, device=DEVICE))
            torch.cuda.current_stream().wait_stream(side)
            slot = torch.zeros((), dtype=torch.int64, device=DEVICE)
            with torch.cuda.graph(graph):
                got = rp.run(op, x, kk, pp, on)
                got_fp = rp.run(op, x, kk, pp, on, fingerprint_out=slot)
            for _ in range(3):
                got.fill_(-1.0)
                got_fp.fill_(-1.0)
                slot.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), op
                assert torch.equal(got_fp.view(torch.int32), want.view(torch.int32)) and int(slot) == int(slot_want), op
        rp.clear_plans()
    with pytest.raises(ValueError, match="pdl must be 0 or 1"):
        rp.run(op, x, k, p, cfg.replace(pdl=2))




PDL_CHECK = Path(__file__).resolve().parent.parent / "gpu" / "pdl_check.py"  # a developer check, not shipped


def _pdl_check(*args: str) -> subprocess.CompletedProcess:
    """gpu/pdl_check.py in its own process (compiled kernels: no TRITON_INTERPRET)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(PDL_CHECK), *args], env=env,
                          capture_output=True, text=True, timeout=580)


def _load_pdl_check():
    """gpu/pdl_check.py as a module in this process (its rules and its refusal; it compiles nothing here)."""
    spec = importlib.util.spec_from_file_location("pdl_check", PDL_CHECK)
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    return pc


def test_pdl_check_rules():
    """The SASS rules on opcode lists: a dependent waits before any global memory instruction
    (the write pass: before any store, its parameters loaded after), signals, and is launched with the attribute; a first launch signals and does not wait."""
    pc = _load_pdl_check()

    dep, first = pdl.DEPENDENT, pdl.FIRST
    assert pc.check("k", dep, ["PREEXIT", "ACQBULK", "LDG.E", "STG.E"], True) == []
    assert pc.check("k", dep, ["PREEXIT", "LDG.E", "ACQBULK", "STG.E"], True)  # a load before the wait
    assert pc.check("k", dep, ["PREEXIT", "ACQBULK", "LDG.E"], False)  # no PDL attribute
    assert pc.check("k", dep, ["ACQBULK", "LDG.E"], True)  # no signal
    assert pc.check("k", first, ["PREEXIT", "LDG.E", "STG.E"], False) == []
    assert pc.check("k", first, ["ACQBULK", "PREEXIT"], False)
    write = ["PREEXIT"] + ["LDG.E.128"] * 8 + ["ACQBULK"] + ["LDG.E"] * 5 + ["STG.E.128"] * 8
    assert pc.check("_renorm_write_kernel", dep, write, True) == []
    assert pc.check("_renorm_write_kernel", dep, ["PREEXIT", "STG.E", "ACQBULK"] + ["LDG.E"] * 5, True)
    assert pc.check("_renorm_write_kernel", dep, ["PREEXIT", "LDG.E", "ACQBULK", "STG.E"], True)
    assert pc.check("k", dep, ["PREEXIT", "@ACQBULK", "LDG.E"], True)  # a predicated wait
    assert pc.check("k", dep, ["PREEXIT", "@BRA", "ACQBULK", "LDG.E"], True)  # a branch could skip the wait
    vec = ["PREEXIT", "LDG.E", "LDG.E.128", "ACQBULK"] + ["LDG.E"] * 5 + ["STG.E.128"]
    assert pc.check("_renorm_write_kernel", dep, vec, True)  # a 32-bit (parameter) load before the wait
    assert pc.is_memory("LDG.E.128") and pc.is_memory("@ATOMG.E.ADD") and pc.is_memory("UTMALDG.2D")
    assert not pc.is_memory("LDS.128") and not pc.is_memory("STS") and not pc.is_memory("REDUX.SUM")

    class K:  # a recorded launch: (kernel, args, kwargs)
        fn = pc.record_launches

    ok = [(K, (), {"PDL": first}), (K, (), {"PDL": dep, "launch_pdl": True}),
          (K, (), {"PDL": dep, "launch_pdl": True})]
    assert pc.check_sequence(ok) == []
    assert pc.check_sequence([(K, (), {"PDL": dep, "launch_pdl": True})] + ok[1:])  # a dependent first
    assert pc.check_sequence(ok[:1] + [(K, (), {"PDL": dep})])  # a dependent without the attribute


@pytest.mark.slow
def test_pdl_kernels_wait_before_memory(monkeypatch, capsys):
    """Every launch of every op (scalar and per-row parameters, with and without the fingerprint
    slot) under pdl=1, compiled for sm_90a by Triton's ptxas: the rules hold; and the
    check fails a compiled kernel that loads before its wait (its self-test, the run's first line)."""
    r = _pdl_check()
    assert r.returncode == 0 and "0 failing" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    first = r.stdout.splitlines()[0]
    assert first.startswith("self-test: ") and first.endswith("-> ok") and "'_load_then_wait': [\"global memory" in first
    assert "_bracket_select_kernel     PDL=1" in r.stdout and "_finalize_kernel" in r.stdout
    # under the interpreter it refuses in one line (its kernels would not be compiled)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _load_pdl_check().main([]) == 2
    err = capsys.readouterr().err
    assert "without TRITON_INTERPRET" in err and len(err.strip().splitlines()) == 1
