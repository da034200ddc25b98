"""Shared set-up of a test run: the Triton interpreter where there is no CUDA (triton_interpreter.py
makes it faster); under pytest-xdist, a module's tests on one worker, torch's threads shared
between the workers and the modules with the most slow tests handed out first; no final garbage
collection when a process ends.

Triton picks the interpreter when a kernel is decorated (`@triton.jit` reads TRITON_INTERPRET), and
tpguard's kernel modules read it at import (tpguard.config.interpreting()): so it is set here,
before any test module is imported, for the whole process. Without CUDA the kernels run under the
interpreter on CPU tensors; with CUDA and TRITON_INTERPRET unset (or 0) they are compiled, the
kernel tests run on the GPU and the tests that need the interpreter on CPU tensors skip, saying so.
An explicit TRITON_INTERPRET is left as it is. The tests' helper modules (multiproc, renorm_setup,
sglang_zygote) are on sys.path through pyproject's `pythonpath`.
"""

from __future__ import annotations

import gc
import os
from collections import Counter

import pytest
import torch

import triton_interpreter


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    # with -n and no --dist: a module's tests on one worker (--dist loadfile), so that its module
    # fixtures (the sglang zygote, the replay runs) are made once (pytest-xdist's own default, load,
    # would make them on every worker)
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadfile"


def pytest_configure(config):
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("TRITON_INTERPRET") == "1":
        triton_interpreter.speed_up()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in pytest-xdist's workers
    if workers > 1:  # the cores are shared between the workers, torch's threads too
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    # xdist hands out whole modules (--dist loadfile) in collection order: the longest first, so that
    # the run does not end on one long module while the other workers wait (a module's slow tests
    # stand for its length; within a module the order stays)
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(scope="session")
def shared_zygote():
    """The sglang zygote this worker's sglang test files share, started at the first call (importing
    sglang takes ~10 s: once per worker, not once per file). Call it, then `.load(__file__, PLAIN)`."""
    import sglang_zygote as sz

    started = []

    def get():
        if not started:
            started.append(sz.SharedZygote())
        return started[0]

    yield get
    for z in started:
        z.close()


def pytest_unconfigure(config):
    # the process ends next: its objects need no collecting (with torch, Triton and sglang loaded,
    # the interpreter's final collection takes about 3 s of each worker's end)
    gc.freeze()
