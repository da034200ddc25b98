"""GPU check of the sglang plugin: sglang 0.5.23's verify functions with flashinfer, 2 ranks.

    python gpu/sglang_check.py OUT.json [--site dflash|eagle|eagle-greedy|sampler]
        [--steps 12] [--bs 32] [--draft 8] [--vocab 128256] [--top-p 0.9] [--scale 0.5]
        [--configs default,deterministic] [--nccl]

Sites: ``dflash`` (below), ``eagle`` (`eagle_sample`'s sampling branch: flashinfer top-p renorm,
sglang's JIT tree sampler, sglang's own rank-0 broadcast), ``eagle-greedy`` (`eagle_sample`'s greedy
branch with sglang's JIT `verify_tree_greedy`, which has no rank-0 broadcast on CUDA; a planted
logits difference on rank 1 every third step: configs ``record`` / ``heal``), ``sampler``
(`Sampler.forward`, flashinfer backend, top-k + top-p + min_p; a planted generator reseed).

Two processes share one GPU and join a gloo group (sglang's own GroupCoordinator, built with
`init_distributed_environment` + `init_model_parallel_group`); each loads tpguard through
sglang's `load_plugins()` and calls sglang's DFlash verify function
(`compute_dflash_sampling_correct_drafts_and_bonus`, which builds the target probabilities
through flashinfer's renorm) on byte-identical inputs every step. Expected:

* ``default`` renorm (flashinfer's float-atomic kernels): divergences, first quantity
  ``target_probs`` (logits, RNG and drafts agree);
* ``deterministic`` (TPGUARD_RENORM=deterministic): none.

If sglang's JIT verify kernel cannot be built here (it needs nvcc, apache-tvm-ffi and flashinfer's
headers), the check falls back to `build_speculative_verify_target_probs` alone (the function
where the probabilities come from) and says so. Exit 0 when both expectations hold, 1 otherwise.
sglang's compiled `sgl_kernel` package is not needed: where it is missing, an import stand-in
that raises if called lets sglang's modules import (nothing this check runs calls it).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys
import tempfile
import time
import traceback
import types

CONFIGS = {
    "default": {"TPGUARD_RENORM": "default"},
    "deterministic": {"TPGUARD_RENORM": "deterministic"},
    "deterministic-flashinfer": {"TPGUARD_RENORM": "flashinfer-det"},
    "deterministic-tpguard": {"TPGUARD_RENORM": "tpguard"},
    # audit: sglang's rank-0 broadcasts on (SGLANG_SPEC_TP_SYNC=all); tpguard fingerprints what each
    # rank computed before them, while the outputs (after the broadcast) stay equal.
    "audit": {"TPGUARD": "audit", "TPGUARD_RENORM": "default", "SGLANG_SPEC_TP_SYNC": "all"},
    # the planted-divergence sites (eagle-greedy): record leaves the outputs apart, heal joins them
    "record": {"TPGUARD_ON_DIVERGENCE": "record"},
    "heal": {"TPGUARD_ON_DIVERGENCE": "heal"},
}


# --- sgl_kernel import stand-in (only where the compiled package is absent) ---------------------

# The modules sglang 0.5.23 imports from sgl_kernel outside try/except on the CUDA path of the
# modules the plugin hooks (found by importing them with CUDA reported and sgl_kernel absent).
# Other sgl_kernel submodules stay missing, so sglang's `try: ... except ImportError` fallbacks
# (e.g. sgl_kernel.scalar_type) still take their fallback.
STAND_IN_MODULES = ("sgl_kernel", "sgl_kernel.quantization", "sgl_kernel.kvcacheio")


class _AbsentName:
    """A name imported from the stand-in: raises if called; its attributes are stand-ins too."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self._name} called, but sgl_kernel is not installed on this machine")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _AbsentName(f"{self._name}.{attr}")


# sgl_kernel's renorms are flashinfer's sampling kernels compiled into sgl_kernel ("Adapt from
# flashinfer"): where sgl_kernel is absent, the stand-in calls flashinfer's own, so sglang's sampler
# (which binds `from sgl_kernel import top_k_renorm_prob, top_p_renorm_prob` on CUDA) still runs
# the same float-atomic algorithms.
FLASHINFER_EQUIVALENTS = {"top_k_renorm_prob": "top_k_renorm_probs", "top_p_renorm_prob": "top_p_renorm_probs"}


