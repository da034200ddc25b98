"""`tpguard launch --nproc-per-node N [harness options]`: the harness through torch.distributed.run.

Harness arguments are checked here first (with the world size N), so bad ones are rejected
before any process starts. The workers' own exit code is returned (3 abort, 4 timeout, 1
diverged, 2 bad arguments) rather than torchrun's generic 1: the first failure torchrun reports
(the earliest to fail) decides it.
"""

from __future__ import annotations

import logging
import sys

from tpguard.errors import EXIT_BAD_INPUT, EXIT_DIVERGED
from tpguard.launch.options import OptionsError, check_paths, parse_options


def torchrun_args(nproc_per_node: int, args: list[str]) -> list[str]:
    return ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0",
            "--monitor-interval", "0.1", "-m", "tpguard.launch", *args]


def launch_via_torchrun(nproc_per_node: int, args: list[str]) -> int:
    try:
        if nproc_per_node < 2:
            raise OptionsError(f"--nproc-per-node must be >= 2 (the harness compares ranks), got {nproc_per_node}")
        check_paths(parse_options(list(args), world_size=nproc_per_node))
    except SystemExit as e:  # --help printed the harness's options
        return int(e.code or 0)
    except OptionsError as e:
        print(f"tpguard launch: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's agent logs its own set-up at WARNING; the workers' messages are what matter here.
    # (failures included: the workers print their own one-line reason, we return their exit code).
    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(torchrun_args(nproc_per_node, list(args))))
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        code = failure.exitcode
        return code if isinstance(code, int) and 0 < code < 128 else EXIT_DIVERGED
    return 0
