"""Reader: find the dumps of one divergent step (every rank's file) and check they belong together.

Input paths are trace directories (their `dumps/` folder is read), dump folders, or dump files.
Files are named `<run>.step<N>.<site>.rank<R>.safetensors` (tpguard/dump.py); their metadata is
the truth, the name an index. Anything that cannot be used is a `ReplayInputError` (one line, exit
code 2): a torn or foreign file, something other than a regular file, several runs or sites without
`--run` / `--site`, a step with no dumps, a rank whose dump is missing, files whose metadata and
names disagree, a replay context or sampling parameters replay cannot use (validate.py).
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import torch

from tpguard.dump import DUMP_FORMAT, DUMPS_SUBDIR, PARAM_PREFIX
from tpguard.errors import TPGuardError
from tpguard.paths import file_kind
from tpguard.quantities import CANONICAL_ORDER
from tpguard.records import MAX_WORLD_SIZE
from tpguard.replay.validate import BadField, check_context, check_params, show

NAME = re.compile(r"^(?P<run>.+)\.step(?P<step>[0-9]+)\.(?P<site>.+)\.rank(?P<rank>[0-9]+)\.safetensors$")
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class ReplayInputError(TPGuardError):
    """Dumps that cannot be replayed; the message is one line."""


@dataclass
class RankDump:
    """One rank's dump file: its metadata, tensor index and (on demand) tensors."""

    path: Path
    run_id: str
    step: int
    site: str
    rank: int
    world_size: int | None
    quantities: list[str] | None
    context: dict | None
    entries: dict[str, tuple[str, list[int]]]  # name -> (safetensors dtype, shape)

    def has(self, name: str) -> bool:
        return name in self.entries

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a file changed or torn since it was indexed
            raise ReplayInputError(f"{self.path}: cannot read tensor {name!r} ({_short(e)})") from None


