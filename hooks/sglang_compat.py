"""Which sglang tpguard supports, and where its hook points are (used by the plugin and `tpguard doctor`).

A hook point is a dotted path that sglang's `HookRegistry` can patch, plus the argument names the
hook reads. `discover()` imports each one's module and checks those names, so a renamed or moved
function is reported as missing or changed instead of being skipped silently.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field

import torch

from tpguard.fingerprint import FORMAT_VERSION

SUPPORTED_SGLANG = ("0.5.23",)


ACCEPT_OUTS = ("correct_len", "bonus", "cap_trim_lens", "commit_lens", "new_seq_lens", "out_tokens")
UNO_RESULT = ("output_ids", "accept_lens", "new_seq_lens", "next_seed_tokens")


@dataclass(frozen=True)
class HookPoint:
    name: str  # short name, also the key in doctor's table
    target: str  # dotted path for HookRegistry
    params: tuple[str, ...] = ()  # argument names the hook reads (checked against the signature)
    algo: str = ""  # dflash | dspark | eagle | uno | sampler | sync
    # The result the hook reads, checked at every checked step before it is read: an int (a
    # tuple of that length), a tuple of attribute names, "tensor", or None (not read).
    returns: object = None
    # owner (opens and checks a verify step), contributor (records into the open step),
    # pause (tpguard does nothing inside: prewarm, rebuilds after acceptance), or "" (sync)
    role: str = "contributor"

    def result_problem(self, out) -> str | None:
        """Why `out` is not the result this hook reads, or None."""
        r = self.returns
        if r is None:
            return None
        if r == "tensor":
            ok = isinstance(out, torch.Tensor)
            want = "a tensor"
        elif isinstance(r, int):
            ok = isinstance(out, (tuple, list)) and len(out) == r
            want = f"a tuple of {r}"
        else:
            ok = all(hasattr(out, a) for a in r)
            want = f"an object with {', '.join(r)}"
        if ok:
            return None
        got = f"a tuple of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        return f"{self.target} returned {got}, tpguard reads {want} (sglang changed this function)"


_DSPARK = "sglang.srt.speculative.dspark_components"
HOOK_POINTS: tuple[HookPoint, ...] = (
    HookPoint("spec_tp_sync", "sglang.srt.speculative.spec_tp_sync.SpecTpSync.sync",
              ("site", "values"), "sync", "tensor", ""),
    # DFlash
    HookPoint("dflash.accept_block", "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._accept_block",
              ("candidates", "next_token_logits", "prefix_lens", "target_predict"), "dflash", 5, "owner"),
    HookPoint("dflash.sampling_accept",
              "sglang.srt.speculative.dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus",
              ("candidates", "next_token_logits", "uniform_samples", "uniform_samples_for_final_sampling"),
              "dflash", 2),
    HookPoint("dflash.target_probs", "sglang.srt.speculative.dflash_utils.build_speculative_verify_target_probs",
              ("next_token_logits",), "dflash", "tensor"),
    HookPoint("dflash.prewarm_sampling", "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.prewarm_sampling",
              (), "dflash", None, "pause"),
    HookPoint("spec.sampling_mask_capture",
              "sglang.srt.speculative.spec_sampling_mask.SpeculativeSamplingMaskCapture.from_logits",
              (), "dflash", None, "pause"),
    # DSpark
    HookPoint("dspark.accept_and_finalize", f"{_DSPARK}.dspark_verify.TargetVerifyExecutor.accept_and_finalize",
              ("folded_accept", "verify_ids_2d", "target_logits", "prefix_lens"), "dspark", ACCEPT_OUTS, "owner"),
    HookPoint("dspark.sampling_accept_graph",
              f"{_DSPARK}.dspark_sampling_accept_graph.DsparkSamplingAcceptGraph.run",
              ("bs", "target_logits"), "dspark", None, "owner"),
    HookPoint("dspark.accept_draft_tokens", f"{_DSPARK}.dspark_verify.accept_draft_tokens",
              ("candidates", "target_logits"), "dspark", 3, "owner"),
    HookPoint("dspark.build_accept_outs", f"{_DSPARK}.dspark_verify.build_accept_outs",
              ("correct_len", "bonus", "cap_trim_lens", "prefix_lens"), "dspark", ACCEPT_OUTS, "owner"),
    HookPoint("dspark.accept_sampling_core",
              "sglang.kernels.ops.speculative.dspark.dspark_accept._accept_sampling_core",
              ("candidates", "target_logits", "gamma"), "dspark", 4),
    HookPoint("dspark.softmax_temp", "sglang.kernels.ops.speculative.dspark.dspark_accept.SoftmaxTemp.execute",
              (), "dspark", "tensor"),
    HookPoint("dspark.blockwise_rejection",
              "sglang.kernels.ops.speculative.dspark.blockwise_rejection.BlockwiseRejection.execute",
              (), "dspark", 3),
    # EAGLE
    HookPoint("eagle.sample", "sglang.srt.speculative.eagle_utils.eagle_sample",
              ("verify_input", "batch", "logits_output"), "eagle", 3, "owner"),
    HookPoint("eagle.verify_coins", "sglang.srt.speculative.eagle_utils._verify_coins",
              ("seq_lens", "candidates"), "eagle", 2),
    HookPoint("eagle.target_softmax", "sglang.kernels.ops.sampling.softmax", (), "eagle", "tensor"),
    HookPoint("eagle.watermark_record",
              "sglang.srt.sampling.watermarking.core.WatermarkState.record_speculative",
              ("accept_index", "accept_lens"), "eagle"),
    # UNO (linear verify; its tree verify is eagle_sample)
    HookPoint("uno.accept_and_pack", "sglang.srt.speculative.uno_worker_v2.UnoWorkerV2._accept_and_pack",
              ("candidates", "target_top1", "committed_seq_lens"), "uno", 4, "owner"),
    HookPoint("uno.run_sampling", "sglang.srt.speculative.uno_utils.run_uno_sampling",
              ("candidates", "next_token_logits", "committed_frontiers"), "uno", UNO_RESULT, "owner"),
    HookPoint("uno.dense_rejection", "sglang.srt.speculative.uno_utils._run_dense_rejection",
              ("candidates", "next_token_logits"), "uno", 2),
    HookPoint("uno.sparse_rejection", "sglang.srt.speculative.uno_utils._run_sparse_rejection",
              ("candidates", "next_token_logits"), "uno", 2),
    # the plain sampler
    HookPoint("sampler.forward", "sglang.srt.layers.sampler.Sampler.forward",
              ("logits_output", "sampling_info"), "sampler", "tensor", "owner"),
)
HOOK_POINTS_BY_NAME = {p.name: p for p in HOOK_POINTS}

# Every module that binds the renorm functions by name (`from ... import top_k_renorm_prob`).
RENORM_MODULES: tuple[str, ...] = (
    "sglang.kernels.ops.sampling.renorm",
    "sglang.srt.speculative.dflash_utils",
    "sglang.srt.speculative.eagle_utils",
    "sglang.srt.layers.sampler",
)
RENORM_NAMES: tuple[str, ...] = ("top_k_renorm_prob", "top_p_renorm_prob")

# Where the plugin finds the TP group of a verify step.
GROUP_GETTER = "sglang.srt.layers.dp_attention.get_dp_tp_group"


def target_tp_group():
    """The process group of the *target* model's TP group (attention-TP under DP attention),
    even while a draft runs under `patch_tensor_parallel_group(draft_group)`: that patch narrows
    sglang's parallel context with scoped overrides, so the group is read from the values beneath
    them (the permanent stamp, then the published config), as `get_dp_tp_group()` reads them
    outside any draft. None when sglang's groups are not built in this process."""
    try:
        from sglang.srt.layers.dp_attention import get_dp_tp_group
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        overrides = getattr(parallel, "_overrides", None)
        if not overrides:
            return get_dp_tp_group().device_group

        def base(name):
            stamp = getattr(parallel, "_stamp", {})
            if name in stamp:
                return stamp[name]
            return getattr(parallel._config, name)

        group = base("attn_tp_group") if base("attn_dp_enabled") else base("tp_group")
        return group.device_group
    except Exception:  # noqa: BLE001 - not built here (a script, a test): the caller says so
        return None


