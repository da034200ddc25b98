"""`tpguard doctor`: installed versions, and whether each sglang hook point tpguard uses is there.

Exit codes: 0 everything found on a supported sglang; 1 something is missing or unsupported (the
plugin would leave those sites unguarded: named here, never a silent no-op); 2 sglang is not
installed or a TPGUARD_* variable is invalid.
"""

from __future__ import annotations

import logging
import sys
import warnings

import orjson

from tpguard.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK

EXIT_PROBLEMS = EXIT_DIVERGED  # 1: "something needs attention"


def doctor(as_json: bool = False) -> int:
    from tpguard.config import GuardConfig
    from tpguard.hooks import sglang_compat

    env_problem = None
    try:
        config = GuardConfig.from_env()
    except ValueError as e:
        config, env_problem = None, str(e)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # sglang's import-time platform warnings
        try:
            disc = sglang_compat.discover()
        finally:
            logging.disable(logging.NOTSET)
    entry_point = _entry_point()
    backend = _renorm_backend()
    report = disc.to_json()
    report.update({"entry_point": entry_point, "deterministic_renorm_backend": backend,
                   "env": config.__dict__ if config else None, "env_problem": env_problem,
                   "limits": _limits()})
    if as_json:
        print(orjson.dumps(report, default=str, option=orjson.OPT_NON_STR_KEYS).decode())
    else:
        print(_render(disc, entry_point, backend, config, env_problem))
    if disc.versions["sglang"] is None or env_problem:
        return EXIT_BAD_INPUT
    if disc.version_problem or disc.missing or not entry_point or not disc.group_getter_found:
        return EXIT_PROBLEMS
    return EXIT_OK


def _entry_point() -> str | None:
    from importlib.metadata import entry_points

    for ep in entry_points(group="sglang.srt.plugins"):
        if ep.name == "tpguard":
            return ep.value
    return None


def _limits() -> list[str]:
    """What the plugin cannot do at some sites, and the renorm's tie rule: said, not hidden."""
    from tpguard.hooks.sglang_sites import FOLDED_NOTE

    from tpguard import renorm_registry
    from tpguard.config import GuardConfig
    from tpguard.hooks.sglang_renorm import tie_rules

    try:
        config = GuardConfig.from_env()
        routed = renorm_registry.routed_to(config.renorm_choice, renorm_registry.here())
    except ValueError:
        routed = None
    return [FOLDED_NOTE] + [f"tie rule: {line}" for line in tie_rules(routed)]


def _renorm_backend() -> str:
    from tpguard import renorm_registry

    return renorm_registry.pick_deterministic(renorm_registry.here())


def _render(disc, entry_point, backend, config, env_problem) -> str:
    v = disc.versions
    lines = ["tpguard doctor", ""]
    lines += [f"  {name:<11}{v.get(name) or 'not installed'}" for name in ("sglang", "flashinfer", "torch", "triton", "tpguard")]
    lines.append("")
    if disc.version_problem:
        lines += [f"  ! {disc.version_problem}", ""]
    if v["sglang"] is None:
        lines.append("  install: pip install --no-deps sglang==0.5.23 && pip install -r requirements/sglang-cpu.txt")
        return "\n".join(lines)
    lines.append(f"  plugin entry point (sglang.srt.plugins): {entry_point or 'MISSING: reinstall tpguard (pip install -e .)'}")
    lines.append(f"  TP group getter {('found' if disc.group_getter_found else 'MISSING')}: "
                 "sglang.srt.layers.dp_attention.get_dp_tp_group")
    lines += ["", "  hook points:"]
    for h in disc.hooks:
        mark = "ok     " if h.found else "n/a    " if h.unavailable else "MISSING"
        lines.append(f"    {mark} {h.point.name:<28} {h.point.target}")
        if not h.found:
            lines.append(f"            {h.problem}")
    lines += ["", "  renorm call sites (TPGUARD_RENORM=deterministic rebinds these):"]
    for site in disc.renorm:
        if site.problem:
            lines.append(f"    MISSING {site.module}: {site.problem}")
            continue
        for name, what in site.bound.items():
            lines.append(f"    {site.module}.{name}: {what}")
    lines.append(f"  deterministic renorm here would use: {backend}")
    lines += ["", "  limits:"] + [f"    - {line}" for line in _limits()]
    lines.append("")
    if env_problem:
        lines.append(f"  ! {env_problem}")
    elif config is not None:
        state = "OFF (set TPGUARD=on or audit, or use `tpguard serve`)" if not config.enabled else config.mode
        lines.append(f"  TPGUARD: {state}; on divergence: {config.policy}; renorm: {config.renorm_choice}; "
                     f"every: {config.every}; trace dir: {config.trace_dir or '(none)'}")
    missing = [h.point.name for h in disc.missing]
    lines.append("")
    lines.append("  verdict: " + ("ok" if not (missing or disc.version_problem or not entry_point)
                                  else f"{len(missing)} hook point(s) missing; those sites are NOT guarded"
                                  if missing else "see the notes above"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(doctor("--json" in sys.argv))
