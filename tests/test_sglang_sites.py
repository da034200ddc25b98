"""Verify paths of sglang 0.5.23 beyond the main ones, through their real functions on 2 gloo ranks:

* UNO's linear verify: `UnoWorkerV2._accept_and_pack` (greedy) and `run_uno_sampling` (its dense
  rejection, its own torch.rand coins, target probs from `build_speculative_verify_target_probs`
  recorded in the ``uno.verify`` step, not as a stray ``dflash.verify`` one); no sglang broadcast,
  so `heal` adds one. (sglang's UNO modules import flashinfer at module level: an import stand-in,
  tests/flashinfer_stand_in.py, lets them import; nothing here calls it.)
* DSpark's block-wise rejection (`BlockwiseRejection`): its noise (key, device counter) is the
  step's coins and its target probs are recorded.
* `SpeculativeSamplingMaskCapture.from_logits` (sglang's mask rebuild after acceptance): no
  tpguard work, no collective.
* DSpark's sampling-accept region (`DsparkSamplingAcceptGraph.run`; the worker skips
  accept_and_finalize on its steps): a key's first step runs the region eagerly and is checked
  once (capture and replay need CUDA: the GPU check).
* DSpark's folded accept (read after the target-verify graph): checked once; `heal` is refused
  with one log line, and the plugin says so at start-up.
* EAGLE's greedy branch with a watermark: under `heal`, sglang's `record_speculative` sees the
  healed accept_index / accept_lens. (sglang dispatches `verify_tree_greedy_func` by platform; on
  this CPU box it would run no kernel, so the test takes its XPU dispatch: sglang's own Triton
  kernel, under the interpreter.)
"""

from __future__ import annotations

import sys

import pytest

import sglang_zygote  # noqa: E402 - tests/ is on sys.path (pytest and `python tests/x.py --zygote`)
from sglang_zygote import divergence_log, logits, plugin_stats, sampling_info

SERVER_ARGS = {"device": "cpu", "sampling_backend": "pytorch", "speculative_use_rejection_sampling": True}

PRELOAD = (
    "flashinfer_stand_in", "torch", "torch.distributed",
    "sglang.srt.plugins", "sglang.srt.plugins.hook_registry", "sglang.srt.managers.scheduler",
    "sglang.srt.distributed.parallel_state", "sglang.srt.layers.dp_attention",
    "sglang.srt.runtime_context", "sglang.srt.server_args", "sglang.srt.speculative.spec_tp_sync",
    "sglang.kernels.ops.sampling.renorm", "sglang.srt.speculative.dflash_utils",
    "sglang.srt.speculative.uno_utils", "sglang.srt.speculative.uno_worker_v2",
    "sglang.srt.speculative.spec_sampling_mask",
    "sglang.srt.speculative.dspark_components.dspark_verify",
    "sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph",
    "sglang.srt.speculative.dspark_components.dspark_draft_sampler",
    "sglang.kernels.ops.speculative.dspark.dspark_accept",
    "sglang.kernels.ops.speculative.dspark.blockwise_rejection",
    "sglang.srt.sampling.sampling_batch_info", "sglang.srt.speculative.eagle_utils",
    "sglang.srt.speculative.eagle_info", "sglang.srt.managers.schedule_batch",
    "sglang.srt.model_executor.forward_batch_info", "sglang.srt.layers.logits_processor",
    "sglang.kernels.ops.speculative.spec_tree", "sglang.srt.sampling.watermarking.core",
    "tpguard.guard", "tpguard.hooks.sglang_plugin", "tpguard.hooks.sglang_sites", "tpguard.hooks.sglang_runtime",
)

STEPS = 3


def _log_lines():
    import logging

    lines = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logging.getLogger("tpguard").addHandler(handler)
    return lines


