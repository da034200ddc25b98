"""The one-launch top-k (+ top-p) of small batches (kernels/renorm_top_k_fused.py): the same bits as
the three launches it replaces (kernels/renorm_top_k.py with ``fused_rows=0``), the reference's kept
sets, its routing rule and its sync words left at zero.

On CPU the kernel runs under the Triton interpreter as two launches (its stages one after the other:
the interpreter runs programs in turn, so a program cannot wait for a later one); on a GPU it is one
launch whose CTAs wait on their row's select (test_one_launch_on_gpu at the benchmark's shapes).
"""

from __future__ import annotations

import pytest
import torch
from renorm_setup import DEVICE, SMALL

from tpguard.kernels import reference as ref
from tpguard.kernels import renorm_top_k_fused as fused
from tpguard.kernels.renorm import top_k_renorm, top_k_top_p_renorm
from tpguard.kernels.renorm_config import default_config
from tpguard.kernels.renorm_top_k import top_k_renorm_triton, top_k_top_p_renorm_triton
from tpguard.kernels.renorm_top_k_select import workspace_flags
from tpguard.kernels.renorm_workspace import SYNC_WORDS, shapes_for, workspace_for
from test_renorm_kernels import assert_matches, make_rows, special_rows

DEFAULT_CONFIG = default_config()  # the process's config (TPGUARD_RENORM_CONFIG)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN rows

CONFIGS = {"default": DEFAULT_CONFIG, "small": SMALL}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def run_both(x, k, p, cfg):
    """(one-launch output, its workspace, three-launch output) of one call."""
    assert fused.fused_fits(x.shape[0], x.shape[1], k, p, None, cfg, x.device)
    ws = workspace_for(shapes_for(x.shape[0], x.shape[1], cfg), cfg, x.device, *workspace_flags(x.shape[1], k, p))
    three = cfg.replace(fused_rows=0)
    if p is None:
        return top_k_renorm_triton(x, k, cfg, workspace=ws), ws, top_k_renorm_triton(x, k, three)
    return top_k_top_p_renorm_triton(x, k, p, cfg, workspace=ws), ws, top_k_top_p_renorm_triton(x, k, p, three)


SAME_BITS_CASES = [
    (100, 7, 1, None, "flat"), (100, 8, 40, 0.5, "peaky"), (1000, 5, 40, None, "peaky"),
    (3000, 3, 40, 0.9, "flat"), (2500, 2, 300, None, "flat"), (2500, 2, 300, "tensor", "flat"),
    (9000, 1, 40, None, "flat"), (9000, 8, 99, 1.0, "peaky"), (5000, 4, 4999, None, "flat"),
    (5000, 3, 5000, None, "flat"), (9000, 6, "tensor", None, "flat"), (700, 5, "tensor", None, "peaky"),
]


# (the small shapes at vocab >= 1000, 4 to 36 chunks a row, take seconds each under the interpreter)
@pytest.mark.parametrize("vocab, rows, k, p, kind, cfg", [
    pytest.param(*case, cfg, marks=pytest.mark.slow) if cfg == "small" and case[0] >= 1000 and case[1] > 1
    else (*case, cfg) for case in SAME_BITS_CASES for cfg in ("default", "small")])