def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {
        "sglang": version_of("sglang"),
        "flashinfer": version_of("flashinfer-python") or version_of("flashinfer"),
        "torch": version_of("torch"),
        "triton": version_of("triton"),
        "tpguard": version_of("tpguard"),
        "fingerprint": FORMAT_VERSION,  # traces hashed with different definitions are not comparable
    }


def version_problem(sglang_version: str | None) -> str | None:
    """One line if this sglang is missing or not a supported version, else None."""
    if sglang_version is None:
        return "sglang is not installed (tpguard's plugin supports sglang " + ", ".join(SUPPORTED_SGLANG) + ")"
    if sglang_version not in SUPPORTED_SGLANG:
        return (f"sglang {sglang_version} is not a supported version (supported: {', '.join(SUPPORTED_SGLANG)}); "
                "hook points that still match are used, the others are reported missing")
    return None


@dataclass
class HookStatus:
    point: HookPoint
    found: bool
    problem: str | None = None  # why not found / what changed
    signature: str | None = None
    # Not importable because a package sglang needs for that path is absent here (flashinfer on a
    # CPU machine): sglang cannot run that path in this process either, so nothing goes unguarded.
    unavailable: bool = False

    def to_json(self) -> dict:
        return {"name": self.point.name, "target": self.point.target, "found": self.found,
                "problem": self.problem, "signature": self.signature, "unavailable": self.unavailable}