def scenario_uno_greedy(rank, world, tp):
    """UNO's greedy pack. Step 1: rank 1's target argmax differs for request 0 (its forward)."""
    import torch
    from sglang.srt.speculative.uno_worker_v2 import UnoWorkerV2

    counts = sglang_zygote.count_collectives()
    log = divergence_log("uno.verify")
    outs = []
    bs, width, vocab = 3, 4, 50
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        top1 = torch.randint(0, vocab, (bs, width), generator=g)
        cand = torch.cat([torch.randint(0, vocab, (bs, 1), generator=g), top1[:, :-1]], dim=1)
        cand[2, 2] = (top1[2, 1] + 1) % vocab  # request 2 rejects its 2nd proposal
        if step == 1 and rank == 1:
            top1[0, 1] = (top1[0, 1] + 1) % vocab  # request 0 rejects at position 1 on rank 1 only
        out = UnoWorkerV2._accept_and_pack(candidates=cand, target_top1=top1,
                                           committed_seq_lens=torch.tensor([5, 9, 13]))
        outs.append([t.tolist() for t in out])
    return {"outs": outs, "log": log, "counts": counts, "stats": plugin_stats()}


def scenario_uno_sampled(rank, world, tp):
    """UNO's sampled linear verify, dense path. Step 1: rank 1 reseeds its generator (coins)."""
    import torch
    from sglang.srt.speculative import uno_utils
    from tpguard.hooks import sglang_runtime

    log = divergence_log("uno.verify")
    recorded = []
    guard = sglang_runtime.RUNTIME.guard("uno.verify")
    check = guard.check

    def check_and_note(step=None, **kw):
        recorded.append(sorted(guard._fps))
        return check(step, **kw)

    guard.check = check_and_note
    bs, width, vocab = 2, 4, 48
    info = sampling_info(bs, vocab, top_p=0.9)
    outs = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(40 + step)
        cand = torch.randint(0, vocab, (bs, width), generator=g)
        q = torch.softmax(torch.randn((bs, width, vocab), generator=g), dim=-1)
        torch.manual_seed(99 if (step == 1 and rank == 1) else 7 + step)
        res = uno_utils.run_uno_sampling(
            candidates=cand, next_token_logits=logits(step, bs * width, vocab), sampling_info=info,
            committed_frontiers=torch.tensor([20, 30]),
            draft_distribution=uno_utils.UnoDraftDistribution(probs=q), max_top_k=vocab)
        outs.append([res.output_ids.tolist(), res.accept_lens.tolist(), res.new_seq_lens.tolist()])
    return {"outs": outs, "log": log, "recorded": recorded, "stats": plugin_stats(),
            "sites": sorted(sglang_runtime.RUNTIME.guards)}


def _dspark_executor(tp, noise=None):
    from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    ex = TargetVerifyExecutor.__new__(TargetVerifyExecutor)
    ex._simulated_correct_len = None
    ex.gamma, ex.verify_num_draft_tokens = 3, 4
    ex._fused_argmax = ex._block_verification = False
    ex._rejection_noise = noise
    ex._tp_sync = SpecTpSync(tp)
    return ex


def _dspark_inputs(step: int, bs: int, vocab: int, info, greedy: bool):
    import torch
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult

    lg = logits(step, bs * 4, vocab)
    drafts = lg.argmax(-1).view(bs, 4)[:, :3].clone()
    block = DraftBlockResult(draft_tokens=drafts, corrected_logits=None,
                             greedy_mask=torch.full((bs,), greedy, dtype=torch.bool),
                             temperatures=info.temperatures, greedy_draft=True)
    return dict(bs=bs, verify_ids_2d=torch.cat([torch.full((bs, 1), 3), drafts], dim=1), target_logits=lg,
                draft_block=block, sampling_info=info, layout=None, prefix_lens=torch.tensor([11, 17][:bs]),
                draft_input=DFlashDraftInputV2.create_idle_input(device=torch.device("cpu")), draft_tokens=drafts)


