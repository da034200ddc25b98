"""Policy fix in the SGLang plugin: the first divergence is healed, its cause is switched off on
every rank at the same step, and later steps are clean. sglang 0.5.23's real verify functions on
2-3 gloo ranks.

The non-deterministic renorm: on this CPU machine sglang binds no renorm kernel (its torch
fallback is deterministic), so each rank binds tpguard's emulation of flashinfer's float-atomic
kernels (`kernels/emulated_atomic.py`) where sglang would bind flashinfer's, before the plugin
loads: as on a GPU, two ranks' target probs then differ in the last bits on identical logits.
"""

from __future__ import annotations

import json
import sys

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
    "sglang.srt.speculative.eagle_info", "sglang.srt.managers.schedule_batch",
    "sglang.srt.model_executor.forward_batch_info", "sglang.srt.layers.logits_processor",
    "sglang.srt.sampling.sampling_batch_info",
    "tpguard.guard", "tpguard.fix", "tpguard.kernels.emulated_atomic", "tpguard.hooks.sglang_plugin",
    "tpguard.hooks.sglang_sites", "tpguard.hooks.sglang_runtime", "tpguard.hooks.sglang_renorm",
)

STEPS = 6


def _bind_atomic_renorm(rank):
    """Where sglang binds flashinfer's renorm on CUDA: the float-atomic emulation instead."""
    from sglang.kernels.ops.sampling import renorm
    from sglang.srt.speculative import dflash_utils, eagle_utils
    from tpguard.kernels import emulated_atomic as ea

    for module in (renorm, dflash_utils, eagle_utils):
        module.top_p_renorm_prob = ea.top_p_renorm_emulated_atomic
        module.top_k_renorm_prob = ea.top_k_renorm_emulated_atomic


def _events(trace_dir, rank):
    from pathlib import Path

    (path,) = Path(trace_dir).glob(f"*.rank{rank}.jsonl")
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "event"]


def scenario_dspark_renorm(rank, world, tp):
    """DSpark's sampled accept (target probs through the bound renorm, top-p 0.8)."""
    import torch
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult
    from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync
    from tpguard.hooks import sglang_renorm

    log = divergence_log("dspark.verify")
    ex = TargetVerifyExecutor.__new__(TargetVerifyExecutor)
    ex._simulated_correct_len, ex.gamma, ex.verify_num_draft_tokens = None, 3, 4
    ex._fused_argmax = ex._block_verification = False
    ex._rejection_noise, ex._tp_sync = None, SpecTpSync(tp)
    bs, vocab = 4, 2048
    info = sampling_info(bs, vocab, top_p=0.8, temperature=1.0)
    outs = []
    for step in range(STEPS):
        lg = logits(step, bs * 4, vocab, scale=0.5)  # flat rows: many kept entries, many partial sums
        drafts = lg.argmax(-1).view(bs, 4)[:, :3].clone()
        block = DraftBlockResult(draft_tokens=drafts, corrected_logits=None, greedy_mask=torch.zeros(bs, dtype=torch.bool),
                                 temperatures=info.temperatures, greedy_draft=True)
        torch.manual_seed(100 + step)
        accept = ex.accept_and_finalize(
            folded_accept=False, bs=bs, verify_ids_2d=torch.cat([torch.full((bs, 1), 3), drafts], dim=1),
            target_logits=lg, draft_block=block, sampling_info=info,
            draft_input=DFlashDraftInputV2.create_idle_input(device=torch.device("cpu")), layout=None,
            prefix_lens=torch.arange(10, 10 + bs), draft_tokens=drafts)
        outs.append([accept.correct_len.tolist(), accept.bonus.tolist(), accept.out_tokens.tolist()])
    return {"outs": outs, "log": log, "stats": plugin_stats(), "bound": sglang_renorm.bound_names()}


scenario_dspark_renorm.before_plugins = _bind_atomic_renorm


