"""Row split of a CUDA-graph-captured renorm call over side streams (renorm_plan.py calls it).

Why: a renorm call is bandwidth-bound streaming passes around latency-bound per-row kernels (the
select kernels and bracket_select run one program per row and leave the GPU mostly idle for
~30-50 us each). Rows are independent (the kernels are batch-invariant: a row's output does not
depend on the other rows), so the same op on row parts, each part on its own stream, gives the
same bits, and the parts' kernels overlap: one part's streaming passes fill the SMs that the
other part's per-row kernels leave idle. Measured on an H200 (256 x 163840, graph replay,
docs/design-renorm.md): top-p flat 327.6 -> 314.6 us, top-p with logits N(0, 1) x 4 307.9
-> 270.4, top-k(40) 166.9 -> 164.1, top-k + top-p 178.1 -> 175.5 (2 parts; 3-4 parts no better
for top-p).

Only inside CUDA graph capture (`RenormConfig.graph_row_split`): eagerly every part pays its
launches' host time again (top-k(40) eager 174 -> 285 us per call), a replayed graph pays none. Not with a fingerprint slot (the fused write pass hashes the whole output).
The side streams fork from the caller's stream and join back into it before the call returns,
so the caller's later work (and the caching allocator's reuse of `probs` or `out`) is ordered
after every part.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MIN_PART_ROWS = 32  # smaller parts have little streaming work to overlap
# Part boundaries at multiples of ALIGN_ROWS rows: every part's pointers (probs, out, per-row parameters)
# then keep the whole call's 16-byte alignment, which Triton compiles into its kernel variants, so a
# captured part runs the variants the eager warm-up compiled (no compile or module load inside a capture).
ALIGN_ROWS = 4
_STREAMS: dict = {}  # torch.device -> side streams, created once per device, outside any capture


def parts_for(rows: int, split: int) -> int:
    """Row parts of a captured call: `split` when every part gets >= MIN_PART_ROWS rows, else 1."""
    return split if split > 1 and rows >= split * MIN_PART_ROWS else 1


def side_streams(device: torch.device, n: int, create: bool = True) -> list | None:
    """n side streams of `device` (cached), or None when they are not there yet and `create` is
    False (during a capture: no stream is made there) or cannot be made (then: no split)."""
    streams = _STREAMS.get(device, [])
    if len(streams) < n:
        if not create:
            return None
        try:
            with torch.cuda.device(device):
                streams = streams + [torch.cuda.Stream() for _ in range(n - len(streams))]
        except RuntimeError:
            return None
        _STREAMS[device] = streams
    return streams[:n]


def part_bounds(rows: int, parts: int) -> list[int]:
    """Row boundaries of the parts: inner ones rounded down to a multiple of ALIGN_ROWS."""
    inner = [rows * i // parts // ALIGN_ROWS * ALIGN_ROWS for i in range(1, parts)]
    return [0] + inner + [rows]


def run_split(run_part: Callable, probs: torch.Tensor, params: tuple, parts: int,
              streams: list | None) -> torch.Tensor:
    """``run_part(probs_part, *params_part, out=out_part)`` over `parts` row slices of one output;
    per-row parameter tensors are sliced alike, scalars passed as they are. With `streams`, each
    part on its own stream, forked from and joined back into the current stream; with None, the
    parts in order on the current stream (CPU: the same results, for tests)."""
    rows = probs.shape[0]
    out = torch.empty_like(probs)
    bounds = part_bounds(rows, parts)
    main = torch.cuda.current_stream(probs.device) if streams else None
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        sliced = tuple(x[a:b] if isinstance(x, torch.Tensor) else x for x in params)
        if streams is None:
            run_part(probs[a:b], *sliced, out=out[a:b])
            continue
        streams[i].wait_stream(main)
        with torch.cuda.stream(streams[i]):
            run_part(probs[a:b], *sliced, out=out[a:b])
    for s in streams or ():
        main.wait_stream(s)
    return out


__all__ = ["ALIGN_ROWS", "MIN_PART_ROWS", "part_bounds", "parts_for", "run_split", "side_streams"]