def scenario_dspark_blockwise(rank, world, tp):
    """Sampled DSpark accept by block-wise rejection. Rank 1's rejection noise runs one step ahead
    from step 1 on (its device counter), so its coins differ."""
    from sglang.kernels.ops.speculative.dspark.blockwise_rejection import make_rejection_noise
    from tpguard.hooks import sglang_runtime

    log = divergence_log("dspark.verify")
    recorded = []
    guard = sglang_runtime.RUNTIME.guard("dspark.verify")
    check = guard.check

    def check_and_note(step=None, **kw):
        recorded.append(sorted(guard._fps))
        return check(step, **kw)

    guard.check = check_and_note
    noise = make_rejection_noise(1234, "cpu")
    ex = _dspark_executor(tp, noise)
    info = sampling_info(2, 32)  # temperature only: no top-k / top-p, so block-wise rejection applies
    outs = []
    for step in range(STEPS):
        if step == 1 and rank == 1:
            noise.counter.add_(1)
        accept = ex.accept_and_finalize(folded_accept=False, **_dspark_inputs(step, 2, 32, info, greedy=False))
        outs.append([accept.correct_len.tolist(), accept.bonus.tolist()])
    return {"outs": outs, "log": log, "recorded": recorded, "stats": plugin_stats()}


def scenario_dspark_sampling_graph(rank, world, tp):
    """One step through the sampling-accept region (its eager first step for a key). Rank 1
    reseeds its generator: its coins differ, so does its accept (sglang's broadcast off)."""
    import torch
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftParams
    from sglang.srt.speculative.dspark_components.dspark_draft_sampler import DsparkDraftSampler
    from sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph import DsparkSamplingAcceptGraph
    from sglang.srt.speculative.dspark_components.dspark_verify import DsparkVerifyEpilogue, StaticVerifyIO
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync
    from tpguard.hooks import sglang_runtime

    log = divergence_log("dspark.verify")
    recorded = []
    guard = sglang_runtime.RUNTIME.guard("dspark.verify")
    check = guard.check

    def check_and_note(step=None, **kw):
        recorded.append(sorted(guard._fps))
        return check(step, **kw)

    guard.check = check_and_note
    bs, stride, vocab = 2, 4, 32
    sync = SpecTpSync(tp)
    epilogue = DsparkVerifyEpilogue(max_bs=bs, verify_num_draft_tokens=stride, device="cpu", tp_sync=sync)
    lg = logits(0, bs * stride, vocab)
    cand = torch.cat([torch.full((bs, 1), 3), lg.argmax(-1).view(bs, stride)[:, :-1]], dim=1)
    epilogue.static_io[bs] = StaticVerifyIO(
        candidates=cand, logits=lg, hidden=torch.zeros(bs * stride, 8), seq_lens=torch.tensor([9, 12]),
        req_pool_indices=torch.arange(bs), out_cache_loc=torch.arange(bs * stride),
        positions=torch.arange(bs * stride))
    sampler = DsparkDraftSampler.__new__(DsparkDraftSampler)  # the draft sampler's buffers the region reads
    sampler.greedy_draft, sampler.step_logits = True, None
    sampler.params = DraftParams(temperatures=torch.full((bs,), 0.7), greedy_mask=torch.zeros(bs, dtype=torch.bool),
                                 step_temperatures=torch.full((bs,), 0.7))
    region = DsparkSamplingAcceptGraph(epilogue=epilogue, resolve_draft_sampler=lambda: sampler, tp_sync=sync,
                                       fused_argmax=False, block_verification=False, device="cpu")
    skipped = region.run(bs=bs, target_logits=lg.clone())  # not the graph's logits: the eager path's step
    torch.manual_seed(5 + rank)
    accept = region.run(bs=bs, target_logits=lg)
    return {"accept": [accept.correct_len.tolist(), accept.bonus.tolist()], "log": log, "recorded": recorded,
            "stats": plugin_stats(), "skipped": skipped is None}


