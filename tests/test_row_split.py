"""Row split of captured renorm calls (kernels/row_split.py): the parts' outputs, written into one
output, are the one-call bits for every op (batch invariance), per-row parameters sliced alike;
on a GPU a captured call takes the split on side streams and its replays give the eager bits.

On CPU (Triton interpreter) the parts run in order on the current stream (no streams, no capture);
the capture path itself needs CUDA (test_captured_call_splits_on_gpu).
"""

from __future__ import annotations

import pytest
import torch
from renorm_setup import DEVICE, SMALL

from tpguard.kernels import renorm, renorm_plan as rp, row_split

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN rows
VOCAB = 700


def batch(rows: int, seed: int = 0) -> torch.Tensor:
    """Flat and peaky rows (bracket passes, gather path) and a NaN row."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([[1.0], [5.0], [2.0]]).repeat(rows // 3 + 1, 1)[:rows]
    x = torch.softmax(torch.randn(rows, VOCAB, generator=g, dtype=torch.float64) * scale, -1).float()
    x[4, 9] = float("nan")
    return x.to(DEVICE)


def test_parts_for():
    assert row_split.parts_for(256, 2) == 2 and row_split.parts_for(64, 2) == 2
    assert row_split.parts_for(63, 2) == 1  # a part of < MIN_PART_ROWS rows: no split
    assert row_split.parts_for(256, 1) == 1 and row_split.parts_for(256, 0) == 1
    assert row_split.parts_for(128, 4) == 4 and row_split.parts_for(127, 4) == 1


def test_part_bounds_keep_alignment():
    # inner boundaries at multiples of 4 rows: every part's pointers keep the call's 16-byte alignment
    assert row_split.part_bounds(256, 2) == [0, 128, 256]
    assert row_split.part_bounds(100, 2) == [0, 48, 100] and row_split.part_bounds(90, 2) == [0, 44, 90]
    assert row_split.part_bounds(130, 3) == [0, 40, 84, 130]
    for rows in range(64, 200):
        for parts in (2, 3, 4):
            b = row_split.part_bounds(rows, parts)
            assert b[0] == 0 and b[-1] == rows and all(x % row_split.ALIGN_ROWS == 0 for x in b[:-1])
            assert all(hi - lo >= 28 for lo, hi in zip(b, b[1:])) or rows < parts * row_split.MIN_PART_ROWS


def test_no_streams_made_during_capture(monkeypatch):
    # side_streams(create=False) (a capture) hands out only streams made before; none: no split
    monkeypatch.setattr(row_split, "_STREAMS", {})
    dev = torch.device("cuda", 0)
    assert row_split.side_streams(dev, 2, create=False) is None
    monkeypatch.setattr(row_split, "_STREAMS", {dev: ["s0", "s1", "s2"]})
    assert row_split.side_streams(dev, 2, create=False) == ["s0", "s1"]


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path of run_split (parts in order)")
@pytest.mark.parametrize("op", rp.OPS)
def test_parts_give_the_one_call_bits(op, monkeypatch):
    monkeypatch.setattr(row_split, "ALIGN_ROWS", 1)  # 7 rows in 3 parts (on a GPU: multiples of 4)
    rows, parts = 7, 3  # a first, a middle and a last part
    x = batch(rows)
    k = torch.tensor([40, 3, 40, VOCAB, 1, 40, 700], dtype=torch.int32) if op in ("top_k", "top_k_top_p") else None
    p = torch.tensor([0.9, 0.5, 0.95, 1.0, 0.9, 0.3, 0.99]) / (9 if op == "min_p" else 1) \
        if op != "top_k" else None
    for kk, pp in ((k, p), (None if k is None else 40, None if p is None else 0.9 / (9 if op == "min_p" else 1))):
        want = rp._run_op(op, x, kk, pp, SMALL, None, None)
        seen = []

        def part(xs, k_part, p_part, out):
            seen.append((xs.shape[0], None if not isinstance(k_part, torch.Tensor) else k_part.tolist()))
            return rp._run_op(op, xs, k_part, p_part, SMALL, None, None, out)

        got = row_split.run_split(part, x, (kk, pp), parts, None)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (op, parts)
        assert sum(n for n, _ in seen) == rows and len(seen) == parts
        if isinstance(kk, torch.Tensor):  # per-row parameters sliced with their rows
            assert sum((ks for _, ks in seen), []) == kk.tolist()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graph capture")
@pytest.mark.parametrize("rows", [96, 100])  # 100: halves at row 48 (multiple of 4), not 50
def test_captured_call_splits_on_gpu(monkeypatch, rows):
    x = batch(rows)
    p = torch.rand(rows, device=DEVICE) * 0.5 + 0.45
    calls = []
    real = row_split.run_split

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(row_split, "run_split", counting)
    for op, k, pp in (("top_p", None, p), ("top_k_top_p", 40, 0.9), ("min_p", None, 0.05)):
        fn = {"top_p": lambda: renorm.top_p_renorm(x, pp, validate=False),
              "top_k_top_p": lambda: renorm.top_k_top_p_renorm(x, k, pp, validate=False),
              "min_p": lambda: renorm.min_p_renorm(x, pp, validate=False)}[op]
        want = fn()  # eager: no split (and the side streams made here)
        assert not calls
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fn()
        assert calls == [2], op
        calls.clear()
        for _ in range(3):
            got.fill_(-1.0)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), op
        # with a fingerprint slot (the guard's fused write pass): no split, the same bits
        slot = torch.zeros((), dtype=torch.int64, device=DEVICE)
        graph2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph2):
            got2 = renorm.top_p_renorm(x, p, validate=False, fingerprint_out=slot)
        graph2.replay()
        torch.cuda.synchronize()
        assert not calls and torch.equal(got2.view(torch.int32), renorm.top_p_renorm(x, p).view(torch.int32))
