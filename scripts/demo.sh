#!/usr/bin/env bash
# The main job: the TP=2 harness on CPU with a divergence, its diagnosis, and the two fixes.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/tpguard demo "$@"
