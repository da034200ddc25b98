"""Run a function on N real processes joined by a gloo process group (for tests).

Processes come from a forkserver that has already imported torch and tpguard, so each test pays
milliseconds, not seconds, per rank; each rank returns a value (or its exception) to the test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback

_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "torch.distributed", "tpguard", "tpguard.guard", "numpy"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, queue, env):
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # the forkserver imported torch before OMP_NUM_THREADS could apply

        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def run_ranks(fn, world_size: int = 2, *args, timeout: float = 120.0, env: dict | None = None):
    """Run fn(rank, world_size, *args) on each rank; return results by rank or raise."""
    queue = _ctx.Queue()
    port = free_port()
    procs = [_ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, env or {}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        r, (name, msg, tb) = sorted(errors.items())[0]
        raise AssertionError(f"rank {r} raised {name}: {msg}\n{tb}")
    return [results[r][1] for r in range(world_size)]


def run_ranks_raw(fn, world_size: int = 2, *args, timeout: float = 120.0, env: dict | None = None):
    """Like run_ranks, but returns (status, value) per rank instead of raising."""
    queue = _ctx.Queue()
    port = free_port()
    procs = [_ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, env or {}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results.get(r, ("missing", None)) for r in range(world_size)]
