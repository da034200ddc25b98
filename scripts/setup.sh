#!/usr/bin/env bash
# Idempotent set-up of the repo-local virtual environment (.venv): torch, tpguard (editable,
# with test tools) and sglang 0.5.23 with the light modules its CPU code paths import.
# Re-runs are a no-op unless pyproject.toml or requirements/ changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp_of() { cat pyproject.toml requirements/*.txt 2>/dev/null | sha256sum | cut -c1-16; }
STAMP=".venv/.tpguard-setup-$(stamp_of)"
if [ -f "$STAMP" ]; then exit 0; fi
echo "tpguard: setting up .venv (first run takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip setuptools wheel >/dev/null
# sglang 0.5.23 pins torch 2.14.1 (it also brings Triton, which the kernel tests run under
# TRITON_INTERPRET=1 on the CPU).
$PIP install "torch==2.14.1"
$PIP install -e ".[dev]"
if [ -f requirements/sglang-cpu.txt ]; then
  $PIP install --no-deps "sglang==0.5.23"
  $PIP install -r requirements/sglang-cpu.txt
fi
rm -f .venv/.tpguard-setup-*
touch "$STAMP"
