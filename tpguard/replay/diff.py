"""Tensor-level diff of the ranks' dumps, in causal order.

Per recorded tensor: the ranks grouped by identical bytes (dtype, shape and bytes), the majority
and culprit ranks by the guard's rule (`tpguard.divergence.split_majority`), and for each rank
outside the majority its distance from the reference rank (the lowest majority rank): the
differing rows (first dimension), the first differing element, the largest absolute difference
and, for floats, the largest distance in ulps (units in the last place: adjacent floats are 1
apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpguard.divergence import split_majority
from tpguard.replay.reader import StepDumps

MAX_ROWS_LISTED = 64


@dataclass
class Distance:
    """How one rank's tensor differs from the reference rank's."""

    rank: int
    reference_rank: int
    problem: str | None = None  # shapes or dtypes differ: no element-wise distance
    rows: list[int] = field(default_factory=list)  # differing rows (first MAX_ROWS_LISTED)
    rows_differing: int = 0
    rows_total: int = 0
    elements_differing: int = 0
    first_index: list[int] | None = None
    first_values: tuple | None = None  # (reference value, this rank's value)
    max_abs: float | None = None
    max_ulp: int | None = None
    nan_mismatches: int = 0

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class TensorDiff:
    name: str
    ranks: list[int]  # ranks that recorded it
    groups: list[list[int]]  # ranks with identical bytes, the majority first
    majority: list[int]
    culprits: list[int]
    dtype: str
    shape: list[int]
    distances: list[Distance] = field(default_factory=list)
    not_recorded: list[int] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return len(self.groups) <= 1

    def to_json(self) -> dict:
        return {"name": self.name, "identical": self.identical, "ranks": self.ranks, "groups": self.groups,
                "majority_ranks": self.majority, "culprit_ranks": self.culprits, "dtype": self.dtype,
                "shape": self.shape, "not_recorded": self.not_recorded,
                "distances": [d.to_json() for d in self.distances]}


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def group_by_bytes(tensors: dict[int, torch.Tensor]) -> list[list[int]]:
    """Ranks holding identical dtype, shape and bytes, the guard's majority group first."""
    keys: dict[tuple, list[int]] = {}
    for r in sorted(tensors):
        t = tensors[r]
        keys.setdefault((str(t.dtype), tuple(t.shape), raw_bytes(t)), []).append(r)
    groups = list(keys.values())
    if len(groups) <= 1:
        return groups
    values = {str(i): g for i, g in enumerate(groups)}
    majority, _ = split_majority(values)
    return [majority] + sorted((g for g in groups if g != majority), key=lambda g: g[0])


_ORDERED_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
                torch.bfloat16: torch.int16}


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Float bits mapped to int64 so that adjacent floats are 1 apart (-0.0 and +0.0 both 0)."""
    bits = t.contiguous().view(_ORDERED_INT[t.dtype]).to(torch.int64)
    sign_mask = {torch.int32: 0x7FFFFFFF, torch.int16: 0x7FFF, torch.int64: 0x7FFFFFFFFFFFFFFF}[_ORDERED_INT[t.dtype]]
    return torch.where(bits < 0, -(bits & sign_mask), bits)


def _item(x: torch.Tensor):
    v = x.item()
    return v if not isinstance(v, float) else float(v)


def distance(ref: torch.Tensor, other: torch.Tensor, ref_rank: int, rank: int) -> Distance:
    d = Distance(rank=rank, reference_rank=ref_rank)
    if ref.dtype != other.dtype or ref.shape != other.shape:
        d.problem = (f"rank {ref_rank}: {str(ref.dtype).removeprefix('torch.')} {list(ref.shape)}, "
                     f"rank {rank}: {str(other.dtype).removeprefix('torch.')} {list(other.shape)}")
        return d
    if ref.numel() == 0:
        return d
    a = ref.reshape(ref.shape[0], -1) if ref.dim() >= 1 else ref.reshape(1, 1)
    b = other.reshape(a.shape)
    if ref.is_floating_point():
        ia, ib = ordered_bits(a), ordered_bits(b)
        diff = (a.contiguous().view(_ORDERED_INT[a.dtype]) != b.contiguous().view(_ORDERED_INT[b.dtype]))
        nan = diff & (torch.isnan(a) | torch.isnan(b))
        d.nan_mismatches = int(nan.sum())
        num = diff & ~nan
        if bool(num.any()):
            d.max_ulp = int((ia - ib).abs()[num].max())
            d.max_abs = float((a.double() - b.double()).abs()[num].max())
    elif ref.dtype == torch.bool:
        diff = a != b
    else:
        diff = a != b
        if bool(diff.any()):
            d.max_abs = int((a.to(torch.int64) - b.to(torch.int64)).abs()[diff].max())
    d.rows_total = a.shape[0]
    rows = diff.any(dim=1).nonzero().flatten()
    d.rows_differing = rows.numel()
    d.rows = rows[:MAX_ROWS_LISTED].tolist()
    d.elements_differing = int(diff.sum())
    flat = diff.reshape(-1).nonzero()
    if flat.numel():
        i = int(flat[0])
        idx = list(torch.unravel_index(torch.tensor(i), tuple(ref.shape))) if ref.dim() else []
        d.first_index = [int(x) for x in idx]
        d.first_values = (_item(ref.reshape(-1)[i]), _item(other.reshape(-1)[i]))
    return d


def diff_tensor(dumps: StepDumps, name: str) -> TensorDiff:
    tensors = {r: d.tensor(name) for r, d in sorted(dumps.ranks.items()) if d.has(name)}
    not_recorded = [r for r in sorted(dumps.ranks) if r not in tensors]
    groups = group_by_bytes(tensors)
    majority = groups[0] if groups else []
    culprits = sorted(r for g in groups[1:] for r in g)
    first = tensors[majority[0]] if majority else None
    td = TensorDiff(name, sorted(tensors), groups, majority, culprits,
                    str(first.dtype).removeprefix("torch.") if first is not None else "",
                    list(first.shape) if first is not None else [], not_recorded=not_recorded)
    for g in groups[1:]:
        td.distances.append(distance(tensors[majority[0]], tensors[g[0]], majority[0], g[0]))
    return td


def diff_step(dumps: StepDumps) -> tuple[list[TensorDiff], list[TensorDiff]]:
    """(diffs of the recorded quantities in causal order, diffs of the sampling parameters)."""
    return ([diff_tensor(dumps, q) for q in dumps.quantities()],
            [diff_tensor(dumps, p) for p in dumps.params()])


def first_differing(diffs: list[TensorDiff]) -> TensorDiff | None:
    return next((d for d in diffs if not d.identical), None)