def scenario_eagle_renorm(rank, world, tp):
    """EAGLE's sampling branch (softmax, the bound top-p renorm, the tree sampler, its broadcast)."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    log = divergence_log("eagle.verify")
    bs, n, vocab = 3, 4, 2048
    info = sampling_info(bs, vocab, top_p=0.8, temperature=1.0)
    outs = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(60 + step)
        draft_probs = torch.softmax(torch.randn((bs, n - 1, vocab), generator=g), dim=-1)
        draft = torch.randint(vocab, (bs, n), generator=g)
        seq_lens = torch.arange(7, 7 + bs)
        nxt = torch.arange(1, n + 1).repeat(bs, 1)
        nxt[:, -1] = -1
        vi = EagleVerifyInput(
            draft_token=draft.reshape(-1), custom_mask=None, positions=(seq_lens.view(-1, 1) + torch.arange(n)).reshape(-1),
            retrieve_index=torch.arange(bs * n).view(bs, n), retrieve_next_token=nxt,
            retrieve_next_sibling=torch.full((bs, n), -1), retrieve_cum_len=None, spec_steps=n - 1, topk=1,
            draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=int(seq_lens.sum()),
            seq_lens_cpu=seq_lens.clone(), draft_probs=draft_probs)
        batch = ScheduleBatch(reqs=[], device="cpu", seq_lens=seq_lens, forward_mode=ForwardMode.TARGET_VERIFY,
                              sampling_info=info)
        torch.manual_seed(200 + step)
        out = eagle_utils.eagle_sample(vi, batch, LogitsProcessorOutput(
            next_token_logits=logits(step, bs * n, vocab, scale=0.5)))
        outs.append([t.tolist() for t in out])
    return {"outs": outs, "log": log, "stats": plugin_stats()}


scenario_eagle_renorm.before_plugins = _bind_atomic_renorm


def scenario_dflash_decision(rank, world, tp):
    """DFlash's greedy accept with its DFLASH_ACCEPT_GREEDY sync off; rank 1's argmax differs in one
    position from step 1 on, every step (a persistent decision-level cause)."""
    import torch
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    counts = sglang_zygote.count_collectives()
    log = divergence_log("dflash.verify")
    worker = DFlashWorkerV2.__new__(DFlashWorkerV2)
    worker._selector_sample, worker._tp_sync, worker.block_size = None, SpecTpSync(tp), 4
    worker._use_triton_accept_bonus, worker.device = False, "cpu"
    bs, vocab, n = 3, 40, 4
    outs = []
    for step in range(STEPS):
        lg = logits(step, bs * n, vocab)
        predict = lg.argmax(-1)
        cand = predict.view(bs, n).clone()
        cand[:, 0] = 5
        cand[:, 1:] = predict.view(bs, n)[:, :-1]  # every draft accepted on rank 0
        if step >= 1 and rank == 1:
            predict = predict.clone()
            predict[n + 1] = (predict[n + 1] + 1) % vocab
        out = worker._accept_block(candidates=cand, next_token_logits=lg,
                                   sampling_info=sampling_info(bs, vocab, greedy=True), draft_input=None,
                                   prefix_lens=torch.tensor([10, 20, 30]), bs=bs, target_predict=predict)
        outs.append([t.tolist() for t in out[:4]])
    from prometheus_client import REGISTRY

    switches = REGISTRY.get_sample_value("tpguard_fix_switches_total", {"site": "dflash.verify", "what": "broadcast"})
    return {"outs": outs, "log": log, "stats": plugin_stats(), "counts": counts, "switch_metric": switches}


def scenario_dflash_target_probs(rank, world, tp):
    """DFlash's target probs through the bound (float-atomic) renorm, 3 steps, top-p 0.8."""
    from sglang.srt.speculative import dflash_utils

    bs, n, vocab = 4, 4, 2048
    info = sampling_info(bs, vocab, top_p=0.8, temperature=1.0)
    for step in range(3):
        dflash_utils.build_speculative_verify_target_probs(
            next_token_logits=logits(step, bs * n, vocab, scale=0.5), sampling_info=info, draft_token_num=n, bs=bs)
    return {"stats": plugin_stats()}


scenario_dflash_target_probs.before_plugins = _bind_atomic_renorm

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


FIX = {"TPGUARD": "on", "TPGUARD_ON_DIVERGENCE": "fix"}


def _switched_once(results, trace_dir, what: str) -> int:
    """The one divergence every rank saw, healed and switched; the switch event on every rank."""
    logs = [r["log"] for r in results]
    assert all(log == logs[0] for log in logs) and len(logs[0]) == 1, logs
    step, _, _, culprits, action, _ = logs[0][0]
    assert action == "healed" and culprits
    for rank in range(len(results)):
        (event,) = [e for e in _events(trace_dir, rank) if e["kind"] == "switch"]
        assert event["step"] == step and event["what"] == what and event["from_step"] == step + 1
    return step


