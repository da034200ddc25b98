"""Programmatic dependent launch (PDL, Hopper and later) for kernels that run back to back.

A launch made with the PDL attribute may start while the launch before it on the stream is still
running: its CTAs are scheduled once every CTA of the earlier grid has signalled
(``griddepcontrol.launch_dependents``) or exited, and ``griddepcontrol.wait`` blocks until the
earlier grid has finished and its writes are visible. The kernels here signal at their start and
wait before they touch anything an earlier launch wrote, so the next kernel's CTAs are already
resident (and may have loaded the call's input) when the one before ends: no launch gap. Used by
the renorm passes (`RenormConfig.pdl`; the fingerprint's finalize when it follows the fused write).

Rules that keep it exact:
* The first launch of a call is a plain one: it starts after the caller's work has finished (a
  PDL launch could start before the kernel that wrote its input).
* A PDL kernel waits before reading or writing any buffer an earlier launch of the call touches;
  only the call's input (never written by the call) may be loaded before the wait.
* The wait covers the chain: a kernel finishes only after its own wait, so waiting on the launch
  before implies every earlier one has finished.
Never under the Triton interpreter (no grid dependency control there) nor on GPUs before sm_90
(`supported`): the kernels then compile without it and launch plainly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tpguard.config import interpreting


# the kernels' PDL constexpr: OFF; DEPENDENT (signal at the start, wait); FIRST (signal at the start, no
# wait: a call's first, plain launch)
OFF, DEPENDENT, FIRST = 0, 1, 2


def enabled(flag) -> bool:
    """PDL for a config flag (never under the interpreter)."""
    return bool(flag) and not interpreting()


# Triton's grid dependency control (tl.extra.cuda.gdc_wait and the launch_pdl option): Triton 3.4 and later
_TRITON_GDC = hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    try:
        return torch.cuda.get_device_capability(index)[0] >= 9  # griddepcontrol: sm_90 and later
    except Exception:  # noqa: BLE001 - no usable CUDA device: plain launches
        return False


def supported(device: torch.device) -> bool:
    """The device has grid dependency control: NVIDIA sm_90+ with Triton >= 3.4 (not under the
    interpreter, not on ROCm)."""
    if device.type != "cuda" or interpreting() or torch.version.hip or not _TRITON_GDC:
        return False
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
    except Exception:  # noqa: BLE001
        return False
    return _supported(index)


def first(flag) -> int:
    """PDL constexpr of a call's first launch (a plain launch that signals its dependent)."""
    return FIRST if enabled(flag) else OFF


def dependent(flag) -> int:
    """PDL constexpr of a call's later launches (launched with `launch_options`: they wait)."""
    return DEPENDENT if enabled(flag) else OFF


def launch_options(flag) -> dict:
    """Launch options of a dependent (second or later) launch: the PDL attribute when enabled."""
    return {"launch_pdl": True} if enabled(flag) else {}


@triton.jit
def pdl_signal(PDL: tl.constexpr):
    """Let the next launch's CTAs be scheduled once every CTA of this grid has got here (a no-op
    unless the next launch has the PDL attribute)."""
    if (PDL == 1) or (PDL == 2):
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """DEPENDENT: wait until the launch before has finished and its writes are visible."""
    if PDL == 1:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first step: signal, then (DEPENDENT) wait. Nothing when OFF."""
    pdl_signal(PDL)
    pdl_wait(PDL)


__all__ = ["DEPENDENT", "FIRST", "OFF", "dependent", "enabled", "first", "launch_options",
           "pdl_enter", "pdl_signal", "pdl_wait", "supported"]