def test_same_bits_as_three_launches(vocab, rows, k, p, kind, cfg):
    x = make_rows(rows, vocab, kind, seed=vocab + rows)
    if p == "tensor":
        p = torch.linspace(0.3, 1.0, rows, device=DEVICE)
    if k == "tensor":  # SGLang's call: a k per row, top-k off (k >= vocab) on some
        k = torch.tensor([40, vocab, 1, 1 << 30, 300, vocab - 1][:rows], dtype=torch.int32, device=DEVICE)
    out, ws, three = run_both(x, k, p, CONFIGS[cfg])
    assert torch.equal(bits(out), bits(three))
    expect = ref.top_k_renorm_reference(x, k) if p is None else ref.top_k_top_p_renorm_reference(x, k, p)
    assert_matches(out, expect)
    assert ws.sync.numel() == rows * SYNC_WORDS and not ws.sync.any()  # zero for the next call


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [300, 5000])
def test_special_rows(vocab):
    """Zero, NaN, infinite, tied and one-entry rows: the three launches' handling, bit for bit."""
    x = special_rows(vocab)
    every_k = torch.tensor([10, vocab, 1, 3, vocab, 7, 2, vocab - 1], dtype=torch.int32, device=DEVICE)
    for k, p in ((10, None), (1, None), (10, 0.7), (vocab - 1, 0.2), (vocab, None), (every_k, None)):
        out, ws, three = run_both(x, k, p, DEFAULT_CONFIG)
        assert torch.equal(bits(out), bits(three)), (vocab, k, p)
        assert not ws.sync.any()


@pytest.mark.slow
def test_batch_invariant_and_repeatable():
    """A row's bits are the same alone, in a batch of 8 (one launch) and in a batch of 66 (three launches:
    more than fused_rows_short rows of 6000 entries)."""
    x = torch.cat([make_rows(10, 6000, "flat", seed=5), make_rows(10, 6000, "peaky", seed=6)])
    x = torch.cat([x, x, x, x[:6]])  # the 20 rows, then repeats of them
    big = top_k_renorm(x, 40, backend="tpguard")
    assert not fused.fused_fits(66, 6000, 40, None, None, DEFAULT_CONFIG, x.device)
    assert fused.fused_fits(8, 6000, 40, None, None, DEFAULT_CONFIG, x.device)
    for start in (0, 9, 12):
        part = x[start:start + 8]
        first = top_k_renorm(part, 40, backend="tpguard")
        for _ in range(2):
            assert torch.equal(bits(top_k_renorm(part, 40, backend="tpguard")), bits(first))
        assert torch.equal(bits(first), bits(big[start:start + 8]))
        assert torch.equal(bits(top_k_renorm(x[start:start + 1], 40, backend="tpguard")), bits(big[start:start + 1]))
    both = top_k_top_p_renorm(x, 40, 0.8, backend="tpguard")
    assert torch.equal(bits(top_k_top_p_renorm(x[3:11], 40, 0.8, backend="tpguard")), bits(both[3:11]))
    k = torch.tensor([40, 6000, 7, 1 << 30] * 17, dtype=torch.int32)[:66]  # per-row k, top-k off on some rows
    big = top_k_renorm(x, k, backend="tpguard")
    for start in (0, 5, 13):
        assert torch.equal(bits(top_k_renorm(x[start:start + 7], k[start:start + 7], backend="tpguard")),
                           bits(big[start:start + 7])), start


