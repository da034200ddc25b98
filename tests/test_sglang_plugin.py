"""tpguard's sglang plugin inside real sglang 0.5.23, on 2 gloo ranks (CPU).

Each scenario runs on 2 ranks that build sglang's own process groups (`init_distributed_environment`
+ `init_model_parallel_group` over gloo: real `GroupCoordinator`s), load plugins with sglang's own
`load_plugins()` (which finds tpguard through its entry point), then call sglang's functions.

sglang takes ~10 s to import, so ranks are forked from one "zygote" process per test module that
imports it once (`python tests/test_sglang_plugin.py --zygote`); a scenario then costs well under
a second. The zygote never runs a torch op before forking (fork-safe).
"""

from __future__ import annotations

import json
import sys

import pytest

import sglang_zygote  # noqa: E402 - tests/ is on sys.path (pytest and the zygote)

# sglang's Triton kernels run on CPU under the interpreter: sglang_zygote.ZYGOTE_ENV sets it.

PRELOAD = (
    "torch", "torch.distributed",
    "sglang.srt.plugins", "sglang.srt.plugins.hook_registry",
    "sglang.srt.distributed.parallel_state", "sglang.srt.layers.dp_attention",
    "sglang.srt.runtime_context", "sglang.srt.speculative.spec_tp_sync",
    "sglang.kernels.ops.sampling.renorm", "sglang.srt.speculative.dflash_utils",
    "sglang.srt.speculative.dflash_worker_v2", "sglang.srt.speculative.dspark_components.dspark_verify",
    "sglang.kernels.ops.speculative.dspark.dspark_accept", "sglang.srt.speculative.eagle_utils",
    "sglang.srt.layers.sampler", "sglang.srt.sampling.sampling_batch_info",
    "tpguard.guard", "tpguard.diagnose", "tpguard.trace", "tpguard.kernels.renorm",
    "tpguard.hooks.sglang_plugin", "tpguard.hooks.sglang_sites", "tpguard.hooks.sglang_renorm",
    "tpguard.hooks.sglang_compat",
)


# =============================================================================================
# Scenarios: run on every rank after sglang's groups are built and load_plugins() ran.
# Each returns something JSON-able.
# =============================================================================================

def _sampling_info(bs: int, vocab: int, top_p: float, top_k: int | None = None):
    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    return SamplingBatchInfo(
        temperatures=torch.full((bs, 1), 0.8), top_ps=torch.full((bs,), top_p),
        top_ks=torch.full((bs,), top_k or vocab, dtype=torch.int32), min_ps=torch.zeros(bs),
        is_all_greedy=False, is_any_greedy=False, need_top_p_sampling=top_p < 1.0,
        need_top_k_sampling=top_k is not None, need_min_p_sampling=False, vocab_size=vocab, device="cpu",
    )


def _logits(step: int, rows: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)  # same on every rank
    return torch.randn((rows, vocab), generator=g) * 3


def _fp(t) -> str:
    from tpguard.fingerprint import fingerprint_tensor, format_fp

    return format_fp(fingerprint_tensor(t))


def _divergence_log(site: str):
    """Divergences the plugin's guard of `site` reports on this rank, as (step, quantity, culprits)."""
    from tpguard.hooks import sglang_runtime

    log = []
    guard = sglang_runtime.RUNTIME.guard(site)
    guard.listeners.append(lambda d: log.append([d.step, d.site, d.quantity, d.culprit_ranks, d.action]))
    return log


_count_collectives = sglang_zygote.count_collectives


def scenario_sync_planted(rank, world, tp):
    """SGLANG_SPEC_TP_SYNC leaves dflash-accept-sample off: rank 1's accept_len differs at step 2."""
    import torch
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite

    sync = SpecTpSync(tp)
    log = _divergence_log("dflash.verify")
    outs = []
    for step in range(4):
        accept_len = torch.tensor([3, 1, 4, 1], dtype=torch.int32) + step
        if step == 2 and rank == 1:
            accept_len[2] += 1
        out = sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, accept_len)
        outs.append(out.tolist())
    return {"log": log, "outs": outs}


