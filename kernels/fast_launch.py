"""Direct launches of Triton kernels whose arguments change on every call (the renorm passes).

Triton's ``kernel[grid](*args, **meta)`` binds and specialises the arguments, builds a cache key,
looks the compiled kernel up and builds launch metadata on every call: tens of microseconds of
host time per launch on the GPU machine (Triton 3.6), most of an eager small-batch renorm
(docs/benchmarks.md). ``launch(kernel, grid, *args, **meta)`` keeps, per kernel and per
*specialisation key* of a call, the compiled kernel's launcher and the argument list Triton handed
it, and later calls the launcher itself with this call's grid, stream and arguments put in place.

The key is a superset of what Triton specialises on: each tensor's dtype, device and 16-byte
alignment; each int's ``== 1``, ``% 16 == 0`` and width class; the keyword values (constexprs,
num_warps, maxnreg) and the current device. Positional arguments must be the kernel's leading
parameters, keywords constexprs or launch options (as at every call site here); that is checked,
not assumed: the argument list is recorded twice (by swapping the compiled kernel's launcher for a
recorder during a real call, which launches nothing, as in ``fingerprint._Launch``), and a key goes
direct only after the second call's list equals, position by position, the one the direct path
would have built for it. Anything else (the interpreter, ``TPGUARD_FAST_LAUNCH=0``, an unknown
launcher layout, launch hooks installed by a profiler, argument types outside the key): Triton's
own launch, as before.
"""

from __future__ import annotations

import torch

from tpguard.kernels.fingerprint import (FAST_LAUNCH_FAILURES, _current_stream, _hooks_idle,
                                         fast_launch_enabled)

_MAX_ENTRIES = 512
_REFUSED = object()
_ENTRIES: dict = {}  # (kernel, key) -> _Entry, or _REFUSED (Triton's launch for that key)


class _Entry:
    __slots__ = ("run", "template", "n_args", "checked")

    def __init__(self, run, template: list, n_args: int):
        template[9:9 + n_args] = [None] * n_args  # this call's tensors: not kept alive by the cache
        self.run, self.template, self.n_args, self.checked = run, template, n_args, False

    def build(self, grid: tuple, args: tuple) -> list:
        t = self.template.copy()
        t[0] = grid[0]
        t[1] = grid[1] if len(grid) > 1 else 1
        t[2] = grid[2] if len(grid) > 2 else 1
        t[3] = _current_stream()
        t[9:9 + self.n_args] = args
        return t


def _int_class(v: int) -> tuple:
    # Triton: 1 becomes a constant, multiples of 16 get a divisibility hint, the width follows the range
    width = 0 if -2**31 <= v < 2**31 else 1 if 0 <= v < 2**32 else 2 if -2**63 <= v < 2**63 else 3
    return ("i", v == 1, v % 16 == 0, width)


def _spec(a):
    if isinstance(a, torch.Tensor):
        return ("t", a.dtype, a.device.index, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return _int_class(a)
    if isinstance(a, float):
        return ("f",)
    if a is None:
        return ("n",)
    raise TypeError(type(a).__name__)  # outside the key: Triton's launch


def _record(kernel, grid: tuple, args: tuple, meta: dict, compiled):
    """The launcher and the argument list Triton hands it for this call (nothing launched), or
    (None, reason)."""
    attr = "_run" if isinstance(getattr(type(compiled), "run", None), property) else "run"
    try:
        real = compiled.run
    except Exception as e:  # noqa: BLE001
        return None, f"compiled.run: {type(e).__name__}"
    if not callable(real) or getattr(compiled, attr, None) is not real:
        return None, f"{type(compiled).__name__}.{attr} is not the launcher"
    calls = []
    setattr(compiled, attr, lambda *a: calls.append(a))
    try:
        kernel[grid](*args, **meta)
    finally:
        setattr(compiled, attr, real)
    if len(calls) != 1:
        return None, f"{len(calls)} launcher calls recorded"
    tmpl = list(calls[0])
    if len(tmpl) < 9 + len(args) or not _hooks_idle(tmpl[7], tmpl[8]):
        return None, f"layout: {len(tmpl)} arguments, hooks {[type(x).__name__ for x in tmpl[7:9]]}"
    return (real, tmpl), ""


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def _matches(built: list, recorded: list) -> bool:
    """The direct path's list for a call equals what Triton handed its launcher (launch metadata,
    position 6, aside: never read while the hooks are idle, which both lists were checked for)."""
    return len(built) == len(recorded) and all(
        i == 6 or _same(x, y) for i, (x, y) in enumerate(zip(built, recorded)))


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``, directly through the compiled launcher once checked."""
    if not fast_launch_enabled() or any(isinstance(v, torch.Tensor) for v in meta.values()):
        kernel[grid](*args, **meta)  # a tensor by keyword: outside the positional layout and the key
        return
    try:
        key = (kernel, torch.cuda.current_device(), len(grid), tuple(_spec(a) for a in args),
               tuple(sorted(meta.items())))
        hash(key)
    except TypeError:
        kernel[grid](*args, **meta)
        return
    entry = _ENTRIES.get(key)
    if entry is not None and entry is not _REFUSED and entry.checked:
        built = entry.build(grid, args)
        if _hooks_idle(built[7], built[8]):
            entry.run(*built)
            return
    compiled = kernel[grid](*args, **meta)
    if entry is _REFUSED or compiled is None or torch.cuda.is_current_stream_capturing():
        return
    got, why = _record(kernel, grid, args, meta, compiled)
    if got is None:
        _refuse(key, kernel, why)
        return
    run, tmpl = got
    if entry is None:
        if len(_ENTRIES) >= _MAX_ENTRIES:
            _ENTRIES.clear()
        _ENTRIES[key] = _Entry(run, tmpl, len(args))
    elif entry.run is run and _matches(entry.build(grid, args), tmpl):
        entry.checked = True
    else:
        _refuse(key, kernel, "the recorded argument lists of two calls disagree with the direct path's")


def _refuse(key, kernel, why: str) -> None:
    _ENTRIES[key] = _REFUSED
    FAST_LAUNCH_FAILURES[getattr(kernel, "__name__", str(kernel))] = why[:300]


def state() -> dict:
    """How many specialisation keys launch directly, wait for their check, or were refused."""
    out = {"direct": 0, "pending": 0, "refused": 0}
    for e in _ENTRIES.values():
        out["refused" if e is _REFUSED else "direct" if e.checked else "pending"] += 1
    return out
