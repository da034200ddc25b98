"""Direct kernel launches: call a compiled Triton kernel's launcher with recorded arguments, only
some of them substituted per call (host time; used by the renorm call plans, kernels/renorm_plan.py,
and through `OutLaunch` by the fingerprint plans, the guard's comparison and the heal copies).

A set of launches recorded from one normal run of a whole op (`OutLaunch`, a subclass,
substitutes a single `out` tensor), with several *roles* substituted per call:
tensors found in the recorded arguments by identity, scalars found by kernel parameter name.

Triton's ``kernel[grid](*args)`` binds and specialises the arguments and looks the compiled
kernel up on every call (tens of us per launch). Here:

1. `capture_launches()` watches one normal run of an op (Triton's own launches, GPU work done)
   and keeps each launch's kernel, grid, arguments and the compiled kernel it returned; a
   `TorchFunctionMode` alongside lists any torch call of that run that may do GPU work (a per-call
   ``fill_`` / ``copy_`` would be skipped by direct launches: such a run is refused). Not a
   `TorchDispatchMode`: entering the first one in a process imports torch's higher-order ops
   (dynamo, sympy, FSDP: 2 s here, 5 s on an H200 host), which a plan's recording paid once per
   process and which dominated the harness's first steps.
2. `DirectLaunch.record()` repeats each launch through Triton with ``CompiledKernel.run``
   swapped for a recorder (no GPU work) and keeps the positional arguments Triton hands the
   launcher. Accepted only for Triton 3.x's layout (grid x3, stream, function, packed metadata,
   launch metadata, enter/exit hooks, then one argument per kernel parameter in signature
   order) with no launch hooks installed (profilers: `hooks_idle`).
3. A later call copies the template, sets the current stream and the roles, and calls the
   launcher. The template is trimmed of per-call work Triton's launcher would repeat (host time,
   docs/design-renorm.md, "Host time"): the workspace tensors become their addresses (the C
   launcher otherwise calls each one's ``data_ptr()`` and ``cuPointerGetAttribute`` per launch),
   substituted tensors are passed as addresses too, the idle hook chains become None (the C
   launcher calls a hook unless it is None), and where `CudaLauncher.__call__` is the Triton 3.6
   one read for this (`C_LAUNCHER_CALL_SHA256`) its C ``launch`` is called directly: that
   ``__call__`` only allocates scratch our kernels do not have. Triton specialises a pointer on
   its 16-byte alignment and an int on ``== 1`` and ``% 16 == 0``: `LaunchSet.accepts` says no
   (the caller then takes Triton's path) when a role differs from the recorded one in those.
4. `validate_once` runs a set directly once per compiled variant per process and compares with
   Triton's result bit for bit (the caller's `rerun`): the one check of every direct launch
   (`prepare_out_launches` uses it for `OutLaunch` lists).

Off under the interpreter and with ``TPGUARD_FAST_LAUNCH=0`` (`enabled`, read when asked);
``TPGUARD_LAUNCH_TRIM=0`` records templates untrimmed (read at record time).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import textwrap
import threading
from dataclasses import dataclass, field

import torch

from tpguard.config import fast_launch, interpreting, launch_trim
from tpguard.kernels.cuda_state import capturing, current_device, current_stream

try:
    import triton
except Exception:  # noqa: BLE001 - no triton: direct launches are off
    triton = None

HEAD = 9  # grid x3, stream, function, packed metadata, launch metadata, enter hook, exit hook
FAILURES: dict[str, str] = {}  # kernel names -> why a direct set was refused (benchmarks print it)
# sha256 of the dedented source of Triton 3.6.0's CudaLauncher.__call__ (triton/backends/nvidia/driver.py):
# scratch allocation (none when sizes are 0), then self.launch(gridX, gridY, gridZ, stream, function,
# self.launch_cooperative_grid, self.launch_pdl, global_scratch, profile_scratch, *args)
C_LAUNCHER_CALL_SHA256 = "ead77febd3d441d474bb8bc0126006c821d25c5ba32235acd60673c9cb83cc78"
_C_LAUNCH_OK: dict[type, bool] = {}  # launcher class -> its __call__ is the one above
LAUNCHERS = {"c": 0, "triton": 0}  # recorded launches by how they are called (benchmarks print it)
_VALIDATED: dict[str, bool] = {}  # compiled variant -> a direct run equal to Triton's (this process)
# aten ops that do no GPU work (allocations, views): anything else in a captured run is refused
_NO_WORK = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view",
    "split", "split_with_sizes", "slice", "select", "as_strided", "alias", "detach", "expand",
    "t", "unsqueeze", "squeeze", "permute", "lift_fresh", "unbind", "narrow",
    # metadata: the launcher's argument binding reads these
    "data_ptr", "size", "stride", "storage_offset", "untyped_storage", "numel", "dim", "element_size",
    "is_contiguous", "get_device", "__get__",  # __get__: a property (shape, dtype, device, is_cuda, ...)
})


def _device_tensor(t) -> bool:
    """A tensor whose address the launcher may take as it is (CUDA memory)."""
    return t.is_cuda


def enabled() -> bool:
    """Direct launches on: compiled Triton (not the interpreter) and TPGUARD_FAST_LAUNCH not 0."""
    return triton is not None and fast_launch() and not interpreting()


def hook_owner():
    """The object holding Triton's launch hooks as attributes (3.4+: `triton.knobs.runtime`), or None."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "launch_enter_hook") else None