def resolve(target: str):
    """The object at a dotted path (imports its module), as HookRegistry resolves it. A module
    whose own import fails raises that error (pkgutil.resolve_name would hide it behind an
    AttributeError)."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name or name.startswith(f"{e.name}."):
                continue  # `name` itself is not a module: try a shorter prefix
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module in {target}", name=parts[0])


def check_point(point: HookPoint) -> HookStatus:
    try:
        obj = resolve(point.target)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("sglang"):
            return HookStatus(point, False, f"needs {e.name}, not installed here (sglang cannot run "
                                            "this path here either)", unavailable=True)
        return HookStatus(point, False, f"ModuleNotFoundError: {e}")
    except Exception as e:  # ImportError, AttributeError, anything an import can raise
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ModuleNotFoundError) and cause.name and not cause.name.startswith("sglang"):
            return HookStatus(point, False, f"needs {cause.name}, not installed here (sglang cannot run "
                                            "this path here either)", unavailable=True)
        return HookStatus(point, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if obj is None or not callable(obj):
        return HookStatus(point, False, f"not callable ({type(obj).__name__})")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return HookStatus(point, True, None, None)
    missing = [p for p in point.params if p not in sig.parameters]
    if missing:
        return HookStatus(point, False, f"signature changed: no argument(s) {missing}", str(sig))
    return HookStatus(point, True, None, str(sig))


@dataclass
class RenormSite:
    module: str
    bound: dict[str, str] = field(default_factory=dict)  # name -> what it is bound to
    problem: str | None = None

    def to_json(self) -> dict:
        return {"module": self.module, "bound": self.bound, "problem": self.problem}


def is_lazy_import(value) -> bool:
    """sglang's LazyImport: any attribute read on it imports its module, so never probe one."""
    return type(value).__name__ == "LazyImport" and "module_name" in vars(value)


def describe_binding(value) -> str:
    if value is None:
        return "None (no kernel on this platform: torch fallback)"
    if is_lazy_import(value):
        return f"{vars(value)['module_name']}.{vars(value)['class_name']} (lazy)"
    attrs = vars(value) if hasattr(value, "__dict__") else {}
    if attrs.get("__tpguard_renorm__"):
        return f"tpguard:{attrs['__tpguard_renorm__']}"
    mod = attrs.get("__module__") or getattr(value, "__module__", None) or type(value).__module__
    name = getattr(value, "__qualname__", None) or type(value).__name__
    return f"{mod}.{name}"


def renorm_sites() -> list[RenormSite]:
    sites = []
    for mod_name in RENORM_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:
            sites.append(RenormSite(mod_name, problem=f"{type(e).__name__}: {e}"))
            continue
        bound = {n: (describe_binding(getattr(mod, n)) if hasattr(mod, n) else "absent (not imported here)")
                 for n in RENORM_NAMES}
        sites.append(RenormSite(mod_name, bound))
    return sites


@dataclass
class Discovery:
    versions: dict[str, str | None]
    version_problem: str | None
    hooks: list[HookStatus]
    renorm: list[RenormSite]
    group_getter_found: bool

    @property
    def missing(self) -> list[HookStatus]:
        return [h for h in self.hooks if not h.found and not h.unavailable]

    def to_json(self) -> dict:
        return {"versions": self.versions, "version_problem": self.version_problem,
                "hooks": [h.to_json() for h in self.hooks], "renorm": [r.to_json() for r in self.renorm],
                "group_getter_found": self.group_getter_found}


def discover() -> Discovery:
    """Versions, and for every hook point whether it was found (imports sglang: seconds)."""
    v = versions()
    problem = version_problem(v["sglang"])
    if v["sglang"] is None:
        hooks = [HookStatus(p, False, "sglang not installed") for p in HOOK_POINTS]
        return Discovery(v, problem, hooks, [], False)
    hooks = [check_point(p) for p in HOOK_POINTS]
    try:
        resolve(GROUP_GETTER)
        group_ok = True
    except Exception:
        group_ok = False
    return Discovery(v, problem, hooks, renorm_sites(), group_ok)
