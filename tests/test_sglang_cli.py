"""`tpguard serve`, and the plugin's version/hook-point checks (no sglang import in this process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import sglang_zygote
from tpguard.hooks import sglang_compat, sglang_renorm

TPGUARD = [sys.executable, "-m", "tpguard.cli"]
PRINT_ENV = [sys.executable, "-c",
             "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
             "if k.startswith(('TPGUARD', 'SGLANG_PLUGINS'))}))"]


def run_cli(*args, env=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("TPGUARD")}
    base.update(env or {})
    return subprocess.run([*TPGUARD, *args], capture_output=True, text=True, env=base, timeout=60)


def test_serve_sets_the_environment_and_execs(tmp_path):
    p = run_cli("serve", "--mode", "audit", "--every", "4", "--on-divergence", "heal", "--renorm",
                "deterministic", "--trace-dir", str(tmp_path), "--", *PRINT_ENV,
                env={"SGLANG_PLUGINS": "other"})
    assert p.returncode == 0, p.stderr
    env = json.loads(p.stdout)
    assert env["TPGUARD"] == "audit" and env["TPGUARD_EVERY"] == "4"
    assert env["TPGUARD_ON_DIVERGENCE"] == "heal" and env["TPGUARD_RENORM"] == "deterministic"
    assert env["TPGUARD_TRACE_DIR"] == str(tmp_path) and env["TPGUARD_RUN_ID"]
    assert env["SGLANG_PLUGINS"] == "other,tpguard"  # a whitelist must not drop the plugin


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--mode", "bogus", "--", "true"], "TPGUARD must be one of off|on|audit"),
    (["--on-divergence", "explode", "--", "true"], "TPGUARD_ON_DIVERGENCE must be one of"),
    ([], "no command given"),
    (["--", "no-such-command-here"], "command not found"),
])
def test_serve_bad_input_is_one_line(args, message):
    p = run_cli("serve", *args)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_version_problem_is_a_clear_message():
    assert sglang_compat.version_problem("0.5.23") is None
    assert "0.5.22 is not a supported version" in sglang_compat.version_problem("0.5.22")
    assert "not installed" in sglang_compat.version_problem(None)


def test_changed_or_missing_hook_point_is_reported():
    moved = sglang_compat.check_point(sglang_compat.HookPoint("x", "tpguard.hooks.no_such_module.fn"))
    assert not moved.found and "no_such_module" in moved.problem
    changed = sglang_compat.check_point(
        sglang_compat.HookPoint("y", "tpguard.hooks.sglang_renorm.make_renorm", ("kind", "no_such_arg")))
    assert not changed.found and "signature changed" in changed.problem and "no_such_arg" in changed.problem
    ok = sglang_compat.check_point(sglang_compat.HookPoint("z", "tpguard.hooks.sglang_renorm.make_renorm", ("kind",)))
    assert ok.found


@pytest.mark.parametrize("backend", ["tpguard", "torch"])
def test_routed_renorms_are_deterministic_and_renormalised(backend):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 500, generator=g), dim=-1)
    top_k = sglang_renorm.make_renorm("top_k", backend)
    top_p = sglang_renorm.make_renorm("top_p", backend)
    ks, ps = torch.tensor([1, 5, 40, 500, 3, 7], dtype=torch.int32), torch.full((6,), 0.8)
    a, b = top_k(probs, ks), top_k(probs.clone(), ks)
    assert torch.equal(a, b) and torch.allclose(a.sum(-1), torch.ones(6))
    assert ((a > 0).sum(-1) >= ks.clamp(max=500)).all()
    c = top_p(probs, ps)
    assert torch.equal(c, top_p(probs.clone(), ps)) and torch.allclose(c.sum(-1), torch.ones(6))


def test_torch_fallback_matches_tpguard_reference():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(4, 300, generator=g) * 2, dim=-1)
    ks, ps = torch.tensor([3, 30, 300, 1], dtype=torch.int32), torch.tensor([0.5, 0.9, 0.99, 0.1])
    for kind, param in (("top_k", ks), ("top_p", ps)):
        ref = sglang_renorm.make_renorm(kind, "tpguard")(probs, param)
        fallback = sglang_renorm.make_renorm(kind, "torch")(probs, param)
        assert torch.equal(ref > 0, fallback > 0), kind
        torch.testing.assert_close(ref, fallback, rtol=1e-6, atol=1e-7)


def test_redrawn_coins_equal_the_coins_drawn():
    """The plugin records a verify step's coins by redrawing them from a copy of the generator."""
    from tpguard.hooks.sglang_sites import snapshot_generator

    torch.manual_seed(123)
    g = snapshot_generator(torch.device("cpu"))
    drawn = (torch.rand((4, 5), dtype=torch.float32), torch.rand((4,), dtype=torch.float32))
    redrawn = (torch.rand((4, 5), dtype=torch.float32, generator=g), torch.rand((4,), dtype=torch.float32, generator=g))
    assert all(torch.equal(a, b) for a, b in zip(drawn, redrawn))


@pytest.mark.slow
@pytest.mark.skipif(sglang_zygote.missing() is not None, reason=str(sglang_zygote.missing()))
def test_doctor_json_is_one_object():
    cpu = {"CUDA_VISIBLE_DEVICES": ""}  # sglang's CPU paths, as in the other sglang tests
    r = run_cli("doctor", "--json", env=cpu)
    report = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr
    assert report["versions"]["sglang"] == "0.5.23"
    assert all(h["found"] or h["unavailable"] for h in report["hooks"])  # UNO needs flashinfer (GPU)
    # (a bad TPGUARD_* variable, exit 2 with the full report: test_sglang_plugin.py, in its zygote)
