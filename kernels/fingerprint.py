"""GPU fast path of tpguard fingerprints (Triton): the launchers' front door.

Reference: `tpguard.kernels.fingerprint_reference` (numpy: `fingerprint_rows_reference`,
`combine_rows_reference`); its docstring holds the definition. Everything here is bit-identical
to it, whatever the config. The public API (CUDA tensors here, anything else to the reference)
is `tpguard.fingerprint`.

Launchers: `fingerprint_rows_triton` / `fingerprint_triton` (one tensor) and
`fingerprint_many_triton` / `ManyPlan` (many tensors in a fixed number of launches). One read pass
over the data, no host sync. By concept:

* fingerprint_config.py: `KernelConfig`, `default_config()` (``TPGUARD_FP_CONFIG``), `SINGLE_TENSOR_CONFIG`;
* fingerprint_words.py: a tensor as rows of words (no copy) and the tiles the kernels walk;
* fingerprint_hash.py: the hash's Triton building blocks (word hash, lane sums, row and top hash);
* fingerprint_lanes.py: one tensor's lane kernel and its launches (`_hash_words`);
* fingerprint_tma.py: the one-tensor lane launch read through Hopper TMA (`KernelConfig.lane_tma`);
* fingerprint_finalize.py: partial lane sums -> row fingerprints (+ the top hash);
* fingerprint_segments.py: many tensors' segment table and its kernels;
* fingerprint_plan.py: many tensors' launch plan (`ManyPlan`) and plan cache;
* direct_launch.py: the plans' recorded launches (`OutLaunch`) and their one check against Triton's.
* interpreter_fix.py: two faults of Triton's CPU interpreter (installed by fingerprint_hash.py and
  renorm_passes.py).

Measured on an H200 the loop is bound by loads in flight, not by issue: the one-tensor default
`SINGLE_TENSOR_CONFIG` reads 256 x 163840 fp32 in 45.8-47.2 us through TMA (48.4-48.9 with ldg
loads in the same processes), `torch.sum` in ~46. `tpguard.bench.fingerprint` measures it
(docs/design-fingerprint.md).

CUDA graphs: launchers allocate outputs and scratch with ``torch.empty`` on the current stream,
never read data on the host and have no data-dependent shapes, so they can be captured. Callers
preallocate nothing, but must (1) call each launcher once before capture with the same shapes and
dtypes (Triton compiles on first use) and (2) for ``fingerprint_many_triton``, warm up with the
same tensors (same addresses) or hold a `ManyPlan` built outside capture (its segment table is
copied to the device once, when the plan is built).
"""

from __future__ import annotations

import torch

from tpguard.config import interpreting
from tpguard.kernels import fingerprint_reference as ref
from tpguard.kernels.direct_launch import device_guard
from tpguard.kernels.fingerprint_config import (SHIFT_ALL, SHIFT_H13, SHIFT_H16, SINGLE_TENSOR_CONFIG, KernelConfig,
                                                default_config)
from tpguard.kernels.fingerprint_lanes import _hash_row_fingerprints, _hash_words
from tpguard.kernels.fingerprint_plan import ManyPlan, clear_plans, fingerprint_many_triton
from tpguard.kernels.fingerprint_words import _check_tensor, _words

try:
    import triton
except ImportError:  # CPU-only install: available() is False and nothing is launched
    triton = None


def available() -> bool:
    """Triton importable and usable: CUDA present, or the Triton CPU interpreter is on."""
    if triton is None:
        return False
    return interpreting() or torch.cuda.is_available()


def fingerprint_rows_triton(t: torch.Tensor, *, config: KernelConfig | None = None) -> torch.Tensor:
    """int64 [rows] (uint64 bits) on t's device, equal to `fingerprint_rows_reference(t)`.
    1 launch (rows of <= chunk_words words) or 2."""
    t = _check_tensor(t, "fingerprint_rows")
    cfg = config or SINGLE_TENSOR_CONFIG
    w = _words(t)
    with device_guard(t.device):
        rows_out, _ = _hash_words(w, ref.row_seed(t.dtype, tuple(t.shape)), None, cfg)
    return rows_out


def fingerprint_triton(t: torch.Tensor, *, config: KernelConfig | None = None) -> torch.Tensor:
    """0-d int64 (uint64 bits) on t's device, equal to the reference `fingerprint_reference(t)`.
    1 launch (small tensors), 2 (rows up to finalize_rows), at most 4 (more rows)."""
    t = _check_tensor(t, "fingerprint")
    cfg = config or SINGLE_TENSOR_CONFIG
    w = _words(t)
    top_seed = ref.top_seed(t.dtype, tuple(t.shape))
    if w.rows == 0:  # no data: a constant of dtype and shape (one fill, no sync)
        return torch.full((), ref.empty_hash(top_seed), dtype=torch.int64, device=t.device)
    with device_guard(t.device):
        rows_out, top = _hash_words(w, ref.row_seed(t.dtype, tuple(t.shape)), top_seed, cfg)
        if top is None:  # too many rows to fuse
            top = _hash_row_fingerprints(rows_out, top_seed, cfg)
    return top.view(())


def fingerprint_on_device(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 (uint64 bits) on t's device, whatever the device: `fingerprint_triton` for a CUDA
    tensor, else the reference computed on the host. For kernels that owe a fingerprint outside a
    write pass (the renorms' ``fingerprint_out=`` on their torch paths); the public door is
    `tpguard.fingerprint.fingerprint_device`, which kernels/ does not import."""
    if t.device.type == "cuda" and available():
        return fingerprint_triton(t)
    return ref.fingerprint_device_reference(t)


__all__ = ["SHIFT_ALL", "SHIFT_H13", "SHIFT_H16", "SINGLE_TENSOR_CONFIG", "KernelConfig", "ManyPlan", "available",
           "clear_plans", "default_config", "fingerprint_many_triton", "fingerprint_on_device",
           "fingerprint_rows_triton", "fingerprint_triton"]
