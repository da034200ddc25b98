"""GPU check of the sglang plugin: DFlash verify of sglang 0.5.23 with flashinfer, 2 ranks on one GPU.

    python -m tpguard.hooks.gpu_check_sglang OUT.json [--steps 12] [--bs 32] [--draft 8]
        [--vocab 128256] [--top-p 0.9] [--scale 0.5] [--configs default,deterministic]

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
    "deterministic-flashinfer": {"TPGUARD_RENORM": "deterministic", "TPGUARD_RENORM_BACKEND": "flashinfer"},
    "deterministic-tpguard": {"TPGUARD_RENORM": "deterministic", "TPGUARD_RENORM_BACKEND": "tpguard"},
    # audit: sglang's rank-0 broadcasts on (SGLANG_SPEC_TP_SYNC=all); tpguard fingerprints what each
    # rank computed before them, while the outputs (after the broadcast) stay equal.
    "audit": {"TPGUARD": "audit", "TPGUARD_RENORM": "default", "SGLANG_SPEC_TP_SYNC": "all"},
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


class _Absent(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
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

    from tpguard.hooks import sglang_sites

    load_plugins()
    via = "load_plugins"
    if sglang_sites.RUNTIME is None:  # tpguard not pip-installed here: no entry point to find
        from sglang.srt.plugins.hook_registry import HookRegistry

        from tpguard.hooks.sglang_plugin import register

        register()
        HookRegistry.apply_hooks()
        via = "register() (no entry point found)"
    rt = sglang_sites.RUNTIME
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=gpu, backend=backend,
                                    distributed_init_method=f"tcp://127.0.0.1:{port}", timeout=600)
    tp = ps.init_model_parallel_group([list(range(world))], rank, backend, use_pynccl=False,
                                      use_custom_allreduce=False, group_name="tp")
    get_parallel().override_permanently(tp_group=tp, attn_dp_enabled=False)

    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative import dflash_utils

    dev = torch.device("cpu") if cpu else torch.device("cuda", gpu)
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite

    tp_sync = SpecTpSync(tp)  # as DFlashWorkerV2._accept_block uses it after the verify function
    decisions = []
    bs, n, vocab = a["bs"], a["draft"], a["vocab"]
    info = SamplingBatchInfo(
        temperatures=torch.ones((bs, 1), device=dev), top_ps=torch.full((bs,), a["top_p"], device=dev),
        top_ks=torch.full((bs,), vocab, dtype=torch.int32, device=dev), min_ps=torch.zeros(bs, device=dev),
        is_all_greedy=False, is_any_greedy=False, need_top_p_sampling=True, need_top_k_sampling=False,
        need_min_p_sampling=False, vocab_size=vocab, device=dev.type)
    log: list = []
    guard = rt.guard("dflash.verify")
    guard.listeners.append(lambda d: log.append({"step": d.step, "quantity": d.quantity,
                                                 "culprit_ranks": d.culprit_ranks, "differing": d.differing}))

    verify_fn, jit_error = "compute_dflash_sampling_correct_drafts_and_bonus", None
    t0 = time.perf_counter()
    for step in range(a["steps"]):
        g = torch.Generator(device=dev).manual_seed(step)  # identical inputs on both ranks
        logits = torch.randn((bs * n, vocab), device=dev, generator=g) * a["scale"]
        candidates = torch.randint(0, vocab, (bs, n), device=dev, generator=g)
        torch.manual_seed(1234 + step)  # the coins: identical on both ranks (seeds CUDA too)
        if jit_error is None:
            try:
                accept_len, bonus = dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus(
                    candidates=candidates, next_token_logits=logits, sampling_info=info,
                    threshold_single=1.0, threshold_acc=1.0)
                if a.get("spec_sync"):
                    tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, accept_len)
                    tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, bonus)
                decisions.append(torch.cat([accept_len.reshape(-1).long(), bonus.reshape(-1).long()]))
                continue
            except Exception as e:  # the JIT kernel could not be built or loaded here
                if step != 0:
                    raise
                jit_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
                verify_fn = "build_speculative_verify_target_probs"
                guard.skip()  # keep both ranks' step numbers aligned (the check never ran)
        dflash_utils.build_speculative_verify_target_probs(
            next_token_logits=logits, sampling_info=info, draft_token_num=n, bs=bs)
    if not cpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0

    # Kernel-level evidence: the bound top-p renorm, called repeatedly on one input.
    probs = torch.softmax(torch.randn((bs * n, vocab), device=dev,
                                      generator=torch.Generator(device=dev).manual_seed(99)) * a["scale"], -1)
    fn = dflash_utils.top_p_renorm_prob or dflash_utils._dflash_top_p_renorm_prob  # None: torch fallback
    first = fn(probs, info.top_ps.repeat_interleave(n))
    repeats = a["repeats"]
    differs = sum(int(not torch.equal(first, fn(probs, info.top_ps.repeat_interleave(n)))) for _ in range(repeats))
    from tpguard.hooks.sglang_compat import describe_binding
    from tpguard.fingerprint import fingerprint

    outputs_fp = f"{fingerprint(torch.cat(decisions)) if decisions else 0:016x}"

    return {"rank": rank, "divergences": log, "stats": rt.stats(), "verify_fn": verify_fn,
            "jit_error": jit_error, "plugin_loaded_via": via, "sgl_kernel_stand_in": stand_in,
            "renorm_bound": describe_binding(fn), "renorm_backend": rt.renorm_backend,
            "repeat_calls_differing": differs, "repeat_calls": repeats, "seconds": round(seconds, 3),
            "outputs_fingerprint": outputs_fp, "backend": backend}


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
    run_args = {**args, "spec_sync": CONFIGS[name].get("SGLANG_SPEC_TP_SYNC") is not None}
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
        out.update({"steps": args["steps"], "divergent_steps": len(r0["divergences"]),
                    "first_quantity_counts": quantities, "verify_fn": r0["verify_fn"],
                    "jit_error": r0["jit_error"]})
    try:
        from tpguard.diagnose import diagnose

        out["diagnose"] = diagnose([env["TPGUARD_TRACE_DIR"]]).to_json()
    except Exception as e:  # noqa: BLE001
        out["diagnose"] = {"error": str(e)}
    return out


def verdict(results: dict) -> tuple[bool, list[str]]:
    notes, ok = [], True
    for name, r in results.items():
        if r.get("errors") or any(x is None for x in r["ranks"]):
            ok = False
            notes.append(f"{name}: a rank failed: {list(r.get('errors', {}).values())[:1]}")
            continue
        n, q = r["divergent_steps"], r["first_quantity_counts"]
        if name == "default":
            good = n > 0 and set(q) == {"target_probs"}
            notes.append(f"default: {n}/{r['steps']} steps diverged, first quantity {q or '-'}"
                         + ("" if good else "  <- expected divergences named target_probs"))
        elif name == "audit":
            good = n > 0 and r.get("outputs_identical", False)
            notes.append(f"audit: {n}/{r['steps']} checks would have diverged ({q or '-'}), outputs identical "
                         f"after sglang's broadcasts: {r.get('outputs_identical')}"
                         + ("" if good else "  <- expected disagreements counted and equal outputs"))
        else:
            good = n == 0
            notes.append(f"{name}: {n}/{r['steps']} steps diverged" + ("" if good else "  <- expected none"))
        ok &= good
    return ok, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tpguard.hooks.gpu_check_sglang", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--draft", type=int, default=8, help="draft tokens per request (rows = bs * draft)")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--scale", type=float, default=0.5, help="logit scale (small: flat rows)")
    ap.add_argument("--repeats", type=int, default=20, help="repeated renorm calls per rank on one input")
    ap.add_argument("--configs", default="default,deterministic",
                    help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=540, help="seconds per config")
    ap.add_argument("--nccl", action="store_true", help="one GPU per rank over NCCL (2 GPUs)")
    ap.add_argument("--cpu", action="store_true", help="dry run of the script on a CPU box (expect FAIL: "
                    "CPU renorm is deterministic)")
    ns = ap.parse_args(argv)
    names = [c.strip() for c in ns.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        print(f"gpu_check_sglang: unknown config(s) {bad}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    import torch

    if not ns.cpu and not torch.cuda.is_available():
        print("gpu_check_sglang: no CUDA device here (--cpu for a dry run)", file=sys.stderr)
        return 2
    args = {"steps": ns.steps, "bs": ns.bs, "draft": ns.draft, "vocab": ns.vocab, "top_p": ns.top_p,
            "scale": ns.scale, "repeats": ns.repeats, "cpu": ns.cpu, "nccl": ns.nccl}
    trace_root = tempfile.mkdtemp(prefix="tpguard-gpu-check-")
    results = {}
    for name in names:
        t0 = time.perf_counter()
        results[name] = run_config(name, args, trace_root, ns.timeout)
        results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    ok, notes = verdict(results)
    from tpguard.hooks.sglang_compat import versions

    report = {"ok": ok, "notes": notes, "args": args, "versions": versions(),
              "device": "cpu" if ns.cpu else torch.cuda.get_device_name(0), "trace_root": trace_root, "results": results}
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("tpguard sglang GPU check:", "PASS" if ok else "FAIL")
    for note in notes:
        print("  " + note)
    for name, r in results.items():
        r0 = (r["ranks"] or [None])[0] or {}
        print(f"  {name}: verify fn {r0.get('verify_fn')}, renorm {r0.get('renorm_bound')}, repeated calls "
              f"differing {r0.get('repeat_calls_differing')}/{r0.get('repeat_calls')}, "
              f"jit {r0.get('jit_error') or 'ok'}, {r.get('wall_s')} s")
    print(f"  json: {ns.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
