"""`tpguard demo`: the README's main command. CPU, gloo, 2 ranks, well under a minute.

1. flashinfer-style renorm (emulated float atomics), top_p 0.9, flat logits, guard with policy
   abort: the first divergence is caught and named, every rank stops with exit code 3;
2. `tpguard diagnose` on that trace;
3. the fix in flight: the same run with policy fix: the first divergence is caught, named and
   healed, the renorm is switched to tpguard's deterministic kernels on every rank at that step,
   and no later step diverges;
4. the same run with flashinfer's kernel kept and policy heal: every divergence healed by a
   rank-0 broadcast of the decisions (a planted bonus-token flip included: real flips are rare),
   outputs identical on both ranks;
5. (unless --skip-hang) why it matters: one flipped bonus token on rank 1 and no guard; a few
   steps later the ranks issue different collectives and wedge; the harness's deadline ends it
   and names the rank (exit code 4).

Each part is `python -m tpguard.launch ...` on 2 ranks with torchrun's environment (the command is
printed); the ranks come from a forkserver that imports torch once, to keep start-up short.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from tpguard.errors import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_OK, EXIT_TIMEOUT

BASE = ["--logits", "flat", "--top-p", "0.9", "--no-progress"]


def _indent(text: str, prefix: str = "    ") -> str:
    keep = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln and "return func(" not in ln]
    return textwrap.indent("\n".join(keep), prefix)


PARTS = ("1-atomic-abort", "3-atomic-fix", "4-atomic-heal", "5-no-guard-hang")


def _check(steps: int, out: str | None, timeout: float) -> None:
    from tpguard.config import trace_dir_problem
    from tpguard.launch.options import OptionsError

    if steps < 1:
        raise OptionsError("--steps must be >= 1")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise OptionsError(f"--timeout must be > 0 seconds and finite, got {timeout}")
    if out:
        problem = trace_dir_problem(out)
        if problem:
            raise OptionsError(f"--out: {problem}")
        # An earlier demo's traces there would make part 2 see two runs; never delete them.
        used = [name for name in PARTS if (Path(out) / name).is_dir() and any((Path(out) / name).iterdir())]
        if used:
            raise OptionsError(f"--out {out} already holds a demo's traces ({', '.join(used)}): "
                               "choose a new or empty directory")


def _one_switch(trace_dir: Path) -> int | None:
    """The step of the run's one switch, if it was the run's only divergence (clean after it)."""
    from tpguard.diagnose import diagnose

    try:
        j = diagnose([trace_dir]).to_json()
    except Exception:  # noqa: BLE001 - the expectation fails with what was seen
        return None
    switches = j["switches"]
    if len(switches) != 1 or j["divergent_steps"] != 1:
        return None
    return switches[0]["step"]


class Demo:
    def __init__(self, out: Path, started: float):
        self.out, self.t0 = out, started
        self.ok = True

    def part(self, n: int, total: int, title: str) -> None:
        print(f"\n[{n}/{total}] {title}", flush=True)

    def run(self, name: str, args: list[str]) -> tuple[list[int | None], str, float]:
        from tpguard.launch.spawn import spawn_ranks

        argv = list(args) if "--no-guard" in args else [*args, "--trace", str(self.out / name)]
        print("    $ torchrun --nproc-per-node 2 -m tpguard.launch " + " ".join(a for a in argv if a != "--no-progress"),
              flush=True)
        t = time.monotonic()
        res = spawn_ranks(argv, 2, timeout=120, capture=True)
        took = time.monotonic() - t
        print(_indent(res.outputs[0]), flush=True)
        return res.exit_codes, res.outputs[1], took

    def expect(self, cond: bool, good: str, bad: str) -> None:
        self.ok &= cond
        print(f"    -> {good if cond else 'UNEXPECTED: ' + bad}", flush=True)


def run_demo(steps: int = 60, out: str | None = None, skip_hang: bool = False, timeout: float = 4.0) -> int:
    """`tpguard demo` (its options: tpguard/cli.py); returns the exit code."""
    from tpguard.launch.options import OptionsError

    try:
        _check(steps, out, timeout)
    except OptionsError as e:
        print(f"tpguard demo: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    keep = bool(out)  # else a temporary directory, removed at the end
    started = time.monotonic()
    out = Path(out) if keep else Path(tempfile.mkdtemp(prefix="tpguard-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    demo = Demo(out, started)
    total = 4 if skip_hang else 5
    print("tpguard demo: 2 ranks on CPU (gloo), DFlash verify of 8 requests x 4 tokens, vocab 4096, "
          "flat logits, top_p 0.9.\nThe renorm adds floats in a random order on each call, as flashinfer's "
          "default multi-CTA kernels do with atomicAdd.")

    demo.part(1, total, "flashinfer-style renorm (emulated float atomics), guard on, policy abort")
    codes, _, took = demo.run("1-atomic-abort", ["--renorm", "emulated-atomic", *BASE, "--steps", str(steps),
                                                 "--on-divergence", "abort"])
    demo.expect(codes == [EXIT_ABORTED] * 2,
                f"caught and named at once; both ranks stopped with exit code 3 ({took:.1f} s)",
                f"exit codes {codes}")

    demo.part(2, total, "tpguard diagnose on that trace")
    print(f"    $ tpguard diagnose {out / '1-atomic-abort'}")
    from tpguard.diagnose import diagnose, render_text
    from tpguard.errors import TPGuardError

    try:
        print(_indent(render_text(diagnose([out / "1-atomic-abort"]))), flush=True)
    except TPGuardError as e:
        demo.expect(False, "", str(e))

    demo.part(3, total, "the fix, in flight: policy fix heals the first divergence and switches its cause off\n"
              "      (the renorm becomes tpguard's deterministic kernels on every rank at that step)")
    codes, _, took = demo.run("3-atomic-fix", ["--renorm", "emulated-atomic", *BASE, "--steps", str(steps),
                                               "--on-divergence", "fix"])
    switched = _one_switch(out / "3-atomic-fix")
    demo.expect(codes == [EXIT_OK] * 2 and switched is not None,
                f"caught, named and healed at step {switched}, switched at that step on both ranks, no divergence "
                f"after it; outputs identical ({took:.1f} s)", f"exit codes {codes}, switch at {switched}")

    demo.part(4, total, "the fix, other way: keep the fast kernel, heal (rank-0 broadcast of the decisions);\n"
              "      a decision flip is rare, so one is planted: rank 1's bonus token at step 3")
    flip = min(3, steps - 1)
    codes, _, took = demo.run("4-atomic-heal", ["--renorm", "emulated-atomic", *BASE, "--steps", str(steps),
                                                "--on-divergence", "heal", "--inject", f"bonus@{flip}:1"])
    demo.expect(codes == [EXIT_OK] * 2, f"every divergence healed, the flip included; outputs identical on both "
                f"ranks ({took:.1f} s)", f"exit codes {codes}")

    if not skip_hang:
        demo.part(5, total, "why it matters: the same flip without a guard (mixed logits, so acceptance "
                  "lengths follow the tokens)")
        codes, _, took = demo.run("5-no-guard-hang", ["--renorm", "deterministic", "--no-progress", "--steps", "40",
                                                      "--inject", "bonus@3:1", "--no-guard",
                                                      "--timeout", f"{timeout:g}"])
        demo.expect(codes == [EXIT_TIMEOUT] * 2,
                    f"the ranks' states drifted and they wedged in a collective; the deadline named the rank "
                    f"and ended both with exit code 4 ({took:.1f} s; with the guard it is named at step 3)",
                    f"exit codes {codes}")

    print(f"\ntraces: {out}" if keep else "\ntraces: written to a temporary directory, now removed (--out DIR keeps them)")
    print(f"demo {'done' if demo.ok else 'FAILED'} in {time.monotonic() - started:.1f} s")
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return EXIT_OK if demo.ok else 1