def launch_hooks() -> tuple:
    """Triton's current launch enter/exit hooks (3.4+: `hook_owner()`'s, HookChain objects that are
    empty unless a profiler added a hook; older: CompiledKernel class attributes)."""
    runtime = hook_owner()
    if runtime is not None:
        return runtime.launch_enter_hook, runtime.launch_exit_hook
    from triton.compiler.compiler import CompiledKernel

    return getattr(CompiledKernel, "launch_enter_hook", None), getattr(CompiledKernel, "launch_exit_hook", None)


def hooks_idle(enter, exit_) -> bool:
    """The recorded hooks are Triton's current ones and call nothing (None or an empty HookChain):
    then the launch metadata recorded with them is never read and a direct launch is Triton's."""
    try:
        now = launch_hooks()
    except Exception:  # noqa: BLE001
        return False
    return enter is now[0] and exit_ is now[1] and _calls_nothing(enter) and _calls_nothing(exit_)


def _calls_nothing(hook) -> bool:  # a function, not a generator over both: ~0.3 us per eager call
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


class _NoGuard:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_GUARD = _NoGuard()


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA device; `off_gpu` elsewhere (the interpreter: the caller's
    stand-in, so grids sized by it are the ones its tests want)."""
    if device.type != "cuda":
        return off_gpu
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def device_guard(device: torch.device):
    """Triton launches (and `current_stream`) are on the current device: make it the tensors' one
    (a context switch only when it is not already current: that costs host time on every eager call)."""
    if device.type != "cuda" or device.index is None or device.index == current_device():
        return _NO_GUARD
    return torch.cuda.device(device)


def c_launch(real):
    """(the C launch function, its 4 extra leading values) when `real` (a compiled kernel's
    launcher) is Triton 3.6's CudaLauncher with no scratch, so calling it adds only those; else None."""
    cls = type(real)
    ok = _C_LAUNCH_OK.get(cls)
    if ok is None:
        try:
            src = textwrap.dedent(inspect.getsource(cls.__call__))
            ok = hashlib.sha256(src.encode()).hexdigest() == C_LAUNCHER_CALL_SHA256
        except Exception:  # noqa: BLE001 - no source (a C or other launcher): call it as it is
            ok = False
        _C_LAUNCH_OK[cls] = ok
    if not ok or getattr(real, "global_scratch_size", 1) != 0 or getattr(real, "profile_scratch_size", 1) != 0:
        return None
    try:
        return real.launch, (real.launch_cooperative_grid, real.launch_pdl, None, None)
    except AttributeError:
        return None


