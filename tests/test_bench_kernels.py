"""`tpguard bench kernels --grid` and `--configs` (tpguard/bench/kernels.py): their argument handling,
and their tables built end to end on CPU under the Triton interpreter. Timing needs a GPU, so here the timer is a
stand-in that runs each call once (the kernels really run) and returns a fixed number, and
flashinfer's place is taken by the drop-in (kernels/flashinfer_api.py), which has its names."""

from __future__ import annotations

import pytest
import torch
from renorm_setup import DEVICE

from tpguard.bench import kernels as bench


def bench_options(monkeypatch, *args) -> dict:
    """What `tpguard bench kernels ARGS` hands the benchmark (running it needs a GPU)."""
    from tpguard.cli import main as cli_main

    got = {}
    monkeypatch.setattr(bench, "main", lambda **opts: got.update(opts) or 0)
    assert cli_main(["bench", "kernels", *args]) == 0
    return got


def test_grid_arguments(monkeypatch):
    a = bench_options(monkeypatch, "--grid")
    assert a["grid"] and a["grid_rows"] == (1, 8, 64, 256, 1024) and a["vocabs"] == (32000, 128256, 163840, 262144)
    assert a["dtypes"] == ("fp32", "bf16") and a["logits"] == ("flat", "peaky") and a["repeats"] == 10
    a = bench_options(monkeypatch, "--grid", "--vocabs", "163840", "--dtypes", "fp32", "--grid-rows", "256",
                      "--no-fused")
    assert a["vocabs"] == (163840,) and a["dtypes"] == ("fp32",) and a["grid_rows"] == (256,) and not a["fused"]
    a = bench_options(monkeypatch, "--grid", "--ops", "top_k")  # one clear line, not ignored
    assert bench.bad_argument(a) == "--ops does not apply to --grid (it times top_p, top_k and top_k_top_p)"
    a = bench_options(monkeypatch, "--quick")
    assert "grid" not in a and (a["iters"], a["repeats"], a["vocabs"]) == (10, 20, (128256, 163840))
    assert a["impls"] == bench.IMPLS and a["ops"] == bench.OPS


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU stand-in of the timer; on a GPU run the bench itself")
def test_grid_tables_on_cpu(monkeypatch, capsys):
    from tpguard.kernels import flashinfer_api

    calls = {"n": 0}

    def one_call(fn, iters, rounds=3, warmup=2):
        fn()
        calls["n"] += 1
        return 100.0 + calls["n"]  # tpguard's cell is timed first: "faster" in every cell

    monkeypatch.setattr(bench, "time_batched", one_call)
    monkeypatch.setattr(bench, "flashinfer_sampling", lambda: flashinfer_api)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "cpu (interpreter)")
    rows = bench.grid(grid_rows=(2,), vocabs=(300,), logits=("flat",), dtypes=("fp32", "bf16"), iters=1,
                      repeats=2, device=DEVICE)
    out = capsys.readouterr().out
    assert "### renorms, fp32 probabilities" in out and "### renorms, bf16 probabilities" in out
    assert "| 2 | 300 | flat |" in out and "SLOWER" not in out
    assert "### logits -> target probs" in out and "| bf16 | 2 | 300 | flat |" in out
    assert "cells where tpguard is not faster than flashinfer's default: 0" in out
    renorm_rows = [r for r in rows if "top_p_tpguard_us" in r]
    assert len(renorm_rows) == 2 and all(r["top_k_differ"] == (0, 0) for r in renorm_rows)
    assert calls["n"] == 2 * (3 * 2 + 3)  # per dtype: 3 ops x 2 implementations, 3 target-probs paths


def test_configs_arguments_and_bad_overrides(monkeypatch, capsys):
    a = bench_options(monkeypatch, "--configs", "|tau_groups_short=0", "--grid-rows", "1,64")
    assert a["configs"] == ["", "tau_groups_short=0"] and a["grid_rows"] == (1, 64) and a["vocabs"] == (32000,)
    assert a["ops"] == ("top_p",) and a["dtypes"] == ("fp32", "bf16") and "grid" not in a
    monkeypatch.undo()
    from tpguard.cli import main as cli_main

    for args, msg in ((("--configs", "tau_groups=x"), "--configs: tau_groups='x': expected int"),
                      (("--configs", "nope=1"), "--configs: unknown field 'nope'"),
                      (("--configs", "", "--dtypes", "fp8"), "unknown dtype 'fp8'"),
                      (("--configs", "", "--ops", "top_q"), "unknown op 'top_q'"),
                      (("--grid", "--dtypes", "fp8"), "unknown dtype 'fp8'"),  # every mode, with or without CUDA
                      (("--impls", "tpguard,nope"), "unknown implementation 'nope'"),
                      (("--configs", "|tps_split=2"), "tps_split must be 0 or 1, got 2"),  # a value
                      (("--configs", "bracket_bins=3"), "bracket_bins must be a power of two"),
                      (("--grid", "--grid-rows", "8,0"), "--grid-rows must be >= 1, got 0"),
                      (("--iters", "0"), "--iters must be >= 1, got 0"),
                      (("--configs", "", "--vocabs", "-5"), "--vocabs must be >= 1, got -5")):
        assert cli_main(["bench", "kernels", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU stand-in of the timer; on a GPU run the bench itself")
def test_config_table_on_cpu(monkeypatch, capsys):
    seen = []

    def one_call(fn, iters):
        seen.append(fn())
        return 10.0 + len(seen)

    monkeypatch.setattr(bench, "graph_or_none", one_call)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "cpu (interpreter)")
    rows = bench.config_table(["", "tau_groups=2,tau_groups_short=0"], grid_rows=(2,), vocabs=(300,),
                              logits=("peaky",), dtypes=("bf16",), ops=("top_p", "top_k"), iters=1, device=DEVICE)
    out = capsys.readouterr().out
    assert "| op | dtype | rows | vocab | logits | defaults | tau_groups=2,tau_groups_short=0 |" in out
    assert "| top_p | bf16 | 2 | 300 | peaky | 11.0 | 12.0 |" in out and "!" not in out.split("\n", 1)[1]
    assert [r["differ"] for r in rows] == [[False, False], [False, False]] and len(seen) == 4
