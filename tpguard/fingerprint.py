"""Fingerprints: a 64-bit hash of a tensor's dtype, shape and bytes (trace format v1; definition
``tpguard.fp/2``, recorded in a trace header's ``versions.fingerprint``). The one public module
for them, on the host, on the device, and from a producer's write pass ("attached").

The definition and its numpy reference: `tpguard.kernels.fingerprint_reference`. CUDA tensors go
to the Triton kernels (`tpguard.kernels.fingerprint`), anything else to the reference; both give
the same bits.

* `fingerprint_tensor(t)`: a Python int in [0, 2**64) (waits for the device);
* `fingerprint_device(t)` / `fingerprint_rows_i64(t)` / `fingerprint_many(tensors)`: int64
  tensors carrying the uint64 bits on the tensors' device, nothing waits for them;
  `fingerprint_rows(t)`: the rows' as ``torch.uint64``;
* attached: a producer that writes a tensor may compute its fingerprint in the same pass
  (``fingerprint_out=``, the renorms' write pass): `call_with_fingerprint` attaches it to the
  result, `attached_fingerprint` gives it back while the tensor is unchanged, and the guards
  record it instead of reading the tensor again;
* `format_fp` / `parse_fp`: the trace's 16 hex digits; `fingerprint_bytes`: host bytes.
"""

from __future__ import annotations

import functools
import inspect

import torch
import xxhash

from tpguard.kernels.fingerprint_reference import (FORMAT_VERSION, M64, fingerprint_device_reference,
                                                   fingerprint_many_reference, fingerprint_reference,
                                                   fingerprint_rows_reference, to_signed, to_unsigned)

__all__ = ["FORMAT_VERSION", "accepts_fingerprint_out", "attach_fingerprint", "attached_fingerprint",
           "call_with_fingerprint", "fingerprint_bytes", "fingerprint_device", "fingerprint_many",
           "fingerprint_rows", "fingerprint_rows_i64", "fingerprint_tensor", "format_fp", "parse_fp", "to_signed",
           "to_unsigned"]


def format_fp(value: int) -> str:
    """Trace format: 16 lower-case hex digits."""
    return f"{int(value) & M64:016x}"


def parse_fp(text: str) -> int:
    if len(text) != 16:
        raise ValueError(f"fingerprint must be 16 hex digits, got {text!r}")
    return int(text, 16)


# --- host and device ---------------------------------------------------------------------------

def _use_kernel(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    from tpguard.kernels import fingerprint as fp_kernel

    return fp_kernel.available()


def fingerprint_rows_i64(t: torch.Tensor) -> torch.Tensor:
    """Row fingerprints as int64 bits, on ``t``'s device (no host sync on GPU)."""
    if _use_kernel(t):
        from tpguard.kernels.fingerprint import fingerprint_rows_triton

        return fingerprint_rows_triton(t)
    return fingerprint_rows_reference(t).to(t.device)


def fingerprint_rows(t: torch.Tensor) -> torch.Tensor:
    """uint64 [rows]: one fingerprint per row (``shape[0]`` rows), to name diverging requests."""
    return fingerprint_rows_i64(t).view(torch.uint64)


def fingerprint_device(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 tensor (uint64 bits) on ``t``'s device; on GPU nothing waits for it."""
    if _use_kernel(t):
        from tpguard.kernels.fingerprint import fingerprint_triton

        return fingerprint_triton(t)
    return fingerprint_device_reference(t)


def fingerprint_tensor(t: torch.Tensor) -> int:
    """64-bit fingerprint of dtype, shape and every byte, as a Python int in [0, 2**64)."""
    if _use_kernel(t):
        return to_unsigned(int(fingerprint_device(t).item()))
    return fingerprint_reference(t)


def fingerprint_many(tensors: list[torch.Tensor], *, out: torch.Tensor | None = None,
                     out_index: list[int] | None = None,
                     bump_index: int | None = None) -> torch.Tensor:
    """int64 [n] (uint64 bits): fingerprints of several tensors, on their (common) device.
    CUDA tensors go to the Triton kernels when available (a fixed number of launches:
    `tpguard.kernels.fingerprint.fingerprint_many_triton`); anything else to the numpy reference.
    With `out`: written to out[out_index[i]] (default i) and out[bump_index] += 1; returns out."""
    tensors = list(tensors)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fingerprint_many: expected torch.Tensor items, got {type(t).__name__}")
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"fingerprint_many: tensors must share one device, got "
                         f"{sorted({str(t.device) for t in tensors})}")
    if device.type == "cuda":
        from tpguard.config import interpreting
        from tpguard.kernels import fingerprint as fp_kernel

        if fp_kernel.available() and not interpreting():
            return fp_kernel.fingerprint_many_triton(tensors, out=out, out_index=out_index, bump_index=bump_index)
    values = fingerprint_many_reference(tensors).to(device)
    if out is None and out_index is None and bump_index is None:
        return values
    if out is None:
        raise ValueError("fingerprint_many: out_index / bump_index need `out`")
    idx = out_index if out_index is not None else list(range(len(tensors)))
    out.index_copy_(0, torch.tensor(idx, dtype=torch.long, device=out.device), values)
    if bump_index is not None:
        out[bump_index:bump_index + 1].add_(1)
    return out


def fingerprint_bytes(data: bytes) -> int:
    """Host bytes (generator states, configs): xxhash64."""
    return xxhash.xxh64_intdigest(data)


# --- attached: computed by the producer that wrote the tensor --------------------------------------

_FP_ATTR = "_tpguard_fingerprint"


def attach_fingerprint(t: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Mark `t` with its already computed fingerprint (a 1-element int64 device tensor, e.g.
    written by the renorm's write pass): `record(name, t)` then uses it instead of reading `t`
    again. Valid while `t` is not modified in place (checked by torch's version counter)."""
    if t.is_inference():  # no version counter to guard the value (SGLang may run under
        return t  # torch.inference_mode): the guard then fingerprints the tensor itself
    setattr(t, _FP_ATTR, (fp, t._version))
    return t


def attached_fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    """The fingerprint attached to `t` by `attach_fingerprint`, or None (none, or `t` changed
    in place since)."""
    got = getattr(t, _FP_ATTR, None)
    if got is None:
        return None
    try:
        if got[1] != t._version:
            return None
    except RuntimeError:  # an inference tensor: no version counter
        return None
    return got[0].reshape(())


@functools.lru_cache(maxsize=64)
def accepts_fingerprint_out(fn) -> bool:
    """Whether producer `fn` takes ``fingerprint_out=`` (a 1-element int64 tensor it fills with
    the fingerprint of the tensor it returns, e.g. the renorms' write pass)."""
    try:
        return "fingerprint_out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def call_with_fingerprint(fn, probs: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``fn(probs, *args, **kwargs)``; when `fn` accepts ``fingerprint_out=``, the result comes
    back with its fingerprint attached (`attach_fingerprint`), so that recording it reads
    nothing. Otherwise the plain call (the guard then fingerprints the result as usual)."""
    if not accepts_fingerprint_out(fn):
        return fn(probs, *args, **kwargs)
    slot = torch.empty((), dtype=torch.int64, device=probs.device)
    return attach_fingerprint(fn(probs, *args, fingerprint_out=slot, **kwargs), slot)
