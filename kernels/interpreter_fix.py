"""Triton < 3.8's CPU interpreter under NumPy >= 2.4: kernels with a runtime loop bound.

That interpreter turns a scalar (a 1-element array) into a loop bound with ``int(data)``, which
NumPy >= 2.4 rejects, so no kernel with a runtime loop bound runs under it. `install()`
re-installs that conversion with ``.squeeze()``, as Triton 3.8 does. The patched function runs only
under the interpreter (``TRITON_INTERPRET=1``): compiled kernels never call it.
"""

from __future__ import annotations

import re

try:
    import triton
except ImportError:  # CPU-only install: nothing to fix
    triton = None


def triton_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def install() -> None:
    """Patch Triton's interpreter when it is older than 3.8 (idempotent). Called where the
    fingerprint's building blocks are defined (kernels/fingerprint_hash.py), which every kernel with
    such a loop imports."""
    if triton is None or triton_version() >= (3, 8):
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "tpguard_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.tpguard_index_fix = True
    interpreter._patch_lang_tensor = patched
