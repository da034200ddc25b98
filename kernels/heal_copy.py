"""Fused heal's payload copies in one launch each way (tpguard/device_guard.py, policy ``heal``).

`heal_pack`: this rank's decision tensors into the int64 payload slots of the guard's vector.
`heal_unpack`: rank 0's payload (row 0 of the gathered matrix) back into this rank's tensors.
Encoding (unchanged from the per-tensor ``copy_`` it replaces): element i of a tensor is the
int64 word at ``offset + i``, the value converted as ``torch.Tensor.copy_`` converts it
(sign-/zero-extended on the way in, truncated on the way back; bool: 0/1 in, ``!= 0`` back).
Reference: `heal_pack_torch` / `heal_unpack_torch` below (also the fallback).

One program per tensor (at most `MAX_TENSORS`, the decision quantities). The tensors' addresses
travel as plain integers with a constexpr dtype code per slot, not as tensor arguments: a cached
direct launch (`OutLaunch`, kernels/direct_launch.py) then keeps no decision tensor alive, so the
allocator can hand a later step the same addresses and the cache hits; the guard's vector (the
substituted `out`) is not kept either.
"""

from __future__ import annotations

import torch

from tpguard.config import interpreting  # the CPU interpreter: CPU tensors only
from tpguard.kernels import interpreter_fix

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch copies
    triton = None

interpreter_fix.install()  # `_copy_one`'s loop bound is a runtime value

MAX_TENSORS = 5  # = len(tpguard.quantities.DECISION_QUANTITIES)
BLOCK = 1024
# dtype -> the kernel's code for it (the pointer type it reads/writes through)
CODES = {torch.int64: 0, torch.int32: 1, torch.int16: 2, torch.int8: 3, torch.uint8: 4, torch.bool: 5}


def _check_capacity(layout, tensors: dict) -> list[tuple[torch.Tensor, int]]:
    """[(tensor, payload offset)] of the present tensors; a tensor over its capacity: ValueError."""
    present = []
    for name, offset, cap in layout:
        t = tensors.get(name)
        if t is not None:
            n = t.numel()
            if n > cap:
                raise ValueError(f"heal_capacity[{name!r}] = {cap} < {n} elements this step")
            present.append((t, offset))
    return present


def heal_pack_torch(vec: torch.Tensor, layout, tensors: dict) -> None:
    """Reference: one copy per tensor into its slots (the guard's code before the kernel)."""
    for t, offset in _check_capacity(layout, tensors):
        vec[offset:offset + t.numel()].copy_(t.reshape(-1))


def heal_unpack_torch(gathered: torch.Tensor, layout, tensors: dict) -> None:
    """Reference: rank 0's payload (the first row of `gathered`, flat or [world, length]) back
    into each tensor."""
    row0 = gathered.reshape(-1)
    for name, offset, _ in layout:
        t = tensors.get(name)
        if t is not None:
            t.view(-1).copy_(row0[offset:offset + t.numel()])


if triton is not None:

    @triton.jit
    def _as_pointer(addr, CODE: tl.constexpr):
        if CODE == 0:
            p = addr.to(tl.pointer_type(tl.int64))
        elif CODE == 1:
            p = addr.to(tl.pointer_type(tl.int32))
        elif CODE == 2:
            p = addr.to(tl.pointer_type(tl.int16))
        elif CODE == 4:
            p = addr.to(tl.pointer_type(tl.uint8))
        else:  # int8, and bool (one byte, 0 or 1)
            p = addr.to(tl.pointer_type(tl.int8))
        return p

    @triton.jit
    def _copy_one(base_ptr, addr, n, offset, CODE: tl.constexpr, UNPACK: tl.constexpr,
                  BLOCK: tl.constexpr):
        p = _as_pointer(addr, CODE)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            if UNPACK:
                x = tl.load(base_ptr + offset + offs, mask=m, other=0)
                if CODE == 5:
                    v = (x != 0).to(tl.int8)
                else:
                    v = x.to(p.dtype.element_ty)
                tl.store(p + offs, v, mask=m)
            else:
                x = tl.load(p + offs, mask=m, other=0)
                tl.store(base_ptr + offset + offs, x.to(tl.int64), mask=m)

    @triton.jit
    def _heal_copy_kernel(base_ptr, a0, a1, a2, a3, a4, n0, n1, n2, n3, n4, o0, o1, o2, o3, o4,
                          C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
                          C4: tl.constexpr, UNPACK: tl.constexpr, BLOCK: tl.constexpr):
        """Program k copies tensor k (address a_k, n_k elements, dtype code C_k) to/from the
        int64 words base_ptr[o_k : o_k + n_k]."""
        pid = tl.program_id(0)
        if pid == 0:
            _copy_one(base_ptr, a0, n0, o0, C0, UNPACK, BLOCK)
        elif pid == 1:
            _copy_one(base_ptr, a1, n1, o1, C1, UNPACK, BLOCK)
        elif pid == 2:
            _copy_one(base_ptr, a2, n2, o2, C2, UNPACK, BLOCK)
        elif pid == 3:
            _copy_one(base_ptr, a3, n3, o3, C3, UNPACK, BLOCK)
        else:
            _copy_one(base_ptr, a4, n4, o4, C4, UNPACK, BLOCK)


def kernel_applies(base: torch.Tensor, present: list[tuple[torch.Tensor, int]]) -> bool:
    """The kernel's case: CUDA (or CPU under TRITON_INTERPRET=1), at most MAX_TENSORS tensors,
    each contiguous, of a dtype in CODES, on base's device. Anything else: the torch copies."""
    if triton is None or _kernel_failed or not present or len(present) > MAX_TENSORS:
        return False
    if base.dtype != torch.int64 or not base.is_contiguous():
        return False
    if base.device.type != ("cpu" if interpreting() else "cuda"):
        return False
    return all(t.device == base.device and t.dtype in CODES and t.is_contiguous() for t, _ in present)


