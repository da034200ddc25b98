"""A plugin you can leave on: sglang 0.5.23's real verify functions on 2 gloo ranks (CPU).

* `on` checks what each rank commits: a difference planted only in rank 1's accept output, which
  sglang's own `SpecTpSync` broadcast aligns, raises no alarm, aborts nothing and makes `heal` add
  no broadcast; `audit` counts it; with that site's sync off, `on` names it with the culprit rank.
* The guard uses the target model's TP group, even when its first hooked call runs under a
  size-1 draft group (`patch_tensor_parallel_group`).
* A hook never breaks a verify step: a function that returns one more value than tpguard reads,
  an exception planted in fingerprinting, a trace file that can no longer grow. sglang's result
  comes back unchanged, the site is disabled on every rank at the same step with one logged error.

Faults are planted the way they would arise: rank 1's accept kernel output changed after it ran,
sglang's function replaced (before the plugin loads) by one with the same parameters and a
6-tuple result, tpguard's fingerprint function raising on rank 1, RLIMIT_FSIZE on rank 1's process.
"""

from __future__ import annotations


import pytest

import sglang_zygote  # noqa: E402 - tests/ is on sys.path (pytest and the zygote)
from sglang_zygote import divergence_log, logits, plugin_stats, sampling_info

SERVER_ARGS = {"device": "cpu", "sampling_backend": "pytorch", "speculative_use_rejection_sampling": True}

PRELOAD = (
    "torch", "torch.distributed",
    "sglang.srt.plugins", "sglang.srt.plugins.hook_registry", "sglang.srt.managers.scheduler",
    "sglang.srt.distributed.parallel_state", "sglang.srt.layers.dp_attention",
    "sglang.srt.runtime_context", "sglang.srt.server_args", "sglang.srt.speculative.spec_tp_sync",
    "sglang.kernels.ops.sampling.renorm", "sglang.srt.speculative.dflash_utils",
    "sglang.srt.speculative.dflash_worker_v2", "sglang.srt.speculative.dspark_components.dspark_verify",
    "sglang.kernels.ops.speculative.dspark.dspark_accept", "sglang.srt.speculative.eagle_utils",
    "sglang.srt.layers.sampler", "sglang.srt.sampling.sampling_batch_info",
    "tpguard.guard", "tpguard.fingerprint", "tpguard.hooks.sglang_plugin", "tpguard.hooks.sglang_sites",
    "tpguard.hooks.sglang_runtime", "tpguard.hooks.sglang_compat",
)

STEPS = 3
PLANTED_STEP = 1


def _dflash_worker(tp):
    """A real DFlashWorkerV2 without its model: the attributes the greedy `_accept_block` reads."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    worker = DFlashWorkerV2.__new__(DFlashWorkerV2)
    worker._selector_sample = None
    worker._tp_sync = SpecTpSync(tp)
    worker.block_size = 4
    worker._use_triton_accept_bonus = False
    worker.device = "cpu"
    return worker


def _dflash_step(worker, step: int, rank: int, plant_predict: bool = False, plant_logits: bool = False):
    """One greedy DFlash verify step through `_accept_block` with the deferred argmax passed in
    (`target_predict`). plant_predict: rank 1's argmax differs in one position (its logits do not),
    a decision-only difference that DFLASH_ACCEPT_GREEDY's broadcast aligns."""
    import torch

    bs, vocab, n = 3, 40, worker.block_size
    lg = logits(step, bs * n, vocab)
    target = lg.argmax(-1).view(bs, n)
    cand = target.clone()  # the draft: the same on every rank
    cand[:, 0] = 5
    cand[1, 1:] = target[1, :-1]  # request 1 accepts every draft
    if plant_logits and rank == 1:
        lg[n + 1, 7] += 50.0
    predict = lg.argmax(-1)
    if plant_predict and rank == 1:
        predict = predict.clone()
        predict[n + 1] = (predict[n + 1] + 1) % vocab  # request 1 rejects at position 1 on rank 1 only
    out = worker._accept_block(candidates=cand, next_token_logits=lg,
                               sampling_info=sampling_info(bs, vocab, greedy=True), draft_input=None,
                               prefix_lens=torch.tensor([10, 20, 30]), bs=bs, target_predict=predict)
    return [t.tolist() if t is not None else None for t in out]


def scenario_dflash_decision_planted(rank, world, tp):
    counts = sglang_zygote.count_collectives()
    log = divergence_log("dflash.verify")
    worker = _dflash_worker(tp)
    outs = [_dflash_step(worker, s, rank, plant_predict=s == PLANTED_STEP) for s in range(STEPS)]
    return {"outs": outs, "log": log, "counts": counts, "stats": plugin_stats()}


