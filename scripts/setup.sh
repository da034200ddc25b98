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
# --no-cache-dir: a pip cache would hold a second copy of every wheel on a small CI disk.
PIP=".venv/bin/python -m pip --disable-pip-version-check -q --no-cache-dir"
$PIP install --upgrade pip setuptools wheel >/dev/null
# CPU build of torch (about 0.2 GB, from the machine's /opt/wheels where it lies) plus Triton for
# the kernel tests under TRITON_INTERPRET=1. sglang 0.5.23 pins torch 2.14.1, a CUDA build of
# several GB on PyPI that filled CI's disk; its CPU code paths run on 2.13 (sglang goes in with
# --no-deps below), so CI does not need the CUDA build.
$PIP install --find-links /opt/wheels "torch==2.13.0"
$PIP install "triton==3.8.0"
$PIP install -e ".[dev]"
if [ -f requirements/sglang-cpu.txt ]; then
  $PIP install -r requirements/sglang-cpu.txt
  $PIP install --no-deps "sglang==0.5.23"  # last: pip would list every GPU package it pins
  # sglang imports torchvision.transforms at module level (its multimodal configs, reached from
  # schedule_batch). PyPI's torchvision links CUDA torch's libraries, so beside the CPU build its C
  # ops do not load; its pure-Python parts (all sglang's CPU paths use) do, once the two meta
  # registrations it makes unconditionally get the same "ops loaded?" guard as the others.
  $PIP install --no-deps "torchvision==0.28.0"
  TV=$(.venv/bin/python -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')
  sed -i 's/^@torch.library.register_fake("torchvision::\([a-z_]*\)")/@register_meta("\1")/' \
    "$TV/_meta_registrations.py"
  .venv/bin/python -W ignore -c "import torchvision.transforms" \
    || { echo "tpguard: torchvision does not import beside this torch" >&2; exit 1; }
fi
rm -f .venv/.tpguard-setup-*
touch "$STAMP"
