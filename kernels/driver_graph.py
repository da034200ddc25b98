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

Stream handles are the raw ``cudaStream_t`` values (``torch.cuda.Stream.cuda_stream``,
`direct_launch.current_stream()`). Only direct launches (Triton's C launcher: ``cuLaunchKernelEx``)
may run inside `capture`'s function: a torch op there would be captured too, or refused.
"""

from __future__ import annotations

import ctypes

_CAPTURE_MODE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
_lib = None


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

    def __del__(self):
        try:
            if self._exec:
                _lib.cuGraphExecDestroy(self._exec)
            if self._graph:
                _lib.cuGraphDestroy(self._graph)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
            pass


__all__ = ["DriverGraph"]