def _dspark_executor(tp):
    from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    ex = TargetVerifyExecutor.__new__(TargetVerifyExecutor)
    ex._simulated_correct_len = None
    ex.gamma = 3
    ex.verify_num_draft_tokens = 4
    ex._fused_argmax = False
    ex._block_verification = False
    ex._rejection_noise = None
    ex._tp_sync = SpecTpSync(tp)
    return ex


def _dspark_step(ex, step: int, *, folded: bool = False):
    import torch
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult

    gamma, bs, vocab = ex.gamma, 2, 32
    lg = logits(step, bs * (gamma + 1), vocab)
    target = lg.argmax(-1).view(bs, gamma + 1)
    drafts = target[:, :gamma].clone()
    drafts[1, 1] = (target[1, 1] + 1) % vocab  # request 1 rejects its 2nd draft
    info = sampling_info(bs, vocab, greedy=True)
    block = DraftBlockResult(draft_tokens=drafts, corrected_logits=None, greedy_mask=torch.ones(bs, dtype=torch.bool),
                             temperatures=info.temperatures, greedy_draft=True)
    accept = ex.accept_and_finalize(
        folded_accept=folded, bs=bs, verify_ids_2d=torch.cat([torch.full((bs, 1), 3), drafts], dim=1),
        target_logits=lg, draft_block=block, sampling_info=info,
        draft_input=DFlashDraftInputV2.create_idle_input(device=torch.device("cpu")), layout=None,
        prefix_lens=torch.tensor([11, 17]), draft_tokens=drafts)
    return {k: getattr(accept, k).tolist() for k in ("correct_len", "bonus", "cap_trim_lens", "commit_lens",
                                                      "new_seq_lens", "out_tokens")}


def _plant_accept_kernel(rank: int, state: dict) -> None:
    """Rank 1's greedy accept kernel (AcceptGreedy) reports one more accepted draft for request 0 at
    the planted step, after it ran: only its decision differs, never its inputs."""
    from sglang.srt.speculative.dspark_components import dspark_verify

    if rank != 1:
        return
    kernel = dspark_verify.AcceptGreedy.execute

    def planted(*args, **kwargs):
        correct_len, bonus, trim = kernel(*args, **kwargs)
        if state["step"] == PLANTED_STEP:
            correct_len = correct_len.clone()
            correct_len[0] = (correct_len[0] + 1) % 4
        return correct_len, bonus, trim

    dspark_verify.AcceptGreedy.execute = planted


def scenario_dspark_decision_planted(rank, world, tp):
    counts = sglang_zygote.count_collectives()
    log = divergence_log("dspark.verify")
    state = {"step": 0}
    _plant_accept_kernel(rank, state)
    ex = _dspark_executor(tp)
    outs = []
    for step in range(STEPS):
        state["step"] = step
        outs.append(_dspark_step(ex, step))
    return {"outs": outs, "log": log, "counts": counts, "stats": plugin_stats()}


def scenario_draft_group_first(rank, world, tp):
    """The process's first hooked call is DSpark's draft sync under a size-1 draft group
    (audit: it is checked); then a dspark.verify step whose accept_len differs on rank 1."""
    import torch
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.dp_attention import get_dp_tp_group
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite

    draft = ps.init_model_parallel_group([[r] for r in range(world)], rank, "gloo", use_pynccl=False,
                                         use_custom_allreduce=False, group_name="draft_tp")
    with ps.patch_tensor_parallel_group(draft, owns_attention=True):
        inside = get_dp_tp_group().world_size
        SpecTpSync(get_dp_tp_group()).sync(SpecTpSyncSite.DSPARK_DRAFT, torch.tensor([[4, 5, 6]]))
    log = divergence_log("dspark.verify")
    accept_len = torch.tensor([2, 1], dtype=torch.int32) + (rank == 1)
    SpecTpSync(tp).sync(SpecTpSyncSite.DSPARK_ACCEPT_GREEDY, accept_len)
    return {"draft_world_inside": inside, "log": log, "stats": plugin_stats()}


def _wrap_accept_block_returning_six(rank):
    """Stands in for a newer sglang: `_accept_block` keeps its parameters and returns one more value."""
    import functools

    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    original = DFlashWorkerV2._accept_block

    @functools.wraps(original)
    def _accept_block(self, **kwargs):
        return (*original(self, **kwargs), None)

    DFlashWorkerV2._accept_block = _accept_block


