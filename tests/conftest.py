"""Test session set-up: Triton's CPU interpreter unless the environment says otherwise.

Triton picks the interpreter when it decorates a kernel (at import), so this runs before any test
module is collected. gpu/check.sh exports TRITON_INTERPRET=0 for its GPU runs: then the kernels
compile for CUDA and the interpreter-only tests skip."""

import os


def pytest_configure(config):
    os.environ.setdefault("TRITON_INTERPRET", "1")
