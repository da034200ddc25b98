#!/usr/bin/env bash
# The import contracts of pyproject.toml ([tool.importlinter]; docs/architecture.md says why each).
# grimp finds a package's modules by walking its folder, so it cannot see the package-dir mapping
# (tpguard.kernels -> kernels/, tpguard.hooks -> hooks/, tpguard.launch -> launch/). It reads a
# temporary tree instead: tpguard/ with a link to each of its entries plus kernels, hooks and
# launch linked in as subpackages, run from outside the repository so that this tree is the only
# tpguard found. Exit status: lint-imports' (0: every contract kept).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LINT="${LINT_IMPORTS:-$ROOT/.venv/bin/lint-imports}"
TREE="$(mktemp -d)"
trap 'rm -rf "$TREE"' EXIT
mkdir "$TREE/tpguard"
for entry in "$ROOT"/tpguard/*; do
  case "$(basename "$entry")" in __pycache__) continue ;; esac
  ln -s "$entry" "$TREE/tpguard/$(basename "$entry")"
done
for sub in kernels hooks launch; do
  ln -s "$ROOT/$sub" "$TREE/tpguard/$sub"
done
cd "$TREE"
PYTHONPATH="$TREE" "$LINT" "$ROOT/pyproject.toml" --no-cache --no-logo "$@"
