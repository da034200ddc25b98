"""Prometheus metrics of the guard, in the process's default registry (SGLang exposes it on
its /metrics endpoint). Optional: without prometheus_client the guard runs without metrics."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_metrics = None


def _create():
    from prometheus_client import Counter, Histogram

    return {
        "checked": Counter("tpguard_checked_steps", "Verify steps the guard compared across ranks",
                           ["site"]),
        "divergences": Counter("tpguard_divergences", "Steps where ranks disagreed, by first quantity",
                               ["site", "quantity"]),
        "heals": Counter("tpguard_heals", "Divergences healed by a rank-0 broadcast", ["site"]),
        "aborts": Counter("tpguard_aborts", "Divergences that aborted the run", ["site"]),
        "timeouts": Counter("tpguard_timeouts", "Ranks that stopped reaching the guard", ["site"]),
        "switches": Counter("tpguard_fix_switches", "Causes switched off by policy fix (renorm, broadcast)",
                            ["site", "what"]),
        "seconds": Histogram("tpguard_guard_seconds", "Host time the guard spent per checked step",
                             ["site"], buckets=(5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2, 0.1)),
    }


def guard_metrics():
    """The metric families, created once per process; None without prometheus_client."""
    global _metrics
    with _lock:
        if _metrics is None:
            try:
                _metrics = _create()
            except ImportError:
                from tpguard.optional import say_once

                say_once("prometheus_client", "the guard's Prometheus metrics")
                _metrics = {}
    return _metrics or None


class MetricsListener:
    """Counts what one guard does (a guard made with `metrics=True` owns one)."""

    def __init__(self, site: str):
        self.site = site
        self.m = guard_metrics()

    def checked(self, seconds: float) -> None:
        if self.m:
            self.m["checked"].labels(self.site).inc()
            self.m["seconds"].labels(self.site).observe(seconds)

    def divergence(self, div) -> None:
        if not self.m:
            return
        self.m["divergences"].labels(self.site, div.quantity).inc()
        if div.action == "healed":
            self.m["heals"].labels(self.site).inc()
        elif div.action == "aborted":
            self.m["aborts"].labels(self.site).inc()

    def switch(self, what: str) -> None:
        if self.m:
            self.m["switches"].labels(self.site, what).inc()

    def timeout(self) -> None:
        if self.m:
            self.m["timeouts"].labels(self.site).inc()