# The address passed for an empty or absent slot (never dereferenced: 0 elements, or no program):
# a fixed 64-bit value, so the argument types and the launch cache key do not depend on it.
_NOWHERE = 1 << 40


def _args(present: list[tuple[torch.Tensor, int]]) -> tuple[list, dict]:
    addrs, ns, offs, meta = [], [], [], {}
    for k in range(MAX_TENSORS):
        if k < len(present):
            t, offset = present[k]
            addrs.append(t.data_ptr() if t.numel() else _NOWHERE)
            ns.append(t.numel())
            offs.append(offset)
            meta[f"C{k}"] = CODES[t.dtype]
        else:  # no program reads it: grid = number of present tensors
            addrs.append(_NOWHERE)
            ns.append(0)
            offs.append(0)
            meta[f"C{k}"] = 0
    return [None] + addrs + ns + offs, meta


_kernel_failed = False
_LAUNCHES: dict = {}  # (direction, addresses, numels, offsets, dtype codes, device) -> OutLaunch
_LAUNCHES_MAX = 64
_SEEN_ONCE: dict = {}  # keys met once outside capture (the direct launch is set up at the second)


def _launch(base: torch.Tensor, present: list[tuple[torch.Tensor, int]], unpack: bool) -> None:
    """One launch; through a recorded direct launcher once checked against Triton's (as
    guard_compare's `_launch`), keyed by the tensors' addresses, never holding the tensors.

    Addresses met for the first time outside capture get Triton's launch only (compiling the
    variant, so a capture after one warm-up step compiles nothing): recording and checking the
    direct launcher cost more host time, which tensors reallocated at new addresses every step
    would pay every step (as a `ManyPlan` used once); from the second meeting on (the caching
    allocator's usual reuse) the launch is set up and then direct."""
    from tpguard.kernels import direct_launch
    from tpguard.kernels.direct_launch import OutLaunch, prepare_out_launches

    args, meta = _args(present)
    meta.update(UNPACK=unpack, BLOCK=BLOCK, num_warps=4)
    grid = (len(present),)
    if not direct_launch.enabled():
        args[0] = base
        _heal_copy_kernel[grid](*args, **meta)
        return
    key = (unpack, tuple(args[1:]), tuple(meta[f"C{k}"] for k in range(MAX_TENSORS)), base.device)
    launch = _LAUNCHES.get(key)
    if launch is not None:
        launch(base, fast=True)
        return
    capturing = torch.cuda.is_current_stream_capturing()
    if not capturing and key not in _SEEN_ONCE:
        if len(_SEEN_ONCE) >= 4 * _LAUNCHES_MAX:
            _SEEN_ONCE.clear()
        _SEEN_ONCE[key] = True
        args[0] = base
        _heal_copy_kernel[grid](*args, **meta)
        return
    launch = OutLaunch(_heal_copy_kernel, grid, tuple(args), meta, out_pos=0)
    launch.normal(base)
    if capturing:
        return  # set up outside capture only

    if unpack:
        def rerun() -> bool:  # the tensors again from the same row 0, over poisoned values
            want = [t.clone() for t, _ in present]
            ok = False
            try:
                for t, _ in present:
                    t.copy_(t.logical_not() if t.dtype == torch.bool else t.bitwise_not())
                launch(base, fast=True)
                ok = all(torch.equal(t, w) for (t, _), w in zip(present, want))
            finally:
                if not ok:  # the values of the normal launch back
                    for (t, _), w in zip(present, want):
                        t.copy_(w)
            return ok
    else:
        def rerun() -> bool:  # the payload again into a poisoned copy of the vector
            direct = base.bitwise_not()
            launch(direct, fast=True)
            want = base.bitwise_not()
            for t, offset in present:
                want[offset:offset + t.numel()] = base[offset:offset + t.numel()]
            return torch.equal(direct, want)

    prepare_out_launches([launch], base, rerun)
    _SEEN_ONCE.pop(key, None)
    if len(_LAUNCHES) >= _LAUNCHES_MAX:
        _LAUNCHES.clear()
    _LAUNCHES[key] = launch


def _run(base: torch.Tensor, present, unpack: bool) -> bool:
    """True: the kernel ran; False: the caller uses the torch copies (not the kernel's case, or
    a Triton that cannot build it)."""
    global _kernel_failed
    if not kernel_applies(base, present):
        return False
    try:
        _launch(base, present, unpack)
        return True
    except Exception as e:  # a Triton that cannot build it: the torch copies give the same bytes
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        _kernel_failed = True
        import logging

        logging.getLogger("tpguard").warning("heal_copy: Triton kernel unavailable (%s); using torch", e)
        return False


def heal_pack(vec: torch.Tensor, layout, tensors: dict) -> None:
    """This rank's decision tensors into `vec`'s payload. `layout`: [(name, offset, capacity)]
    (DeviceStepGuard.heal_layout); absent names are skipped; over capacity: ValueError."""
    present = _check_capacity(layout, tensors)
    if present and not _run(vec, present, unpack=False):
        heal_pack_torch(vec, layout, tensors)


def heal_unpack(gathered: torch.Tensor, layout, tensors: dict) -> None:
    """Rank 0's payload into the tensors. `gathered`: the contiguous all-gathered buffer (flat or
    [world, length]); its first row is rank 0's vector."""
    present = [(tensors[name], offset) for name, offset, _ in layout if tensors.get(name) is not None]
    if present and not _run(gathered, present, unpack=True):
        heal_unpack_torch(gathered, layout, tensors)
