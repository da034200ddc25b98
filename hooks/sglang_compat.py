"""Which sglang tpguard supports, and where its hook points are (used by the plugin and `tpguard doctor`).

A hook point is a dotted path that sglang's `HookRegistry` can patch, plus the argument names the
hook reads. `discover()` imports each one's module and checks those names, so a renamed or moved
function is reported as missing or changed instead of being skipped silently.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import pkgutil
from dataclasses import dataclass, field

from tpguard.fingerprint import FORMAT_VERSION

SUPPORTED_SGLANG = ("0.5.23",)


@dataclass(frozen=True)
class HookPoint:
    name: str  # short name, also the key in doctor's table
    target: str  # dotted path for HookRegistry
    params: tuple[str, ...] = ()  # argument names the hook reads (checked against the signature)
    algo: str = ""  # dflash | dspark | eagle | sampler | sync


HOOK_POINTS: tuple[HookPoint, ...] = (
    HookPoint("spec_tp_sync", "sglang.srt.speculative.spec_tp_sync.SpecTpSync.sync",
              ("site", "values"), "sync"),
    HookPoint("dflash.accept_block", "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._accept_block",
              ("candidates", "next_token_logits", "prefix_lens", "target_predict"), "dflash"),
    HookPoint("dflash.sampling_accept",
              "sglang.srt.speculative.dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus",
              ("candidates", "next_token_logits", "uniform_samples", "uniform_samples_for_final_sampling"),
              "dflash"),
    HookPoint("dflash.target_probs", "sglang.srt.speculative.dflash_utils.build_speculative_verify_target_probs",
              ("next_token_logits",), "dflash"),
    HookPoint("dspark.accept_and_finalize",
              "sglang.srt.speculative.dspark_components.dspark_verify.TargetVerifyExecutor.accept_and_finalize",
              ("verify_ids_2d", "target_logits", "prefix_lens"), "dspark"),
    HookPoint("dspark.accept_draft_tokens",
              "sglang.srt.speculative.dspark_components.dspark_verify.accept_draft_tokens",
              ("candidates", "target_logits"), "dspark"),
    HookPoint("dspark.build_accept_outs", "sglang.srt.speculative.dspark_components.dspark_verify.build_accept_outs",
              ("correct_len", "bonus", "cap_trim_lens", "prefix_lens"), "dspark"),
    HookPoint("dspark.accept_sampling_core",
              "sglang.kernels.ops.speculative.dspark.dspark_accept._accept_sampling_core",
              ("candidates", "target_logits", "gamma"), "dspark"),
    HookPoint("eagle.sample", "sglang.srt.speculative.eagle_utils.eagle_sample",
              ("verify_input", "batch", "logits_output"), "eagle"),
    HookPoint("eagle.verify_coins", "sglang.srt.speculative.eagle_utils._verify_coins",
              ("seq_lens", "candidates"), "eagle"),
    HookPoint("sampler.forward", "sglang.srt.layers.sampler.Sampler.forward",
              ("logits_output", "sampling_info"), "sampler"),
)

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

    def to_json(self) -> dict:
        return {"name": self.point.name, "target": self.point.target, "found": self.found,
                "problem": self.problem, "signature": self.signature}


def resolve(target: str):
    """The object at a dotted path (imports its module), as HookRegistry resolves it."""
    obj_path, attr = target.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(obj_path), attr)


def check_point(point: HookPoint) -> HookStatus:
    try:
        obj = resolve(point.target)
    except Exception as e:  # ImportError, AttributeError, anything an import can raise
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
        return [h for h in self.hooks if not h.found]

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
