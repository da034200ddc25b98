"""Optional dependencies (extras `dump`, `metrics`): without them, one line and the rest works.

"Not installed" is made real for one subprocess: a directory first on PYTHONPATH holds a module of
that name whose import fails as a missing package's would.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _hide(tmp_path, *modules):
    d = tmp_path / "hidden"
    d.mkdir(exist_ok=True)
    for m in modules:
        (d / f"{m}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{m}'\", name='{m}')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]))
    return env


def test_replay_without_safetensors_is_one_line(tmp_path):
    env = _hide(tmp_path, "safetensors")
    r = subprocess.run([sys.executable, "-m", "tpguard", "replay", str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "tpguard replay: dumps need safetensors, which is not installed: pip install 'tpguard[dump]'"]


def test_guard_without_prometheus_client_runs_and_says_so(tmp_path):
    env = _hide(tmp_path, "prometheus_client")
    code = ("import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
            "from tpguard.guard import StepGuard\n"
            "g = StepGuard(None, metrics=True, quantities=('rng_state', 'out_tokens'))\n"
            "for s in range(3):\n"
            "    g.record('out_tokens', torch.arange(4)); g.check()\n"
            "print('checked', g.stats['checked'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "checked 3" in r.stdout, r.stderr
    lines = [x for x in r.stderr.splitlines() if "prometheus_client" in x]
    assert len(lines) == 1 and "pip install 'tpguard[metrics]'" in lines[0]


@pytest.mark.parametrize("module", ["safetensors", "prometheus_client"])
def test_core_imports_without_the_extra(tmp_path, module):
    env = _hide(tmp_path, module)
    r = subprocess.run([sys.executable, "-c", "import tpguard.guard, tpguard.diagnose, tpguard.cli, tpguard.dump"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