def scenario_sync_audit(rank, world, tp):
    """Audit: the broadcast is on; rank 1 computes a different accept_len at steps 1 and 3 (a sync
    call with no verify step open is a step of its own: the site's first quantity)."""
    import torch
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite
    from tpguard.hooks import sglang_plugin

    sync = SpecTpSync(tp)
    log = _divergence_log("dflash.verify")
    outs = []
    for step in range(5):
        accept_len = torch.arange(6, dtype=torch.int32) % 3 + step
        if rank == 1 and step in (1, 3):
            accept_len[step] = 0
        out = sync.sync(SpecTpSyncSite.DFLASH_SELECTOR, accept_len)
        outs.append(out.tolist())
    return {"log": log, "outs": outs, "stats": sglang_plugin.stats()}


def scenario_target_probs_planted(rank, world, tp):
    """DFlash target-prob path (torch renorm on CPU). Step 1: rank 1 uses a slightly different
    top_p (same logits: target_probs differs first). Step 2: rank 1's logits differ."""
    from sglang.srt.speculative import dflash_utils

    bs, n, vocab = 3, 4, 256
    log = _divergence_log("dflash.verify")
    fps = []
    for step in range(3):
        info = _sampling_info(bs, vocab, top_p=0.95 if (step == 1 and rank == 1) else 0.9)
        logits = _logits(step, bs * n, vocab)
        if step == 2 and rank == 1:
            logits[5, 7] += 0.5
        probs = dflash_utils.build_speculative_verify_target_probs(
            next_token_logits=logits, sampling_info=info, draft_token_num=n, bs=bs)
        fps.append(_fp(probs))
    return {"log": log, "fps": fps}


def scenario_outputs(rank, world, tp):
    """The same calls whatever TPGUARD is: outputs (fingerprints) and collectives counted."""
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative import dflash_utils
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite

    counts = _count_collectives()
    sync = SpecTpSync(tp)
    fps = []
    for step in range(3):
        info = _sampling_info(2, 128, top_p=0.85, top_k=20)
        probs = dflash_utils.build_speculative_verify_target_probs(
            next_token_logits=_logits(step, 2 * 3, 128), sampling_info=info, draft_token_num=3, bs=2)
        accept_len = torch.tensor([step, rank], dtype=torch.int32)  # differs: broadcast aligns it
        sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, accept_len)
        fps += [_fp(probs), accept_len.tolist()]
    tpguard_hooks = sorted(t for t, hooks in HookRegistry._hooks.items()
                           if any(getattr(h, "__module__", "").startswith("tpguard") for _, h, _ in hooks))
    wrapped = hasattr(dflash_utils.build_speculative_verify_target_probs, "__wrapped__")
    return {"fps": fps, "collectives": counts["n"], "tpguard_hooks": tpguard_hooks, "wrapped": wrapped}


def scenario_renorm_routed(rank, world, tp):
    """TPGUARD_RENORM=deterministic: every bound name is tpguard's, and DFlash's target probs are tpguard's
    fused kernel's."""
    import torch
    from sglang.srt.speculative import dflash_utils
    from tpguard.hooks import sglang_renorm, sglang_runtime

    bound = sglang_renorm.bound_names()
    bs, n, vocab = 2, 3, 300
    info = _sampling_info(bs, vocab, top_p=0.7)  # no top-k: the dense softmax + top-p path
    logits = _logits(0, bs * n, vocab)
    probs = dflash_utils.build_speculative_verify_target_probs(
        next_token_logits=logits, sampling_info=info, draft_token_num=n, bs=bs)
    # the routed path: tpguard's fused logits -> target probs in place of sglang's function
    from tpguard.kernels.target_probs import target_probs

    expected = target_probs(logits, 0.8, top_p=torch.full((bs * n,), 0.7))
    return {"bound": bound, "same_as_tpguard": bool(torch.equal(probs.view(bs * n, -1), expected)),
            "backend": sglang_runtime.RUNTIME.renorm_backend}


def scenario_heal(rank, world, tp):
    """Policy heal with the sglang broadcast off: rank 1's accept_len is replaced by rank 0's."""
    import torch
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite

    sync = SpecTpSync(tp)
    log = _divergence_log("dflash.verify")
    accept_len = torch.tensor([2, 2, 2], dtype=torch.int32)
    if rank == 1:
        accept_len[1] = 0
    out = sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, accept_len)
    return {"log": log, "out": out.tolist()}


