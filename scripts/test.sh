#!/usr/bin/env bash
# All tests (CPU: gloo process groups, Triton under the interpreter, real sglang 0.5.23).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