def scenario_mask_capture(rank, world, tp):
    """sglang rebuilds the verified target policy after acceptance, outside any verify step."""
    import torch
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.spec_sampling_mask import SpeculativeSamplingMaskCapture
    from tpguard.hooks import sglang_runtime

    counts = sglang_zygote.count_collectives()
    info = sampling_info(2, 40, top_p=0.8)
    info.sampling_mask_batch_indices = torch.tensor([0, 1])
    info.sampling_mask_top_ks = [5, 5]
    cap = SpeculativeSamplingMaskCapture.from_logits(
        info, next_token_logits=logits(0, 2 * 4, 40), draft_input=DFlashDraftInputV2.create_idle_input(
            device=torch.device("cpu")), draft_token_num=4, bs=2)
    return {"built": cap is not None and cap.target_probs is not None, "collectives": counts["n"],
            "guards": sorted(sglang_runtime.RUNTIME.guards)}


def scenario_dspark_folded(rank, world, tp):
    """The folded accept: the target-verify graph wrote the accept buffers (here: written as the
    graph would), rank 1's correct_len differs at step 1 (sglang's broadcast off)."""
    import torch
    from sglang.srt.speculative.dspark_components.dspark_verify import DsparkVerifyEpilogue

    lines = _log_lines()
    counts = sglang_zygote.count_collectives()
    log = divergence_log("dspark.verify")
    ex = _dspark_executor(tp)
    ex.verify_epilogue = DsparkVerifyEpilogue(max_bs=2, verify_num_draft_tokens=4, device="cpu",
                                              tp_sync=ex._tp_sync)
    info = sampling_info(2, 32, greedy=True)
    outs = []
    for step in range(STEPS):
        ep = ex.verify_epilogue
        ep.correct_len_buf.copy_(torch.tensor([2, 1]) + (step == 1 and rank == 1))
        ep.bonus_buf.copy_(torch.tensor([7, 8]) + step)
        ep.commit_lens_buf.copy_(ep.correct_len_buf.to(torch.int32) + 1)
        accept = ex.accept_and_finalize(folded_accept=True, **_dspark_inputs(step, 2, 32, info, greedy=True))
        outs.append([accept.correct_len.tolist(), accept.commit_lens.tolist()])
    return {"outs": outs, "log": log, "lines": lines, "counts": counts, "stats": plugin_stats()}


def _record_what_watermark_sees(rank):
    """Stands in for sglang's `WatermarkState.record_speculative` (before the plugin wraps it):
    the same function, noting the accept_index / accept_lens it records."""
    from sglang.srt.sampling.watermarking import core

    original = core.WatermarkState.record_speculative
    core.WATERMARK_SEEN = []

    def record_speculative(self, req_pool_indices, context_hashes, selected, accept_index, accept_lens):
        core.WATERMARK_SEEN.append([accept_index.tolist(), accept_lens.tolist()])
        return original(self, req_pool_indices, context_hashes, selected, accept_index, accept_lens)

    core.WatermarkState.record_speculative = record_speculative


