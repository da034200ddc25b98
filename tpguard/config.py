"""All of tpguard's knobs in one place: the guard's settings and the TPGUARD_* environment."""

from __future__ import annotations

import contextlib
import math
import os
import re
import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

from tpguard.quantities import CANONICAL_ORDER, DECISIONS_MODE
from tpguard.renorm_words import PLUGIN_RENORMS, RENORM_BACKEND_ALIASES, RENORM_BACKEND_VALUES, plugin_choice

POLICIES = ("record", "heal", "abort", "fix")
MODES = ("off", "on", "audit")
GUARD_KINDS = ("auto", "sync", "device")
QUANTITY_SETS = {"full": CANONICAL_ORDER, "decisions": DECISIONS_MODE}
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


@dataclass
class GuardConfig:
    mode: str = "off"  # TPGUARD: off | on | audit
    trace_dir: str | None = None  # TPGUARD_TRACE_DIR
    every: int = 1  # TPGUARD_EVERY: check every N verify steps
    sample_one_in: int = 0  # TPGUARD_SAMPLE: 1-in-N random steps with a shared seed (0: off)
    policy: str = "record"  # TPGUARD_ON_DIVERGENCE
    renorm: str = "default"  # TPGUARD_RENORM: default | deterministic | tpguard | flashinfer-det | torch
    dump: bool = False  # TPGUARD_DUMP
    timeout_s: float = 60.0  # TPGUARD_TIMEOUT
    quantity_set: str = "full"  # TPGUARD_QUANTITIES: full | decisions
    merged: bool = False  # TPGUARD_MERGED: rank 0 also writes a merged trace
    clean_every: int = 1  # TPGUARD_CLEAN_EVERY: write 1 in N clean step records
    max_trace_bytes: int = 0  # TPGUARD_MAX_TRACE_MB (0: no rotation)
    run_id: str | None = None  # TPGUARD_RUN_ID: one id for every process of a server (tpguard serve)
    # TPGUARD_RENORM_BACKEND (older spelling of TPGUARD_RENORM=NAME): tpguard | flashinfer-det | torch, with
    # TPGUARD_RENORM=deterministic ("": the first available; "flashinfer": flashinfer-det)
    renorm_backend: str = ""
    all_processes: bool = False  # TPGUARD_ALL_PROCESSES: hook non-scheduler processes too (scripts)
    # TPGUARD_GUARD: auto (DeviceStepGuard on NCCL groups for record/abort, StepGuard otherwise),
    # sync (always StepGuard: host-synchronous, names rows, dumps), device (always DeviceStepGuard)
    guard: str = "auto"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        _check("TPGUARD", self.mode, MODES)
        _check("TPGUARD_ON_DIVERGENCE", self.policy, POLICIES)
        _check("TPGUARD_RENORM", self.renorm, PLUGIN_RENORMS)
        _check("TPGUARD_QUANTITIES", self.quantity_set, tuple(QUANTITY_SETS))
        _check("TPGUARD_RENORM_BACKEND", self.renorm_backend, RENORM_BACKEND_VALUES + tuple(RENORM_BACKEND_ALIASES))
        _check("TPGUARD_GUARD", self.guard, GUARD_KINDS)
        if self.every < 1:
            raise ValueError(f"TPGUARD_EVERY must be >= 1, got {self.every}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"TPGUARD_TIMEOUT must be > 0 and finite, got {self.timeout_s}")
        if self.sample_one_in < 0:
            raise ValueError(f"TPGUARD_SAMPLE must be >= 0 (0: off), got {self.sample_one_in}")
        if self.clean_every < 1:
            raise ValueError(f"TPGUARD_CLEAN_EVERY must be >= 1, got {self.clean_every}")
        if self.max_trace_bytes < 0:
            raise ValueError(f"TPGUARD_MAX_TRACE_MB must be >= 0 (0: no rotation), got {self.max_trace_bytes / 2**20:g}")
        if self.run_id is not None:
            check_run_id(self.run_id, "TPGUARD_RUN_ID")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def renorm_choice(self) -> str:
        """What the plugin routes sglang's renorms to: ``default`` (nothing), ``deterministic`` or an
        implementation's name (tpguard.renorm_words.plugin_choice of TPGUARD_RENORM and
        TPGUARD_RENORM_BACKEND)."""
        return plugin_choice(self.renorm, self.renorm_backend)

    @property
    def quantities(self) -> tuple[str, ...]:
        return QUANTITY_SETS[self.quantity_set]

    @classmethod
    def from_env(cls, env: dict | None = None) -> "GuardConfig":
        env = os.environ if env is None else env

        def get(k: str, default: str) -> str:  # set but empty (or blank) means unset
            return str(env.get(k, "")).strip() or default

        def integer(k: str, default: str) -> int:
            try:
                return int(get(k, default))
            except ValueError:
                raise ValueError(f"{k} must be an integer, got {env.get(k)!r}") from None

        def number(k: str, default: str) -> float:
            try:
                x = float(get(k, default))
            except ValueError:
                raise ValueError(f"{k} must be a number, got {env.get(k)!r}") from None
            if not math.isfinite(x):
                raise ValueError(f"{k} must be a finite number, got {env.get(k)!r}")
            return x

        def flag(k: str) -> bool:
            v = get(k, "0").lower()
            if v not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError(f"{k} must be one of {'|'.join(TRUE_WORDS + FALSE_WORDS)}, got {env.get(k)!r}")
            return v in TRUE_WORDS

        try:
            return cls(
                mode=get("TPGUARD", "off").lower(),
                trace_dir=env.get("TPGUARD_TRACE_DIR") or None,
                every=integer("TPGUARD_EVERY", "1"),
                sample_one_in=integer("TPGUARD_SAMPLE", "0"),
                policy=get("TPGUARD_ON_DIVERGENCE", "record").lower(),
                renorm=get("TPGUARD_RENORM", "default").lower(),
                dump=flag("TPGUARD_DUMP"),
                timeout_s=number("TPGUARD_TIMEOUT", "60"),
                quantity_set=get("TPGUARD_QUANTITIES", "full").lower(),
                merged=flag("TPGUARD_MERGED"),
                clean_every=integer("TPGUARD_CLEAN_EVERY", "1"),
                max_trace_bytes=int(number("TPGUARD_MAX_TRACE_MB", "0") * 1024 * 1024),
                run_id=str(env.get("TPGUARD_RUN_ID", "")).strip() or None,
                renorm_backend=get("TPGUARD_RENORM_BACKEND", "").lower(),
                all_processes=flag("TPGUARD_ALL_PROCESSES"),
                guard=get("TPGUARD_GUARD", "auto").lower(),
            )
        except (ValueError, TypeError, OverflowError) as e:  # one line, names the variable
            raise ValueError(f"tpguard: bad environment: {e}") from None


RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_id(run_id: object, what: str = "run id") -> str:
    """A run id becomes part of file names: letters, digits, '.', '_', '-' (no '/', no '..')."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id) or ".." in run_id:
        raise ValueError(f"{what} must be 1-128 letters, digits, '.', '_' or '-' (starting with a letter "
                         f"or digit, no '..'), got {run_id!r}")
    return run_id


# --- kernel and launch knobs ----------------------------------------------------------------------
# Read when used, never at import: a test, a benchmark or a server may set them after tpguard loads.
# (Triton itself reads TRITON_INTERPRET when a kernel is decorated; interpreting() answers with the
# same rule, so a caller can tell which kind of kernel it holds.)

_ENCODED_KEYS: dict[str, object] = {}  # knob name -> os.environ's key for it (encoding it costs a call)


def env_value(name: str, default: str = "") -> str:
    """os.environ.get(name, default), read from os.environ's own dict: for an unset variable
    os.environ.get raises and catches a KeyError (~1 us), and the renorms read three unset knobs on
    every call. os.environ.get where that dict is not there."""
    data = getattr(os.environ, "_data", None)
    if data is None:
        return os.environ.get(name, default)
    key = _ENCODED_KEYS.get(name)
    if key is None:
        key = _ENCODED_KEYS[name] = os.environ.encodekey(name)
    raw = data.get(key)
    return default if raw is None else os.environ.decodevalue(raw)


@contextlib.contextmanager
def env_set(name: str, value: str):
    """The knob `name` = `value` inside (benchmarks that compare settings in one process), as it was after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def env_snapshot(names: tuple[str, ...]):
    """(os.environ's own dict, the names' keys in it, their values now: None where unset), for a
    compiled reader that compares the knobs per call (kernels/lane_entry.py); None where os.environ
    has no such dict."""
    data = getattr(os.environ, "_data", None)
    if data is None:
        return None
    keys = tuple(os.environ.encodekey(name) for name in names)
    return data, keys, tuple(data.get(key) for key in keys)


def interpreting() -> bool:
    """TRITON_INTERPRET as Triton reads it: 1, true, on or yes."""
    return env_value("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def debug() -> bool:
    """TPGUARD_DEBUG=1: a command-line error prints its traceback too."""
    return os.environ.get("TPGUARD_DEBUG", "").strip() == "1"


def fast_launch() -> bool:
    """TPGUARD_FAST_LAUNCH=0: always Triton's own launch (no recorded direct launches)."""
    return env_value("TPGUARD_FAST_LAUNCH", "1").strip() != "0"


def launch_trim() -> bool:
    """TPGUARD_LAUNCH_TRIM=0: record launch templates as Triton hands them (the benchmark's baseline)."""
    return env_value("TPGUARD_LAUNCH_TRIM", "1").strip() != "0"


def fingerprint_config_text() -> str:
    """TPGUARD_FP_CONFIG: ``field=value,...`` over the fingerprint kernel's default config."""
    return env_value("TPGUARD_FP_CONFIG")


def renorm_config_text() -> str:
    """TPGUARD_RENORM_CONFIG: ``field=value,...`` over the renorm kernels' default config."""
    return env_value("TPGUARD_RENORM_CONFIG")


def renorm_plan_limits() -> tuple[int, int]:
    """(TPGUARD_RENORM_PLANS, TPGUARD_RENORM_PLAN_MB in bytes): how many recorded renorm call plans a
    process keeps, and their memory cap."""
    return _plan_limits(env_value("TPGUARD_RENORM_PLANS"), env_value("TPGUARD_RENORM_PLAN_MB"))


@functools.lru_cache(maxsize=16)
def _plan_limits(plans_raw: str, mb_raw: str) -> tuple[int, int]:  # both parses behind one cache lookup
    plans = _parse_number("TPGUARD_RENORM_PLANS", plans_raw, "16", int)
    mb = _parse_number("TPGUARD_RENORM_PLAN_MB", mb_raw, "256", float)
    return plans, int(mb * (1 << 20))


def renorm_graph_rows() -> int:
    """TPGUARD_RENORM_GRAPH_ROWS: up to how many rows a renorm call is replayed as a CUDA graph."""
    return _env_number("TPGUARD_RENORM_GRAPH_ROWS", "1024", int)


def _env_number(name: str, default: str, kind):
    return _parse_number(name, env_value(name), default, kind)


@functools.lru_cache(maxsize=64)
def _parse_number(name: str, raw: str, default: str, kind):
    """The parse of one variable's text, cached: the renorm plans read their limits on every call."""
    text = raw.strip() or default
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if value < 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be >= 0 and finite, got {text!r}")
    return value


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {'|'.join(allowed)}, got {value!r}")


def trace_dir_problem(path: str | os.PathLike) -> str | None:
    """Why traces cannot be written under `path` (created here if missing), or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        return f"trace directory {path} exists and is not a directory"
    except OSError as e:
        return f"trace directory {path} cannot be created ({e.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"trace directory {path} is not writable"
    return None


def output_file_problem(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at `path` (checked before the work that produces it), or None."""
    p = Path(path)
    if p.is_dir():
        return "is a directory"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return "not writable"
    return None


def replace_from_text(base, text: str, what: str):
    """A copy of dataclass instance `base` with ``name=value,...`` applied (kernel configs from an
    environment variable or a command line). Values take the type of the field's current value
    (int, float, str); ``none`` unsets an optional one. A bad item: a one-line ValueError naming
    `what`."""
    fields = [f.name for f in dataclasses.fields(base)]
    changes = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if name not in fields:
            raise ValueError(f"{what}: unknown field {name!r} (known: {', '.join(fields)})")
        current = getattr(base, name)
        try:
            if value.strip().lower() == "none":
                changes[name] = None
            elif isinstance(current, str):
                changes[name] = value.strip()
            else:
                changes[name] = float(value) if isinstance(current, float) else int(value)
        except ValueError:
            raise ValueError(f"{what}: {name}={value!r}: expected {type(current).__name__}") from None
    return dataclasses.replace(base, **changes)
