"""Typed records of the trace format v1 (docs/trace-format.md).

Each record converts to and from the JSON object of one trace line. Readers ignore fields they
do not know; `extra` keeps them so that a rewrite loses nothing. The guard reports a divergence
as the record it writes (`DivergenceRecord`), so what a listener sees is what the trace holds.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Union

from tpguard.errors import TraceError
from tpguard.quantities import CANONICAL_ORDER

SCHEMA = "tpguard.trace/1"
MAX_STEP = 2**63 - 1  # steps are int64 counters in the guard; a reader refuses larger ones
# ranks a reader accepts: a world size sizes lists and messages, so a corrupt one must not cost memory
# (tensor-parallel groups are far smaller)
MAX_WORLD_SIZE = 1 << 16

# A step record's fingerprint value: one hex string for every rank of the record, one entry per
# rank, or null when not captured.
FpValue = Union[str, list, None]


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Header:
    run_id: str
    world_size: int
    ranks: list[int]
    quantities: list[str] = field(default_factory=lambda: list(CANONICAL_ORDER))
    algo: str = "synthetic"
    created: str = field(default_factory=now_iso)
    versions: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    type = "header"


@dataclass
class StepRecord:
    run_id: str
    step: int
    site: str
    ranks: list[int]
    fp: dict[str, FpValue]
    extra: dict = field(default_factory=dict)

    type = "step"

    def values_by_rank(self, quantity: str) -> dict[int, str | None]:
        return expand_fp(self.fp.get(quantity), self.ranks)


@dataclass
class DivergenceRecord:
    """The first divergence of one step at one site (tpguard.divergence finds it)."""

    run_id: str
    step: int
    site: str
    quantity: str
    values: dict[str, list[int]]  # fingerprint -> ranks holding it
    culprit_ranks: list[int]
    action: str = "recorded"
    dump: str | None = None
    # Fields beyond the spec (readers may ignore them); the optional ones are left out when None.
    majority_ranks: list[int] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)  # every differing quantity, causal order
    rows: list[int] | None = None  # diverging rows of `quantity`, when they could be named
    healed: list[str] | None = None  # decisions rank 0 broadcast (policy heal; [] if all agreed)
    note: str | None = None  # why the policy could not act as asked (a refused heal)
    switch: str | None = None  # policy fix: the switch this divergence turned on (tpguard.fix)
    extra: dict = field(default_factory=dict)

    type = "divergence"


@dataclass
class EventRecord:
    run_id: str
    kind: str
    step: int | None = None
    site: str | None = None
    rank: int | None = None
    message: str = ""
    extra: dict = field(default_factory=dict)

    type = "event"


Record = Union[Header, StepRecord, DivergenceRecord, EventRecord]

_FIELDS = {
    "header": ("run_id", "world_size", "ranks", "quantities", "algo", "created", "versions", "config"),
    "step": ("run_id", "step", "site", "ranks", "fp"),
    "divergence": (
        "run_id", "step", "site", "quantity", "values", "culprit_ranks", "action", "dump",
        "majority_ranks", "differing", "rows", "healed", "note", "switch",
    ),
    "event": ("run_id", "kind", "step", "site", "rank", "message"),
}
_TYPES = {"header": Header, "step": StepRecord, "divergence": DivergenceRecord, "event": EventRecord}
# Fields written only when set (None: left out of the line).
_OPTIONAL = {"divergence": ("rows", "healed", "note", "switch"), "event": ("step", "site", "rank")}
_REQUIRED = {
    "header": ("schema", "run_id", "world_size", "ranks"),
    "step": ("run_id", "step", "site", "ranks", "fp"),
    "divergence": ("run_id", "step", "site", "quantity", "values", "culprit_ranks"),
    "event": ("run_id", "kind"),
}


def to_json(rec: Record) -> dict[str, Any]:
    """The JSON object of one line; `type` first, `fp` last (cheap to compare textually)."""
    out: dict[str, Any] = {"type": rec.type}
    if rec.type == "header":
        out["schema"] = SCHEMA
    for name in _FIELDS[rec.type]:
        value = getattr(rec, name)
        if value is None and name in _OPTIONAL.get(rec.type, ()):
            continue
        out[name] = value
    out.update(rec.extra)
    if "fp" in out:
        out["fp"] = out.pop("fp")
    return out


def from_json(obj: Any) -> Record:
    """A typed record from one parsed line; TraceError if it is not a v1 record."""
    if not isinstance(obj, dict):
        raise TraceError("a trace line is not a JSON object")
    kind = obj.get("type")
    if kind not in _TYPES:
        raise TraceError(f"unknown record type {kind!r}")
    missing = [k for k in _REQUIRED[kind] if k not in obj]
    if missing:
        raise TraceError(f"{kind} record without {', '.join(missing)}")
    if kind == "header" and obj["schema"] != SCHEMA:
        raise TraceError(f"unknown schema {obj['schema']!r} (this tpguard reads {SCHEMA!r})")
    known = set(_FIELDS[kind]) | {"type", "schema"}
    kwargs = {k: obj[k] for k in _FIELDS[kind] if k in obj}
    kwargs["extra"] = {k: v for k, v in obj.items() if k not in known}
    try:
        rec = _TYPES[kind](**kwargs)
    except TypeError as e:
        raise TraceError(f"bad {kind} record: {e}") from None
    _validate(rec)
    return rec


def _is_int(x: Any) -> bool:
    return type(x) is int  # JSON true/false load as bool, an int subclass: not a step or a rank


def _validate(rec: Record) -> None:
    if rec.type in ("step", "divergence") and not _is_int(rec.step):
        raise TraceError(f"{rec.type} record with a non-integer step {rec.step!r}")
    if rec.type == "header":
        _validate_header(rec)
    if rec.type in ("divergence", "event") and not _side_fields_ok(rec):
        raise TraceError(f"{rec.type} record with fields of the wrong type")
    if rec.type == "step":
        if not isinstance(rec.ranks, list) or not all(_is_int(r) for r in rec.ranks):
            raise TraceError(f"step record with bad ranks {rec.ranks!r}")
        if not isinstance(rec.fp, dict):
            raise TraceError("step record whose fp is not an object")
        for q, v in rec.fp.items():
            if isinstance(v, list) and len(v) != len(rec.ranks):
                raise TraceError(f"step {rec.step}: fp[{q!r}] has {len(v)} values for {len(rec.ranks)} ranks")


def _side_fields_ok(rec: Union[DivergenceRecord, EventRecord]) -> bool:
    """Field types the readers (the diagnose report) rely on, for divergence and event records."""
    if rec.type == "divergence":
        return (isinstance(rec.site, str) and isinstance(rec.quantity, str) and isinstance(rec.action, str)
                and isinstance(rec.values, dict) and isinstance(rec.culprit_ranks, list)
                and isinstance(rec.majority_ranks, list) and isinstance(rec.differing, list)
                and (rec.rows is None or (isinstance(rec.rows, list) and all(_is_int(r) for r in rec.rows)))
                and (rec.healed is None or isinstance(rec.healed, list))
                and (rec.note is None or isinstance(rec.note, str))
                and (rec.switch is None or isinstance(rec.switch, str)))
    return (isinstance(rec.kind, str) and (rec.step is None or _is_int(rec.step))
            and isinstance(rec.message, str))


def _validate_header(h: Header) -> None:
    """Types of the header fields readers rely on (a null `quantities`, optional in the spec,
    becomes the canonical order)."""
    if not isinstance(h.run_id, str) or not h.run_id:
        raise TraceError(f"header with bad run_id {h.run_id!r} (a non-empty string)")
    if not _is_int(h.world_size) or h.world_size < 1:
        raise TraceError(f"header with bad world_size {h.world_size!r} (an integer >= 1)")
    if not isinstance(h.ranks, list) or not h.ranks or not all(_is_int(r) for r in h.ranks):
        raise TraceError(f"header with bad ranks {h.ranks!r} (a non-empty list of integers)")
    if len(set(h.ranks)) != len(h.ranks):
        raise TraceError(f"header lists a rank twice: {h.ranks}")
    if h.quantities is None:
        h.quantities = list(CANONICAL_ORDER)
    if not isinstance(h.quantities, list) or not all(isinstance(q, str) for q in h.quantities):
        raise TraceError(f"header with bad quantities {h.quantities!r} (a list of names)")
    if not isinstance(h.algo, str):
        raise TraceError(f"header with bad algo {h.algo!r} (a string)")


def expand_fp(value: FpValue, ranks: list[int]) -> dict[int, str | None]:
    """rank -> fingerprint hex (or None) from a step record's string-or-list value."""
    if value is None or isinstance(value, str):
        return {r: value for r in ranks}
    return dict(zip(ranks, value))


def compact_fp(values: list[str | None]) -> FpValue:
    """The writer's form: a single string (or null) when every rank agrees, else the list."""
    first = values[0] if values else None
    if all(v == first for v in values):
        return first
    return list(values)
