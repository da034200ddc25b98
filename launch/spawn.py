"""Start N harness ranks as local processes with torchrun's environment, without torchrun.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_USE_AGENT_STORE and OMP_NUM_THREADS=1 (what torchrun sets; the store is hosted by
this process, as torchrun's agent hosts it) and runs `tpguard.launch.__main__.main(argv)`, so it is
the same code path as `torchrun --nproc-per-node N -m tpguard.launch`. Processes come from a
forkserver that has imported torch once, so the demo and the tests pay torch's import once, not
once per rank per run. Returns every rank's own exit code (and its output when captured).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import dataclass

_PRELOAD = ["torch", "torch.distributed", "numpy", "tpguard.guard", "tpguard.launch.harness"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_entry(argv: list[str], env: dict[str, str], out_path: str | None) -> None:
    if out_path is not None:
        fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    import torch

    # torch was imported by the forkserver before OMP_NUM_THREADS was set here: apply it now, or
    # each rank spins up one OpenMP thread per core and the ranks fight over the cores.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    code = 1
    try:
        from tpguard.launch.__main__ import main

        code = main(argv)
    except SystemExit as e:  # --help, or a library calling sys.exit
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 - reported, then the rank exits non-zero
        import traceback

        traceback.print_exc()
        print(f"[rank {env.get('RANK')}] internal error: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # A rank that timed out may hold a pending collective; never wait for it at exit.
        os._exit(code)


@dataclass
class SpawnResult:
    exit_codes: list[int | None]  # None: killed after `timeout`
    outputs: list[str]  # per rank, when captured


def _agent_store(world_size: int):
    """The rendezvous store, hosted here as torchrun's agent hosts it, so it outlives any rank
    (a rank that timed out and exited must not take the store the others read from with it)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def spawn_ranks(argv: list[str], world_size: int, timeout: float | None = None, capture: bool = False,
                env: dict[str, str] | None = None) -> SpawnResult:
    ctx = _context()
    store = _agent_store(world_size)
    port = store.port
    tmp = tempfile.mkdtemp(prefix="tpguard-spawn-") if capture else None
    procs, paths = [], []
    for r in range(world_size):
        rank_env = {**(env or {}), "RANK": str(r), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        path = os.path.join(tmp, f"rank{r}.log") if tmp else None
        p = ctx.Process(target=_rank_entry, args=(list(argv), rank_env, path), name=f"tpguard-rank{r}")
        p.start()
        procs.append(p)
        paths.append(path)
    codes: list[int | None] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    for p in procs:
        p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if p.is_alive():  # only ever the processes started above, by their own handle
            p.kill()
            p.join(5)
            codes.append(None)
        else:
            codes.append(p.exitcode)
    outputs = []
    for path in paths:
        if path is None:
            outputs.append("")
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                outputs.append(f.read())
            os.unlink(path)
        except OSError:
            outputs.append("")
    if tmp:
        os.rmdir(tmp)  # empty by now (only the rank logs were written there)
    return SpawnResult(codes, outputs)