def _flashinfer_equivalent(name: str):
    def call(*args, **kwargs):
        import flashinfer.sampling

        return getattr(flashinfer.sampling, FLASHINFER_EQUIVALENTS[name])(*args, **kwargs)

    call.__module__, call.__name__ = "flashinfer.sampling", FLASHINFER_EQUIVALENTS[name]
    call.__qualname__ = f"{FLASHINFER_EQUIVALENTS[name]} (as sgl_kernel.{name})"
    return call


class _Absent(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if self.__name__ == "sgl_kernel" and name in FLASHINFER_EQUIVALENTS:
            return _flashinfer_equivalent(name)
        return _AbsentName(f"{self.__name__}.{name}")


class _AbsentFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname in STAND_IN_MODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _Absent(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


def sgl_kernel_stand_in() -> bool:
    """On CUDA, install the stand-in if `import sgl_kernel` fails; True if it was installed."""
    import torch

    if not torch.cuda.is_available():  # sglang's CPU path imports no sgl_kernel name unguarded
        return False
    try:
        import sgl_kernel  # noqa: F401

        return False
    except Exception:
        sys.modules.pop("sgl_kernel", None)
        sys.meta_path.insert(0, _AbsentFinder())
        return True


# --- one rank ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, env: dict, args: dict, queue) -> None:
    os.environ.update(env)
    try:
        queue.put((rank, "ok", run_rank(rank, world, port, args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_rank(rank: int, world: int, port: int, a: dict) -> dict:
    import torch

    stand_in = sgl_kernel_stand_in()
    cpu = a.get("cpu", False)  # a dry run of this script's logic on a CPU box (no flashinfer)
    nccl = a.get("nccl", False)  # one GPU per rank, NCCL (else: both ranks share GPU 0 over gloo)
    gpu = rank if nccl else 0
    backend = "nccl" if nccl else "gloo"
    if not cpu:
        torch.cuda.set_device(gpu)
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel

    from tpguard.hooks import sglang_runtime

    load_plugins()
    via = "load_plugins"
    if sglang_runtime.RUNTIME is None:  # tpguard not pip-installed here: no entry point to find
        from sglang.srt.plugins.hook_registry import HookRegistry

        from tpguard.hooks.sglang_plugin import register

        register()
        HookRegistry.apply_hooks()
        via = "register() (no entry point found)"
    rt = sglang_runtime.RUNTIME
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=gpu, backend=backend,
                                    distributed_init_method=f"tcp://127.0.0.1:{port}", timeout=600)
    tp = ps.init_model_parallel_group([list(range(world))], rank, backend, use_pynccl=False,
                                      use_custom_allreduce=False, group_name="tp")
    get_parallel().override_permanently(tp_group=tp, attn_dp_enabled=False)

    server_args = dict(a.get("server_args") or {})
    if cpu and "sampling_backend" in server_args:  # dry run: no flashinfer on a CPU box
        server_args["sampling_backend"] = "pytorch"
    if server_args:
        from sglang.srt.runtime_context import get_context

        get_context().override_server_args(**server_args, tp_size=world).install()
    dev = torch.device("cpu") if cpu else torch.device("cuda", gpu)
    site = SITES[a.get("site", "dflash")]
    log: list = []
    rt.guard(site.guard).listeners.append(
        lambda d: log.append({"step": d.step, "quantity": d.quantity, "culprit_ranks": d.culprit_ranks,
                              "differing": d.differing, "action": d.action}))
    t0 = time.perf_counter()
    run = site.drive(rank, tp, rt, dev, a)
    if not cpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    from tpguard.fingerprint import fingerprint_tensor
    from tpguard.hooks.sglang_compat import describe_binding

    decisions = run.pop("decisions")
    outputs_fp = f"{fingerprint_tensor(torch.cat(decisions)) if decisions else 0:016x}"
    fn = run.pop("renorm", None)
    differs, repeats = None, a["repeats"]
    if fn is not None:  # kernel-level evidence: the bound top-p renorm, called repeatedly on one input
        bs, n = a["bs"], a["draft"]
        probs = torch.softmax(torch.randn((bs * n, a["vocab"]), device=dev,
                                          generator=torch.Generator(device=dev).manual_seed(99)) * a["scale"], -1)
        ps_ = torch.full((bs * n,), a["top_p"], device=dev)
        first = fn(probs, ps_)
        differs = sum(int(not torch.equal(first, fn(probs, ps_))) for _ in range(repeats))
    return {"rank": rank, "site": site.guard, "divergences": log, "stats": rt.stats(),
            "plugin_loaded_via": via, "sgl_kernel_stand_in": stand_in,
            "renorm_bound": describe_binding(fn) if fn is not None else None, "renorm_backend": rt.renorm_backend,
            "repeat_calls_differing": differs, "repeat_calls": repeats, "seconds": round(seconds, 3),
            "outputs_fingerprint": outputs_fp, "backend": backend, **run}


# --- the verify functions this check drives ------------------------------------------------------

def _sampling_info(dev, bs: int, vocab: int, *, top_p: float = 1.0, top_k: int | None = None,
                   min_p: float = 0.0, greedy: bool = False):
    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    return SamplingBatchInfo(
        temperatures=torch.ones((bs, 1), device=dev), top_ps=torch.full((bs,), top_p, device=dev),
        top_ks=torch.full((bs,), 1 if greedy else (top_k or vocab), dtype=torch.int32, device=dev),
        min_ps=torch.full((bs,), min_p, device=dev), is_all_greedy=greedy, is_any_greedy=greedy,
        need_top_p_sampling=top_p < 1.0, need_top_k_sampling=top_k is not None,
        need_min_p_sampling=min_p > 0, vocab_size=vocab, device=dev.type)


def drive_dflash(rank, tp, rt, dev, a) -> dict:
    """DFlash: `DFlashWorkerV2._accept_block` on its sampling path (sglang's JIT verify kernel,
    then its DFLASH_ACCEPT_SAMPLE broadcast), the step's owner as in a server; if the JIT kernel
    cannot be built here, `build_speculative_verify_target_probs` alone."""
    import torch
    from sglang.srt.speculative import dflash_utils
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    bs, n, vocab = a["bs"], a["draft"], a["vocab"]
    worker = DFlashWorkerV2.__new__(DFlashWorkerV2)  # the attributes _accept_block reads
    worker._selector_sample, worker._tp_sync, worker.block_size = None, SpecTpSync(tp), n
    worker._use_triton_accept_bonus, worker.device = False, dev
    draft_input = DFlashDraftInputV2.create_idle_input(device=dev)
    info = _sampling_info(dev, bs, vocab, top_p=a["top_p"])
    decisions = []
    verify_fn, jit_error = "DFlashWorkerV2._accept_block (sampling path)", None
    if not dflash_utils.is_dflash_sampling_verify_available():
        jit_error = "is_dflash_sampling_verify_available() is False here"
    for step in range(a["steps"]):
        g = torch.Generator(device=dev).manual_seed(step)  # identical inputs on both ranks
        logits = torch.randn((bs * n, vocab), device=dev, generator=g) * a["scale"]
        candidates = torch.randint(0, vocab, (bs, n), device=dev, generator=g)
        torch.manual_seed(1234 + step)  # the coins: identical on both ranks (seeds CUDA too)
        if jit_error is None:
            try:
                accept_len, _, bonus, _, _ = worker._accept_block(
                    candidates=candidates, next_token_logits=logits, sampling_info=info,
                    draft_input=draft_input, prefix_lens=torch.full((bs,), 100, device=dev), bs=bs)
                decisions.append(torch.cat([accept_len.reshape(-1).long(), bonus.reshape(-1).long()]))
                continue
            except Exception as e:  # the JIT kernel could not be built or loaded here
                if step != 0:
                    raise
                jit_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        verify_fn = "build_speculative_verify_target_probs"
        dflash_utils.build_speculative_verify_target_probs(
            next_token_logits=logits, sampling_info=info, draft_token_num=n, bs=bs)
    renorm = dflash_utils.top_p_renorm_prob or dflash_utils._dflash_top_p_renorm_prob
    return {"decisions": decisions, "verify_fn": verify_fn, "jit_error": jit_error, "renorm": renorm}


def drive_dspark(rank, tp, rt, dev, a) -> dict:
    """DSpark, eager: `TargetVerifyExecutor.accept_and_finalize` with a sampled accept (its target
    probs through flashinfer's top-p renorm, sglang's Triton chain sampler), then
    `build_accept_outs` with its three DSPARK_ACCEPT_SAMPLE broadcasts."""
    import torch
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.dspark_components import dspark_verify
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    bs, n, vocab = a["bs"], a["draft"], a["vocab"]
    ex = dspark_verify.TargetVerifyExecutor.__new__(dspark_verify.TargetVerifyExecutor)
    ex._simulated_correct_len, ex.gamma, ex.verify_num_draft_tokens = None, n - 1, n
    ex._fused_argmax = ex._block_verification = False
    ex._rejection_noise, ex._tp_sync = None, SpecTpSync(tp)
    info = _sampling_info(dev, bs, vocab, top_p=a["top_p"])
    draft_input = DFlashDraftInputV2.create_idle_input(device=dev)
    decisions = []
    for step in range(a["steps"]):
        g = torch.Generator(device=dev).manual_seed(300 + step)
        logits = torch.randn((bs * n, vocab), device=dev, generator=g) * a["scale"]
        ids = torch.randint(0, vocab, (bs, n), device=dev, generator=g)
        drafts = ids[:, 1:].contiguous()
        block = DraftBlockResult(draft_tokens=drafts, corrected_logits=None,
                                 greedy_mask=torch.zeros(bs, dtype=torch.bool, device=dev),
                                 temperatures=info.temperatures, greedy_draft=True)
        torch.manual_seed(555 + step)  # the coins: identical on both ranks
        accept = ex.accept_and_finalize(
            folded_accept=False, bs=bs, verify_ids_2d=ids, target_logits=logits, draft_block=block,
            sampling_info=info, draft_input=draft_input, layout=None,
            prefix_lens=torch.full((bs,), 50, device=dev), draft_tokens=drafts)
        decisions.append(torch.cat([accept.correct_len.reshape(-1).long(), accept.bonus.reshape(-1).long(),
                                    accept.out_tokens.reshape(-1).long()]))
    from sglang.srt.speculative import dflash_utils

    renorm = dflash_utils.top_p_renorm_prob or dflash_utils._dflash_top_p_renorm_prob
    return {"decisions": decisions, "verify_fn": "TargetVerifyExecutor.accept_and_finalize (eager, sampled)",
            "jit_error": None, "renorm": renorm}


def _eagle_inputs(step: int, dev, bs: int, n: int, vocab: int, scale: float, info):
    """A chain (topk=1) EAGLE verify of n tokens per request: real EagleVerifyInput, ScheduleBatch,
    LogitsProcessorOutput; identical on every rank."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    g = torch.Generator(device=dev).manual_seed(50 + step)
    logits = torch.randn((bs * n, vocab), device=dev, generator=g) * scale
    # drafts: the target's own argmax on some positions so greedy verify accepts a few
    draft = torch.randint(vocab, (bs, n), device=dev, generator=g)
    hit = torch.rand((bs, n), device=dev, generator=g) < 0.6
    draft = torch.where(hit, logits.argmax(-1).view(bs, n).roll(1, dims=1), draft)
    seq_lens = torch.arange(7, 7 + bs, dtype=torch.int64, device=dev)
    next_token = torch.arange(1, n + 1, device=dev).repeat(bs, 1)
    next_token[:, -1] = -1
    verify_input = EagleVerifyInput(
        draft_token=draft.reshape(-1), custom_mask=None,
        positions=(seq_lens.view(-1, 1) + torch.arange(n, device=dev)).reshape(-1),
        retrieve_index=torch.arange(bs * n, device=dev).view(bs, n), retrieve_next_token=next_token,
        retrieve_next_sibling=torch.full((bs, n), -1, device=dev), retrieve_cum_len=None,
        spec_steps=n - 1, topk=1, draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=int(seq_lens.sum()), seq_lens_cpu=seq_lens.cpu(), draft_probs=None)
    batch = ScheduleBatch(reqs=[], device=dev.type, seq_lens=seq_lens, forward_mode=ForwardMode.TARGET_VERIFY,
                          sampling_info=info)
    return verify_input, batch, LogitsProcessorOutput(next_token_logits=logits)


def drive_eagle(rank, tp, rt, dev, a) -> dict:
    """EAGLE's sampling branch (`eagle_sample`: softmax, flashinfer top-p renorm, sglang's JIT
    target-only tree sampler, then sglang's own rank-0 broadcast of the results)."""
    import torch
    from sglang.srt.speculative import eagle_utils

    bs, n, vocab = a["bs"], a["draft"], a["vocab"]
    info = _sampling_info(dev, bs, vocab, top_p=a["top_p"])
    decisions = []
    for step in range(a["steps"]):
        vi, batch, lo = _eagle_inputs(step, dev, bs, n, vocab, a["scale"], info)
        torch.manual_seed(4321 + step)  # the coins: identical on both ranks
        predict, accept_lens, accept_index = eagle_utils.eagle_sample(vi, batch, lo)
        decisions.append(torch.cat([predict.reshape(-1).long(), accept_lens.reshape(-1).long(),
                                    accept_index.reshape(-1).long()]))
    return {"decisions": decisions, "verify_fn": "eagle_utils.eagle_sample (sampling branch)",
            "jit_error": None, "renorm": eagle_utils.top_p_renorm_prob}


def drive_eagle_greedy(rank, tp, rt, dev, a) -> dict:
    """EAGLE's greedy branch (argmax + sglang's JIT verify_tree_greedy; no rank-0 broadcast on
    CUDA). On every third step rank 1's logits differ in one row (a planted divergence): `record`
    leaves the ranks' outputs different, `heal` broadcasts rank 0's and they stay equal."""
    import torch
    from sglang.srt.speculative import eagle_utils

    bs, n, vocab = a["bs"], a["draft"], a["vocab"]
    info = _sampling_info(dev, bs, vocab, greedy=True)
    decisions, planted = [], []
    for step in range(a["steps"]):
        vi, batch, lo = _eagle_inputs(step, dev, bs, n, vocab, a["scale"], info)
        torch.manual_seed(4321 + step)  # as a server seeds every rank alike (greedy draws nothing)
        if step % 3 == 1:
            planted.append(step)
            if rank == 1:
                lo.next_token_logits[0, 17] += 100.0  # another argmax in the first row (always emitted)
        predict, accept_lens, accept_index = eagle_utils.eagle_sample(vi, batch, lo)
        decisions.append(torch.cat([predict.reshape(-1).long(), accept_lens.reshape(-1).long(),
                                    accept_index.reshape(-1).long()]))
    return {"decisions": decisions, "verify_fn": "eagle_utils.eagle_sample (greedy branch)",
            "jit_error": None, "planted_steps": planted}


def drive_sampler(rank, tp, rt, dev, a) -> dict:
    """The plain sampler, flashinfer backend with top-k + top-p + min_p (`Sampler.forward`: softmax,
    top-k and top-p renorm, flashinfer's `min_p_sampling_from_probs`). Rank 1 reseeds its generator
    on step 2 (a planted divergence, named rng_state)."""
    import torch
    from sglang.srt.layers import sampler as sampler_mod
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    bs, vocab = a["bs"] * a["draft"], a["vocab"]
    sampler = sampler_mod.Sampler()
    info = _sampling_info(dev, bs, vocab, top_p=a["top_p"], top_k=1024, min_p=0.05)
    decisions = []
    for step in range(a["steps"]):
        g = torch.Generator(device=dev).manual_seed(70 + step)
        logits = torch.randn((bs, vocab), device=dev, generator=g) * a["scale"]
        torch.manual_seed(999 if (step == 2 and rank == 1) else 77 + step)
        tokens = sampler.forward(LogitsProcessorOutput(next_token_logits=logits), info, False, [], [],
                                 torch.arange(bs, device=dev))
        decisions.append(tokens.reshape(-1).long())
    return {"decisions": decisions, "verify_fn": "layers.sampler.Sampler.forward (flashinfer, min_p)",
            "jit_error": None, "planted_steps": [2], "renorm": getattr(sampler_mod, "top_p_renorm_prob", None)}


class Site:
    def __init__(self, guard: str, drive, server_args: dict, configs: str):
        self.guard, self.drive, self.server_args, self.configs = guard, drive, server_args, configs


# --site name -> the guard it reports to, the driver, the sglang config it publishes, default configs
SITES = {
    # a published server config (sglang's spec namespace: the sampled verify reads its thresholds)
    "dflash": Site("dflash.verify", drive_dflash, {"sampling_backend": "flashinfer"}, "default,audit,deterministic"),
    "dspark": Site("dspark.verify", drive_dspark, {"sampling_backend": "flashinfer"}, "default,audit,deterministic"),
    "eagle": Site("eagle.verify", drive_eagle,
                  {"sampling_backend": "flashinfer", "speculative_use_rejection_sampling": False},
                  "default,audit,deterministic"),
    "eagle-greedy": Site("eagle.verify", drive_eagle_greedy, {"sampling_backend": "flashinfer"}, "record,heal"),
    "sampler": Site("sampler", drive_sampler, {"sampling_backend": "flashinfer"}, "default,deterministic"),
}


# --- the parent ----------------------------------------------------------------------------------

def run_config(name: str, args: dict, trace_root: str, timeout: float) -> dict:
    import multiprocessing as mp

    env = {"TPGUARD": "on", "TPGUARD_ON_DIVERGENCE": "record",
           "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS": "0" if args.get("nccl") else "1",
           "TPGUARD_TRACE_DIR": os.path.join(trace_root, name), "SGLANG_PLUGINS": "tpguard",
           "TPGUARD_RUN_ID": f"gpu-check-{name}", "TPGUARD_ALL_PROCESSES": "1", **CONFIGS[name]}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    run_args = {**args, "spec_sync": CONFIGS[name].get("SGLANG_SPEC_TP_SYNC") is not None,
                "server_args": SITES[args["site"]].server_args}
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, env, run_args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < 2 and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=5)
            except Exception:
                continue
            (results if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    out = {"config": name, "env": {k: v for k, v in env.items() if k.startswith("TPGUARD")},
           "ranks": [results.get(r) for r in range(2)], "errors": errors}
    r0 = results.get(0)
    if r0 is not None:
        quantities: dict[str, int] = {}
        for d in r0["divergences"]:
            quantities[d["quantity"]] = quantities.get(d["quantity"], 0) + 1
        fps = [(results.get(r) or {}).get("outputs_fingerprint") for r in range(2)]
        out["outputs_identical"] = fps[0] is not None and fps[0] == fps[1]
        out.update({"steps": args["steps"], "divergent_steps": len({d["step"] for d in r0["divergences"]}),
                    "first_quantity_counts": quantities, "verify_fn": r0["verify_fn"],
                    "jit_error": r0["jit_error"], "planted_steps": r0.get("planted_steps"),
                    "healed": sum(d.get("action") == "healed" for d in r0["divergences"])})
    try:
        from tpguard.diagnose import diagnose

        out["diagnose"] = diagnose([env["TPGUARD_TRACE_DIR"]]).to_json()
    except Exception as e:  # noqa: BLE001
        out["diagnose"] = {"error": str(e)}
    return out


def verdict(results: dict, site: str) -> tuple[bool, list[str]]:
    """The expectation of each config: renorm sites diverge in target_probs with flashinfer's
    default renorm and never with the deterministic one; planted sites name the planted quantity
    and `heal` leaves equal outputs."""
    notes, ok = [], True
    planted_quantity = {"eagle-greedy": "target_logits", "sampler": "rng_state"}.get(site)
    for name, r in results.items():
        if r.get("errors") or any(x is None for x in r["ranks"]):
            ok = False
            notes.append(f"{name}: a rank failed: {list(r.get('errors', {}).values())[:1]}")
            continue
        n, q, steps = r["divergent_steps"], r["first_quantity_counts"], r["steps"]
        planted = set(r.get("planted_steps") or [])
        natural = {k: v for k, v in q.items() if k != planted_quantity} if planted else q
        if name == "default":
            # sglang's own broadcasts stay on: the decisions they align raise no alarm, so every
            # divergence is named target_probs and the outputs are equal (the sampler has none)
            aligned = r.get("outputs_identical", False) or site == "sampler"
            good = n > 0 and set(natural) == {"target_probs"} and aligned
            notes.append(f"default: {n}/{steps} steps diverged, first quantity {q or '-'}, outputs "
                         f"identical {r.get('outputs_identical')}"
                         + ("" if good else "  <- expected divergences named target_probs only, equal outputs"))
        elif name == "audit":
            good = n > 0 and r.get("outputs_identical", False)
            notes.append(f"audit: {n}/{steps} checks would have diverged ({q or '-'}), outputs identical "
                         f"after sglang's broadcasts: {r.get('outputs_identical')}"
                         + ("" if good else "  <- expected disagreements counted and equal outputs"))
        elif name in ("record", "heal"):
            want_equal = name == "heal"
            good = (q.get(planted_quantity, 0) == len(planted) and n == len(planted)
                    and r.get("outputs_identical") == want_equal)
            notes.append(f"{name}: {n}/{steps} steps diverged (planted {len(planted)}), first quantity "
                         f"{q or '-'}, healed {r.get('healed')}, outputs identical {r.get('outputs_identical')}"
                         + ("" if good else f"  <- expected the planted steps named {planted_quantity} and "
                                            f"outputs {'equal' if want_equal else 'apart'}"))
        else:
            good = not natural
            notes.append(f"{name}: {n}/{steps} steps diverged, first quantity {q or '-'}"
                         + (f" (planted: {sorted(planted)})" if planted else "")
                         + ("" if good else "  <- expected none beyond the planted ones"))
        ok &= good
    return ok, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu/sglang_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--draft", type=int, default=8, help="draft tokens per request (rows = bs * draft)")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--scale", type=float, default=0.5, help="logit scale (small: flat rows)")
    ap.add_argument("--repeats", type=int, default=20, help="repeated renorm calls per rank on one input")
    ap.add_argument("--site", default="dflash", choices=sorted(SITES),
                    help="which sglang verify function to drive")
    ap.add_argument("--configs", default=None,
                    help="comma list of: " + ", ".join(CONFIGS) + " (default: the site's)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per config")
    ap.add_argument("--nccl", action="store_true", help="one GPU per rank over NCCL (2 GPUs)")
    ap.add_argument("--cpu", action="store_true", help="dry run of the script on a CPU box (expect FAIL: "
                    "CPU renorm is deterministic)")
    ns = ap.parse_args(argv)
    names = [c.strip() for c in (ns.configs or SITES[ns.site].configs).split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        print(f"sglang_check: unknown config(s) {bad}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    import torch

    if not ns.cpu and not torch.cuda.is_available():
        print("sglang_check: no CUDA device here (--cpu for a dry run)", file=sys.stderr)
        return 2
    args = {"steps": ns.steps, "bs": ns.bs, "draft": ns.draft, "vocab": ns.vocab, "top_p": ns.top_p,
            "scale": ns.scale, "repeats": ns.repeats, "cpu": ns.cpu, "nccl": ns.nccl, "site": ns.site}
    trace_root = tempfile.mkdtemp(prefix="tpguard-gpu-check-")
    results = {}
    for name in names:
        t0 = time.perf_counter()
        results[name] = run_config(name, args, trace_root, ns.timeout)
        results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    ok, notes = verdict(results, ns.site)
    from tpguard.hooks.sglang_compat import versions

    report = {"ok": ok, "notes": notes, "args": args, "versions": versions(),
              "device": "cpu" if ns.cpu else torch.cuda.get_device_name(0), "trace_root": trace_root, "results": results}
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"tpguard sglang GPU check ({ns.site}):", "PASS" if ok else "FAIL")
    for note in notes:
        print("  " + note)
    for name, r in results.items():
        r0 = (r["ranks"] or [None])[0] or {}
        print(f"  {name}: verify fn {r0.get('verify_fn')}, renorm {r0.get('renorm_bound')}, repeated calls "
              f"differing {r0.get('repeat_calls_differing')}/{r0.get('repeat_calls')}, "
              f"outputs identical {r.get('outputs_identical')}, "
              f"jit {r0.get('jit_error') or 'ok'}, {r.get('wall_s')} s")
    print(f"  json: {ns.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