def test_routing_rule():
    cfg = DEFAULT_CONFIG
    dev = torch.device(DEVICE)
    kt = torch.tensor([40] * 4)
    for k in (40, 163840, kt):  # top-k alone: any k
        assert fused.fused_fits(1, 163840, k, None, None, cfg, dev)
        assert fused.fused_fits(cfg.fused_rows, 163840, k, None, None, cfg, dev)
        assert not fused.fused_fits(cfg.fused_rows + 1, 163840, k, None, None, cfg, dev)  # three launches
        assert not fused.fused_fits(0, 163840, k, None, None, cfg, dev)
        assert not fused.fused_fits(4, 163840, k, None, torch.zeros((), dtype=torch.int64), cfg, dev)  # fp slot
        assert not fused.fused_fits(4, 163840, k, None, None, cfg.replace(fused_rows=0), dev)
    # with top-p: a scalar k < vocab only (a row with k >= vocab is plain top-p: the bracket passes)
    assert fused.fused_fits(4, 163840, 40, 0.9, None, cfg, dev)
    assert fused.fused_fits(4, 163840, 40, torch.full((4,), 0.9), None, cfg, dev)
    assert not fused.fused_fits(4, 163840, 163840, 0.9, None, cfg, dev)
    assert not fused.fused_fits(4, 163840, kt, 0.9, None, cfg, dev)
    # the workspace's sync words where the kernel may run
    assert workspace_flags(1000, 40)[2] and workspace_flags(1000, 1000)[2] and workspace_flags(1000, kt)[2]
    assert workspace_flags(1000, 40, 0.9)[2] and not workspace_flags(1000, 1000, 0.9)[2]
    assert not workspace_flags(1000, kt, 0.9)[2]
    # short rows (<= 1024 groups: vocab <= 32768): top-k alone in one launch up to fused_rows_short rows
    short = 32000
    assert cfg.fused_rows_short > cfg.fused_rows
    for k in (40, 32000, torch.tensor([40] * cfg.fused_rows_short)):
        assert fused.fused_fits(cfg.fused_rows_short, short, k, None, None, cfg, dev)
        assert not fused.fused_fits(cfg.fused_rows_short + 1, short, k, None, None, cfg, dev)
    assert fused.fused_fits(cfg.fused_rows_short, 32768, 40, None, None, cfg, dev)
    assert not fused.fused_fits(cfg.fused_rows + 1, 32769, 40, None, None, cfg, dev)
    assert not fused.fused_fits(cfg.fused_rows + 1, short, 40, 0.9, None, cfg, dev)  # top-k + top-p: fused_rows
    assert not fused.fused_fits(cfg.fused_rows + 1, short, 40, None, None, cfg.replace(fused_rows_short=0), dev)
    assert not fused.fused_fits(1, short, 40, None, None, cfg.replace(fused_rows=0), dev)  # 0: off everywhere
    if DEVICE == "cuda":  # a row's CTAs must fit the GPU at once
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        assert not fused.fused_fits(1, (sms + 1) * cfg.chunk, 40, None, None, cfg, dev)


@pytest.mark.skipif(DEVICE != "cuda", reason="the one-launch wait runs on a GPU (the interpreter runs two launches)")
@pytest.mark.parametrize("vocab", [128256, 163840])
def test_one_launch_on_gpu(vocab):
    """The benchmark's shapes: one launch, the three launches' bits, 1,000 repeated calls bit-identical."""
    from tpguard.kernels import renorm_plan

    for rows in (1, 3, 8):
        x = torch.cat([make_rows(rows, vocab, "flat", seed=rows), make_rows(rows, vocab, "peaky", seed=rows + 1)])[
            ::2][:rows].contiguous()
        every_k = torch.tensor([40, vocab, 1, 1024, 1 << 30, 7, 2, 40][:rows], dtype=torch.int32, device=DEVICE)
        for k, p in ((40, None), (1, None), (1024, None), (40, 0.9), (every_k, None)):
            out, ws, three = run_both(x, k, p, DEFAULT_CONFIG)
            assert torch.equal(bits(out), bits(three)), (rows, k, p)
            assert not ws.sync.any()
        renorm_plan.clear_plans()
        first = top_k_renorm(x, 40)
        for _ in range(1000):  # through the plan: its one recorded launch
            assert torch.equal(bits(top_k_renorm(x, 40)), bits(first))
        plan = renorm_plan.plans()[-1][1]
        assert plan.state == "on" and len(plan.direct.launches) == 1, plan.refusal


