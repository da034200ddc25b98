"""The step-owning hooks of tpguard's sglang plugin, driven through sglang 0.5.23's real functions
on 2 gloo ranks (CPU).

`tests/test_sglang_plugin.py` drives the contributors (`SpecTpSync.sync`, the DFlash target probs,
DSpark's sampled accept, EAGLE's coins). This file drives the functions that *own* a verify step
(their hook opens the step's scope and runs its one check):

* `layers.sampler.Sampler.forward` (a real `Sampler()`, pytorch sampling backend, the min_p path);
* `eagle_utils.eagle_sample` (its sampling branch: `_verify_coins`, sglang's Triton chain sampler
  under `TRITON_INTERPRET=1`, its own rank-0 broadcasts; and the routed top-k/top-p renorms);
* `dflash_worker_v2.DFlashWorkerV2._accept_block` (the greedy path: sglang's
  `DFLASH_ACCEPT_GREEDY` sync, `compute_dflash_correct_drafts_and_bonus`, `_commit_accept`);
* `dspark_verify.TargetVerifyExecutor.accept_and_finalize` (the eager path: `accept_draft_tokens`
  -> `AcceptGreedy`, `build_accept_outs` with its three `SpecTpSync.sync` calls, the finalize and
  out-token kernels).

In each, one rank gets a planted divergence; the tests check that the guard names the site,
quantity and rank, that `TPGUARD_ON_DIVERGENCE=heal` leaves the ranks with equal outputs, and that
`TPGUARD=off` gives the same outputs as no plugin (no collective).

Workers: `DFlashWorkerV2` and `TargetVerifyExecutor` need a model runner to construct, so the
tests make real instances of those classes with `cls.__new__(cls)` and set only the attributes
the called method reads, each a real sglang or torch object (a real `SpecTpSync` on sglang's TP
`GroupCoordinator`, ints, bools, None). The method called is sglang's own, through the class
attribute the plugin patched.

Not drivable on this box (neither CUDA nor sglang's CPU engine): EAGLE's greedy branch (here
`verify_tree_greedy_func` has no kernel: `reject_out_of_tree_path` returns for the in-tree
"unknown" platform and predict/accept_index/num_correct_drafts keep their initial 0/-1/0 on every
rank, so there is nothing to diverge or heal; with `SGLANG_USE_CPU_ENGINE=1` `spec_tree` imports
`sgl_kernel`, which is not installed), the sampler's flashinfer backend (`top_k_renorm_prob`,
`min_p_sampling_from_probs`, `top_k_top_p_sampling_from_probs` are bound in `layers.sampler` only
on CUDA/MUSA/XPU), DFlash's sampled accept (CUDA JIT kernel) and the folded (CUDA graph) DSpark path.

Like test_sglang_plugin.py: ranks are forked from one zygote process that imports sglang once.
"""

from __future__ import annotations


import pytest

import sglang_zygote  # noqa: E402 - tests/ is on sys.path (pytest and the zygote)

# sglang's Triton kernels run on CPU under the interpreter: sglang_zygote.ZYGOTE_ENV sets it.

# The config sglang would publish in a scheduler: the torch sampling backend (no flashinfer here)
# and EAGLE's rejection sampling (the Triton chain sampler, which runs on CPU).
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
    "sglang.srt.model_executor.forward_batch_info", "sglang.kernels.ops.speculative.reject_sampling",
    "sglang.srt.layers.sampler", "sglang.srt.layers.logits_processor",
    "sglang.srt.sampling.sampling_batch_info",
    "tpguard.guard", "tpguard.fingerprint", "tpguard.kernels.renorm",
    "tpguard.hooks.sglang_plugin", "tpguard.hooks.sglang_sites", "tpguard.hooks.sglang_renorm",
    "tpguard.hooks.sglang_compat",
)


# =============================================================================================
# Scenarios: run on every rank after sglang's groups are built, its config published and
# load_plugins() ran. Each returns something JSON-able.
# =============================================================================================

def _sampling_info(bs: int, vocab: int, *, greedy: bool = False, top_p: float = 1.0,
                   top_k: int | None = None, min_p: float = 0.0, temperature: float = 0.8):
    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    return SamplingBatchInfo(
        temperatures=torch.full((bs, 1), 1.0 if greedy else temperature), top_ps=torch.full((bs,), top_p),
        top_ks=torch.full((bs,), 1 if greedy else (top_k or vocab), dtype=torch.int32),
        min_ps=torch.full((bs,), min_p), is_all_greedy=greedy, is_any_greedy=greedy,
        need_top_p_sampling=top_p < 1.0, need_top_k_sampling=top_k is not None,
        need_min_p_sampling=min_p > 0, vocab_size=vocab, device="cpu",
    )


