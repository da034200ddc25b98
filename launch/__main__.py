"""`python -m tpguard.launch [options]` under torchrun (env RANK, WORLD_SIZE, MASTER_ADDR, ...).

Meets the other ranks within --timeout (launch/rendezvous.py), initialises the default process
group (gloo on CPU; NCCL with --device cuda when each rank has its own GPU; gloo when ranks share
one), runs the harness, prints rank 0's summary, and exits with the run's code (docs/harness.md):
0 ok, 1 diverged, 2 bad arguments, 3 aborted, 4 timeout (a rank stopped answering, died, or never
arrived: named), 5 internal error, 6 this rank cannot go on (its trace cannot be written), 130 /
143 on SIGINT / SIGTERM (launch/signals.py). Failures are one line, never a traceback. A rank that
did not end cleanly may leave a collective pending, so it exits with os._exit after flushing.
"""

from __future__ import annotations

import datetime
import os
import sys

from tpguard.errors import EXIT_BAD_INPUT, EXIT_RANK_DIED, EXIT_TIMEOUT, TPGuardError
from tpguard.launch.options import HarnessOptions, OptionsError, check_paths, parse_options

LAUNCHER_ENV = "TPGUARD_LAUNCHER"  # "1" in ranks started by `tpguard launch`, which prints the run's one line


def choose_backend(opts: HarnessOptions, world_size: int) -> str:
    if opts.backend != "auto":
        return opts.backend
    if opts.device == "cuda":
        import torch

        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return "nccl" if torch.cuda.device_count() >= local_world else "gloo"
    return "gloo"


def check_environment(opts: HarnessOptions, world_size: int) -> str:
    """Checks that need torch (devices, backends); returns the process group backend."""
    import torch

    from tpguard.renorm_registry import BackendUnavailable, get_backend

    if opts.device == "cuda" and not torch.cuda.is_available():
        raise OptionsError("--device cuda: no GPU is visible here (use --device cpu)")
    try:
        get_backend(opts.renorm, opts.device)
    except BackendUnavailable as e:
        raise OptionsError(f"--renorm {opts.renorm}: {e}") from None
    backend = choose_backend(opts, world_size)
    if backend == "nccl" and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world_size)):
        raise OptionsError("--backend nccl needs one GPU per rank; ranks sharing a GPU use --backend gloo")
    return backend


def init_process_group(opts: HarnessOptions, backend: str, rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    from tpguard.launch.harness import device_for_rank
    from tpguard.launch.rendezvous import rendezvous

    device_for_rank(opts)
    store = rendezvous(rank, world_size, opts.timeout)
    pg_timeout = datetime.timedelta(seconds=max(60.0, 2 * opts.timeout))
    store.set_timeout(pg_timeout)
    kwargs = {"timeout": pg_timeout}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)


def _env_int(name: str, default: int) -> int:
    """torchrun's RANK / WORLD_SIZE (set by hand when run without torchrun)."""
    value = os.environ.get(name, "").strip() or str(default)
    try:
        return int(value)
    except ValueError:
        raise OptionsError(f"environment variable {name} must be an integer, got {value!r}") from None


def crash_line(e: BaseException, code: int) -> str:
    if isinstance(e, TPGuardError):  # its message is the line (a start-up timeout, a trace write)
        return str(e)
    if code == EXIT_RANK_DIED:  # the machine failed the rank (a full disk, a file size limit)
        return f"tpguard: this rank cannot go on: {type(e).__name__}: {e}"
    return (f"tpguard: internal error: {type(e).__name__}: {e} (a tpguard bug; TPGUARD_DEBUG=1 shows "
            "the traceback)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Bad arguments are rejected before torch is imported (instant); a process group can only
    # exist already if torch.distributed was imported (a test calling main() in a rank process).
    dist = sys.modules.get("torch.distributed")
    already = dist is not None and dist.is_available() and dist.is_initialized()
    try:
        rank = dist.get_rank() if already else _env_int("RANK", 0)
        world = dist.get_world_size() if already else _env_int("WORLD_SIZE", 1)
    except OptionsError as e:
        print(f"tpguard launch: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    try:
        opts = parse_options(argv, world)
        check_paths(opts, reused_run_id=False)
        backend = check_environment(opts, world)
    except OptionsError as e:
        if rank == 0:
            print(f"tpguard launch: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    import torch.distributed as dist

    from tpguard.launch.state_collective import StartupTimeoutError

    if not already:  # this process is the rank: its signals, its rendezvous
        from tpguard.launch import signals

        signals.install(rank, announce=os.environ.get(LAUNCHER_ENV) != "1")
        try:
            init_process_group(opts, backend, rank, world)
        except OptionsError as e:
            print(f"tpguard launch: error: {e}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        except StartupTimeoutError as e:
            print(f"[rank {rank}] {e}", file=sys.stderr, flush=True)
            return e.exit_code
    from tpguard.launch.harness import run_harness
    from tpguard.launch.summary import format_text

    try:
        summary = run_harness(opts)
    except Exception as e:  # noqa: BLE001 - one line and a documented code, never a traceback
        from tpguard.config import debug

        if debug():
            raise
        from tpguard.launch.harness import crash_code

        code = crash_code(e)
        # under `tpguard launch` the launcher prints the line from the note this rank left
        if not (getattr(e, "tpguard_noted", False) and os.environ.get(LAUNCHER_ENV) == "1"):
            print(f"[rank {rank}] {crash_line(e, code)}", file=sys.stderr, flush=True)
        return code
    code = summary.exit_code
    if rank == 0 and not opts.quiet:
        print(format_text(summary), flush=True)
    # Each rank says how its run ended; under `tpguard launch` only rank 0 does (the launcher
    # names a rank that died or froze, and every rank's message is in its trace).
    launched = os.environ.get(LAUNCHER_ENV) == "1"
    if summary.ended != "completed" and summary.message and (rank != 0 or opts.quiet) and not (launched and rank):
        print(f"[rank {rank}] {summary.message}", file=sys.stderr, flush=True)
    if not already and code != EXIT_TIMEOUT:
        dist.destroy_process_group()
    return code


def exit_with(code: int) -> None:
    """Flush and leave. A rank that did not end cleanly may hold a pending collective, or a
    thread blocked on a store whose host is gone, either of which would block a normal exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_with(main())