@dataclass
class StepDumps:
    """Every rank's dump of one (run, step, site)."""

    run_id: str
    step: int
    site: str
    world_size: int
    ranks: dict[int, RankDump]
    trace_dir: Path | None
    other_steps: list[int] = field(default_factory=list)  # more dumped steps of this run and site
    notes: list[str] = field(default_factory=list)

    @property
    def reference(self) -> RankDump:
        return self.ranks[min(self.ranks)]

    @property
    def context(self) -> dict | None:
        return self.reference.context

    def quantities(self) -> list[str]:
        """Recorded quantities in causal order (the run's order), then any other recorded tensor
        that is not a sampling parameter."""
        order = self.reference.quantities or list(CANONICAL_ORDER)
        names: list[str] = []
        for r in sorted(self.ranks):
            for k in self.ranks[r].entries:
                if not k.startswith(PARAM_PREFIX) and k not in names:
                    names.append(k)
        known = [q for q in order if q in names]
        return known + sorted(q for q in names if q not in order)

    def params(self) -> list[str]:
        names = {k for d in self.ranks.values() for k in d.entries if k.startswith(PARAM_PREFIX)}
        return sorted(names)


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def open_regular(path: Path):
    """(binary file, size) of a regular file; anything else is a ReplayInputError naming it.

    Opening a FIFO blocks until a writer comes, a device may never end: stat first, then open
    without blocking and check what was opened (the path may have changed in between)."""
    if not stat.S_ISREG(mode := os.stat(path).st_mode):
        raise ReplayInputError(f"{path}: not a regular file ({file_kind(mode)}): not a dump")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReplayInputError(f"{path}: not a regular file ({file_kind(st.st_mode)}): not a dump")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_index(path: Path) -> tuple[dict, dict[str, tuple[str, list[int]]]]:
    """(metadata, tensor index) of a safetensors file, checked against the file's size: a file cut
    short (a rank killed while writing, a copy cut off) is torn."""
    try:
        fh, size = open_regular(path)
        with fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ReplayInputError(f"{path}: torn or not a dump: {size} bytes, truncated before the 8-byte "
                                       "header length a safetensors file starts with")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise ReplayInputError(f"{path}: torn or not a dump: not a safetensors file ({size} bytes; its first "
                                       f"8 bytes give a header of {n} bytes, over safetensors' 100 MiB limit)")
            if 8 + n > size:
                raise ReplayInputError(f"{path}: torn or not a dump: {size} bytes, truncated inside its header or not "
                                       f"a safetensors file (its first 8 bytes give a header of {n} bytes)")
            header = orjson.loads(fh.read(n))
    except OSError as e:
        raise ReplayInputError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError):
        raise ReplayInputError(f"{path}: torn or not a dump (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ReplayInputError(f"{path}: torn or not a dump (its header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    entries: dict[str, tuple[str, list[int]]] = {}
    end = 0
    for name, info in header.items():
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            entries[name] = (str(info["dtype"]), [int(s) for s in info["shape"]])
        except (KeyError, TypeError, ValueError):
            raise ReplayInputError(f"{path}: torn or not a dump (tensor {name!r} has no valid entry)") from None
        end = max(end, stop)
    if 8 + n + end != size:
        raise ReplayInputError(f"{path}: torn dump: its tensors need {8 + n + end} bytes, the file has {size}")
    return meta, entries


def _meta_int(meta: dict, key: str, m: re.Match | None, path: Path, low: int, high: int | None = None) -> int | None:
    """An integer metadata field (its name's value when the metadata lacks it); None when neither has it."""
    if key not in meta:
        return int(m.group(key)) if m and key in NAME.groupindex else None
    try:
        v = int(meta[key])
    except ValueError:
        v = None
    if v is None or v < low or (high is not None and v > high):
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ReplayInputError(f"bad dump {path}: metadata {key} is {show(meta[key])}, expected an integer {span}")
    return v


def _meta_json(meta: dict, key: str, path: Path):
    """A JSON metadata field, or None. The context is parsed again leniently when it is not strict
    JSON (NaN, Infinity), so the check can name the field holding such a value."""
    if key not in meta:
        return None
    try:
        return orjson.loads(meta[key])
    except ValueError as e:
        if key == "context":
            try:
                return json.loads(meta[key])
            except ValueError:
                pass
        raise ReplayInputError(f"bad dump {path}: {key} is not JSON ({' '.join(str(e).split())[:120]})") from None


def load_rank_dump(path: Path) -> RankDump:
    m = NAME.match(path.name)
    meta, entries = read_index(path)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ReplayInputError(f"{path}: not a tpguard dump (bad metadata)")
    fmt = meta.get("format")
    if fmt is not None and fmt != DUMP_FORMAT:
        raise ReplayInputError(f"{path}: dump format {fmt!r} is not supported (this tpguard reads {DUMP_FORMAT})")
    run_id = meta.get("run_id") or (m and m.group("run"))
    site = meta.get("site") or (m and m.group("site"))
    step = _meta_int(meta, "step", m, path, 0)
    rank = _meta_int(meta, "rank", m, path, 0)
    if not run_id or not site or step is None or rank is None:
        raise ReplayInputError(f"{path}: not a tpguard dump (no run, step, site and rank in its metadata "
                               "or name)")
    world = _meta_int(meta, "world_size", None, path, 1, MAX_WORLD_SIZE)
    quantities = _meta_json(meta, "quantities", path)
    if quantities is not None and not (isinstance(quantities, list) and all(isinstance(q, str) for q in quantities)):
        raise ReplayInputError(f"bad dump {path}: quantities is {show(quantities)}, expected a list of quantity names")
    context = _meta_json(meta, "context", path)
    if m and (m.group("run"), int(m.group("step")), m.group("site"), int(m.group("rank"))) != (run_id, step, site, rank):
        raise ReplayInputError(f"{path}: its metadata says run {run_id}, step {step}, site {site}, rank {rank}, "
                               "its name says otherwise (renamed or mixed dumps)")
    dump = RankDump(path, run_id, step, site, rank, world, quantities, context, entries)
    try:
        if context is not None:
            check_context(context, entries)
        check_params(dump, context)
    except BadField as e:
        raise ReplayInputError(f"bad dump {path}: {e}") from None
    return dump


class _Named:
    """A dump file known by its name only (not opened yet)."""

    def __init__(self, path: Path, m: re.Match):
        self.path, self.run_id, self.site = path, m.group("run"), m.group("site")
        self.step, self.rank = int(m.group("step")), int(m.group("rank"))


def dump_files(paths: list[str | Path]) -> tuple[list[Path], Path | None, list[Path]]:
    """(dump files, the trace directory next to them, leftover partial files) for the paths."""
    files: list[Path] = []
    partial: list[Path] = []
    trace_dir: Path | None = None
    for p in map(Path, paths):
        if p.is_dir():
            folder = p / DUMPS_SUBDIR if (p / DUMPS_SUBDIR).is_dir() else p
            trace_dir = trace_dir or (p if folder != p else p.parent)
            files += sorted(folder.glob("*.safetensors"))
            partial += sorted(folder.glob("*.safetensors.tmp"))
        elif p.is_file():
            files.append(p)
            trace_dir = trace_dir or (p.parent.parent if p.parent.name == DUMPS_SUBDIR else p.parent)
        else:
            try:
                mode = p.stat().st_mode
            except FileNotFoundError:
                raise ReplayInputError(f"{p}: no such file or directory") from None
            except OSError as e:
                raise ReplayInputError(f"{p}: cannot read ({e.strerror or e})") from None
            raise ReplayInputError(f"{p}: not a regular file ({file_kind(mode)}): not a dump or a folder of dumps")
    if not files:
        where = ", ".join(map(str, paths))
        raise ReplayInputError(f"no dumps under {where} (a run writes them with --dump / TPGUARD_DUMP=1, "
                               f"in <trace dir>/{DUMPS_SUBDIR}/, on a divergent step)")
    return files, trace_dir, partial


def _trace_world_size(trace_dir: Path | None, run_id: str) -> int | None:
    """World size from the run's trace header next to the dumps (dumps that do not record it)."""
    if trace_dir is None:
        return None
    from tpguard.trace import merged_trace_path, rank_trace_path

    for path in (merged_trace_path(trace_dir, run_id), rank_trace_path(trace_dir, run_id, 0)):
        try:
            fh, _ = open_regular(Path(path))  # a FIFO in its place must not hang the replay
            with fh:
                head = orjson.loads(fh.readline())
            world = int(head["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not 1 <= world <= MAX_WORLD_SIZE:
            raise ReplayInputError(f"{path}: the trace header's world_size is {world}, expected an integer in "
                                   f"[1, {MAX_WORLD_SIZE}]")
        return world
    return None


def _choose(kind: str, option: str, values: list, wanted):
    if wanted is not None:
        return wanted
    if len(values) == 1:
        return values[0]
    shown = ", ".join(map(str, values[:8])) + (", ..." if len(values) > 8 else "")
    raise ReplayInputError(f"the dumps hold {len(values)} {kind}s ({shown}): choose one with {option}")


def open_step(paths: list[str | Path], run: str | None = None, step: int | None = None,
              site: str | None = None) -> StepDumps:
    """Every rank's dump of one step: --run (default: the only run), --step (default: the first
    dumped step, the first divergence), --site (default: the only site dumped at that step)."""
    files, trace_dir, partial = dump_files(paths)
    # Files are chosen by name; only the chosen ones (and any not named as tpguard names them)
    # are opened, so a torn dump of another step or run does not stop this one.
    dumps = [_Named(p, m) if (m := NAME.match(p.name)) else load_rank_dump(p) for p in files]
    runs = sorted({d.run_id for d in dumps})
    if run is not None and run not in runs:
        raise ReplayInputError(f"no dumps of run {run!r} (dumped runs: {', '.join(runs)})")
    run = _choose("run", "--run", runs, run)
    mine = [d for d in dumps if d.run_id == run]
    steps = sorted({d.step for d in mine})
    if step is not None and step not in steps:
        raise ReplayInputError(f"run {run} has no dump of step {step} (dumped steps: "
                               f"{', '.join(map(str, steps[:20]))}{', ...' if len(steps) > 20 else ''})")
    chosen_step = steps[0] if step is None else step
    at_step = [d for d in mine if d.step == chosen_step]
    sites = sorted({d.site for d in at_step})
    if site is not None and site not in sites:
        raise ReplayInputError(f"run {run} step {chosen_step} has no dump of site {site!r} "
                               f"(dumped sites: {', '.join(sites)})")
    site = _choose("site", "--site", sites, site)
    chosen = [load_rank_dump(d.path) if isinstance(d, _Named) else d for d in at_step if d.site == site]
    by_rank: dict[int, RankDump] = {}
    for d in chosen:
        if d.rank in by_rank:
            raise ReplayInputError(f"two dumps of rank {d.rank} for run {run} step {chosen_step} site {site}: "
                                   f"{by_rank[d.rank].path} and {d.path}")
        by_rank[d.rank] = d
    worlds = {d.world_size for d in chosen if d.world_size is not None}
    if len(worlds) > 1:
        raise ReplayInputError(f"the dumps of run {run} step {chosen_step} disagree on the world size "
                               f"({sorted(worlds)}): mixed dumps")
    world = worlds.pop() if worlds else _trace_world_size(trace_dir, run)
    if world is None:
        raise ReplayInputError(f"cannot tell how many ranks run {run} had: its dumps do not record it and "
                               f"no trace of the run is next to them")
    missing = [r for r in range(world) if r not in by_rank]
    stray = sorted(r for r in by_rank if r >= world)
    if stray:
        raise ReplayInputError(f"dumps of rank(s) {stray} in a run of world size {world}: mixed dumps")
    if missing:
        torn = [p.name for p in partial if p.name.startswith(f"{run}.step{chosen_step}.{site}.rank")]
        hint = f"; partial file(s) {', '.join(torn)}: the rank stopped while writing" if torn else ""
        raise ReplayInputError(f"rank(s) {missing} have no dump of run {run} step {chosen_step} site {site} "
                               f"(world size {world}, found rank(s) {sorted(by_rank)}){hint}")
    if len(by_rank) < 2:
        raise ReplayInputError(f"run {run} step {chosen_step}: only rank {sorted(by_rank)} dumped: nothing to compare")
    orders = {orjson.dumps(d.quantities) for d in chosen}
    if len(orders) > 1:
        raise ReplayInputError(f"the dumps of run {run} step {chosen_step} list different quantities: mixed dumps")
    others = sorted({d.step for d in mine if d.site == site and d.step != chosen_step})
    return StepDumps(run, chosen_step, site, world, by_rank, trace_dir, others)