def _logits(step: int, rows: int, vocab: int, scale: float = 3.0):
    import torch

    g = torch.Generator().manual_seed(1000 + step)  # same on every rank
    return torch.randn((rows, vocab), generator=g) * scale


def _divergence_log(site: str):
    """Divergences the plugin's guard of `site` reports on this rank: [step, site, quantity, culprits, action]."""
    from tpguard.hooks import sglang_runtime

    log = []
    if sglang_runtime.RUNTIME is not None:
        sglang_runtime.RUNTIME.guard(site).listeners.append(
            lambda d: log.append([d.step, d.site, d.quantity, d.culprit_ranks, d.action]))
    return log


def _recorded(site: str):
    """The quantities each checked step of `site` recorded (names, in the order of the guard)."""
    from tpguard.hooks import sglang_runtime

    seen = []
    if sglang_runtime.RUNTIME is not None:
        guard = sglang_runtime.RUNTIME.guard(site)
        check = guard.check

        def check_and_note(step=None, **kw):
            seen.append(sorted(guard._fps))
            return check(step, **kw)

        guard.check = check_and_note
    return seen


_count_collectives = sglang_zygote.count_collectives


def _result(site: str, outs, log, recorded, counts) -> dict:
    from tpguard.hooks import sglang_runtime

    wrapped = sglang_runtime.RUNTIME is not None and bool(sglang_runtime.RUNTIME.hooks_installed)
    return {"outs": outs, "log": log, "recorded": recorded, "collectives": counts["n"], "hooked": wrapped}


def scenario_sampler(rank, world, tp):
    """Sampler.forward (pytorch backend, top-k + top-p + min_p). Step 1: rank 1's generator is
    seeded differently (rng_state first). Step 3: rank 1's logits differ (target_logits first)."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.sampler import Sampler

    counts = _count_collectives()
    log, recorded = _divergence_log("sampler"), _recorded("sampler")
    sampler = Sampler()
    bs, vocab = 8, 64
    outs = []
    for step in range(4):
        torch.manual_seed(99 if (step == 1 and rank == 1) else 20 + step)
        logits = _logits(step, bs, vocab, scale=0.5)  # flat: another coin picks another token
        if step == 3 and rank == 1:
            logits[:, 9] += 4.0
        info = _sampling_info(bs, vocab, top_p=0.95, top_k=48, min_p=0.05)
        tokens = sampler.forward(LogitsProcessorOutput(next_token_logits=logits), info, False, [], [],
                                 torch.arange(bs))
        outs.append(tokens.tolist())
    return _result("sampler", outs, log, recorded, counts)


def _eagle_step(step: int, rank: int, bs: int, spec_steps: int, vocab: int, info):
    """A chain (topk=1) EAGLE verify: real EagleVerifyInput, ScheduleBatch, LogitsProcessorOutput."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    n = spec_steps + 1
    g = torch.Generator().manual_seed(50 + step)
    draft_probs = torch.softmax(torch.randn((bs, spec_steps, vocab), generator=g), dim=-1)
    drafts = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=g).view(bs, spec_steps)
    draft = torch.cat([torch.randint(vocab, (bs, 1), generator=g), drafts], dim=1)
    seq_lens = torch.tensor([7 + i for i in range(bs)], dtype=torch.int64)
    next_token = torch.arange(1, n + 1).repeat(bs, 1)
    next_token[:, -1] = -1
    verify_input = EagleVerifyInput(
        draft_token=draft.reshape(-1), custom_mask=None,
        positions=(seq_lens.view(-1, 1) + torch.arange(n)).reshape(-1),
        retrieve_index=torch.arange(bs * n).view(bs, n), retrieve_next_token=next_token,
        retrieve_next_sibling=torch.full((bs, n), -1), retrieve_cum_len=None, spec_steps=spec_steps,
        topk=1, draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=int(seq_lens.sum()), seq_lens_cpu=seq_lens.clone(), draft_probs=draft_probs)
    batch = ScheduleBatch(reqs=[], device="cpu", seq_lens=seq_lens, forward_mode=ForwardMode.TARGET_VERIFY,
                          sampling_info=info)
    logits = _logits(step, bs * n, vocab, scale=1.0)
    return verify_input, batch, LogitsProcessorOutput(next_token_logits=logits)


