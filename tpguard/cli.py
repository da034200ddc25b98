"""The `tpguard` command: one typer app; each command's work lives in tpguard/commands/.

Exit codes (tpguard/errors.py, one table in docs/exit-codes.md): 0 ok/clean, 1 diverged, 2 bad
input or arguments (one line on stderr, never a traceback), 3 aborted on divergence, 4 rank
timeout, 5 internal error (a tpguard bug: one line; TPGUARD_DEBUG=1 shows the traceback), 6 a rank
died, 7 diagnose: nothing compared, 130 / 143 SIGINT / SIGTERM. `python -m tpguard` runs main()
too (tpguard/__main__.py).
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

try:  # typer >= 0.20 vendors click as typer._click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as click_exc

from tpguard.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, TPGuardError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Find and fix tensor-parallel rank divergence in speculative decoding.",
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print numbers (GPU where present).")
app.add_typer(bench_app, name="bench")

PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}
# launch/demo/serve/bench pass --help on to the program they run
PASSTHROUGH_HELP = {**PASSTHROUGH, "help_option_names": []}


@app.command()
def diagnose(
    paths: List[str] = typer.Argument(..., help="trace files or directories (per-rank, merged, mixed; .gz/.zst too)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
    run: Optional[str] = typer.Option(None, "--run", help="the run to read when the files hold several"),
    html: Optional[str] = typer.Option(None, "--html", help="also write a self-contained HTML report "
                                       "(replaces only an earlier report)"),
):
    """Name the first divergence in traces: step, site, quantity, culprit rank, cause and fix.

    Exit 0 clean, 1 diverged, 7 nothing compared, 2 unusable input (docs/exit-codes.md)."""
    from tpguard.commands.diagnose import run_diagnose

    raise typer.Exit(run_diagnose(paths, as_json=json_out, run=run, html_path=html))


@app.command()
def replay(
    paths: List[str] = typer.Argument(..., help="trace directories (their dumps/), dump folders or dump files"),
    run: Optional[str] = typer.Option(None, "--run", help="the run, when the dumps hold several"),
    step: Optional[int] = typer.Option(None, "--step", help="the step (default: the first dumped one)"),
    site: Optional[str] = typer.Option(None, "--site", help="the site, when a step has dumps of several"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda (default: the run's, if here)"),
    calls: int = typer.Option(100, "--calls", help="calls of the re-run stage per backend"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
):
    """Re-run a divergent step from its dumps: tensor diff, the stage re-run, cause and fix confirmed."""
    from tpguard.commands.replay import run_replay

    if device is not None and device not in ("cpu", "cuda"):
        raise click_exc.BadParameter(f"must be cpu or cuda, got {device!r}", param_hint="'--device'")
    if calls < 1:
        raise click_exc.BadParameter(f"must be >= 1, got {calls}", param_hint="'--calls'")
    if step is not None and step < 0:
        raise click_exc.BadParameter(f"must be >= 0, got {step}", param_hint="'--step'")
    raise typer.Exit(run_replay(paths, run=run, step=step, site=site, device=device, calls=calls,
                                as_json=json_out))


@app.command(context_settings=PASSTHROUGH_HELP)
def launch(ctx: typer.Context,
           nproc_per_node: int = typer.Option(2, "--nproc-per-node", help="ranks to start")):
    """Run the TP harness on N local ranks, as torchrun --standalone would (options: docs/harness.md)."""
    from tpguard.launch.runner import launch_ranks

    raise typer.Exit(launch_ranks(nproc_per_node, list(ctx.args)))


@app.command(context_settings=PASSTHROUGH_HELP)
def demo(ctx: typer.Context):
    """The README demo: divergence caught and named, diagnosed, then fixed two ways (CPU, 2 ranks)."""
    from tpguard.launch.demo import run_demo

    raise typer.Exit(run_demo(list(ctx.args)))


@app.command()
def determinism(
    calls: int = typer.Option(20, "--calls", help="repeated calls per kernel on identical input"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    rows: int = typer.Option(0, "--rows", help="rows per input (0: a default for the device)"),
    vocab: int = typer.Option(0, "--vocab", help="vocabulary size (0: a default for the device)"),
):
    """Determinism and batch-invariance table of every renorm/sampling kernel found here."""
    from tpguard.determinism import main as determinism_main

    if device not in ("auto", "cpu", "cuda"):
        raise click_exc.BadParameter(f"must be auto, cpu or cuda, got {device!r}", param_hint="'--device'")
    for name, value in (("--rows", rows), ("--vocab", vocab)):
        if value < 0:
            raise click_exc.BadParameter(f"must be >= 0 (0: a default for the device), got {value}",
                                         param_hint=f"'{name}'")
    if 0 < vocab < 2:
        raise click_exc.BadParameter(f"must be >= 2, got {vocab}", param_hint="'--vocab'")
    kwargs = {"n_calls": calls, "device": device}
    if rows:
        kwargs["rows"] = rows
    if vocab:
        kwargs["vocab"] = vocab
    raise typer.Exit(determinism_main(**kwargs) or 0)


# `tpguard audit`: the command's earlier name (TPGUARD=audit is the guard's mode; the table is "determinism")
app.command("audit", hidden=True)(determinism)


@app.command()
def doctor(json_out: bool = typer.Option(False, "--json", help="print one JSON object")):
    """Installed sglang/flashinfer/torch versions and which hook points tpguard found."""
    from tpguard.commands.doctor import doctor as doctor_main

    raise typer.Exit(doctor_main(as_json=json_out))


@app.command(context_settings=PASSTHROUGH)
def serve(
    ctx: typer.Context,
    mode: str = typer.Option("on", "--mode", help="on | audit | off"),
    trace_dir: Optional[str] = typer.Option(None, "--trace-dir"),
    every: int = typer.Option(1, "--every", help="check every N verify steps"),
    on_divergence: str = typer.Option("record", "--on-divergence", help="record | heal | abort | fix"),
    renorm: str = typer.Option("default", "--renorm",
                               help="default | deterministic | tpguard | flashinfer-det | torch (TPGUARD_RENORM)"),
    dump: bool = typer.Option(False, "--dump"),
):
    """Run an SGLang launch command with the tpguard plugin enabled: tpguard serve -- python -m sglang..."""
    from tpguard.commands.serve import serve as serve_main

    raise typer.Exit(serve_main(list(ctx.args), mode=mode, trace_dir=trace_dir, every=every,
                                on_divergence=on_divergence, renorm=renorm, dump=dump))


@bench_app.command("kernels", context_settings=PASSTHROUGH_HELP)
def bench_kernels(ctx: typer.Context):
    """Renorm kernels: tpguard vs flashinfer (default, deterministic) vs torch (docs/benchmarks.md)."""
    from tpguard.bench.kernels import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)) or 0)


@bench_app.command("fingerprint", context_settings=PASSTHROUGH_HELP)
def bench_fingerprint(ctx: typer.Context):
    """Fingerprint kernel throughput and the guard's per-step fingerprint cost."""
    from tpguard.bench.fingerprint import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)) or 0)


