"""CUDA graphs of direct launches, captured and launched through the CUDA driver API (libcuda, which
Triton's launchers already use), not `torch.cuda.CUDAGraph` (used by kernels/renorm_graph.py).

Why not torch's: `CUDAGraph.capture_begin` registers the process's default CUDA generator with every
graph; while it captures, that generator is marked capturing for the whole process (another thread
drawing random numbers then fails), its offset tensor is refilled on the capture stream, and every
`replay()` refills the generator's seed and offset tensors first (two more launches per replay).
A graph of our own kernel launches needs none of that, nor torch's allocator bookkeeping: nothing
in the capture allocates.

    graph = DriverGraph.capture(lambda: launches(values), side_stream)  # thread-local capture
    graph.launch(current_stream)
    args = graph.pointer_args({placeholder.data_ptr(): role, ...})  # captured addresses, by role
    args.set(tensors_by_role)  # cuGraphExecKernelNodeSetParams: the next launch uses these tensors
    graph.launch(current_stream)

Stream handles are the raw ``cudaStream_t`` values (``torch.cuda.Stream.cuda_stream``,
`direct_launch.current_stream()`). Only direct launches (Triton's C launcher: ``cuLaunchKernelEx``)
may run inside `capture`'s function: a torch op there would be captured too, or refused.
"""

from __future__ import annotations

import ctypes

_CAPTURE_MODE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
_NODE_TYPE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_MAX_PARAMS = 1024
_lib = None
_node_api: bool | None = None  # the driver has the kernel-node calls pointer_args needs (CUDA >= 12.4)


