"""Optional dependencies: imported when used, with one line saying how to install what is missing.

safetensors (extra ``dump``): the guard's dumps and `tpguard replay`. prometheus_client (extra
``metrics``): the guard's Prometheus counters; without it the guard runs without metrics.
"""

from __future__ import annotations

import importlib
import logging

EXTRAS = {"safetensors": "dump", "prometheus_client": "metrics"}


class MissingDependency(ImportError):
    """An optional package is not installed; the message is one line naming the extra."""


def missing(module: str, what: str) -> str | None:
    """One line if `module` cannot be imported (what needs it, and the pip extra), else None."""
    try:
        importlib.import_module(module)
        return None
    except ImportError:
        extra = EXTRAS.get(module, module)
        return f"{what} need {module}, which is not installed: pip install 'tpguard[{extra}]'"


def require(module: str, what: str):
    """The module, or MissingDependency with one line."""
    problem = missing(module, what)
    if problem:
        raise MissingDependency(problem)
    return importlib.import_module(module)


_said: set[str] = set()


def say_once(module: str, what: str, logger: str = "tpguard") -> None:
    """Log, once per process, that `what` is off because `module` is missing."""
    problem = missing(module, what)
    if problem and module not in _said:
        _said.add(module)
        logging.getLogger(logger).warning("tpguard: %s", problem)
