"""`tpguard serve [flags] -- <sglang launch command>`: run sglang with tpguard's plugin enabled.

Sets the TPGUARD_* variables from the flags (and one TPGUARD_RUN_ID, so every scheduler/TP
process of the server writes the same run), then replaces itself with the given command. sglang
loads the plugin in each process through its `sglang.srt.plugins` entry point.
"""

from __future__ import annotations

import os
import shutil
import sys

from tpguard.errors import EXIT_BAD_INPUT

USAGE = "usage: tpguard serve [--mode on|audit|off] [...] -- python -m sglang.launch_server --model-path ..."


def serve_env(mode: str = "on", trace_dir: str | None = None, every: int = 1, on_divergence: str = "record",
              renorm: str = "default", dump: bool = False, base: dict | None = None) -> dict:
    """The environment the sglang command runs with; ValueError (one line) on a bad flag."""
    from tpguard.config import GuardConfig
    from tpguard.guard import new_run_id

    env = dict(os.environ if base is None else base)
    if mode != "off" and not trace_dir:
        trace_dir = env.get("TPGUARD_TRACE_DIR") or "tpguard-traces"
    GuardConfig(mode=mode, trace_dir=trace_dir, every=every, policy=on_divergence, renorm=renorm, dump=dump)
    env.update({"TPGUARD": mode, "TPGUARD_EVERY": str(every), "TPGUARD_ON_DIVERGENCE": on_divergence,
                "TPGUARD_RENORM": renorm, "TPGUARD_DUMP": "1" if dump else "0"})
    if trace_dir:
        env["TPGUARD_TRACE_DIR"] = os.path.abspath(trace_dir)
    env.setdefault("TPGUARD_RUN_ID", new_run_id())
    GuardConfig.from_env(env)  # TPGUARD_* inherited from the caller's environment too
    plugins = env.get("SGLANG_PLUGINS", "").strip()
    if plugins and "tpguard" not in [p.strip() for p in plugins.split(",")]:
        env["SGLANG_PLUGINS"] = plugins + ",tpguard"  # a whitelist without us would skip the plugin
    return env


def serve(argv: list[str], mode: str = "on", trace_dir: str | None = None, every: int = 1,
          on_divergence: str = "record", renorm: str = "default", dump: bool = False) -> int:
    """Exec `argv` with the TPGUARD_* environment; returns only on error (exit code)."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print(f"tpguard serve: no command given; {USAGE}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        env = serve_env(mode, trace_dir, every, on_divergence, renorm, dump)
    except ValueError as e:
        print(f"tpguard serve: {str(e).replace('tpguard: ', '')}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from tpguard.config import trace_dir_problem

    problem = trace_dir_problem(env["TPGUARD_TRACE_DIR"]) if mode != "off" and env.get("TPGUARD_TRACE_DIR") else None
    if problem:  # every TP rank would fail to open its trace only once the server is up
        print(f"tpguard serve: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    exe = shutil.which(argv[0], path=env.get("PATH"))
    if exe is None:
        print(f"tpguard serve: command not found: {argv[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if mode != "off":
        print(f"tpguard serve: TPGUARD={mode}, on divergence {on_divergence}, renorm {renorm}, "
              f"trace {env.get('TPGUARD_TRACE_DIR')} (run {env['TPGUARD_RUN_ID']})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(exe, argv, env)
    return 0  # not reached