def scenario_abort(rank, world, tp):
    """Policy abort: every rank raises RankDivergenceError at the same step."""
    import torch
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite
    from tpguard.errors import RankDivergenceError

    sync = SpecTpSync(tp)
    for step in range(3):
        v = torch.tensor([step, step + (rank if step == 1 else 0)])
        try:
            sync.sync(SpecTpSyncSite.DFLASH_TARGET, v)
        except RankDivergenceError as e:
            return {"raised_at": step, "message": str(e)}
    return {"raised_at": None}


def scenario_dspark_accept(rank, world, tp):
    """DSpark's sampled accept (torch path, sglang's Triton chain sampler under the interpreter)
    inside accept_draft_tokens: coins, target_probs, accept_len recorded; rank 1's logits differ."""
    import torch
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.dspark_components import dspark_verify
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult
    from tpguard.hooks import sglang_runtime

    torch.manual_seed(7)
    bs, gamma, vocab = 2, 3, 64
    log = _divergence_log("dspark.verify")
    recorded = []
    guard = sglang_runtime.RUNTIME.guard("dspark.verify")
    orig_check = guard.check

    def check_and_note(step=None, **kw):  # what the step recorded, just before its check
        recorded.append(sorted(guard._fps))
        return orig_check(step, **kw)

    guard.check = check_and_note
    info = _sampling_info(bs, vocab, top_p=0.9)
    logits = _logits(0, bs * (gamma + 1), vocab)
    if rank == 1:
        logits[1, 3] += 2.0
    drafts = torch.randint(0, vocab, (bs, gamma), generator=torch.Generator().manual_seed(3))
    block = DraftBlockResult(draft_tokens=drafts, corrected_logits=None, greedy_mask=torch.zeros(bs, dtype=torch.bool),
                             temperatures=info.temperatures, greedy_draft=True)
    draft_input = DFlashDraftInputV2.create_idle_input(device=torch.device("cpu"))
    cand = torch.cat([torch.zeros(bs, 1, dtype=torch.int64), drafts], dim=1)
    out = dspark_verify.accept_draft_tokens(
        candidates=cand, target_logits=logits, draft_block=block, sampling_info=info,
        draft_input=draft_input, gamma=gamma, verify_num_draft_tokens=gamma + 1)
    return {"log": log, "recorded": recorded, "accept_len": out[0].tolist()}


def scenario_eagle_coins(rank, world, tp):
    """EAGLE's verify coins (torch.rand path): rank 1's generator is reseeded at step 1."""
    import torch
    from sglang.srt.speculative import eagle_utils

    log = _divergence_log("eagle.verify")
    for step in range(3):
        torch.manual_seed(12 if (step == 1 and rank == 1) else 11)
        eagle_utils._verify_coins(sampling_info=_sampling_info(2, 16, top_p=1.0), seq_lens=torch.tensor([5, 6]),
                                  draft_token_num=4, candidates=torch.zeros(2, 4, dtype=torch.int64),
                                  device="cpu")
    return {"log": log}


def plain_doctor():
    """`tpguard doctor --json` in a process that has sglang imported already."""
    import contextlib
    import io

    from tpguard.commands.doctor import doctor

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = doctor(as_json=True)
    return {"rc": rc, "report": json.loads(buf.getvalue())}


def plain_not_a_worker():
    """load_plugins() in a process that is not a scheduler (tokenizer, detokenizer, launcher)."""
    sys.modules.pop("sglang.srt.managers.scheduler", None)
    from sglang.srt.plugins import load_plugins
    from tpguard.hooks import sglang_runtime

    load_plugins()
    return {"hooked": sglang_runtime.RUNTIME is not None}


def plain_unwritable_trace_dir():
    """load_plugins() in a scheduler process whose TPGUARD_TRACE_DIR cannot be created."""
    import logging

    from sglang.srt.plugins import load_plugins
    from tpguard.hooks import sglang_runtime

    lines = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logging.getLogger("tpguard").addHandler(handler)
    load_plugins()
    rt = sglang_runtime.RUNTIME
    return {"hooked": rt is not None, "trace_dir": rt and rt.config.trace_dir, "log": lines}


PLAIN = {"doctor": plain_doctor, "not_a_worker": plain_not_a_worker,
         "unwritable_trace_dir": plain_unwritable_trace_dir}