def int_class(v: int) -> tuple:
    """What Triton bakes into a kernel about an int argument (its specialisation)."""
    return (v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31))


@dataclass
class Captured:
    kernel: object
    grid: tuple
    args: tuple
    meta: dict
    compiled: object


class _TorchWork:
    """Names of the torch calls made inside the window that may do GPU work (see _NO_WORK)."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        seen = self.seen = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", repr(func))
                if name not in _NO_WORK:
                    seen.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


@contextlib.contextmanager
def capture_launches():
    """Yields (launches, torch_ops): the Triton launches this thread makes inside the window
    (`Captured`, in order) and the names of the torch ops that may do GPU work."""
    from triton.runtime.jit import JITFunction

    launches: list[Captured] = []
    work = _TorchWork()
    real = JITFunction.run
    me = threading.get_ident()

    def run(self, *args, grid, warmup, **kwargs):
        compiled = real(self, *args, grid=grid, warmup=warmup, **kwargs)
        if not warmup and threading.get_ident() == me:
            launches.append(Captured(self, grid, args, dict(kwargs), compiled))
        return compiled

    JITFunction.run = run
    try:
        with work.mode:
            yield launches, work.seen
    finally:
        JITFunction.run = real


class DirectLaunch:
    """One recorded launch: the launcher's argument template, with `slots` [(index, role, as
    address)] that each call fills from its role values."""

    __slots__ = ("kernel", "grid", "args", "meta", "compiled", "run", "template", "slots", "refusal",
                 "hooks", "keep", "trimmed", "c_launch")

    def __init__(self, kernel, grid: tuple, args: tuple, meta: dict, compiled=None):
        self.kernel, self.grid, self.args, self.meta, self.compiled = kernel, grid, args, meta, compiled
        self.run = self.template = None
        self.slots: tuple = ()  # (template index, role, pass the role's address rather than the value)
        self.refusal = ""
        self.hooks: tuple = (None, None)  # Triton's enter / exit hooks at recording (hooks_idle)
        self.keep: list = []  # the tensors whose addresses the template holds (kept alive)
        self.trimmed = False
        self.c_launch = False  # `run` is Triton's C launch itself (`c_launch`)

    @property
    def name(self) -> str:
        return getattr(getattr(self.kernel, "fn", None), "__name__", None) or str(self.kernel)

    @property
    def variant(self) -> str:
        # trimmed or not: each way is checked against Triton's launch on its own (validate_once)
        return f"{self.name}:{getattr(self.compiled, 'hash', '')}:{'trim' if self.trimmed else 'as-is'}"

    def record(self, tensors: dict, scalars: dict, keep_args: bool = False, args: tuple | None = None,
               views_ok: bool = False) -> bool:
        """Record the launcher's arguments (no GPU work; needs a launch before: a captured one, or
        a subclass's own normal launch). `tensors`: role -> the tensor passed (found by identity); `scalars`:
        kernel parameter name -> (role, the value passed). True if the layout is recognised.
        `args`: the Python arguments to record with (default: the ones given at construction).
        `views_ok`: other arguments may be views of a substituted tensor (callers that key their
        cached launches on those arguments' addresses, as `OutLaunch`'s do).
        Without `keep_args` the Python arguments are dropped (no caller tensor kept alive)."""
        compiled = self.compiled
        if compiled is None:
            self.refusal = "no compiled kernel"
            return False
        attr = "_run" if isinstance(getattr(type(compiled), "run", None), property) else "run"
        try:
            real = compiled.run  # initialises the handles where that is lazy
        except Exception as e:  # noqa: BLE001
            self.refusal = f"compiled.run: {type(e).__name__}"
            return False
        if not callable(real) or getattr(compiled, attr, None) is not real:
            self.refusal = f"{type(compiled).__name__}.{attr} is not the launcher"
            return False
        calls = []
        setattr(compiled, attr, lambda *a: calls.append(a))
        try:
            self.kernel[self.grid](*(self.args if args is None else args), **self.meta)
        finally:
            setattr(compiled, attr, real)
        names = list(getattr(self.kernel, "signature").parameters)
        grid = tuple(self.grid) + (1,) * (3 - len(self.grid))
        tmpl = list(calls[0]) if len(calls) == 1 else []
        if len(tmpl) != HEAD + len(names) or tuple(tmpl[:3]) != grid or tmpl[3] != current_stream() \
                or not hooks_idle(tmpl[7], tmpl[8]):
            self.refusal = (f"layout: {len(calls)} calls, {len(tmpl)} args for {len(names)} parameters, "
                            f"grid {tuple(tmpl[:3])} vs {grid}")
            return False
        slots = []
        for i in range(HEAD, len(tmpl)):
            for role, t in tensors.items():
                if tmpl[i] is t:
                    slots.append((i, role))
        if len({i for i, _ in slots}) != len(slots):  # a later call may pass two tensors there
            self.refusal = "one tensor passed in two roles"
            return False
        for name, (role, value) in scalars.items():
            if name in names:
                i = HEAD + names.index(name)
                if type(tmpl[i]) is not type(value) or tmpl[i] != value:
                    self.refusal = f"parameter {name}: {tmpl[i]!r} where {value!r} was passed"
                    return False
                slots.append((i, role))
        # a view of a role tensor passed in its place would stay the recorded one: refuse
        role_storage = set() if views_ok else {t.untyped_storage().data_ptr() for t in tensors.values()}
        taken = {i for i, _ in slots}
        for i in range(HEAD, len(tmpl)):
            if i not in taken and isinstance(tmpl[i], torch.Tensor) \
                    and tmpl[i].untyped_storage().data_ptr() in role_storage:
                self.refusal = f"argument {names[i - HEAD]} is a view of a substituted tensor"
                return False
        for i in taken:
            tmpl[i] = None  # the recorded call's probs / out are not kept alive
        if not keep_args:
            self.args = None
        self.hooks = (tmpl[7], tmpl[8])
        # TPGUARD_LAUNCH_TRIM=0: the template as Triton hands it (tensors, hook chains,
        # CudaLauncher.__call__): the benchmark's baseline for the trims (gpu/renorm_host.py --gpu)
        trim = self.trimmed = launch_trim()
        keep, ptr, direct = [], set(), None
        if trim:
            tmpl[7] = tmpl[8] = None  # idle (checked above; callers check hooks_idle(*hooks) per call)
            for i in range(HEAD, len(tmpl)):
                if i not in taken and isinstance(tmpl[i], torch.Tensor) and _device_tensor(tmpl[i]):
                    keep.append(tmpl[i])
                    tmpl[i] = tmpl[i].data_ptr()
            # a role is a tensor (found by identity) or a scalar (by name), never both
            ptr = {role for role, t in tensors.items() if _device_tensor(t)}
            direct = c_launch(real)
        else:
            keep = [a for a in tmpl[HEAD:] if isinstance(a, torch.Tensor)]
        slots = [(i, role, role in ptr) for i, role in slots]
        run = real
        if direct is not None:  # grid x3, stream, function, then the 4 values CudaLauncher adds
            run, extra = direct
            tmpl[5:5] = list(extra)
            slots = [(i + len(extra), role, as_ptr) for i, role, as_ptr in slots]
        LAUNCHERS["c" if direct is not None else "triton"] += 1
        self.run, self.template, self.slots, self.keep = run, tmpl, tuple(slots), keep
        self.c_launch = direct is not None
        return True

    def launch(self, stream: int, values, addresses=None) -> None:
        """The launch with the call's role values; `addresses`: the tensor roles' addresses read before (by
        role: LaunchSet.addresses), else read here."""
        args = self.template.copy()
        args[3] = stream
        for i, role, as_ptr in self.slots:
            if as_ptr:
                args[i] = values[role].data_ptr() if addresses is None else addresses[role]
            else:
                args[i] = values[role]
        self.run(*args)


@dataclass
class LaunchSet:
    """The direct launches of one op call, recorded together. `values` (a call's roles, by
    index) must match the recorded run's in what Triton specialises (`accepts`)."""

    launches: list
    tensor_roles: tuple = ()  # (role, ptr % 16 of the recorded tensor)
    int_roles: tuple = ()  # (role, int_class of the recorded value)
    hooks: tuple = field(default=(None, None))

    @classmethod
    def record(cls, captured: list, torch_ops: list, values, tensor_roles, scalar_names: dict):
        """A set from a captured run (`capture_launches`), or a str saying why not.
        `values`: the run's roles; `tensor_roles`: the roles that may be tensors (others are
        skipped: a scalar is found by name, never by identity); `scalar_names`: kernel
        parameter name -> role of a scalar."""
        if torch_ops:
            return f"torch ops with GPU work in the run: {sorted(set(torch_ops))}"
        if not captured:
            return "no launches"
        tensors = {r: values[r] for r in tensor_roles if isinstance(values[r], torch.Tensor)}
        launches = [DirectLaunch(c.kernel, c.grid, c.args, c.meta, c.compiled) for c in captured]
        found = set()
        scalars = {name: (r, values[r]) for name, r in scalar_names.items()}
        for launch in launches:
            if not launch.record(tensors, scalars):
                return f"{launch.name}: {launch.refusal}"
            found.update(slot[1] for slot in launch.slots)
        missing = (set(tensors) | set(scalar_names.values())) - found
        if missing:
            return f"roles {sorted(missing)} not found among the launchers' arguments"
        ints = tuple((r, int_class(values[r])) for r in sorted(set(scalar_names.values()))
                     if isinstance(values[r], int))
        return cls(launches, tuple((r, t.data_ptr() % 16) for r, t in tensors.items()), ints,
                   launches[0].hooks)

    def addresses(self, values) -> list | None:
        """The tensor roles' addresses (by role; None elsewhere) where the set accepts `values`: each
        at its recorded 16-byte alignment on the GPU, each int of its recorded class, no launch hook
        added; else None."""
        addresses = [None] * len(values)
        for r, align in self.tensor_roles:
            t = values[r]
            address = addresses[r] = t.data_ptr()
            # is_cuda: Triton's launcher refuses a host tensor; given its address it would not
            if address % 16 != align or not _device_tensor(t):
                return None
        for r, cls in self.int_roles:
            if int_class(values[r]) != cls:
                return None
        return addresses if hooks_idle(*self.hooks) else None

    def accepts(self, values) -> bool:
        return self.addresses(values) is not None

    def __call__(self, values) -> None:
        stream = current_stream()
        for launch in self.launches:
            launch.launch(stream, values)

    def launch_if_accepted(self, values) -> bool:
        """`accepts`, then the launches, each tensor's address read once (host time of an eager call);
        False, with nothing launched, where the set does not accept `values`."""
        addresses = self.addresses(values)
        if addresses is None:
            return False
        stream = current_stream()
        for launch in self.launches:
            launch.launch(stream, values, addresses)
        return True

    @property
    def names(self) -> str:
        return ",".join(launch.name for launch in self.launches)


