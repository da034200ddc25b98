"""Triton's interpreter, faster for the tests (conftest.py, and the sglang zygote's ranks): the same
kernels run the same way, with less of the interpreter's own work around them."""

from __future__ import annotations

import inspect


def speed_up() -> None:
    patch_language_once_per_launch()
    remember_numpy_dtypes()
    skip_discarded_overflow_checks()
    share_tensor_shapes()
    broadcast_equal_shapes_at_once()


def broadcast_equal_shapes_at_once() -> None:
    """Two operands of one block shape: Triton's broadcast walks the dimensions and compares its
    result with each operand's shape as tl.tuples (each comparison builds new ones), to return both
    unchanged. Here equal dimensions return them at once; any other pair takes Triton's way."""
    try:
        from triton.language import core
        from triton.runtime import interpreter
    except ImportError:
        return
    semantic = getattr(interpreter, "interpreter_semantic", None)
    broadcast = getattr(type(semantic), "broadcast_impl_value", None)
    if broadcast is None or getattr(broadcast, "equal_at_once", False):
        return
    tl_tuple = core.tuple

    def broadcast_impl_value(self, lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        if lhs_ty.is_block() and rhs_ty.is_block() and type(lhs_ty.shape) is tl_tuple \
                and type(rhs_ty.shape) is tl_tuple and lhs_ty.shape.values == rhs_ty.shape.values:
            return lhs, rhs
        return broadcast(self, lhs, rhs)

    broadcast_impl_value.equal_at_once = True
    type(semantic).broadcast_impl_value = broadcast_impl_value


def share_tensor_shapes() -> None:
    """Every block type and tl.tensor the interpreter makes (several per operation) builds its shape
    anew: a tl.tuple with its tuple type, a validated numel, a name (a fifth of the kernel tests'
    time). Here those of one block shape share them, built once by Triton's own code and never
    changed after. Kept only where the results equal the originals' on samples (a Triton whose
    types differ runs as it is)."""
    try:
        import builtins
        import math

        from triton.language import core
    except ImportError:
        return
    tensor, block_type, tl_tuple = core.tensor, core.block_type, core.tuple
    build_tensor, build_block = tensor.__init__, block_type.__init__
    if getattr(build_tensor, "shares_shapes", False):
        return
    tensor_shapes: dict = {}  # (dims) -> (the tensor's shape: tl.tuple of constexprs, its numel)
    block_shapes: dict = {}  # (dims) -> (the block type's shape: tl.tuple, numel, the shape's text)

    def dims(shape) -> builtins.tuple:  # a block type's shape (a tl.tuple of ints) as a plain key
        return builtins.tuple(shape.values) if builtins.type(shape) is tl_tuple else builtins.tuple(shape)

    def init_tensor(self, handle, ty):
        self.handle = handle
        self.type = ty
        self.dtype = ty.scalar
        key = dims(ty.shape) if ty.is_block() else ()
        entry = tensor_shapes.get(key)
        if entry is None:
            entry = tensor_shapes[key] = (tl_tuple([core.constexpr(d) for d in key]), core.constexpr(math.prod(key)))
        self.shape, self.numel = entry

    def init_block(self, element_ty, shape):
        kind = builtins.type(shape)
        entry = block_shapes.get(dims(shape)) if kind is list or kind is tl_tuple else None
        if entry is None:  # Triton's own checks and build; kept when the dimensions are plain ints
            build_block(self, element_ty, shape)
            if all(builtins.type(d) is int for d in self.shape.values):
                block_shapes[dims(self.shape)] = (self.shape, self.numel, str(self.shape))
            return
        self.element_ty = element_ty
        self.shape, self.numel, text = entry
        self.name = f"<{text}, {element_ty}>"

    def same(a, b) -> bool:
        return vars(a).keys() == vars(b).keys() and all(
            repr(v) == repr(vars(b)[k]) and builtins.type(v) is builtins.type(vars(b)[k]) for k, v in vars(a).items())

    try:
        ok = True
        for shape in ([4, 8], tl_tuple([4, 8]), [16]):
            for _ in range(2):  # built, then shared
                want, got = block_type.__new__(block_type), block_type.__new__(block_type)
                build_block(want, core.int32, shape)
                init_block(got, core.int32, shape)
                ok = ok and same(want, got) and want == got
        for ty in (block_type(core.float32, [4, 8]), core.float32):
            for _ in range(2):
                want, got = tensor.__new__(tensor), tensor.__new__(tensor)
                build_tensor(want, None, ty)
                init_tensor(got, None, ty)
                ok = ok and same(want, got) and [d.value for d in want.shape] == [d.value for d in got.shape]
    except Exception:  # noqa: BLE001 - another Triton: leave its types as they are
        return
    if not ok:
        return
    tensor_shapes.clear()
    block_shapes.clear()
    init_tensor.shares_shapes = True
    tensor.__init__ = init_tensor
    block_type.__init__ = init_block


def skip_discarded_overflow_checks() -> None:
    """Every integer +, - and * in a kernel first builds an int64 overflow check (casts, the op,
    two compares, an and) that `device_assert` then drops, since the interpreter's options have
    debug off: a third of the kernel tests' time. Here the check is not built when it would be
    dropped; with debug on it is built and asserted as before."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    semantic = getattr(interpreter, "interpreter_semantic", None)
    build = getattr(type(semantic), "binary_op_sanitize_overflow_impl", None)
    options = getattr(getattr(semantic, "builder", None), "options", None)
    if build is None or getattr(build, "skips_dropped", False) or not hasattr(options, "debug") \
            or not hasattr(type(semantic), "device_assert"):
        return

    def sanitize(self, lhs, rhs, binary_op):
        if self.builder.options.debug:  # device_assert asserts: build the check
            return build(self, lhs, rhs, binary_op)
        return None  # (device_assert would return at once: nothing built, nothing checked)

    sanitize.skips_dropped = True
    type(semantic).binary_op_sanitize_overflow_impl = sanitize


def remember_numpy_dtypes() -> None:
    """The interpreter's `_get_np_dtype` builds a table of 18 numpy dtypes at every call (a tenth of
    the kernel tests' time): here each Triton dtype's answer is kept after its first call."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    get = getattr(interpreter, "_get_np_dtype", None)
    if get is None or getattr(get, "remembered", False):
        return
    known = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type) and not isinstance(tt_dtype.element_ty, tl.pointer_type):
            tt_dtype = tt_dtype.element_ty  # a block's answer is its element type's
        if isinstance(tt_dtype, (tl.pointer_type, tl.block_type)):
            return get(tt_dtype)
        try:
            return known[tt_dtype]
        except KeyError:
            known[tt_dtype] = answer = get(tt_dtype)
            return answer
        except TypeError:  # not hashable
            return get(tt_dtype)

    np_dtype.remembered = True
    interpreter._get_np_dtype = np_dtype


def patch_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language when a kernel launches and undoes it when the
    launch ends; it patches it again at every call of a @triton.jit helper inside the kernel (the
    language modules the helper's globals name), which took about half of the kernel tests' time
    and changes nothing for a module the launch patched already. Here a helper called inside a launch
    patches only modules not yet patched in it (triton.language.core for triton's own helpers such
    as tl.sum), and the launch's end undoes that too. Triton versions without these internals run
    as they are."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or getattr(patch, "once_per_launch", False) or scope_type is None \
            or not isinstance(getattr(scope_type(), "_changes", None), list):
        return
    # the launches running now: (scope, ids of the language modules patched, helpers seen) each
    launches = []

    def languages(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_once(fn):
        if launches:  # a helper called inside a launch
            scope, patched, seen = launches[-1]
            if fn not in seen:
                seen.add(fn)
                new = languages(fn)
                if not new <= patched:
                    scope._changes.extend(patch(fn)._changes)  # undone with the launch's own
                    patched |= new
            return scope_type()
        scope = patch(fn)
        entry = (scope, languages(fn), set())
        restore = scope.restore

        def restore_and_end():
            launches.remove(entry)
            restore()

        scope.restore = restore_and_end
        launches.append(entry)
        return scope

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
