"""fingerprint_many's launch plan: the fingerprints of one fixed list of tensors in a fixed number of
launches through the segment table (kernels/fingerprint_segments.py), and the plan cache behind
`fingerprint_many_triton`.

Lane launches for the segments that need partial sums (short rows of many rows: 1; long rows: 1
per (16-byte aligned or not, word size) class present, or 1 per long tensor with
``KernelConfig.many_long="rows"``), then ONE finish launch that finalizes those and reads each
small tensor (rows of <= 64 words, <= 16384 words) whole in one program. The guard's decisions set
is 1 launch, its full set 2; each value is stored straight into the caller's vector slot
(``out_index``), and the guard's step counter is bumped by the same launch (``bump_index``).

Host time: a plan records the arguments that Triton passes to each compiled kernel's launcher and
then calls the launcher directly (`OutLaunch`, kernels/direct_launch.py; checked bit for bit
against Triton's own launch once per kernel per process; ``TPGUARD_FAST_LAUNCH=0`` turns it off).

Reference: `tpguard.kernels.fingerprint_reference.fingerprint_many_reference`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tpguard.config import interpreting
from tpguard.kernels import direct_launch
from tpguard.kernels import fingerprint_reference as ref
from tpguard.kernels.direct_launch import OutLaunch, device_guard, prepare_out_launches
from tpguard.kernels.fingerprint_config import KernelConfig, default_config
from tpguard.kernels.fingerprint_finalize import _finalize_chunks
from tpguard.kernels.fingerprint_segments import _record
from tpguard.kernels.fingerprint_words import (_MAX_GRID_Y, _check_tensor, _next_pow2, _reg_opts, _seed_args, _tile,
                                               _trailing_contiguous, _warps, _words)

try:
    import triton
except ImportError:  # CPU-only install: nothing here is launched
    triton = None

if triton is not None:
    from tpguard.kernels.fingerprint_segments import _many_finish_kernel, _many_lanes_kernel, _seg_lanes_kernel

SHORT_ROW_WORDS = 64  # rows of up to this many words share tiles
SMALL_SEGMENT_WORDS = 16384  # a segment of rows x BN words up to this: 1 program
SMALL_TILE = 4096  # words per tile of the small-segment kernel


class ManyPlan:
    """Fingerprints of one fixed list of tensors in a fixed number of launches.
    A plan owns its scratch (partial sums): run one plan on one stream at a time.

    Built on the host from addresses, dtypes, shapes and strides (never data). Its segment table
    is copied to the device once, at construction (pinned memory, asynchronous). `run()` is
    capturable in a CUDA graph: keep the plan alive as long as the graph, and the tensors at the
    same addresses (with ``keep_tensors`` the plan holds references to them). Tensors whose rows
    are not contiguous blocks are copied into scratch owned by the plan at each run (one copy
    launch each). The plan owns its scratch of partial sums: one run at a time per plan.

    Launches: lane launches for the segments that need partial sums (short rows of many rows;
    long rows by word size, or one per long tensor with ``many_long="rows"``), then ONE finish
    launch (`_many_finish_kernel`) that finalizes those and reads and hashes each small segment
    (rows of <= 64 words, <= SMALL_SEGMENT_WORDS words in all, and empty tensors) whole in one
    program. A set of small tensors (the guard's decisions set) is that one launch.

    ``out_index``: where each fingerprint goes in `run`'s `out` (default 0..n-1), so that a caller
    (the guard) gets them written straight into its own vector; ``bump_index``: an int64 slot of
    `out` that each run adds 1 to (the guard's device step counter), done by the finish launch.
    """

    # ordinary tensors even when made under inference mode: each run copies into the scratch of
    # non-contiguous tensors, maybe outside it
    @torch.inference_mode(False)
    def __init__(self, tensors: list[torch.Tensor], config: KernelConfig | None = None, *,
                 keep_tensors: bool = True, out_index: list[int] | None = None,
                 bump_index: int | None = None):
        cfg = config or default_config()
        if not tensors:
            raise ValueError("fingerprint_many: no tensors")
        tensors = [_check_tensor(t, "fingerprint_many") for t in tensors]
        device = tensors[0].device
        for t in tensors:
            if t.device != device:
                raise ValueError(f"fingerprint_many: tensors must share one device, "
                                 f"got {device} and {t.device}")
        if device.type != "cpu" and interpreting():
            raise ValueError("fingerprint_many: under TRITON_INTERPRET=1 the segment table holds "
                             "host addresses; pass CPU tensors")
        if out_index is not None and len(out_index) != len(tensors):
            raise ValueError("fingerprint_many: out_index needs one index per tensor")
        self.device = device
        self.n = len(tensors)
        self.config = cfg
        self.out_index = list(out_index) if out_index is not None else list(range(self.n))
        self.out_size = max(self.out_index + [bump_index if bump_index is not None else -1]) + 1
        self.bump_index = bump_index
        self._copy_index = [i for i, t in enumerate(tensors)
                            if t.dim() >= 2 and not _trailing_contiguous(t)]
        self._scratch = [torch.empty_like(tensors[i], memory_format=torch.contiguous_format)
                         for i in self._copy_index]
        views = list(tensors)
        for i, scratch in zip(self._copy_index, self._scratch):
            views[i] = scratch
        self._sources = tensors if keep_tensors else None

        short, long_aligned, long_unaligned, small = [], [], [], []
        for i, t in enumerate(views):
            w = _words(t)
            seg = (i, t, w)
            if w.rows == 0 or w.n_words == 0:
                small.append(seg)  # nothing to read: the small kernel's loop hashes no words
            elif w.n_words <= SHORT_ROW_WORDS:
                short.append(seg)
            elif w.data.data_ptr() % 16 == 0 and (w.row_stride * w.eb) % 16 == 0:
                long_aligned.append(seg)
            else:
                long_unaligned.append(seg)
        small_bn = _next_pow2(max((w.n_words for _, _, w in short), default=1))
        small += [x for x in short if x[2].rows * small_bn <= SMALL_SEGMENT_WORDS]
        short = [x for x in short if x[2].rows * small_bn > SMALL_SEGMENT_WORDS]

        short_bn = _next_pow2(max((w.n_words for _, _, w in short), default=1))
        short_rows = _next_pow2(max((w.rows for _, _, w in short), default=1))
        groups = [(short, max(1, min(cfg.block_words // short_bn, short_rows)), short_bn, False, 0)]
        per_segment = []
        if cfg.many_long == "rows":
            per_segment = [(x, aligned) for aligned, segs in ((True, long_aligned),
                                                              (False, long_unaligned)) for x in segs]
        else:
            for aligned, segs in ((True, long_aligned), (False, long_unaligned)):
                for eb in (4, 2, 1):  # one launch per word size: no dead loop copies in registers
                    groups.append(_long_group([x for x in segs if x[2].eb == eb], cfg, aligned, eb))
        records: list[list[int]] = []
        lane_specs = []  # ("table", grid, rec0, n_recs, meta) or ("seg", grid, record, meta)
        part = 0
        for segs, br, bn, aligned, eb in groups:
            if not segs:
                continue
            chunk_tiles = max(1, cfg.chunk_words // bn)
            rec0, item = len(records), 0
            for i, t, w in segs:
                chunks = max(1, -(-w.n_words // (chunk_tiles * bn)))
                records.append(_record(i, t, w, part, chunks, item, self.out_index[i]))
                part += chunks * w.rows * 2
                item += -(-w.rows // br) * chunks
            meta = dict(BR=br, BN=bn, CHUNK_TILES=chunk_tiles, ALIGNED=aligned, EB=eb,
                        SHIFTS=cfg.shifts, num_warps=_warps(br * bn, cfg))
            if eb:
                meta.update(_reg_opts(cfg))
            lane_specs.append(("table", (item,), rec0, len(segs), meta))
        for (i, t, w), aligned in per_segment:
            br, bn, chunk_tiles, chunks = _tile(w.rows, w.n_words, cfg)
            if chunks > _MAX_GRID_Y:
                raise ValueError(f"rows of {w.n_words} words need {chunks} chunks (> {_MAX_GRID_Y}); "
                                 "raise KernelConfig.chunk_words")
            records.append(_record(i, t, w, part, chunks, 0, self.out_index[i]))
            meta = dict(EB=w.eb, BR=br, BN=bn, CHUNK_TILES=chunk_tiles, ALIGNED=aligned,
                        SHIFTS=cfg.shifts, num_warps=_warps(br * bn, cfg),
                        **_reg_opts(cfg))
            s_lo, _ = _seed_args(ref.row_seed(t.dtype, tuple(t.shape)))
            lane_specs.append(("seg", (-(-w.rows // br), chunks),
                               (w.data.data_ptr(), part, w.rows, w.n_words, w.row_stride, s_lo),
                               meta))
            part += chunks * w.rows * 2
        self.n_lane_records = len(records)
        for i, t, w in small:
            records.append(_record(i, t, w, 0, 1, 0, self.out_index[i]))
        self.n_records = len(records)
        self.n_small = len(small)
        self.partial_size = max(part, 2)
        lane_rows = [r[1] for r in records[:self.n_lane_records]]
        max_chunks = max((r[8] for r in records[:self.n_lane_records]), default=1)
        self._fbr = max(1, min(256, _next_pow2(max(lane_rows, default=1))))
        self._fbc = _finalize_chunks(self._fbr, max_chunks)
        host = torch.tensor(records, dtype=torch.int64).reshape(-1)
        if device.type == "cuda":
            host = host.pin_memory()
        self.table = host.to(device, non_blocking=True)
        self._host_table = host  # read by the asynchronous copy: keep it alive
        self._partial = torch.empty(self.partial_size, dtype=torch.int64, device=device)

        self._kernel_launches: list[OutLaunch] = []
        bump = bump_index is not None
        sbn = _next_pow2(max(max((w.n_words for _, _, w in small), default=1), 1))
        small_rows = _next_pow2(max((w.rows for _, _, w in small), default=1))
        for spec in lane_specs:
            if spec[0] == "table":
                _, grid, rec0, n_recs, meta = spec
                self._kernel_launches.append(OutLaunch(_many_lanes_kernel, grid,
                                                     (self.table, self._partial, rec0, n_recs), meta))
            else:
                _, grid, args, meta = spec
                self._kernel_launches.append(OutLaunch(_seg_lanes_kernel, grid,
                                                     (args[0], self._partial) + args[1:], meta))
        sbr = max(1, min(SMALL_TILE // sbn, small_rows))  # 1 x 1 without small tensors
        self._kernel_launches.append(OutLaunch(
            _many_finish_kernel, (self.n_records,),
            (self.table, self._partial, None, self.n_lane_records, bump_index if bump else 0),
            dict(FBR=self._fbr, FBC=self._fbc, SBR=sbr, SBN=sbn, HAS_LANE=self.n_lane_records > 0,
                 HAS_SMALL=bool(small), BUMP=bump,
                 num_warps=max(_warps(self._fbr * self._fbc, cfg) if self.n_lane_records else 1,
                               _warps(sbr * sbn, cfg) if small else 1)),
            out_pos=2))
        # fast launches: "untested" until the second run outside capture sets them up
        self._runs = 0
        self._fast = "untested" if (direct_launch.enabled() and device.type == "cuda") else "off"

    @property
    def launches(self) -> int:
        """Kernel launches per run(): copies of non-contiguous tensors + lane launches + 1."""
        return len(self._copy_index) + len(self._kernel_launches)

    @property
    def fast_launch(self) -> str:
        """"on" (launchers called directly), "off", or "untested" (before the first run)."""
        return self._fast

    def _launch_all(self, out: torch.Tensor, fast: bool = False) -> None:
        for launch in self._kernel_launches:
            launch(out, fast=fast)

    def _first_run(self, out: torch.Tensor) -> None:
        """Triton's launches into `out`, then the direct path's set-up (`prepare_out_launches`):
        recorded launchers, and (once per kernel per process) a direct run from the same starting
        state that must give the same `out`, bit for bit."""
        before = out.clone()
        self._launch_all(out)

        def rerun() -> bool:
            direct = before.clone()
            # poison the scratch the normal run filled: a direct lane launch that wrote nothing
            # (or elsewhere) must show up in the finish kernel's output
            self._partial.fill_(-1)
            self._launch_all(direct, fast=True)
            return torch.equal(direct, out)

        self._fast = "on" if prepare_out_launches(self._kernel_launches, out, rerun) else "off"

    def run(self, out: torch.Tensor | None = None,
            tensors: list[torch.Tensor] | None = None) -> torch.Tensor:
        """int64 fingerprints (uint64 bits) at `out[out_index[i]]` (default: [n], in the order
        the tensors were given). `out`: optional preallocated int64 tensor on the plan's device
        (required with a bump index). `tensors`: the tensors, if the plan was built without
        keeping them (same addresses, dtypes, shapes, strides)."""
        sources = tensors if tensors is not None else self._sources
        if self._copy_index and sources is None:
            raise ValueError("ManyPlan.run: pass the tensors (the plan was built without them)")
        if out is None:
            if self.bump_index is not None:
                raise ValueError("ManyPlan.run: pass `out` (the plan bumps one of its slots)")
            out = torch.empty(self.out_size, dtype=torch.int64, device=self.device)
        elif out.dtype != torch.int64 or out.device != self.device or out.numel() < self.out_size \
                or not out.is_contiguous():
            raise ValueError(f"ManyPlan.run: out must be a contiguous int64 tensor of >= {self.out_size} "
                             f"elements on {self.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        with device_guard(self.device):
            for i, scratch in zip(self._copy_index, self._scratch):
                scratch.copy_(sources[i])
            if self._fast == "untested" and not torch.cuda.is_current_stream_capturing():
                self._runs += 1
                if self._runs >= 2:  # a plan used once (addresses that moved) never pays for it
                    self._first_run(out)
                else:
                    self._launch_all(out)
            else:
                self._launch_all(out, fast=self._fast == "on")
        return out


def _long_group(segs: list, cfg: KernelConfig, aligned: bool, eb: int) -> tuple:
    """(segments, BR, BN, aligned, eb) of a long-rows launch: [rows_per_tile, BN] tiles, fewer
    rows per tile when no segment has that many rows."""
    rows = _next_pow2(max((w.rows for _, _, w in segs), default=1))
    br = max(1, min(cfg.rows_per_tile, rows))
    return segs, br, cfg.block_words // br, aligned, eb


_PLAN_CACHE: OrderedDict[tuple, ManyPlan] = OrderedDict()
_PLAN_CACHE_SIZE = 64
_CAPTURED_PLANS: dict[tuple, ManyPlan] = {}  # used inside a CUDA graph capture: never evicted


def clear_plans() -> None:
    """Forget the cached plans (e.g. after switching direct launches on or off: a plan keeps its state)."""
    _PLAN_CACHE.clear()
    _CAPTURED_PLANS.clear()


def fingerprint_many_triton(tensors: list[torch.Tensor], *, config: KernelConfig | None = None,
                            out: torch.Tensor | None = None, out_index: list[int] | None = None,
                            bump_index: int | None = None) -> torch.Tensor:
    """int64 [n]: 0-d fingerprints of several tensors on one device, in at most 5 launches
    (+1 copy per tensor whose rows are not contiguous blocks), independent of n; 1 launch when
    every tensor is small (the guard's decisions set). With `out` / `out_index` / `bump_index`:
    see `ManyPlan` (written in place, `out` returned).

    Plans are cached by the tensors' (address, dtype, shape, strides) and the output layout.
    Under CUDA graph capture a cached plan is required (warm up with the same tensors first); it
    is then kept for good.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fingerprint_many: expected torch.Tensor items, got {type(t).__name__}")
    key = (tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in tensors),
           config or default_config(), tuple(out_index) if out_index is not None else None, bump_index)
    plan = _CAPTURED_PLANS.get(key) or _PLAN_CACHE.get(key)
    capturing = tensors[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if plan is None:
        if capturing:
            raise RuntimeError("fingerprint_many: no plan for these tensors during CUDA graph "
                               "capture; call it once with the same tensors before capturing, "
                               "or build a ManyPlan outside capture")
        plan = ManyPlan(tensors, config, keep_tensors=False,  # the cache must not pin memory
                        out_index=out_index, bump_index=bump_index)
        _PLAN_CACHE[key] = plan
        while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
            _PLAN_CACHE.popitem(last=False)
    elif key in _PLAN_CACHE:
        _PLAN_CACHE.move_to_end(key)
    if capturing:
        _CAPTURED_PLANS[key] = plan
    return plan.run(out=out, tensors=tensors)
