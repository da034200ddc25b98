"""tpguard's sglang plugin: entry point `register()` in group `sglang.srt.plugins`.

sglang 0.5.23 calls `load_plugins()` first thing in every scheduler/TP process (and honours
`SGLANG_PLUGINS`); that calls `register()`, then `HookRegistry.apply_hooks()` patches every target
and every `from X import Y` binding of it. With TPGUARD unset or `off`, `register()` returns at
once: no hook, no import, no collective.

Environment (tpguard.config.GuardConfig): TPGUARD=off|on|audit, TPGUARD_TRACE_DIR, TPGUARD_EVERY,
TPGUARD_ON_DIVERGENCE=record|heal|abort, TPGUARD_RENORM=default|deterministic|tpguard|flashinfer-det|torch
(tpguard/renorm_words.py), TPGUARD_DUMP,
TPGUARD_TIMEOUT, TPGUARD_QUANTITIES=full|decisions, TPGUARD_SAMPLE, TPGUARD_MERGED,
TPGUARD_RUN_ID (set by `tpguard serve`: one run id for every process of a server),
TPGUARD_RENORM_BACKEND (older spelling of TPGUARD_RENORM=NAME), TPGUARD_ALL_PROCESSES=1 (hook processes other
than sglang's schedulers too: scripts that call sglang's functions directly), TPGUARD_GUARD=auto|sync|device
(auto: the no-host-sync DeviceStepGuard on NCCL groups with policy record/abort).
"""

from __future__ import annotations

import importlib.util
import logging
import sys

from tpguard.config import GuardConfig
from tpguard.hooks import sglang_runtime

logger = logging.getLogger("tpguard.sglang")


def register() -> None:
    """Install tpguard's hooks through sglang's HookRegistry (AROUND hooks), if TPGUARD is on."""
    try:
        config = GuardConfig.from_env()
    except ValueError as e:  # a bad TPGUARD_* value: one line, and sglang runs unguarded
        logger.error("%s; tpguard is NOT active in this process", e)
        return
    if not config.enabled:
        return
    if sglang_runtime.RUNTIME is not None:  # load_plugins() is once per process; be safe anyway
        return
    if not in_tp_worker() and not config.all_processes:
        # The engine, DP controller, tokenizer and detokenizer also call load_plugins(); only
        # scheduler (TP worker) processes run verify steps, and hooking elsewhere would import
        # the model stack.
        logger.debug("tpguard: not a scheduler process; no hooks here")
        return
    if config.trace_dir:
        from tpguard.config import trace_dir_problem

        problem = trace_dir_problem(config.trace_dir)
        if problem:  # found now, not at the first verify step inside sglang's scheduler
            logger.error("tpguard: %s; traces are NOT written (divergences still reach the log and "
                         "the metrics)", problem)
            config.trace_dir = None
    install(config)


SCHEDULER_ENTRY = ("sglang.srt.managers.scheduler", "run_scheduler_process")


def in_tp_worker() -> bool:
    """A scheduler (TP worker) process: `load_plugins()` is called from sglang's
    `run_scheduler_process`, the first thing a scheduler process runs. The engine's main
    process and the DP controller import the scheduler module too, and call `load_plugins()`
    from elsewhere (`Engine.__init__`, `run_data_parallel_controller_process`)."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == SCHEDULER_ENTRY[1]
                and frame.f_globals.get("__name__") == SCHEDULER_ENTRY[0]):
            return True
        frame = frame.f_back
    return False


def install(config: GuardConfig):
    """Register the hooks and routes for `config` (enabled); returns the plugin's Runtime."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from tpguard.hooks import sglang_compat, sglang_renorm

    versions = sglang_compat.versions()
    problem = sglang_compat.version_problem(versions["sglang"])
    if problem:
        logger.warning("tpguard: %s", problem)
    from tpguard.hooks import sglang_sites

    rt = sglang_runtime.Runtime(config, versions=versions)
    sglang_runtime.RUNTIME = rt

    for point in sglang_compat.HOOK_POINTS:
        status = sglang_compat.check_point(point)
        if status.unavailable:  # e.g. UNO without flashinfer: sglang cannot run it here either
            logger.info("tpguard: hook point %s: %s", point.name, status.problem)
            continue
        if not status.found:
            rt.hooks_missing.append(point.name)
            logger.warning("tpguard: hook point %s (%s) not found: %s; that site is NOT guarded",
                           point.name, point.target, status.problem)
            continue
        HookRegistry.register(point.target, sglang_sites.HOOKS[point.name], HookType.AROUND)
        rt.hooks_installed.append(point.name)

    if config.renorm_choice != "default":
        # TPGUARD_RENORM=deterministic (the first available) or tpguard|flashinfer-det|torch (that one where
        # it runs): tpguard/renorm_registry.py
        routing = sglang_renorm.route(config.renorm_choice, on_output=rt.on_renorm_output)
        rt.renorm_backend = routing.backend
        rt.renorm_routing = routing
        logger.info("tpguard: renorm routed to deterministic kernels (%s) at %s", routing.backend,
                    ", ".join(sglang_compat.RENORM_MODULES))
    else:
        # Keep sglang's kernels; wrap the ones that exist so their result is the step's target_probs.
        # (None bindings stay None: HookRegistry cannot wrap None safely.)
        seen: set[int] = set()
        for target in renorm_targets():
            obj = sglang_compat.resolve(target)
            if obj is None or id(obj) in seen:
                continue
            if sglang_compat.is_lazy_import(obj) and importlib.util.find_spec(
                    vars(obj)["module_name"].split(".")[0]) is None:
                continue  # its kernel package is absent: wrapping would import it and fail
            seen.add(id(obj))
            HookRegistry.register(target, sglang_sites.hook_renorm_output, HookType.AROUND)
    logger.info("tpguard: %s mode, policy %s, hooks on %s%s", config.mode, rt.policy,
                ", ".join(rt.hooks_installed) or "nothing",
                f"; missing: {', '.join(rt.hooks_missing)}" if rt.hooks_missing else "")
    if "dspark.accept_and_finalize" in rt.hooks_installed and (rt.audit or rt.policy in ("heal", "fix")):
        logger.warning("tpguard: %s", sglang_sites.FOLDED_NOTE)
    if rt.policy == "fix":
        logger.warning("tpguard: policy fix: a renorm switch rebinds sglang's renorm call sites; a renorm "
                       "captured inside a CUDA graph keeps its kernels until sglang captures again (heal "
                       "goes on there)")
    return rt


def renorm_targets() -> list[str]:
    import importlib

    from tpguard.hooks.sglang_compat import RENORM_MODULES, RENORM_NAMES

    out = []
    for mod_name in RENORM_MODULES:
        try:
            module = importlib.import_module(mod_name)
        except Exception:
            continue
        out += [f"{mod_name}.{n}" for n in RENORM_NAMES if getattr(module, n, None) is not None]
    return out


def stats() -> dict:
    """Per-site guard counters of this process ({} when the plugin is off)."""
    rt = sglang_runtime.RUNTIME
    return rt.stats() if rt is not None else {}