def scenario_eagle(rank, world, tp, renorm: bool = False):
    """eagle_sample's sampling branch. Step 1: rank 1's generator is reseeded (rng_state first,
    then its coins).
    Step 2: rank 1's logits differ (target_logits first). With `renorm` the batch uses top-k/top-p
    (the routed deterministic renorms; on CPU sglang binds none)."""
    import torch
    from sglang.srt.speculative import eagle_utils

    counts = _count_collectives()
    log, recorded = _divergence_log("eagle.verify"), _recorded("eagle.verify")
    bs, spec_steps, vocab = 3, 3, 48
    outs = []
    for step in range(3):
        info = _sampling_info(bs, vocab, top_p=0.9 if renorm else 1.0, top_k=32 if renorm else None)
        verify_input, batch, logits_output = _eagle_step(step, rank, bs, spec_steps, vocab, info)
        if step == 2 and rank == 1:
            logits_output.next_token_logits[4, 11] += 1.0
        torch.manual_seed(31 if (step == 1 and rank == 1) else 30)
        predict, accept_lens, accept_index = eagle_utils.eagle_sample(verify_input, batch, logits_output)
        outs.append([predict.tolist(), accept_lens.tolist(), accept_index.tolist()])
    return _result("eagle.verify", outs, log, recorded, counts)


def scenario_eagle_renorm(rank, world, tp):
    return scenario_eagle(rank, world, tp, renorm=True)


def _spec_tp_sync(tp):
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    return SpecTpSync(tp)


def scenario_dflash_accept_block(rank, world, tp, triton: bool = False):
    """DFlashWorkerV2._accept_block, greedy path (sglang has no sampled DFlash verify on CPU).
    Step 1: rank 1's target logits differ in one position, so its argmax, accept_len, bonus and
    out_tokens differ. `triton`: sglang's fused Triton accept/bonus kernel (interpreted), which
    also writes new_seq_lens; else the eager torch path (new_seq_lens None)."""
    import torch
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    counts = _count_collectives()
    log, recorded = _divergence_log("dflash.verify"), _recorded("dflash.verify")
    # A real DFlashWorkerV2 without its model: the attributes _accept_block reads on this path.
    worker = DFlashWorkerV2.__new__(DFlashWorkerV2)
    worker._selector_sample = None
    worker._tp_sync = _spec_tp_sync(tp)
    worker.block_size = 4
    worker._use_triton_accept_bonus = triton
    worker.device = "cpu"  # the Triton path's double-buffered outputs (_ensure_accept_bonus_buffers)
    worker._accept_bonus_buffer_cap = 0
    worker._accept_bonus_buffer_slot = 0
    bs, vocab = 3, 40
    outs = []
    for step in range(3):
        logits = _logits(step, bs * worker.block_size, vocab)
        target = logits.argmax(-1).view(bs, worker.block_size)
        cand = target.clone()
        cand[:, 0] = 5  # the verified token
        cand[0, 2] = (target[0, 1] + 1) % vocab  # request 0 rejects at its 2nd draft
        cand[1, 1:] = target[1, :-1]  # request 1 accepts every draft
        cand[2, 1] = (target[2, 0] + 1) % vocab  # request 2 rejects its 1st draft
        if step == 1 and rank == 1:
            logits[1 * worker.block_size + 1, (target[1, 1] + 3) % vocab] += 20.0  # request 1, position 1
        prefix = torch.tensor([10, 20, 30], dtype=torch.int64)
        accept_len, commit_lens, bonus, out_tokens, new_seq_lens = worker._accept_block(
            candidates=cand, next_token_logits=logits, sampling_info=_sampling_info(bs, vocab, greedy=True),
            draft_input=None, prefix_lens=prefix, bs=bs)
        outs.append([t.tolist() if t is not None else None
                     for t in (accept_len, commit_lens, bonus, out_tokens, new_seq_lens)])
    assert worker._use_triton_accept_bonus == triton  # sglang did not fall back to the eager path
    return _result("dflash.verify", outs, log, recorded, counts)


def scenario_dflash_accept_block_triton(rank, world, tp):
    return scenario_dflash_accept_block(rank, world, tp, triton=True)