SCENARIOS = {k[len("scenario_"):]: v for k, v in dict(globals()).items() if k.startswith("scenario_")}



# =============================================================================================
# Tests
# =============================================================================================

if reason := sglang_zygote.missing():  # not importing sglang here: the zygote does, once
    pytest.skip(reason, allow_module_level=True)

pytestmark = pytest.mark.slow  # sglang imported by a process of its own


@pytest.fixture(scope="module")
def zygote(shared_zygote):
    return shared_zygote().load(__file__, PLAIN)


def _diagnose(trace_dir):
    from tpguard.diagnose import diagnose

    return diagnose([str(trace_dir)])


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("tpguard") == "tpguard.hooks.sglang_plugin:register"


def test_spec_tp_sync_divergence_named(zygote, tmp_path):
    env = {"TPGUARD": "on", "TPGUARD_TRACE_DIR": str(tmp_path),
           "SGLANG_SPEC_TP_SYNC": "all,-dflash-accept-sample"}
    r0, r1 = zygote.run("sync_planted", env)
    assert r0["log"] == r1["log"] == [[2, "dflash.verify", "accept_len", [1], "recorded"]]
    assert r1["outs"][2] != r0["outs"][2]  # broadcast off: nothing aligned them
    diag = _diagnose(tmp_path)
    first = diag.to_json()["first_divergence"]
    assert (first["step"], first["site"], first["quantity"], first["culprit_ranks"]) == \
        (2, "dflash.verify", "accept_len", [1])


def test_audit_counts_pre_broadcast_disagreements(zygote, tmp_path):
    env = {"TPGUARD": "audit", "TPGUARD_TRACE_DIR": str(tmp_path), "SGLANG_SPEC_TP_SYNC": "all",
           "TPGUARD_ON_DIVERGENCE": "abort"}  # audit never aborts: it only records
    r0, r1 = zygote.run("sync_audit", env)
    assert r0["outs"] == r1["outs"]  # sglang's broadcast kept the ranks in agreement
    assert [e[0] for e in r0["log"]] == [1, 3]
    assert {e[2] for e in r0["log"]} == {"accept_len"} and all(e[3] == [1] for e in r0["log"])
    stats = r0["stats"]["dflash.verify"]
    assert stats["checked"] == 5 and stats["divergences"] == 2 and stats["aborted"] == 0


def test_dflash_target_probs_divergence_named(zygote, tmp_path):
    r0, r1 = zygote.run("target_probs_planted", {"TPGUARD": "on", "TPGUARD_TRACE_DIR": str(tmp_path)})
    assert r0["log"] == r1["log"] == [[1, "dflash.verify", "target_probs", [1], "recorded"],
                                      [2, "dflash.verify", "target_logits", [1], "recorded"]]
    assert r0["fps"][0] == r1["fps"][0] and r0["fps"][1] != r1["fps"][1]
    first = _diagnose(tmp_path).to_json()["first_divergence"]
    assert (first["step"], first["quantity"], first["culprit_ranks"]) == (1, "target_probs", [1])


def test_off_changes_nothing(zygote):
    off = zygote.run("outputs", {})
    explicit_off = zygote.run("outputs", {"TPGUARD": "off", "TPGUARD_RENORM": "deterministic"})
    on = zygote.run("outputs", {"TPGUARD": "on"})
    for r in off + explicit_off:
        assert r["tpguard_hooks"] == [] and r["wrapped"] is False and r["collectives"] == 0
    assert [r["fps"] for r in off] == [r["fps"] for r in explicit_off] == [r["fps"] for r in on]
    assert on[0]["wrapped"] is True and on[0]["collectives"] > 0
    assert "sglang.srt.speculative.spec_tp_sync.SpecTpSync.sync" in on[0]["tpguard_hooks"]


def test_deterministic_renorm_reaches_every_call_site(zygote):
    r0, r1 = zygote.run("renorm_routed", {"TPGUARD": "on", "TPGUARD_RENORM": "deterministic"})
    from tpguard.hooks.sglang_compat import RENORM_MODULES, RENORM_NAMES

    assert set(r0["bound"]) == set(RENORM_MODULES)
    for module, names in r0["bound"].items():
        for name in RENORM_NAMES:
            assert names[name].startswith("tpguard:tpguard."), (module, name, names[name])
    assert r0["backend"] == "tpguard"
    assert r0["same_as_tpguard"] and r1["same_as_tpguard"]


