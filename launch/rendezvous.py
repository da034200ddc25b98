"""Meeting the other ranks: the store, then everyone's arrival, all within --timeout.

torch's env:// rendezvous waits for a missing rank for the process group's timeout (a minute or
more), logging each failed connection attempt with a C++ stack trace, and then raises. Here a rank connects to the store (or hosts it:
rank 0 when no launcher does, as torch does), posts its arrival and waits for every rank's,
all bounded by --timeout; a rank that never came is named (exit code 4). The store is returned
for `init_process_group(store=...)`, so the process group never waits for a rank again at start.
"""

from __future__ import annotations

import datetime
import os
import time

from tpguard.launch.options import OptionsError
from tpguard.launch.state_collective import StartupTimeoutError
from tpguard.watchdog import bounded, silence_c10d


def agent_hosts_store() -> bool:
    """torchrun's agent (or `tpguard launch`) hosts the store; otherwise rank 0 does."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _endpoint() -> tuple[str, int]:
    addr = os.environ.get("MASTER_ADDR", "").strip()
    port = os.environ.get("MASTER_PORT", "").strip()
    if not addr or not port:
        raise OptionsError("environment variables MASTER_ADDR and MASTER_PORT must be set "
                           "(run under torchrun or tpguard launch, or set them with RANK and WORLD_SIZE)")
    try:
        number = int(port)
    except ValueError:
        raise OptionsError(f"environment variable MASTER_PORT must be an integer, got {port!r}") from None
    if not 0 < number < 65536:
        raise OptionsError(f"environment variable MASTER_PORT must be in [1, 65535], got {number}")
    return addr, number


def rendezvous(rank: int, world_size: int, timeout_s: float):
    """The store, once every rank has arrived; StartupTimeoutError naming those that did not."""
    from torch.distributed import TCPStore

    addr, port = _endpoint()
    deadline = time.monotonic() + timeout_s
    agent = agent_hosts_store()
    hosting = not agent and rank == 0
    where = f"{addr}:{port}"
    errors: list[BaseException] = []

    def connect():
        try:
            return TCPStore(addr, port, world_size, is_master=hosting, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=timeout_s), multi_tenant=hosting)
        except Exception as e:  # noqa: BLE001 - sorted below
            errors.append(e)
            return None

    store = bounded(connect, timeout_s + 0.5)  # (c10d's logs off: one line for a failure, below)
    if store is None:
        silence_c10d()  # the connecting thread may still be retrying, and logging each attempt
        text = str(errors[0]) if errors else ""
        if hosting:
            raise OptionsError(f"rank 0 cannot host the store at {where}: {text.splitlines()[0] if text else '?'} "
                               "(MASTER_PORT in use?)")
        if agent:
            raise StartupTimeoutError(f"tpguard: no store at {where} within {timeout_s:g} s (the launcher that "
                                      "hosts it is gone?)")
        raise StartupTimeoutError(f"tpguard: rank(s) [0] never arrived within {timeout_s:g} s: no store at "
                                  f"{where} (rank 0 hosts it)")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    keys = [f"tpguard/arrived/{attempt}/{r}" for r in range(world_size)]
    if bounded(lambda: store.set(keys[rank], str(os.getpid())) or True, max(0.1, deadline - time.monotonic()),
               False) is False:
        raise StartupTimeoutError(f"tpguard: rank {rank}: the store at {where} does not answer")
    missing = list(range(world_size))
    while True:
        arrived = bounded(lambda: [r for r in missing if store.check([keys[r]])], 1.0)
        if arrived is not None:
            missing = [r for r in missing if r not in arrived]
        if not missing:
            return store
        if time.monotonic() >= deadline:
            raise StartupTimeoutError(
                f"tpguard: rank(s) {missing} never arrived within {timeout_s:g} s "
                f"(rank {rank} waited; world size {world_size}, store {where})")
        time.sleep(0.05)
