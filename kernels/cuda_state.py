"""The current CUDA device, stream and capture state through torch's C calls (no Triton import).

torch.cuda.current_device() and is_current_stream_capturing() check lazy initialisation in Python,
~1 us each, several times per eager renorm call; the C calls below skip that (CUDA is initialised:
a tensor of the call is on it). The direct launches (direct_launch.py) and the plan lanes
(renorm_lane.py) read them.
"""

from __future__ import annotations

import torch

_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def current_device() -> int:
    """The current CUDA device's index."""
    return _GET_DEVICE() if _GET_DEVICE is not None else torch.cuda.current_device()


def current_stream() -> int:
    """The current stream of the current device, as the launcher takes it (a raw handle)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(current_device())
    return torch.cuda.current_stream().cuda_stream


def capturing() -> bool:
    """The current stream is capturing a CUDA graph."""
    return bool(_CAPTURING()) if _CAPTURING is not None else torch.cuda.is_current_stream_capturing()


__all__ = ["capturing", "current_device", "current_stream"]
