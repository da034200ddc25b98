"""The guard's on-device comparison of the gathered fingerprint vectors (one launch).

Input: the all-gathered int64 matrix [world, length] whose rows are
``[step, site id, present mask, fingerprint x Q, numel x Q, ...]`` (tpguard/guard.py). Output,
int64 [Q + 1]: 1 where quantity q was captured by at least two ranks with different values
(null values are never compared), and the OR of those last. Reference: `compare_gathered_torch`
below (also the CPU path).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install
    triton = None

# The vector's header words (step, site id, present mask): tpguard/guard.py's `_HDR`, with the
# layout (a kernel imports nothing above kernels/; tests/test_device_guard.py checks they agree).
HDR = 3


def compare_gathered_torch(gathered: torch.Tensor, q: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: per-quantity 'differs' flags and their OR, as int64 [q + 1]."""
    if out is None:
        out = torch.empty(q + 1, dtype=torch.int64, device=gathered.device)
    shifts = torch.arange(q, device=gathered.device, dtype=torch.int64)
    present = ((gathered[:, 2:3] >> shifts) & 1).bool()  # [W, Q]
    values = gathered[:, HDR:HDR + q]
    hi = torch.where(present, values, torch.iinfo(torch.int64).max).amin(0)
    lo = torch.where(present, values, torch.iinfo(torch.int64).min).amax(0)
    differs = (present.sum(0) >= 2) & (hi != lo)
    out[:q] = differs
    out[q] = differs.any()
    return out


if triton is not None:

    @triton.jit
    def _flags(g_ptr, W, L, Q, BW: tl.constexpr, BQ: tl.constexpr, H: tl.constexpr):
        r = tl.arange(0, BW)[:, None]
        c = tl.arange(0, BQ)[None, :]
        ok = (r < W) & (c < Q)
        mask = tl.load(g_ptr + r * L + 2, mask=r < W, other=0)
        present = ((mask >> c.to(tl.int64)) & 1) != 0
        present = present & ok
        vals = tl.load(g_ptr + r * L + H + c, mask=ok, other=0)
        big = tl.full(vals.shape, 9223372036854775807, tl.int64)
        small = tl.full(vals.shape, -9223372036854775807 - 1, tl.int64)
        hi = tl.min(tl.where(present, vals, big), axis=0)
        lo = tl.max(tl.where(present, vals, small), axis=0)
        cnt = tl.sum(present.to(tl.int32), axis=0)
        return ((cnt >= 2) & (hi != lo)).to(tl.int64)

    @triton.jit
    def _compare_kernel(g_ptr, out_ptr, W, L, Q, BW: tl.constexpr, BQ: tl.constexpr, H: tl.constexpr = 3):
        differs = _flags(g_ptr, W, L, Q, BW, BQ, H)
        cols = tl.arange(0, BQ)
        tl.store(out_ptr + cols, differs, mask=cols < Q)
        tl.store(out_ptr + Q, tl.max(differs, axis=0))

    @triton.jit
    def _compare_to_host_kernel(g_ptr, host_ptr, W, L, Q, C, BW: tl.constexpr, BQ: tl.constexpr,
                                BC: tl.constexpr, H: tl.constexpr = 3):
        """_compare_kernel writing the flags, and the first C columns of every gathered row, straight
        into host_ptr (pinned host memory, mapped) in the layout of [gathered, flags]: what the
        host reads, with no copy node after the comparison in a CUDA graph."""
        r = tl.arange(0, BW)[:, None]
        cc = tl.arange(0, BC)[None, :]
        keep = (r < W) & (cc < C)
        tl.store(host_ptr + r * L + cc, tl.load(g_ptr + r * L + cc, mask=keep, other=0), mask=keep)
        differs = _flags(g_ptr, W, L, Q, BW, BQ, H)
        cols = tl.arange(0, BQ)
        tl.store(host_ptr + W * L + cols, differs, mask=cols < Q)
        tl.store(host_ptr + W * L + Q, tl.max(differs, axis=0))