def scenario_eagle_greedy_watermark(rank, world, tp):
    """EAGLE greedy verify with a watermark state. Step 1: rank 1's logits reject request 0's
    second draft (its first one still accepted), so its accept_index / accept_lens differ."""
    import torch
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.sampling.watermarking import core
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    spec_tree._is_xpu = True  # sglang's Triton verify_tree_greedy (see the module docstring)
    log = divergence_log("eagle.verify")
    bs, n, vocab = 2, 4, 48
    ws = core.WatermarkState(max_num_reqs=4, context_window=2, max_contexts_per_req=8, key="0123456789abcdef",
                             device="cpu", vocab_size=vocab, default_enabled=True)
    outs = []
    for step in range(2):
        info = sampling_info(bs, vocab, greedy=True)
        info.has_watermark_candidates = True
        lg = logits(step, bs * n, vocab)
        target = lg.argmax(-1).view(bs, n)
        draft = torch.cat([torch.full((bs, 1), 3), target[:, :-1]], dim=1)  # every draft accepted
        if step == 1 and rank == 1:
            lg[2, (target[0, 2] + 1) % vocab] += 50.0  # request 0, position 2: another argmax
        seq_lens = torch.tensor([7, 9])
        nxt = torch.arange(1, n + 1).repeat(bs, 1)
        nxt[:, -1] = -1
        vi = EagleVerifyInput(
            draft_token=draft.reshape(-1), custom_mask=torch.tril(torch.ones(n, n, dtype=torch.bool)).repeat(
                bs, 1, 1).flatten(), positions=(seq_lens.view(-1, 1) + torch.arange(n)).reshape(-1),
            retrieve_index=torch.arange(bs * n).view(bs, n), retrieve_next_token=nxt,
            retrieve_next_sibling=torch.full((bs, n), -1), retrieve_cum_len=None, spec_steps=n - 1, topk=1,
            draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=int(seq_lens.sum()),
            seq_lens_cpu=seq_lens.clone(), draft_probs=None)
        batch = ScheduleBatch(reqs=[], device="cpu", seq_lens=seq_lens, forward_mode=ForwardMode.TARGET_VERIFY,
                              sampling_info=info)
        batch.req_pool_indices = torch.arange(bs)
        out = eagle_utils.eagle_sample(vi, batch, LogitsProcessorOutput(next_token_logits=lg), watermark_state=ws,
                                       watermark_full_mask=False)
        outs.append([t.tolist() for t in out])
    return {"outs": outs, "log": log, "watermark_saw": core.WATERMARK_SEEN}


scenario_eagle_greedy_watermark.before_plugins = _record_what_watermark_sees


def plain_startup_note():
    """load_plugins() in a scheduler-like process with heal or audit: one start-up line."""
    from sglang.srt.plugins import load_plugins

    lines = _log_lines()
    load_plugins()
    return [line for line in lines if "folded accept" in line]


SCENARIOS = {k[len("scenario_"):]: v for k, v in dict(globals()).items() if k.startswith("scenario_")}
PLAIN = {"startup_note": plain_startup_note}

if __name__ == "__main__" and "--zygote" in sys.argv:
    sglang_zygote.zygote_main(PRELOAD, SCENARIOS, PLAIN, SERVER_ARGS)
    sys.exit(0)


# =============================================================================================
# Tests
# =============================================================================================

if reason := sglang_zygote.missing():  # not importing sglang here: the zygote does, once
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.slow  # sglang imported by a process of its own


@pytest.fixture(scope="module")
def zygote():
    z = sglang_zygote.Zygote(__file__, PLAIN)
    yield z
    z.close()


ON = {"TPGUARD": "on"}
HEAL = {"TPGUARD": "on", "TPGUARD_ON_DIVERGENCE": "heal"}


def test_uno_greedy_is_guarded_and_healed(zygote):
    plain = zygote.run("uno_greedy", {})
    assert plain[0]["outs"][1] != plain[1]["outs"][1]  # UNO has no broadcast of its own
    r0, r1 = zygote.run("uno_greedy", ON)
    assert [r0["outs"], r1["outs"]] == [plain[0]["outs"], plain[1]["outs"]]
    assert r0["log"] == r1["log"] == [[1, "uno.verify", "accept_index", [1], "recorded", None]]
    h0, h1 = zygote.run("uno_greedy", HEAL)
    assert h0["outs"] == h1["outs"] == plain[0]["outs"]  # incl. new_seq_lens, recomputed
    assert h1["log"][0][4] == "healed" and {"commit_lens", "bonus", "out_tokens"} <= set(h1["log"][0][5])
    assert h1["counts"]["broadcast"] > r1["counts"]["broadcast"]