def test_chunks_per_cta():
    """The grid at one CTA per SM (the default rule), and the same bits at any chunks per CTA."""
    cfg = DEFAULT_CONFIG
    assert [fused.chunks_per_cta(rows, 40, cfg, 132) for rows in (1, 2, 3, 4, 6, 8)] == [1, 1, 1, 2, 2, 4]
    assert fused.chunks_per_cta(8, 32, cfg, 132) == 2 and fused.chunks_per_cta(4, 3, cfg, 2) == 4
    assert fused.chunks_per_cta(8, 40, cfg.replace(fused_per_cta=2), 132) == 2
    x = make_rows(3, 4096 * 5 + 100, "flat", seed=3)  # 6 chunks: a CTA past the row's end at 4 per CTA
    expect = top_k_renorm_triton(x, 40, DEFAULT_CONFIG.replace(fused_rows=0))
    for per in (2, 4, 8):
        out = top_k_renorm_triton(x, 40, DEFAULT_CONFIG.replace(fused_per_cta=per))
        assert torch.equal(bits(out), bits(expect)), per


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefetch_same_bits(dtype):
    """fused_prefetch (the next chunk's load in flight, the first output chunk's input loaded before the
    wait): the same bits as without, at 1 and 4 chunks per CTA (a CTA past the row's end), scalar and per-row k."""
    x = torch.cat([make_rows(2, 4096 * 5 + 100, "flat", seed=5), make_rows(2, 4096 * 5 + 100, "peaky", seed=6)])
    x = x.to(dtype)
    k_rows = torch.tensor([40, 1, 4096 * 5 + 100, 300], dtype=torch.int32, device=x.device)
    view = torch.int32 if dtype == torch.float32 else torch.int16
    for per, k in ((1, k_rows), (4, 40)):  # (few: each is two more compiled variants on a GPU)
        cfg = DEFAULT_CONFIG.replace(fused_per_cta=per)
        on = top_k_renorm_triton(x, k, cfg.replace(fused_prefetch=1))
        off = top_k_renorm_triton(x, k, cfg.replace(fused_prefetch=0))
        assert on.dtype == dtype and torch.equal(on.view(view), off.view(view)), per
        assert torch.equal(on.view(view), top_k_renorm_triton(x, k, cfg.replace(fused_rows=0)).view(view)), per


def test_one_launch_on_short_rows_up_to_fused_rows_short():
    """Top-k alone on short rows at fused_rows_short rows: one launch (the sync words in its workspace,
    zero again after the call), the three launches' bits, scalar and per-row k."""
    x = torch.cat([make_rows(12, 3000, "flat", seed=21), make_rows(12, 3000, "peaky", seed=22)])
    cfg = DEFAULT_CONFIG.replace(fused_rows_short=24)
    k_rows = torch.tensor([40, 3000, 1, 7, 1 << 30, 300] * 4, dtype=torch.int32, device=x.device)
    for k in (40, k_rows):
        assert fused.fused_fits(24, 3000, k, None, None, cfg, x.device)
        ws = workspace_for(shapes_for(24, 3000, cfg), cfg, x.device, False, False, True)
        assert ws.sync.numel() == 24 * SYNC_WORDS
        out = top_k_renorm_triton(x, k, cfg, workspace=ws)
        assert not ws.sync.any()
        assert torch.equal(bits(out), bits(top_k_renorm_triton(x, k, cfg.replace(fused_rows=0))))
    assert workspace_for(shapes_for(25, 3000, cfg), cfg, x.device, False, False, True).sync.numel() == 0
    if DEVICE == "cuda":  # the default rule through the call plan: 64 x 32000 is one recorded launch
        from tpguard.kernels import renorm_plan

        x = make_rows(64, 32000, "flat", seed=23)
        renorm_plan.clear_plans()
        first = top_k_renorm(x, 40)
        for _ in range(3):
            assert torch.equal(bits(top_k_renorm(x, 40)), bits(first))
        assert torch.equal(bits(first), bits(top_k_renorm_triton(x, 40, DEFAULT_CONFIG.replace(fused_rows=0))))
        plan = renorm_plan.plans()[-1][1]
        assert plan.state == "on" and len(plan.direct.launches) == 1, plan.refusal


def test_workspace_without_sync_words_takes_three_launches():
    """A caller's workspace made without the sync words (`with_sync=False`) is never handed to the one launch."""
    x = make_rows(2, 3000, "peaky", seed=8)
    ws = workspace_for(shapes_for(2, 3000, DEFAULT_CONFIG), DEFAULT_CONFIG, x.device, False, False)
    assert ws.sync.numel() == 0
    out = top_k_renorm_triton(x, 40, workspace=ws)
    assert torch.equal(bits(out), bits(top_k_renorm_triton(x, 40, DEFAULT_CONFIG.replace(fused_rows=0))))