def validate_once(launches: LaunchSet, rerun) -> bool:
    """True if every compiled variant of the set was checked before in this process, or
    `rerun()` (a direct run compared with Triton's, bit for bit) says so now."""
    variants = {launch.variant for launch in launches.launches}
    if any(_VALIDATED.get(v) is False for v in variants):
        FAILURES[launches.names] = "direct launch disagreed before"
        return False
    if all(_VALIDATED.get(v) for v in variants):
        return True
    try:
        ok = bool(rerun())
    except Exception as e:  # noqa: BLE001 - any failure: Triton's own launch, as before
        FAILURES[launches.names] = f"{type(e).__name__}: {e}"[:300]
        return False
    for v in variants:
        _VALIDATED[v] = _VALIDATED.get(v, True) and ok
    if not ok:
        FAILURES[launches.names] = "direct launch disagreed with Triton's"
    return ok


class OutLaunch(DirectLaunch):
    """One fixed kernel launch (grid, arguments, meta) repeated by a plan, optionally with a
    different `out` tensor at argument `out_pos` each time.

    Direct path (host time): Triton's ``kernel[grid](...)`` binds and specializes the arguments and
    looks up the compiled kernel on every call (30-80 us of Python per launch on the GPU machine's
    Triton 3.6). `record()` keeps the positional arguments Triton hands the compiled kernel's
    launcher; later launches call the launcher directly with those, only the stream and `out`
    substituted, and only after `ManyPlan` (kernels/fingerprint_plan.py) / `guard_compare` /
    `heal_copy` compared a direct launch with Triton's own bit for bit (`prepare_out_launches`:
    `validate_once`); anything else (interpreter, other layouts, launch hooks, failures): Triton's
    launch. `fast` asks for the direct path at a call."""

    __slots__ = ("out_pos", "_out_align")

    def __init__(self, kernel, grid: tuple, args: tuple, meta: dict, out_pos: int | None = None):
        super().__init__(kernel, grid, args, meta)
        self.out_pos, self._out_align = out_pos, 0

    @property
    def ready(self) -> bool:
        return self.run is not None

    def _bound(self, out):
        if self.out_pos is None:
            return self.args
        args = list(self.args)
        args[self.out_pos] = out
        return args

    def normal(self, out=None):
        self.compiled = self.kernel[self.grid](*self._bound(out), **self.meta)

    def __call__(self, out=None, fast: bool = False):
        # direct only with `out` at the recorded alignment and no launch hook added since (profilers)
        if fast and self.run is not None and (out is None or (out.data_ptr() % 16 == self._out_align
                                                              and out.is_cuda)) \
                and hooks_idle(*self.hooks):
            return self.launch(current_stream(), [out])
        return self.normal(out)

    def record(self, out=None) -> bool:
        """Record the launcher's arguments (no GPU work); True if the layout is recognised and
        `out` was found among them. Needs a normal launch before (the compiled kernel)."""
        # views_ok: the guard's comparison writes `out` next to `gathered` in one buffer; the callers
        # key their cached launches on the other arguments' addresses
        role = {} if out is None or self.out_pos is None else {0: out}  # lane launches never read `out`
        if not super().record(role, {}, keep_args=True, args=self._bound(out), views_ok=True):
            return False
        if self.out_pos is not None and not self.slots:
            self.refusal = "output argument not found among the launcher's arguments"
            self.forget()
            return False
        self._out_align = out.data_ptr() % 16 if role else 0
        return True

    def forget(self) -> None:
        self.run, self.template, self.slots, self.keep = None, None, (), []


