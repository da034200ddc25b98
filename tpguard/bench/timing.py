"""Timers shared by the benchmarks (GPU): CUDA events, back-to-back batches, CUDA-graph replay,
and wall/host clocks. Each returns median microseconds per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

Fn = Callable[[], object]


def time_events(fn: Fn, iters: int, warmup: int = 3) -> float:
    """Each call between its own pair of CUDA events (GPU time, plus any launch gaps inside)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in pairs)


def time_batched(fn: Fn, iters: int, rounds: int = 7, warmup: int = 3) -> float:
    """`rounds` batches of `iters` back-to-back calls between events: the GPU queue stays ahead of
    the host, so this is device time whenever the host launches faster than the device runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(per_call)


def time_wall(fn: Fn, iters: int, warmup: int = 5) -> float:
    """Host clock with the device synchronised around each call: what a caller waits."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def time_host(fn: Fn, iters: int) -> float:
    """Host time per call (Python + launch overhead), no synchronisation inside the loop."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return host


def capture(fn: Fn, warmup: int = 2, per_replay: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `per_replay` calls of fn, after warm-up calls on a side stream (they compile
    kernels, cache plans and initialise communicators outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_replay):
            fn()
    return graph


def time_graph(fn: Fn, iters: int, per_replay: int = 1, timer: Callable[[Fn, int], float] = time_events,
               strict: bool = True) -> float | None:
    """Microseconds per call replayed from a CUDA graph (GPU time, no launch gaps). With
    strict=False a call that cannot be captured gives None instead of an exception."""
    try:
        graph = capture(fn, per_replay=per_replay)
        return timer(graph.replay, iters) / per_replay
    except Exception:  # noqa: BLE001 - some calls sync or allocate in ways capture refuses
        if strict:
            raise
        torch.cuda.synchronize()
        return None
