"""One-launch top-k (+ top-p) renorm for small batches (Triton). Reference:
kernels/reference.py (``top_k_renorm_reference``, ``top_k_top_p_renorm_reference``); the
three-launch pipeline it replaces at <= ``RenormConfig.fused_rows`` rows (``fused_rows_short`` for top-k alone
on rows of <= 32768 entries: renorm_config.top_k_fused_rows): renorm_top_k.py.

Why: at 1-8 rows a top-k call is three short launches (row stats, select, write; ~25 us of GPU
work) and an eager call's time is the host's time to issue them (docs/design-renorm.md, "Host time").
Here the three run in one grid (CTAs per row, rows), each CTA on a run of consecutive chunks of its row
(`chunks_per_cta`: the whole grid at one CTA per SM):

1. every CTA writes its chunks' row stats (`row_stats_loaded`, the pass-1 code) and arrives on its
   row's counter (an integer atomic: no float is ever added atomically);
2. the row's last CTA to arrive runs the row's select (`top_k_select_row`, the same code as the
   select kernel's) and raises the row's ready flag;
3. every CTA waits for its row's flag, then writes its chunks of the output (`write_value`).

With `RenormConfig.fused_prefetch` a CTA loads its next chunk while it reduces or writes the one before, and
its first output chunk's input before the wait (H100, graph: 15 of 24 top-k cells at 1-64 x 32000-163840
faster, 8 slower, 2% summed; docs/benchmarks.md, "The entries on"). Same values into the same code: same bits.

Same bits as the three launches: the stats and the select are the same code at the same warps and
block shapes (renorm_top_k.py runs the row stats of top-k alone at the select's warps for this: a
float64 sum's order follows the warps), so a row's chunk sums, total and select sums are the same.
Calls routed here (`fused_fits`): top-k alone with any k (a row with k >= vocab is renormalised by
its total), and top-k + top-p with a scalar k < vocab (plain top-p rows need the bracket passes).
Tests compare the two paths bit for bit.

The wait needs every CTA of a row resident at once: CTAs are dispatched in block order (x fastest:
a row's CTAs are consecutive), so at most one row is partly dispatched and it completes once its
CTAs fit the GPU at once: a row of at most SM-count CTAs suffices
(one CTA per SM always fits), the assumption CUTLASS's split-K semaphores and CUB's look-back
make. Under the Triton interpreter programs run one after another, so there the grid runs as
two launches (STAGES=1: stats + select, STAGES=2: wait + write), the same code otherwise.

Sync words (``Workspace.sync``, int32 [rows, 4]: arrived, ready, done, -) are zero between calls:
the last CTA to arrive zeroes `arrived`, the last CTA to finish zeroes `ready` and `done`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpguard.kernels.direct_launch import sm_count as _device_sms
from tpguard.kernels.renorm_config import RenormConfig, reg_cap, top_k_fused_rows
from tpguard.kernels.renorm_passes import load_chunk, load_write_params, row_stats_loaded, store_probs, write_value
from tpguard.kernels.renorm_top_k_select import top_k_select_row, workspace_flags

@triton.jit
def _top_k_fused_kernel(probs_ptr, vocab, n_chunks, n_groups, n_samples,
                        chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, gid_ptr, cand_ptr, list_cap,
                        k_ptr, k_val, p_ptr, p_val, params_ptr, flag_ptr, plan_ptr, target_ptr, Z, out_ptr, sync_ptr,
                        HAS_K_ARR: tl.constexpr, HAS_P_ARR: tl.constexpr, WITH_TOP_P: tl.constexpr,
                        CHUNK: tl.constexpr, G: tl.constexpr, SG: tl.constexpr, CH_BLOCK: tl.constexpr, NG_BLOCK: tl.constexpr,
                        NS_BLOCK: tl.constexpr, SUB: tl.constexpr, REG: tl.constexpr,
                        TAU_GROUPS: tl.constexpr, CSUB: tl.constexpr,
                        STAGES: tl.constexpr, PER_CTA: tl.constexpr, SHORT: tl.constexpr = False,
                        ENTRY_ROUNDS: tl.constexpr = 16, PREFETCH: tl.constexpr = True):
    """One CTA per PER_CTA consecutive chunks of a row (module doc); the select kernel's arguments
    (renorm_top_k.select_launch_args), then the output and the sync words."""
    cta = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    n_ctas = tl.cdiv(n_chunks, PER_CTA)
    sync = sync_ptr + row * 4  # SYNC_WORDS
    if (STAGES & 1) != 0:
        if PREFETCH:
            ahead = load_chunk(probs_ptr, row, cta * PER_CTA, vocab, CHUNK, G)
        for j in tl.static_range(PER_CTA):
            chunk = cta * PER_CTA + j
            if PREFETCH:  # the next chunk's load in flight while this one reduces: the same sums
                held = ahead
                if j + 1 < PER_CTA:
                    ahead = load_chunk(probs_ptr, row, chunk + 1, vocab, CHUNK, G)
            if chunk < n_chunks:
                if not PREFETCH:
                    held = load_chunk(probs_ptr, row, chunk, vocab, CHUNK, G)
                row_stats_loaded(held, row, chunk, n_chunks, n_groups, n_samples,
                                 chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, CHUNK, G, SG, False)
        tl.debug_barrier()  # every thread's stats stored before the release below
        arrived = tl.atomic_add(sync, 1, sem="acq_rel", scope="gpu")
        if arrived == n_ctas - 1:  # the row's last CTA: the others' stats are visible (acquire)
            tl.debug_barrier()
            tl.atomic_xchg(sync, 0, sem="relaxed", scope="gpu")  # all arrived: zero for the next call
            top_k_select_row(row, probs_ptr, vocab, n_chunks, n_groups, n_samples,
                             chunk_sum_ptr, chunk_bad_ptr, gmax_ptr, gsamp_ptr, gid_ptr, cand_ptr, list_cap,
                             k_ptr, k_val, p_ptr, p_val, params_ptr, flag_ptr, plan_ptr, target_ptr, Z,
                             HAS_K_ARR, HAS_P_ARR, WITH_TOP_P, G, SG, CH_BLOCK, NG_BLOCK, NS_BLOCK, SUB, REG,
                             TAU_GROUPS, CSUB, SHORT=SHORT, ENTRY_ROUNDS=ENTRY_ROUNDS)
            tl.debug_barrier()  # the row's params stored before the flag
            tl.atomic_xchg(sync + 1, 1, sem="release", scope="gpu")
    if (STAGES & 2) != 0:
        src = probs_ptr + row * vocab
        first = (cta * PER_CTA) * CHUNK + tl.arange(0, CHUNK)
        if PREFETCH:  # the first chunk loaded before the wait (no CTA writes the input)
            ahead = tl.load(src + first, mask=first < vocab, other=0.0)
        # volatile loads while waiting (atomic reads of one word by every waiting CTA queue up at its L2
        # slice: 4 rows 36.3 -> 27.5 us on an H200), then one acquire
        while tl.load(sync + 1, volatile=True) == 0:
            pass
        tl.atomic_add(sync + 1, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()  # no thread reads the params before the flag was seen
        thr1, r1, thr2, r2, live, fill = load_write_params(params_ptr, flag_ptr, row)
        for j in tl.static_range(PER_CTA):
            offs = first + j * CHUNK
            mask = offs < vocab
            if PREFETCH:  # and each next chunk's load in flight while this one is written
                held = ahead
                if j + 1 < PER_CTA:
                    ahead = tl.load(src + offs + CHUNK, mask=offs + CHUNK < vocab, other=0.0)
            else:
                held = tl.load(src + offs, mask=mask, other=0.0)
            store_probs(out_ptr + row * vocab + offs,
                        write_value(held.to(tl.float32), thr1, r1, thr2, r2, live, fill), mask)
        done = tl.atomic_add(sync + 2, 1, sem="relaxed", scope="gpu")
        if done == n_ctas - 1:  # every CTA of the row is past its wait
            tl.atomic_xchg(sync + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync + 2, 0, sem="relaxed", scope="gpu")


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (the interpreter: 132, an H200's, so the grid is the GPU's)."""
    return _device_sms(device, 132)