def test_uno_sampled_records_its_step_in_one_site(zygote):
    r0, r1 = zygote.run("uno_sampled", ON, timeout=120)
    assert r0["sites"] == ["uno.verify"]  # its target probs did not open a dflash.verify step
    assert {"rng_state", "seq_lens", "draft_tokens", "target_logits", "target_probs", "coins", "accept_len",
            "bonus", "commit_lens", "out_tokens"} <= set(r0["recorded"][0])
    assert r0["log"] == r1["log"] and r0["log"][0][:4] == [1, "uno.verify", "rng_state", [1]]
    h0, h1 = zygote.run("uno_sampled", HEAL, timeout=120)
    assert h0["outs"] == h1["outs"]


def test_blockwise_rejection_noise_and_probs_are_recorded(zygote):
    r0, r1 = zygote.run("dspark_blockwise", {**ON, "SGLANG_SPEC_TP_SYNC": "off"}, timeout=120)
    assert {"target_probs", "coins"} <= set(r0["recorded"][0])
    assert r0["log"][0][:4] == [1, "dspark.verify", "coins", [1]]


def test_mask_rebuild_after_acceptance_is_not_a_step(zygote):
    r0, r1 = zygote.run("mask_capture", ON)
    assert r0["built"] and r0["collectives"] == 0 and r0["guards"] == []


def test_folded_accept_is_checked_and_heal_refused(zygote):
    off = {"SGLANG_SPEC_TP_SYNC": "off"}
    r0, r1 = zygote.run("dspark_folded", {**ON, **off})
    assert r0["log"] == r1["log"] == [[1, "dspark.verify", "accept_len", [1], "recorded", None]]
    h0, h1 = zygote.run("dspark_folded", {**HEAL, **off})
    assert h0["outs"] == r0["outs"] and h1["outs"] == r1["outs"]  # nothing healed partly
    assert h1["log"] == [[1, "dspark.verify", "accept_len", [1], "recorded", None]]
    assert h1["counts"]["broadcast"] == r1["counts"]["broadcast"]
    refused = [line for line in h1["lines"] if "heal is refused" in line]
    assert len(refused) == 1 and "folded accept" in refused[0]


def test_folded_accept_limits_said_at_start_up(zygote):
    for env in ({"TPGUARD": "audit"}, HEAL):
        (lines,) = zygote.run("startup_note", {**env, "TPGUARD_ALL_PROCESSES": "1"})
        assert len(lines) == 1 and "audit cannot see" in lines[0]
    assert zygote.run("startup_note", {**ON, "TPGUARD_ALL_PROCESSES": "1"}) == [[]]


def test_eagle_greedy_heal_reaches_the_watermark(zygote):
    r0, r1 = zygote.run("eagle_greedy_watermark", ON, timeout=120)
    assert r0["log"] == r1["log"] and r0["log"][0][:4] == [1, "eagle.verify", "target_logits", [1]]
    assert r0["outs"][1] != r1["outs"][1] and r0["watermark_saw"][1] != r1["watermark_saw"][1]
    h0, h1 = zygote.run("eagle_greedy_watermark", HEAL, timeout=120)
    assert h0["outs"] == h1["outs"] == r0["outs"]  # the greedy branch has no broadcast: heal's
    assert h0["watermark_saw"] == h1["watermark_saw"] == r0["watermark_saw"]  # recorded after the heal


def test_dspark_sampling_accept_region_is_checked_once(zygote):
    r0, r1 = zygote.run("dspark_sampling_graph", {**ON, "SGLANG_SPEC_TP_SYNC": "off"}, timeout=120)
    assert r0["skipped"]  # that call left the step to accept_and_finalize: no check of its own
    assert r0["stats"]["dspark.verify"]["checked"] == r1["stats"]["dspark.verify"]["checked"] == 1
    assert {"rng_state", "target_logits", "accept_len", "bonus", "cap_trim_lens", "commit_lens",
            "out_tokens"} <= set(r0["recorded"][0])
    assert r0["log"] == r1["log"] and r0["log"][0][:4] == [0, "dspark.verify", "rng_state", [1]]