def _cuda():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        p, u64 = ctypes.c_void_p, ctypes.c_ulonglong
        for name, args in (("cuStreamBeginCapture_v2", [p, ctypes.c_int]),
                           ("cuStreamEndCapture", [p, ctypes.POINTER(p)]),
                           ("cuGraphInstantiateWithFlags", [ctypes.POINTER(p), p, u64]),
                           ("cuGraphLaunch", [p, p]),
                           ("cuGraphExecDestroy", [p]),
                           ("cuGraphDestroy", [p]),
                           ("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _lib = lib
    return _lib


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h)."""

    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.POINTER(ctypes.c_void_p)),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _node_calls() -> bool:
    """Declare the kernel-node calls; False where the driver lacks one (cuFuncGetParamInfo: CUDA 12.4)."""
    global _node_api
    if _node_api is None:
        lib = _cuda()
        p, size = ctypes.c_void_p, ctypes.c_size_t
        params = ctypes.POINTER(_KernelNodeParams)
        try:
            for name, args in (("cuGraphGetNodes", [p, ctypes.POINTER(p), ctypes.POINTER(size)]),
                               ("cuGraphNodeGetType", [p, ctypes.POINTER(ctypes.c_int)]),
                               ("cuGraphKernelNodeGetParams_v2", [p, params]),
                               ("cuFuncGetParamInfo", [p, size, ctypes.POINTER(size), ctypes.POINTER(size)]),
                               ("cuGraphExecKernelNodeSetParams_v2", [p, p, params])):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, ctypes.c_int
            _node_api = True
        except AttributeError:
            _node_api = False
    return _node_api


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what}: {(name.value or b'CUDA error').decode()} ({result})")


class DriverGraph:
    """One instantiated graph; destroyed with the object (a pending launch still completes)."""

    def __init__(self, graph: ctypes.c_void_p, exec_: ctypes.c_void_p):
        self._graph, self._exec = graph, exec_

    @classmethod
    def capture(cls, fn, stream: int) -> "DriverGraph":
        """Capture what `fn()` launches on `stream` (thread-local mode: other threads' CUDA calls are
        not disturbed). The capture always ends, also when `fn` raises."""
        lib = _cuda()
        _check(lib.cuStreamBeginCapture_v2(ctypes.c_void_p(stream), _CAPTURE_MODE_THREAD_LOCAL), "begin capture")
        graph = ctypes.c_void_p()
        try:
            fn()
        except BaseException:
            lib.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph))  # the stream back to normal
            if graph:
                lib.cuGraphDestroy(graph)
            raise
        _check(lib.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph)), "end capture")
        exec_ = ctypes.c_void_p()
        result = lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0)
        if result != 0:
            lib.cuGraphDestroy(graph)
            _check(result, "instantiate graph")
        return cls(graph, exec_)

    def launch(self, stream: int) -> None:
        _check(_lib.cuGraphLaunch(self._exec, ctypes.c_void_p(stream)), "launch graph")

    def pointer_args(self, addresses: dict) -> "PointerArgs":
        """The kernel arguments of this graph that hold one of `addresses` (address -> key), made
        settable per launch (`PointerArgs.set`). Found by value: every 8-byte argument equal to an
        address (captured placeholders' addresses, which no other argument holds). RuntimeError where
        the driver lacks the calls, the graph holds anything but kernel nodes, or an address is in
        no kernel's arguments."""
        if not _node_calls():
            raise RuntimeError("the driver has no cuFuncGetParamInfo (CUDA < 12.4)")
        lib = _cuda()
        count = ctypes.c_size_t(0)
        _check(lib.cuGraphGetNodes(self._graph, None, ctypes.byref(count)), "graph nodes")
        nodes = (ctypes.c_void_p * count.value)()
        _check(lib.cuGraphGetNodes(self._graph, nodes, ctypes.byref(count)), "graph nodes")
        holders = {key: ctypes.c_uint64(address) for address, key in addresses.items()}
        patched, found = [], set()
        for node in nodes:
            kind = ctypes.c_int(-1)
            _check(lib.cuGraphNodeGetType(node, ctypes.byref(kind)), "node type")
            if kind.value != _NODE_TYPE_KERNEL:
                raise RuntimeError(f"a graph node of type {kind.value}, not a kernel")
            params = _KernelNodeParams()
            _check(lib.cuGraphKernelNodeGetParams_v2(node, ctypes.byref(params)), "kernel node parameters")
            if not params.func or not params.kernelParams or params.extra:
                raise RuntimeError("a kernel node without a function or a kernelParams array")
            sizes = _param_sizes(params.func)
            own = (ctypes.c_void_p * max(len(sizes), 1))()
            hit = False
            for i, size in enumerate(sizes):
                own[i] = params.kernelParams[i]
                if size == 8:
                    key = addresses.get(ctypes.c_uint64.from_address(own[i]).value)
                    if key is not None:
                        own[i] = ctypes.addressof(holders[key])
                        found.add(key)
                        hit = True
            if hit:
                params.kernelParams = ctypes.cast(own, ctypes.POINTER(ctypes.c_void_p))
                patched.append((ctypes.c_void_p(node), params, own))
        missing = set(holders) - found
        if missing:
            raise RuntimeError(f"addresses of {sorted(map(str, missing))} in no kernel's arguments")
        return PointerArgs(self, patched, holders)

    def __del__(self):
        try:
            if self._exec:
                _lib.cuGraphExecDestroy(self._exec)
            if self._graph:
                _lib.cuGraphDestroy(self._graph)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
            pass


def _param_sizes(func) -> list:
    """The byte size of each parameter a kernel function takes (cuFuncGetParamInfo answers up to the last)."""
    lib, sizes = _cuda(), []
    offset, size = ctypes.c_size_t(0), ctypes.c_size_t(0)
    while len(sizes) < _MAX_PARAMS and \
            lib.cuFuncGetParamInfo(func, len(sizes), ctypes.byref(offset), ctypes.byref(size)) == 0:
        sizes.append(size.value)
    return sizes


class PointerArgs:
    """Pointer arguments of a graph's kernel nodes, each bound to a key, set per launch in the
    instantiated graph (cuGraphExecKernelNodeSetParams: later launches only; a launch already
    enqueued keeps the values it had)."""

    def __init__(self, graph: DriverGraph, patched: list, holders: dict):
        self._graph = graph
        self._keep = patched  # each node's parameters and argument array, alive while the graph may launch
        self._patched = [(node, ctypes.byref(params)) for node, params, _own in patched]
        self._holders = list(holders.items())
        self._set_params = _lib.cuGraphExecKernelNodeSetParams_v2

    def set(self, values) -> bool:
        """Point the bound arguments at ``values[key].data_ptr()`` for every key; False (the
        graph then holds some old values) where the driver refused an update."""
        for key, holder in self._holders:
            holder.value = values[key].data_ptr()
        fn, exec_ = self._set_params, self._graph._exec
        ok = True
        for node, ref in self._patched:
            ok = fn(exec_, node, ref) == 0 and ok
        return ok


__all__ = ["DriverGraph", "PointerArgs"]
