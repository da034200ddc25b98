"""`RenormConfig.reverse_chunks` (kernels/renorm_passes.pass_chunk): a streaming pass that follows another
reads the chunk columns in the opposite order. Each program still gets one chunk, every chunk once, and
every op gives the same bits and fingerprint slots as with every pass first to last.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from renorm_setup import DEVICE, SMALL, mixed_batch

from tpguard.kernels import renorm_plan as rp
from tpguard.kernels.renorm_config import default_config
from tpguard.kernels.renorm_passes import pass_chunk
from tpguard.kernels.renorm_workspace import shapes_for
from tpguard.kernels.target_probs import target_probs_triton

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN rows


@triton.jit
def _order_kernel(ticket_ptr, seen_ptr, n_chunks, REVERSE: tl.constexpr):
    chunk = pass_chunk(REVERSE)
    row = tl.program_id(0)
    t = tl.atomic_add(ticket_ptr + row, 1)  # the order programs of a row got here
    tl.store(seen_ptr + row * n_chunks + chunk, t)


@pytest.mark.parametrize("reverse", [False, True])
def test_pass_chunk_visits_every_chunk_once_in_its_order(reverse):
    rows, n_chunks = 3, 7
    ticket = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    seen = torch.full((rows, n_chunks), -1, dtype=torch.int32, device=DEVICE)
    _order_kernel[(rows, n_chunks)](ticket, seen, n_chunks, REVERSE=reverse)
    got = seen.cpu()
    for r in range(rows):  # a permutation: every chunk of the row visited by exactly one program
        assert sorted(got[r].tolist()) == list(range(n_chunks)), got[r]
    if DEVICE == "cpu":  # the interpreter runs programs in grid order: the order itself
        want = torch.arange(n_chunks, dtype=torch.int32)
        want = want.flip(0) if reverse else want
        assert torch.equal(got, want.expand(rows, n_chunks)), got


def configs(rows: int, vocab: int):
    base = SMALL if DEVICE == "cpu" else default_config()
    on, off = base.replace(reverse_chunks=1), base.replace(reverse_chunks=0)
    assert shapes_for(rows, vocab, on).n_chunks > 2
    return on, off


# CPU: 6 chunks of SMALL's 256, the last one partial
VOCAB, ROWS = (163840, 9) if DEVICE == "cuda" else (1300, 5)


@pytest.mark.slow
@pytest.mark.parametrize("op", rp.OPS)
def test_reverse_chunks_same_bits(op):
    """Every renorm, scalar and per-row parameters (some k >= vocab: top-k + top-p's bracket passes), with and
    without the fingerprint slot: the alternating order gives the bits of every pass in order."""
    on, off = configs(ROWS, VOCAB)
    x = mixed_batch(ROWS, VOCAB)
    k = 40 if op in ("top_k", "top_k_top_p") else None
    k_rows = None if k is None else torch.tensor(([40, 3, VOCAB, 1000] * ROWS)[:ROWS], dtype=torch.int32,
                                                 device=DEVICE)
    p = {"top_p": 0.9, "top_k_top_p": 0.9, "min_p": 0.05}.get(op)
    p_rows = None if p is None else torch.rand(ROWS, device=DEVICE) * 0.5 + (0.45 if op != "min_p" else 0.0)
    for kk, pp in ((k, p), (k_rows, p_rows)):
        for slot in (None, torch.zeros((), dtype=torch.int64, device=DEVICE)):
            want_slot = None if slot is None else torch.zeros_like(slot)
            want = rp._run_op(op, x, kk, pp, off, want_slot, None)
            got = rp._run_op(op, x, kk, pp, on, slot, None)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (op, kk is k)
            if slot is not None:
                assert int(slot) == int(want_slot), (op, kk is k)


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [40, None])  # with top-k: no bracket pass, the write pass reversed
def test_reverse_chunks_same_bits_target_probs(top_k):
    on, off = configs(ROWS, VOCAB)
    logits = torch.log(mixed_batch(ROWS, VOCAB).clamp_min(1e-30))
    for slot in (None, torch.zeros((), dtype=torch.int64, device=DEVICE)):
        want_slot = None if slot is None else torch.zeros_like(slot)
        want = target_probs_triton(logits, 0.8, top_k, 0.9, None, off, want_slot)
        got = target_probs_triton(logits, 0.8, top_k, 0.9, None, on, slot)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        if slot is not None:
            assert int(slot) == int(want_slot)
