#!/usr/bin/env bash
# All tests (CPU: gloo process groups, Triton under the interpreter, real sglang 0.5.23), one
# pytest-xdist worker per core (PYTEST_XDIST_AUTO_NUM_WORKERS=N for another number). Arguments go
# to pytest: `./scripts/test.sh -m "not slow"` is the inner loop's subset.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -q -n logical tests "$@"