@bench_app.command("guard", context_settings=PASSTHROUGH_HELP)
def bench_guard(ctx: typer.Context):
    """Guard cost per verify step, guard off vs on, in one process (and fused heal vs broadcasts)."""
    from tpguard.bench.guard import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)) or 0)


@bench_app.command("diagnose", context_settings=PASSTHROUGH_HELP)
def bench_diagnose(ctx: typer.Context):
    """Diagnose throughput on a generated long trace (1,000,000 steps x 2 ranks by default)."""
    from tpguard.bench.diagnose import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)) or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point: usage errors and tpguard errors become one line on stderr and exit code 2."""
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="tpguard")
        return int(rv or 0)
    except typer.Exit as e:
        return int(e.exit_code)
    except typer.Abort:
        print("tpguard: aborted", file=sys.stderr)
        return 130
    except click_exc.NoArgsIsHelpError:
        return 0  # help was printed
    except click_exc.ClickException as e:  # usage errors included
        print(f"tpguard: error: {e.format_message()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TPGuardError as e:
        print(f"tpguard: {e}", file=sys.stderr)
        return e.exit_code
    except ModuleNotFoundError as e:
        print(f"tpguard: error: a component is not installed ({e.name})", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("tpguard: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a path the user gave that cannot be read or written
        where = f"{e.filename}: " if e.filename else ""
        print(f"tpguard: error: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - a bug must not look like exit 1 ("diverged")
        if os.environ.get("TPGUARD_DEBUG"):
            raise
        msg = " ".join(str(e).split())[:300]
        print(f"tpguard: internal error: {type(e).__name__}: {msg} (a tpguard bug; "
              "rerun with TPGUARD_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