@pytest.mark.parametrize("scenario,site,world", [("dspark_renorm", "dspark.verify", 2),
                                                 ("eagle_renorm", "eagle.verify", 3)])
def test_renorm_cause_switched_to_deterministic_kernels(zygote, tmp_path, scenario, site, world):
    plain = zygote.run(scenario, {**FIX, "TPGUARD": "on", "TPGUARD_ON_DIVERGENCE": "record"},
                       world=world, timeout=180)
    assert len(plain[0]["log"]) >= 3 and {e[2] for e in plain[0]["log"]} == {"target_probs"}  # it recurs
    fixed = zygote.run(scenario, {**FIX, "TPGUARD_TRACE_DIR": str(tmp_path)}, world=world, timeout=180)
    step = _switched_once(fixed, tmp_path, "renorm")
    assert fixed[0]["log"][0][2] == "target_probs"
    assert all(r["outs"] == fixed[0]["outs"] for r in fixed)
    assert fixed[0]["stats"][site]["checked"] == STEPS and step < STEPS - 2  # clean steps after it


def test_decision_cause_switches_sglangs_broadcast_on(zygote, tmp_path):
    env = {**FIX, "SGLANG_SPEC_TP_SYNC": "all,-dflash-accept-greedy", "TPGUARD_TRACE_DIR": str(tmp_path)}
    r0, r1 = zygote.run("dflash_decision", env, timeout=120)
    step = _switched_once([r0, r1], tmp_path, "broadcast")
    assert step == 1 and r0["log"][0][2] == "accept_index"
    assert r0["outs"] == r1["outs"]  # healed at step 1, SGLang's broadcast forced on after it
    assert r0["stats"]["dflash.verify"]["checked"] == STEPS
    assert r0["switch_metric"] == r1["switch_metric"] == 1.0  # the Prometheus counter


def test_diagnose_shows_the_switch(zygote, tmp_path):
    from tpguard.diagnose import diagnose, render_text
    from tpguard.diagnose.html import render_html

    env = {**FIX, "SGLANG_SPEC_TP_SYNC": "all,-dflash-accept-greedy", "TPGUARD_TRACE_DIR": str(tmp_path)}
    zygote.run("dflash_decision", env, timeout=120)
    diag = diagnose([str(tmp_path)])
    (sw,) = diag.to_json()["switches"]
    assert (sw["step"], sw["site"], sw["what"], sw["from_step"]) == (1, "dflash.verify", "broadcast", 2)
    assert "switched at step 1, site dflash.verify" in render_text(diag)
    assert "<br>switch" in render_html(diag) and "Switched</b> at step 1" in render_html(diag)


def test_plugin_dumps_replay_to_the_cause(zygote, tmp_path):
    """TPGUARD_DUMP=1: each rank dumps the divergent step with what replay needs; `tpguard replay`
    re-runs the bound renorm on the agreed logits and confirms it as the cause."""
    import subprocess

    r0, _ = zygote.run("dflash_target_probs", {"TPGUARD": "on", "TPGUARD_TRACE_DIR": str(tmp_path),
                                               "TPGUARD_DUMP": "1"}, timeout=120)
    assert r0["stats"]["dflash.verify"]["divergences"] >= 1
    dumped = sorted(p.name.split(".rank")[1] for p in (tmp_path / "dumps").glob("*.safetensors"))
    assert {"0.safetensors", "1.safetensors"} <= set(dumped)
    r = subprocess.run([sys.executable, "-m", "tpguard", "replay", str(tmp_path), "--calls", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr  # confirmed
    assert "emulated-atomic" in r.stdout and "CONFIRMED" in r.stdout


def test_eagle_dumps_without_a_rerunnable_context_say_so(zygote, tmp_path):
    """EAGLE's rejection-sampling verify (draft probs): its dumps carry no replay context, the guard
    goes on, and `tpguard replay` diffs the ranks and says it cannot re-run (exit 2)."""
    import subprocess

    r0, r1 = zygote.run("eagle_renorm", {"TPGUARD": "on", "TPGUARD_TRACE_DIR": str(tmp_path), "TPGUARD_DUMP": "1"},
                        timeout=180)
    assert "disabled" not in r0["stats"]["eagle.verify"] and r0["stats"]["eagle.verify"]["divergences"] >= 1
    r = subprocess.run([sys.executable, "-m", "tpguard", "replay", str(tmp_path), "--calls", "4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "target_probs" in r.stdout, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
