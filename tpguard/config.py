"""All of tpguard's knobs in one place: the guard's settings and the TPGUARD_* environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tpguard.quantities import CANONICAL_ORDER, DECISIONS_MODE

POLICIES = ("record", "heal", "abort")
MODES = ("off", "on", "audit")
RENORMS = ("default", "deterministic")
RENORM_BACKENDS = ("", "tpguard", "flashinfer", "torch")  # "": the first available
GUARD_KINDS = ("auto", "sync", "device")
QUANTITY_SETS = {"full": CANONICAL_ORDER, "decisions": DECISIONS_MODE}


@dataclass
class GuardConfig:
    mode: str = "off"  # TPGUARD: off | on | audit
    trace_dir: str | None = None  # TPGUARD_TRACE_DIR
    every: int = 1  # TPGUARD_EVERY: check every N verify steps
    sample_one_in: int = 0  # TPGUARD_SAMPLE: 1-in-N random steps with a shared seed (0: off)
    policy: str = "record"  # TPGUARD_ON_DIVERGENCE
    renorm: str = "default"  # TPGUARD_RENORM
    dump: bool = False  # TPGUARD_DUMP
    timeout_s: float = 60.0  # TPGUARD_TIMEOUT
    quantity_set: str = "full"  # TPGUARD_QUANTITIES: full | decisions
    merged: bool = False  # TPGUARD_MERGED: rank 0 also writes a merged trace
    clean_every: int = 1  # TPGUARD_CLEAN_EVERY: write 1 in N clean step records
    max_trace_bytes: int = 0  # TPGUARD_MAX_TRACE_MB (0: no rotation)
    run_id: str | None = None  # TPGUARD_RUN_ID: one id for every process of a server (tpguard serve)
    renorm_backend: str = ""  # TPGUARD_RENORM_BACKEND: tpguard | flashinfer | torch ("": first available)
    all_processes: bool = False  # TPGUARD_ALL_PROCESSES: hook non-scheduler processes too (scripts)
    # TPGUARD_GUARD: auto (DeviceStepGuard on NCCL groups for record/abort, StepGuard otherwise),
    # sync (always StepGuard: host-synchronous, names rows, dumps), device (always DeviceStepGuard)
    guard: str = "auto"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        _check("TPGUARD", self.mode, MODES)
        _check("TPGUARD_ON_DIVERGENCE", self.policy, POLICIES)
        _check("TPGUARD_RENORM", self.renorm, RENORMS)
        _check("TPGUARD_QUANTITIES", self.quantity_set, tuple(QUANTITY_SETS))
        _check("TPGUARD_RENORM_BACKEND", self.renorm_backend, RENORM_BACKENDS)
        _check("TPGUARD_GUARD", self.guard, GUARD_KINDS)
        if self.every < 1:
            raise ValueError(f"TPGUARD_EVERY must be >= 1, got {self.every}")
        if self.timeout_s <= 0:
            raise ValueError(f"TPGUARD_TIMEOUT must be > 0, got {self.timeout_s}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def quantities(self) -> tuple[str, ...]:
        return QUANTITY_SETS[self.quantity_set]

    @classmethod
    def from_env(cls, env: dict | None = None) -> "GuardConfig":
        env = os.environ if env is None else env
        get = lambda k, d: env.get(k, d).strip()  # noqa: E731
        try:
            return cls(
                mode=get("TPGUARD", "off").lower() or "off",
                trace_dir=env.get("TPGUARD_TRACE_DIR") or None,
                every=int(get("TPGUARD_EVERY", "1")),
                sample_one_in=int(get("TPGUARD_SAMPLE", "0")),
                policy=get("TPGUARD_ON_DIVERGENCE", "record").lower(),
                renorm=get("TPGUARD_RENORM", "default").lower(),
                dump=get("TPGUARD_DUMP", "0") in ("1", "true", "yes", "on"),
                timeout_s=float(get("TPGUARD_TIMEOUT", "60")),
                quantity_set=get("TPGUARD_QUANTITIES", "full").lower(),
                merged=get("TPGUARD_MERGED", "0") in ("1", "true", "yes", "on"),
                clean_every=int(get("TPGUARD_CLEAN_EVERY", "1")),
                max_trace_bytes=int(float(get("TPGUARD_MAX_TRACE_MB", "0")) * 1024 * 1024),
                run_id=env.get("TPGUARD_RUN_ID") or None,
                renorm_backend=get("TPGUARD_RENORM_BACKEND", "").lower(),
                all_processes=get("TPGUARD_ALL_PROCESSES", "0") in ("1", "true", "yes", "on"),
                guard=get("TPGUARD_GUARD", "auto").lower() or "auto",
            )
        except ValueError as e:  # int("x") and our own checks: one line, names the variable
            raise ValueError(f"tpguard: bad environment: {e}") from None


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {'|'.join(allowed)}, got {value!r}")