def test_heal_aligns_decisions(zygote):
    env = {"TPGUARD": "on", "TPGUARD_ON_DIVERGENCE": "heal", "SGLANG_SPEC_TP_SYNC": "off"}
    r0, r1 = zygote.run("heal", env)
    assert r0["out"] == r1["out"] == [2, 2, 2]
    assert r1["log"] == [[0, "dflash.verify", "accept_len", [1], "healed"]]


def test_abort_raises_on_every_rank_at_the_same_step(zygote):
    r0, r1 = zygote.run("abort", {"TPGUARD": "on", "TPGUARD_ON_DIVERGENCE": "abort",
                                  "SGLANG_SPEC_TP_SYNC": "off"})
    assert r0["raised_at"] == r1["raised_at"] == 1
    assert "dflash.target" in r0["message"] and "out_tokens" in r0["message"]


def test_dspark_sampled_accept_records_each_quantity(zygote):
    """accept_draft_tokens alone (no build_accept_outs after it): its decisions are computed, not
    committed, so `on` records its inputs and `audit` its decisions too."""
    inputs = {"rng_state", "draft_tokens", "target_logits", "target_probs", "coins"}
    decisions = {"accept_index", "accept_len", "bonus", "cap_trim_lens"}
    r0, r1 = zygote.run("dspark_accept", {"TPGUARD": "on"}, timeout=120)
    assert r0["recorded"] == r1["recorded"] and set(r0["recorded"][0]) == inputs
    assert r0["log"] and r0["log"][0][2] == "target_logits" and r0["log"][0][3] == [1]
    a0, a1 = zygote.run("dspark_accept", {"TPGUARD": "audit"}, timeout=120)
    assert a0["recorded"] == a1["recorded"] and set(a0["recorded"][0]) == inputs | decisions


def test_eagle_verify_coins_divergence_named(zygote):
    r0, r1 = zygote.run("eagle_coins", {"TPGUARD": "on"})
    assert r0["log"] == r1["log"] == [[1, "eagle.verify", "coins", [1], "recorded"]]


def test_doctor_finds_every_hook_point(zygote):
    (r,) = zygote.run("doctor", {})
    report = r["report"]
    assert r["rc"] == 0, report
    assert report["versions"]["sglang"] == "0.5.23" and report["version_problem"] is None
    from tpguard.hooks.sglang_compat import HOOK_POINTS

    assert len(report["hooks"]) == len(HOOK_POINTS)
    # UNO's modules import flashinfer at module level: not here (CPU), and sglang cannot run UNO here
    assert all(h["found"] or (h["unavailable"] and h["name"].startswith("uno.")) for h in report["hooks"])
    assert report["entry_point"] == "tpguard.hooks.sglang_plugin:register"
    assert any("folded accept" in line and "heal is refused" in line for line in report["limits"])
    assert any(line.startswith("tie rule:") and "DFlash sparse verify" in line for line in report["limits"])


def test_doctor_with_a_bad_variable_is_still_the_full_report(zygote):
    (r,) = zygote.run("doctor", {"TPGUARD_EVERY": "x"})
    report = r["report"]
    assert r["rc"] == 2 and "TPGUARD_EVERY" in report["env_problem"]
    from tpguard.hooks.sglang_compat import HOOK_POINTS

    assert report["versions"]["sglang"] == "0.5.23" and len(report["hooks"]) == len(HOOK_POINTS)


def test_only_scheduler_processes_are_hooked(zygote):
    assert zygote.run("not_a_worker", {"TPGUARD": "on"}) == [{"hooked": False}]
    assert zygote.run("not_a_worker", {"TPGUARD": "on", "TPGUARD_ALL_PROCESSES": "1"}) == [{"hooked": True}]


def test_unwritable_trace_dir_is_one_log_line_at_load(zygote, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    (r,) = zygote.run("unwritable_trace_dir", {"TPGUARD": "on", "TPGUARD_TRACE_DIR": str(blocker / "traces"),
                                               "TPGUARD_ALL_PROCESSES": "1"})
    assert r["hooked"] and r["trace_dir"] is None  # guarded, without traces
    assert any("cannot be created" in line and "NOT written" in line for line in r["log"]), r["log"]