def scenario_dspark_accept_and_finalize(rank, world, tp):
    """TargetVerifyExecutor.accept_and_finalize, eager greedy path. Step 1: rank 1's target
    logits differ in one position (accept_len / bonus / commit_lens / out_tokens follow)."""
    import torch
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult
    from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor

    counts = _count_collectives()
    log, recorded = _divergence_log("dspark.verify"), _recorded("dspark.verify")
    # A real TargetVerifyExecutor without its target worker: the attributes the eager path reads
    # (the folded CUDA-graph path, folded_accept=True, is not taken).
    gamma, bs, vocab = 3, 2, 32
    executor = TargetVerifyExecutor.__new__(TargetVerifyExecutor)
    executor._simulated_correct_len = None
    executor.gamma = gamma
    executor.verify_num_draft_tokens = gamma + 1
    executor._fused_argmax = False
    executor._block_verification = False
    executor._tp_sync = _spec_tp_sync(tp)
    draft_input = DFlashDraftInputV2.create_idle_input(device=torch.device("cpu"))
    outs = []
    for step in range(3):
        logits = _logits(step, bs * (gamma + 1), vocab)
        target = logits.argmax(-1).view(bs, gamma + 1)
        drafts = target[:, :gamma].clone()
        drafts[1, 1] = (target[1, 1] + 1) % vocab  # request 1 rejects its 2nd draft
        if step == 1 and rank == 1:
            logits[0 * (gamma + 1) + 1, (target[0, 1] + 2) % vocab] += 20.0  # request 0, position 1
        ids = torch.cat([torch.full((bs, 1), 3, dtype=torch.int64), drafts], dim=1)
        info = _sampling_info(bs, vocab, greedy=True)
        block = DraftBlockResult(draft_tokens=drafts, corrected_logits=None,
                                 greedy_mask=torch.ones(bs, dtype=torch.bool), temperatures=info.temperatures,
                                 greedy_draft=True)
        accept = executor.accept_and_finalize(
            folded_accept=False, bs=bs, verify_ids_2d=ids, target_logits=logits, draft_block=block,
            sampling_info=info, draft_input=draft_input, layout=None,
            prefix_lens=torch.tensor([11, 17], dtype=torch.int64), draft_tokens=drafts)
        outs.append({k: getattr(accept, k).tolist() for k in ("correct_len", "bonus", "cap_trim_lens",
                                                               "commit_lens", "new_seq_lens", "out_tokens")})
    return _result("dspark.verify", outs, log, recorded, counts)


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
HEAL = {"TPGUARD": "on", "TPGUARD_ON_DIVERGENCE": "heal"}
SYNC_OFF = {"SGLANG_SPEC_TP_SYNC": "off"}  # sglang's own rank-0 broadcasts off: the ranks drift


def _assert_off_changes_nothing(zygote, scenario: str, env: dict, outs_on: list) -> None:
    """No plugin and TPGUARD=off give the same outputs, no hook and no guard collective; and a
    recording guard (which never writes a tensor) gives those outputs too."""
    plain = zygote.run(scenario, env)
    off = zygote.run(scenario, {**env, "TPGUARD": "off", "TPGUARD_ON_DIVERGENCE": "heal"})
    for r in plain + off:
        assert r["hooked"] is False and r["collectives"] == 0 and r["log"] == [] and r["recorded"] == []
    assert [r["outs"] for r in plain] == [r["outs"] for r in off] == outs_on


def test_sampler_forward(zygote):
    r0, r1 = zygote.run("sampler", ON)
    assert r0["log"] == r1["log"] == [[1, "sampler", "rng_state", [1], "recorded"],
                                      [3, "sampler", "target_logits", [1], "recorded"]]
    assert set(r0["recorded"][0]) == {"rng_state", "target_logits", "out_tokens"}
    assert r0["outs"][1] != r1["outs"][1] and r0["outs"][0] == r1["outs"][0]  # the coin moved a token
    assert r0["hooked"] and r0["collectives"] > 0

    h0, h1 = zygote.run("sampler", HEAL)
    assert h0["outs"] == h1["outs"] == r0["outs"]  # rank 0's tokens broadcast on steps 1 and 3
    assert [e[4] for e in h1["log"]] == ["healed", "healed"]
    _assert_off_changes_nothing(zygote, "sampler", {}, [r0["outs"], r1["outs"]])