def prepare_out_launches(launches: list[OutLaunch], out, rerun) -> bool:
    """After a normal run of `launches` into `out`: record their launchers, then `validate_once`:
    if one of these kernels was never checked in this process, `rerun()` repeats the run with
    direct launches (from the same starting state, into a scratch tensor) and says whether it
    equals `out` (one host sync, once per kernel). False (refusals in FAILURES): Triton's launch
    stays."""
    group = LaunchSet(list(launches))
    try:
        for launch in launches:
            if not launch.record(out):
                raise RuntimeError(f"launcher layout not recognised ({launch.refusal})")
    except Exception as e:  # noqa: BLE001 - any failure: Triton's own launch, as before
        FAILURES[group.names] = f"{type(e).__name__}: {e}"[:300]
        ok = False
    else:
        ok = validate_once(group, rerun)
    if not ok:
        for launch in launches:
            launch.forget()
    return ok


__all__ = ["C_LAUNCHER_CALL_SHA256", "Captured", "DirectLaunch", "FAILURES", "LAUNCHERS", "LaunchSet", "OutLaunch",
           "c_launch", "capture_launches", "capturing", "current_device", "current_stream", "device_guard", "enabled",
           "hook_owner", "hooks_idle", "int_class", "prepare_out_launches", "validate_once"]