def chunks_per_cta(rows: int, n_chunks: int, cfg: RenormConfig, sms: int) -> int:
    """``cfg.fused_per_cta``, or when 0 the fewest (a power of two) that put the whole grid on the
    GPU at one CTA per SM: H200, 163840 vocab, graph us: 1 row: 1 per CTA 24.9, 4 per CTA
    28.3; 4 rows: 27.5 / 26.9 (2) / 28.9; 8 rows: 51.0 / 31.2 (2) / 29.6 (4); three launches 24.2-28.3.
    More CTAs than SMs wait on each other's SMs; fewer make each CTA's share longer."""
    if cfg.fused_per_cta:
        return cfg.fused_per_cta
    per = 1
    while per < n_chunks and rows * triton.cdiv(n_chunks, per) > sms:
        per *= 2
    return per


def fused_fits(rows: int, vocab: int, top_k, top_p, fingerprint_out, cfg: RenormConfig,
               device: torch.device) -> bool:
    """Whether a call takes the one-launch kernel: top-k alone (any k), or top-k + top-p with a scalar
    k < vocab (module doc); no fingerprint slot, at most `top_k_fused_rows` rows (``cfg.fused_rows``, or
    ``fused_rows_short`` for top-k alone on short rows), and a row's CTAs fit the GPU at once."""
    most = top_k_fused_rows(cfg, triton.cdiv(vocab, cfg.group), top_p is not None)
    if not (0 < rows <= most) or fingerprint_out is not None:
        return False
    if workspace_flags(vocab, top_k, top_p)[1]:
        return False  # plain top-p rows: the bracket passes (renorm_top_k.py)
    if device.type != "cuda":
        return True  # the interpreter: two launches (module doc)
    return triton.cdiv(triton.cdiv(vocab, cfg.chunk), cfg.fused_per_cta or 1) <= sm_count(device)


def launch_fused(select_args: tuple, blocks: dict, out: torch.Tensor, s, ws, cfg: RenormConfig, warps: int) -> None:
    """The one-launch top-k (+ top-p) into `out` (`fused_fits` said yes; ws.sync zeroed). `select_args`,
    `blocks`: renorm_top_k.select_launch_args; `warps`: the three launches' select warps
    (renorm_config.top_k_select_warps), so that both paths sum in the same order."""
    probs = select_args[0]
    per = chunks_per_cta(s.rows, s.n_chunks, cfg, sm_count(probs.device))
    grid = (triton.cdiv(s.n_chunks, per), s.rows)
    for stages in ((3,) if probs.is_cuda else (1, 2)):
        _top_k_fused_kernel[grid](*select_args, out, ws.sync, **blocks, CHUNK=s.chunk, STAGES=stages, PER_CTA=per,
                                  PREFETCH=bool(cfg.fused_prefetch), num_warps=warps, **reg_cap(cfg.select_maxnreg, warps))


__all__ = ["chunks_per_cta", "fused_fits", "launch_fused", "sm_count"]