def test_eagle_sample(zygote):
    r0, r1 = zygote.run("eagle", ON, timeout=120)
    assert r0["log"] == r1["log"] == [[1, "eagle.verify", "rng_state", [1], "recorded"],
                                      [2, "eagle.verify", "target_logits", [1], "recorded"]]
    assert {"rng_state", "seq_lens", "draft_tokens", "target_logits", "coins", "accept_index", "accept_len",
            "out_tokens"} <= set(r0["recorded"][0])
    assert r0["outs"] == r1["outs"]  # the sampling branch has sglang's rank-0 broadcast
    h0, h1 = zygote.run("eagle", HEAL, timeout=120)
    assert h0["outs"] == h1["outs"] == r0["outs"] and [e[4] for e in h1["log"]] == ["healed", "healed"]
    _assert_off_changes_nothing(zygote, "eagle", {}, [r0["outs"], r1["outs"]])


def test_eagle_sample_routed_renorm_records_target_probs(zygote):
    env = {"TPGUARD": "on", "TPGUARD_RENORM": "deterministic"}
    r0, r1 = zygote.run("eagle_renorm", env, timeout=120)
    assert "target_probs" in r0["recorded"][0] and r0["recorded"] == r1["recorded"]
    assert r0["log"] == r1["log"] == [[1, "eagle.verify", "rng_state", [1], "recorded"],
                                      [2, "eagle.verify", "target_logits", [1], "recorded"]]
    assert r0["outs"] == r1["outs"]


@pytest.mark.parametrize("scenario", ["dflash_accept_block", "dflash_accept_block_triton"])
def test_dflash_accept_block(zygote, scenario):
    r0, r1 = zygote.run(scenario, {**ON, **SYNC_OFF}, timeout=120)
    assert r0["log"] == r1["log"] == [[1, "dflash.verify", "target_logits", [1], "recorded"]]
    assert {"rng_state", "seq_lens", "draft_tokens", "target_logits", "accept_index", "accept_len",
            "bonus", "commit_lens", "out_tokens"} <= set(r0["recorded"][0])
    assert r0["outs"][1] != r1["outs"][1] and r0["outs"][0] == r1["outs"][0]  # no broadcast: drift
    if scenario.endswith("triton"):
        assert r0["outs"][1][4] != r1["outs"][1][4]  # new_seq_lens drifted too
    h0, h1 = zygote.run(scenario, {**HEAL, **SYNC_OFF}, timeout=120)
    # rank 0's accept_len/commit_lens/bonus/out_tokens broadcast, new_seq_lens recomputed from them
    assert h0["outs"] == h1["outs"] == r0["outs"] and [e[4] for e in h1["log"]] == ["healed"]
    _assert_off_changes_nothing(zygote, scenario, SYNC_OFF, [r0["outs"], r1["outs"]])


def test_dflash_accept_block_with_sglang_broadcast(zygote):
    """SGLANG_SPEC_TP_SYNC on (default): sglang's DFLASH_ACCEPT_GREEDY broadcast keeps the outputs
    equal; tpguard still names the logits."""
    r0, r1 = zygote.run("dflash_accept_block", ON)
    assert r0["outs"] == r1["outs"]
    assert r0["log"] == [[1, "dflash.verify", "target_logits", [1], "recorded"]]


def test_dspark_accept_and_finalize(zygote):
    r0, r1 = zygote.run("dspark_accept_and_finalize", {**ON, **SYNC_OFF}, timeout=120)
    assert r0["log"] == r1["log"] == [[1, "dspark.verify", "target_logits", [1], "recorded"]]
    assert {"rng_state", "seq_lens", "draft_tokens", "target_logits", "accept_len", "cap_trim_lens", "bonus",
            "commit_lens", "out_tokens"} <= set(r0["recorded"][0])
    assert r0["outs"][1] != r1["outs"][1] and r0["outs"][0] == r1["outs"][0]
    h0, h1 = zygote.run("dspark_accept_and_finalize", {**HEAL, **SYNC_OFF}, timeout=120)
    assert h0["outs"] == h1["outs"] == r0["outs"]  # incl. new_seq_lens and cap_trim_lens
    assert [e[4] for e in h1["log"]] == ["healed"]
    _assert_off_changes_nothing(zygote, "dspark_accept_and_finalize", SYNC_OFF, [r0["outs"], r1["outs"]])