def compare_gathered(gathered: torch.Tensor, q: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [q + 1] flags on gathered's device: one Triton launch on CUDA, torch elsewhere."""
    if out is None:
        out = torch.empty(q + 1, dtype=torch.int64, device=gathered.device)
    global _kernel_failed
    if gathered.is_cuda and triton is not None and gathered.is_contiguous() and not _kernel_failed:
        w, length = gathered.shape
        try:
            _launch(gathered, out, w, length, q)
            return out
        except Exception as e:  # a Triton that cannot build it: the torch ops give the same flags
            _kernel_failed = True
            import logging

            logging.getLogger("tpguard").warning("guard_compare: Triton kernel unavailable (%s); using torch", e)
    return compare_gathered_torch(gathered, q, out)


def compare_gathered_to_host(gathered: torch.Tensor, q: int, host: torch.Tensor, cols: int) -> None:
    """The comparison written straight into `host` (pinned, laid out as [gathered, flags]); only
    the first `cols` columns of each gathered row are copied. One Triton launch; callers check
    `zero_copy_works(device)` first (outside capture)."""
    w, length = gathered.shape
    _compare_to_host_kernel[(1,)](gathered, host, w, length, q, cols, BW=max(2, triton.next_power_of_2(w)),
                                  BQ=max(2, triton.next_power_of_2(q)),
                                  BC=max(2, triton.next_power_of_2(cols)), H=HDR)


_ZERO_COPY: dict = {}  # device -> whether compare_gathered_to_host gave the copy path's bytes


def zero_copy_works(device: torch.device) -> bool:
    """Once per device, outside capture: the zero-copy comparison against compare_gathered + a
    copy, on a synthetic disagreement. False where Triton cannot write pinned host memory."""
    device = torch.device(device)
    if device.type != "cuda" or triton is None:
        return False
    if device not in _ZERO_COPY:
        ok = False
        try:
            w, q = 3, 11
            length = HDR + 2 * q + 5
            g = torch.arange(w * length, dtype=torch.int64, device=device).view(w, length)
            g[:, 2] = (1 << q) - 1
            g[:, HDR:HDR + q] = 7
            g[1, HDR + 4] = 8  # rank 1 differs in quantity 4
            want = torch.zeros(w * length + q + 1, dtype=torch.int64)
            want[: w * length] = g.reshape(-1).cpu()
            want[w * length:] = compare_gathered(g, q).cpu()
            host = torch.full((w * length + q + 1,), -1, dtype=torch.int64, pin_memory=True)
            compare_gathered_to_host(g, q, host, length)
            torch.cuda.synchronize(device)
            ok = torch.equal(host, want)
        except Exception as e:  # noqa: BLE001 - any failure: the copy path
            import logging

            logging.getLogger("tpguard").warning("guard_compare: zero-copy result unavailable (%s)", e)
        _ZERO_COPY[device] = ok
    return _ZERO_COPY[device]


_kernel_failed = False
_LAUNCHES: dict = {}  # (gathered address, shape, q, device) -> fixed launch (fast path)
_LAUNCHES_MAX = 64


def _launch(gathered: torch.Tensor, out: torch.Tensor, w: int, length: int, q: int) -> None:
    """The compare launch; through a recorded direct launcher (`OutLaunch`, kernels/direct_launch.py:
    host time) once it was checked against Triton's launch, else Triton's launch."""
    from tpguard.kernels import direct_launch
    from tpguard.kernels.direct_launch import OutLaunch, prepare_out_launches

    meta = dict(BW=max(2, triton.next_power_of_2(w)), BQ=max(2, triton.next_power_of_2(q)), H=HDR)
    if not direct_launch.enabled():
        _compare_kernel[(1,)](gathered, out, w, length, q, **meta)
        return
    key = (gathered.data_ptr(), w, length, q, gathered.device)
    launch = _LAUNCHES.get(key)
    if launch is not None:
        launch(out, fast=True)
        return
    launch = OutLaunch(_compare_kernel, (1,), (gathered, None, w, length, q), meta, out_pos=1)
    launch.normal(out)
    if torch.cuda.is_current_stream_capturing():
        return  # set up outside capture only

    def rerun() -> bool:
        direct = torch.empty_like(out)
        launch(direct, fast=True)
        return torch.equal(direct, out)

    prepare_out_launches([launch], out, rerun)
    if len(_LAUNCHES) >= _LAUNCHES_MAX:
        _LAUNCHES.clear()
    _LAUNCHES[key] = launch
