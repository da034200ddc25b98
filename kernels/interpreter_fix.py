"""Two faults of Triton's CPU interpreter that `install()` mends; the patched functions run only
under the interpreter (``TRITON_INTERPRET=1``): compiled kernels never call them.

* Triton < 3.8 under NumPy >= 2.4: the interpreter turns a scalar (a 1-element array) into a loop
  bound with ``int(data)``, which NumPy >= 2.4 rejects, so no kernel with a runtime loop bound runs.
  Re-installed with ``.squeeze()``, as Triton 3.8 does.
* Casts between bfloat16 and float32 (Triton 3.6-3.8): the interpreter's bit-level conversion maps
  a subnormal to a wrong value (bfloat16 2.76e-40 -> float32 5.88e-39, 7.3e-40 -> 0), where the
  GPU's conversions are exact (bfloat16 -> float32) and round to nearest even (float32 ->
  bfloat16). Replaced by those two conversions, done on the bits, when a probe shows the fault.
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
    """Patch Triton's interpreter where it needs it (idempotent). Called where the fingerprint's
    building blocks are defined (kernels/fingerprint_hash.py), which every kernel with a runtime
    loop bound imports, and by the renorms' shared passes (kernels/renorm_passes.py)."""
    if triton is None:
        return
    _install_bf16_casts()
    if triton_version() >= (3, 8):
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


def _bf16_to_f32(bits16):
    import numpy as np

    return (bits16.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values):
    import numpy as np

    b = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    r = ((b.astype(np.uint64) + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0) | ((b >> 16) & 0x8000).astype(np.uint16), r)


def _install_bf16_casts() -> None:
    import numpy as np
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    convert = getattr(interpreter, "_convert_float", None)
    if builder is None or convert is None or getattr(builder.cast_impl, "tpguard_bf16_fix", False):
        return
    import triton.language as tl

    probe = np.array([0x0001, 0x3F80], dtype=np.uint16)  # the smallest subnormal, 1.0
    try:
        if np.array_equal(convert(probe, tl.bfloat16, tl.float32, None).view(np.float32), _bf16_to_f32(probe)):
            return  # this interpreter converts right
    except Exception:  # noqa: BLE001 - another interpreter: leave it as it is
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == tl.bfloat16 and d == tl.float32:
            return interpreter.TensorHandle(_bf16_to_f32(np.asarray(src.data, dtype=np.uint16)), d)
        if s == tl.float32 and d == tl.bfloat16:
            return interpreter.TensorHandle(_f32_to_bf16(src.data), d)
        return original(self, src, dst_type)

    cast_impl.tpguard_bf16_fix = True
    builder.cast_impl = cast_impl
