"""Which sglang processes the plugin hooks: scheduler (TP worker) processes only.

Each kind of process is a fresh Python process that calls sglang 0.5.23's own entry function of
that process, with TPGUARD=on. Every entry function calls `load_plugins()` first thing, then fails
on the empty arguments given here (no model, no ports): the test reads whether sglang's plugin
loader ran and whether tpguard installed its hooks, right after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import sglang_zygote

if reason := sglang_zygote.missing():
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.slow  # sglang imported by a process of its own

PROBE = r"""
import json, os, sys
import sglang
from sglang.srt.managers.scheduler import run_scheduler_process
from sglang.srt.managers.data_parallel_controller import run_data_parallel_controller_process
from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

ENTRY = {
    "scheduler": lambda: run_scheduler_process(None, None, 0, 0, 0, None, None),
    "engine": lambda: sglang.Engine(model_path="/no/such/model"),  # offline Engine / HTTP server main
    "dp_controller": lambda: run_data_parallel_controller_process(None, None, None),
    "detokenizer": lambda: run_detokenizer_process(None, None),
}
for kind, entry in ENTRY.items():  # each kind in a process of its own, forked before load_plugins()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        error = None
        try:
            entry()
        except BaseException as e:  # the empty arguments: expected, after load_plugins()
            error = type(e).__name__
        import sglang.srt.plugins as plugins
        from tpguard.hooks import sglang_runtime
        os.write(write, json.dumps({"kind": kind, "loader_ran": plugins._plugins_loaded,
                                    "hooked": sglang_runtime.RUNTIME is not None,
                                    "scheduler_module": "sglang.srt.managers.scheduler" in sys.modules,
                                    "error": error}).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        print(f.read(), flush=True)
    os.waitpid(pid, 0)
os._exit(0)  # (printed and flushed: a normal exit would spend ~2.5 s collecting sglang's modules)
"""


@pytest.fixture(scope="module")
def kinds() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPGUARD", "SGLANG"))}
    env.update({**sglang_zygote.ZYGOTE_ENV, "TPGUARD": "on"})  # (CPU processes, as the zygote's)
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    found = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return {f["kind"]: f for f in found}


@pytest.mark.parametrize("kind,hooked", [("scheduler", True), ("engine", False), ("dp_controller", False),
                                         ("detokenizer", False)])
def test_only_scheduler_processes_are_hooked(kinds, kind, hooked):
    r = kinds[kind]
    assert r["loader_ran"] and r["error"], r  # sglang's own load_plugins() ran, then its set-up failed
    assert r["hooked"] is hooked, r
    assert r["scheduler_module"]  # every kind imports the scheduler module here: not the criterion
