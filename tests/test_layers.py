"""The layers you can check (docs/architecture.md): the import contracts of pyproject.toml, run by
scripts/lint-imports.sh, and the size of a module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("tpguard", "kernels", "hooks", "launch")
MAX_LINES = 700  # one concept per file: past this a module holds two


def test_import_contracts():
    lint = Path(sys.executable).with_name("lint-imports")
    if sys.version_info < (3, 11):
        pytest.skip("import-linter needs Python >= 3.11")
    if not lint.is_file() and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("import-linter is not installed in this Python (the GPU check's image): the repo's .venv has it")
    assert lint.is_file(), f"{lint} is missing: ./scripts/setup.sh installs it (the dev extra)"
    r = subprocess.run([str(ROOT / "scripts" / "lint-imports.sh")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LINT_IMPORTS": str(lint)})
    assert r.returncode == 0, f"import contracts broken (pyproject.toml [tool.importlinter]):\n{r.stdout}{r.stderr}"


def test_modules_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))}
    assert sizes, "no modules found"
    too_long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines (split them by concept): {too_long}"