def scenario_dflash_six_values(rank, world, tp):
    log = divergence_log("dflash.verify")
    worker = _dflash_worker(tp)
    outs = [_dflash_step(worker, s, rank, plant_logits=s == 2) for s in range(STEPS)]
    return {"outs": outs, "log": log, "stats": plugin_stats()}


scenario_dflash_six_values.before_plugins = _wrap_accept_block_returning_six


def scenario_fingerprint_fault(rank, world, tp):
    """tpguard's fingerprinting raises on rank 1 at the planted step; a logits difference at the
    last step would be named if the site were still guarded."""
    from tpguard import guard as guard_mod

    counts = sglang_zygote.count_collectives()
    log = divergence_log("dflash.verify")
    worker = _dflash_worker(tp)
    real = guard_mod.fingerprint_device
    outs = []
    for step in range(STEPS):
        if rank == 1 and step == PLANTED_STEP:
            def broken(t):
                raise RuntimeError("planted fingerprint fault")
            guard_mod.fingerprint_device = broken
        outs.append(_dflash_step(worker, step, rank, plant_logits=step == STEPS - 1))
        guard_mod.fingerprint_device = real
    return {"outs": outs, "log": log, "counts": counts, "stats": plugin_stats()}


def scenario_trace_stops_growing(rank, world, tp):
    """Rank 1's trace can no longer grow after step 0 (RLIMIT_FSIZE at its current size, as a full
    quota would); a logits difference at the last step is still named on both ranks."""
    import os
    import resource
    import signal

    from tpguard.hooks import sglang_runtime

    log = divergence_log("dflash.verify")
    worker = _dflash_worker(tp)
    outs = [_dflash_step(worker, 0, rank)]
    trace = sglang_runtime.RUNTIME.trace
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        trace.flush()
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(trace.path), limits[1]))
    try:
        outs += [_dflash_step(worker, s, rank, plant_logits=s == STEPS - 1) for s in range(1, STEPS)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return {"outs": outs, "log": log, "stats": plugin_stats(), "trace_open": sglang_runtime.RUNTIME.guards[
        "dflash.verify"].trace is not None}


SCENARIOS = {k[len("scenario_"):]: v for k, v in dict(globals()).items() if k.startswith("scenario_")}



# =============================================================================================
# Tests
# =============================================================================================

if reason := sglang_zygote.missing():  # not importing sglang here: the zygote does, once
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.slow  # sglang imported by a process of its own


@pytest.fixture(scope="module")
def zygote(shared_zygote):
    return shared_zygote().load(__file__)


ON = {"TPGUARD": "on"}
SITES = {  # scenario -> (site, the quantity the planted decision shows up as first, the sync to turn off)
    "dflash_decision_planted": ("dflash.verify", "accept_index", "all,-dflash-accept-greedy"),
    "dspark_decision_planted": ("dspark.verify", "accept_len", "all,-dspark-accept-greedy"),
}


@pytest.mark.parametrize("scenario", sorted(SITES))
def test_decision_aligned_by_sglang_is_no_divergence(zygote, scenario):
    site, quantity, sync_off = SITES[scenario]
    plain = zygote.run(scenario, {})  # no plugin: sglang's broadcast aligns the planted decision
    assert plain[0]["outs"] == plain[1]["outs"]
    on = zygote.run(scenario, ON)
    assert [r["outs"] for r in on] == [r["outs"] for r in plain]
    assert on[0]["log"] == on[1]["log"] == [] and on[0]["stats"][site]["checked"] == STEPS
    aborting = zygote.run(scenario, {**ON, "TPGUARD_ON_DIVERGENCE": "abort"})  # nothing to abort
    assert [r["outs"] for r in aborting] == [r["outs"] for r in plain]
    healing = zygote.run(scenario, {**ON, "TPGUARD_ON_DIVERGENCE": "heal"})
    assert [r["outs"] for r in healing] == [r["outs"] for r in plain]
    assert [r["counts"]["broadcast"] for r in healing] == [r["counts"]["broadcast"] for r in on]  # none added


@pytest.mark.parametrize("scenario", sorted(SITES))
def test_audit_counts_what_sglang_aligned(zygote, scenario):
    site, quantity, _ = SITES[scenario]
    audit = zygote.run(scenario, {"TPGUARD": "audit", "TPGUARD_ON_DIVERGENCE": "abort"})
    assert audit[0]["outs"] == audit[1]["outs"]
    assert audit[0]["log"] == audit[1]["log"] == [[PLANTED_STEP, site, quantity, [1], "recorded", None]]
    assert audit[0]["stats"][site]["divergences"] == 1 and audit[0]["stats"][site]["aborted"] == 0


@pytest.mark.parametrize("scenario", sorted(SITES))
def test_sync_off_names_the_decision_and_heal_aligns_it(zygote, scenario):
    site, quantity, sync_off = SITES[scenario]
    off = {"SGLANG_SPEC_TP_SYNC": sync_off}
    plain = zygote.run(scenario, off)
    assert plain[0]["outs"][PLANTED_STEP] != plain[1]["outs"][PLANTED_STEP]  # nothing aligns it now
    on = zygote.run(scenario, {**ON, **off})
    assert on[0]["log"] == on[1]["log"] and on[0]["log"][0][:5] == [PLANTED_STEP, site, quantity, [1], "recorded"]
    healed = zygote.run(scenario, {**ON, **off, "TPGUARD_ON_DIVERGENCE": "heal"})
    assert healed[0]["outs"] == healed[1]["outs"] == plain[0]["outs"]  # rank 0's decisions everywhere
    assert healed[1]["log"][0][4] == "healed" and quantity in healed[1]["log"][0][5]
    assert healed[1]["counts"]["broadcast"] > on[1]["counts"]["broadcast"]  # heal broadcast, sglang did not


def test_guard_uses_the_target_group_under_a_draft_group(zygote):
    r0, r1 = zygote.run("draft_group_first", {"TPGUARD": "audit", "SGLANG_SPEC_TP_SYNC": "off"})
    assert r0["draft_world_inside"] == 1  # the first hooked call ran under the size-1 draft group
    assert r0["log"] == r1["log"] == [[0, "dspark.verify", "accept_len", [1], "recorded", None]]
    assert r0["stats"]["dspark.draft"]["checked"] == 1


def test_changed_return_arity_disables_the_site_not_the_step(zygote):
    plain = zygote.run("dflash_six_values", {"SGLANG_SPEC_TP_SYNC": "off"})
    on = zygote.run("dflash_six_values", {**ON, "SGLANG_SPEC_TP_SYNC": "off"})
    assert [r["outs"] for r in on] == [r["outs"] for r in plain]  # sglang's 6 values, unchanged
    assert all(len(o) == 6 for o in on[0]["outs"])
    for r in on:
        assert r["log"] == []  # the site stopped at step 0, before the planted logits of step 2
        assert "returned a tuple of 6, tpguard reads a tuple of 5" in r["stats"]["dflash.verify"]["disabled"]


def test_fingerprint_fault_disables_the_site_on_every_rank(zygote):
    plain = zygote.run("fingerprint_fault", {"SGLANG_SPEC_TP_SYNC": "off"})
    on = zygote.run("fingerprint_fault", {**ON, "SGLANG_SPEC_TP_SYNC": "off"}, timeout=60)
    assert [r["outs"] for r in on] == [r["outs"] for r in plain]
    r0, r1 = on
    assert r0["log"] == r1["log"] == []  # never reached the planted logits: disabled at step 1
    assert "planted fingerprint fault" in r1["stats"]["dflash.verify"]["disabled"]
    assert "rank(s) [1]" in r0["stats"]["dflash.verify"]["disabled"]
    assert r0["stats"]["dflash.verify"]["checked"] == r1["stats"]["dflash.verify"]["checked"] == 2
    assert r0["counts"]["n"] == r1["counts"]["n"]  # collectives stayed paired: nobody waited


def test_trace_that_stops_growing_keeps_the_checks(zygote, tmp_path):
    r0, r1 = zygote.run("trace_stops_growing", {**ON, "TPGUARD_TRACE_DIR": str(tmp_path),
                                                "SGLANG_SPEC_TP_SYNC": "off"})
    expected = [STEPS - 1, "dflash.verify", "target_logits", [1], "recorded", None]
    assert r0["log"] == r1["log"] == [expected]  # rank 1 still compares, without its trace
    assert r0["trace_open"] and not r1["trace_open"]
    assert "disabled" not in r1["stats"]["dflash.verify"]
    import json

    (rank0,) = tmp_path.glob("*.rank0.jsonl")
    records = [json.loads(line) for line in rank0.read_text().splitlines()]
    (div,) = [r for r in records if r["type"] == "divergence"]  # every rank's values, on rank 0's disk
    assert (div["step"], div["quantity"], div["culprit_ranks"]) == (STEPS - 1, "target_logits", [1])
    (rank1,) = tmp_path.glob("*.rank1.jsonl")
    assert [json.loads(line)["type"] for line in rank1.read_text().splitlines()] == ["header", "step"]
