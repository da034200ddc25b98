"""The `tpguard` command: one typer app declaring every command's options (the harness's are in
launch/options.py); the work lives in tpguard/commands/, launch/, tpguard/bench/ and tpguard/determinism.py.
`python -m tpguard.launch` (a rank) and `python -m tpguard.bench.*` parse with the same declarations.

Exit codes (tpguard/errors.py, one table in docs/exit-codes.md): 0 ok/clean, 1 diverged, 2 bad
input or arguments (one line on stderr, never a traceback), 3 aborted on divergence, 4 rank
timeout, 5 internal error (a tpguard bug: one line; TPGUARD_DEBUG=1 shows the traceback), 6 a rank
died, 7 diagnose: nothing compared, 130 / 143 SIGINT / SIGTERM. `python -m tpguard` runs main()
too (tpguard/__main__.py).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import List, Optional

import typer

try:  # typer >= 0.20 vendors click as typer._click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as click_exc

from tpguard.cli_types import comma_list, one_of
from tpguard.config import debug
from tpguard.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_SIGINT, TPGuardError
from tpguard.launch.options import HarnessOptions, with_harness_options

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Find and fix tensor-parallel rank divergence in speculative decoding.",
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print numbers (GPU where present).")
app.add_typer(bench_app, name="bench")

# serve passes what follows its options on to the command it runs
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


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
    from tpguard.replay import MAX_CALLS

    if device is not None and device not in ("cpu", "cuda"):
        raise click_exc.BadParameter(f"must be cpu or cuda, got {device!r}", param_hint="'--device'")
    if not 1 <= calls <= MAX_CALLS:
        raise click_exc.BadParameter(f"must be in [1, {MAX_CALLS}], got {calls}", param_hint="'--calls'")
    if step is not None and step < 0:
        raise click_exc.BadParameter(f"must be >= 0, got {step}", param_hint="'--step'")
    raise typer.Exit(run_replay(paths, run=run, step=step, site=site, device=device, calls=calls,
                                as_json=json_out))


@app.command()
@with_harness_options
def launch(harness: HarnessOptions,
           nproc_per_node: int = typer.Option(2, "--nproc-per-node", help="ranks to start")):
    """Run the TP harness on N local ranks, as torchrun --standalone would (options: docs/harness.md)."""
    from tpguard.launch.runner import launch_ranks

    raise typer.Exit(launch_ranks(nproc_per_node, harness))


@app.command()
def demo(
    steps: int = typer.Option(60, "--steps", help="steps of the fixed runs"),
    out: Optional[str] = typer.Option(None, "--out", help="keep the traces in this directory (default: a temporary one)"),
    skip_hang: bool = typer.Option(False, "--skip-hang", help="skip part 5 (the hang without a guard)"),
    timeout: float = typer.Option(4.0, "--timeout", help="deadline of part 5's waits, seconds"),
):
    """The README demo: divergence caught and named, diagnosed, then fixed two ways (CPU, 2 ranks)."""
    from tpguard.commands.demo import run_demo

    raise typer.Exit(run_demo(steps=steps, out=out, skip_hang=skip_hang, timeout=timeout))


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


@bench_app.command("kernels")
def bench_kernels(
    rows: int = typer.Option(256, "--rows", help="rows of the main table"),
    vocabs: Optional[str] = typer.Option(None, "--vocabs", callback=comma_list(int), show_default=False,
                                         help="vocabulary sizes, comma-separated (default 128256,163840; with "
                                              "--grid 32000,128256,163840,262144)"),
    logits: str = typer.Option("flat,peaky", "--logits", callback=comma_list(), help="flat and/or peaky"),
    iters: int = typer.Option(50, "--iters", help="timed calls per cell"),
    repeats: Optional[int] = typer.Option(None, "--repeats", show_default=False,
                                          help="repeated calls compared bit for bit (default 200; with --grid 10)"),
    top_p: float = typer.Option(0.9, "--top-p"),
    top_k: int = typer.Option(40, "--top-k"),
    min_p: float = typer.Option(0.1, "--min-p"),
    batch_sizes: str = typer.Option("1,8,64", "--batch-sizes", callback=comma_list(int)),
    top_ks: str = typer.Option("40,256,1024", "--top-ks", callback=comma_list(int)),
    impls: Optional[str] = typer.Option(None, "--impls", callback=comma_list(), show_default=False,
                                        help="some of tpguard,flashinfer,flashinfer-det,torch (default: all)"),
    ops: Optional[str] = typer.Option(None, "--ops", callback=comma_list(), show_default=False,
                                      help="some of top_p,top_k,top_k_top_p,min_p (default: all)"),
    graphs: bool = typer.Option(False, "--graphs", help="also time CUDA-graph replays in the main table"),
    json_path: Optional[str] = typer.Option(None, "--json", help="also write the results to this file"),
    quick: bool = typer.Option(False, "--quick", help="fewer iterations and repeats"),
    host_profile: bool = typer.Option(False, "--host-profile", help="only: host time of eager tpguard calls at "
                                      "1 row and a cProfile of them (where eager time goes)"),
    grid: bool = typer.Option(False, "--grid", help="only: the grid (rows x vocab x logits x dtype), tpguard vs "
                              "flashinfer, and the fused logits -> target probs kernel vs softmax + renorms"),
    grid_rows: Optional[str] = typer.Option(None, "--grid-rows", callback=comma_list(int), show_default=False,
                                            help="rows of --grid (default 1,8,64,256,1024)"),
    dtypes: Optional[str] = typer.Option(None, "--dtypes", callback=comma_list(), show_default=False,
                                         help="dtypes of --grid (default fp32,bf16)"),
    no_fused: bool = typer.Option(False, "--no-fused", help="--grid without the logits -> target probs table"),
    configs: Optional[str] = typer.Option(None, "--configs", metavar="A|B|...", show_default=False,
                                          help="only: tpguard's --ops (default top_p) under these RenormConfig "
                                               "overrides ('|'-separated, '' the defaults), us from a CUDA graph, "
                                               "bits checked against the first (--grid-rows, --vocabs default "
                                               "32000, --logits, --dtypes)"),
):
    """Renorm kernels: tpguard vs flashinfer (default, deterministic) vs torch (docs/benchmarks.md)."""
    from tpguard.bench import kernels

    raise typer.Exit(kernels.main(**kernels.run_options(
        rows=rows, vocabs=vocabs, logits=logits, iters=iters, repeats=repeats, top_p=top_p, top_k=top_k,
        min_p=min_p, batch_sizes=batch_sizes, top_ks=top_ks, impls=impls, ops=ops, graphs=graphs,
        json_path=json_path, quick=quick, host_profile=host_profile, grid=grid, grid_rows=grid_rows,
        dtypes=dtypes, no_fused=no_fused, configs=None if configs is None else configs.split("|"))) or 0)


@bench_app.command("fingerprint")
def bench_fingerprint(
    iters: int = typer.Option(50, "--iters", help="timed calls per measurement (median)"),
    shapes: str = typer.Option("all", "--shapes", callback=one_of("all", "main"), help="all | main"),
    sweep: bool = typer.Option(False, "--sweep", help="also time tiling configs on the main shape"),
    sweep_budget: float = typer.Option(30.0, "--sweep-budget", metavar="S", help="seconds the sweep may spend "
                                       "on the main shape (the full set gets 10 more)"),
    sweep_configs: Optional[str] = typer.Option(None, "--sweep-configs", metavar="A|B|...", help="sweep these "
                                                "KernelConfig overrides ('|'-separated, '' the defaults) instead "
                                                "of the list"),
    full_set_configs: Optional[str] = typer.Option(None, "--full-set-configs", metavar="A|B|...", help="with "
                                                   "--sweep: sweep these whole KernelConfig overrides on the "
                                                   "guard's full set instead of the 3 fastest and FULL_SET_CONFIGS "
                                                   "x long-row variants"),
    check: bool = typer.Option(True, "--check/--no-check", help="check bit for bit against the numpy reference "
                               "(--no-check skips it)"),
):
    """Fingerprint kernel throughput and the guard's per-step fingerprint cost."""
    from tpguard.bench.fingerprint import main as bench_main

    raise typer.Exit(bench_main(iters=iters, shapes=shapes, sweep=sweep, sweep_budget=sweep_budget,
                                sweep_configs=sweep_configs, full_set_configs=full_set_configs, check=check) or 0)


@bench_app.command("guard")
def bench_guard(
    bs: int = typer.Option(32, "--bs", help="requests per step"),
    draft_tokens: int = typer.Option(8, "--draft-tokens", help="verify positions per request"),
    vocab: int = typer.Option(163840, "--vocab", help="vocabulary size"),
    iters: int = typer.Option(50, "--iters", help="timed calls per measurement"),
    json_path: Optional[str] = typer.Option(None, "--json", help="also write results to this file"),
    profile: bool = typer.Option(False, "--profile", help="also print where the host time of an eager guarded "
                                 "step goes (cProfile)"),
    config: str = typer.Option("", "--config", help="KernelConfig overrides for the guard's fingerprints, e.g. "
                               "block_words=2048,num_warps=4,many_long=rows,maxnreg=128 (the sweep's best line of "
                               "`tpguard bench fingerprint --sweep`)"),
    heal_only: bool = typer.Option(False, "--heal-only", help="with 2+ ranks: only the fused heal vs broadcasts "
                                   "comparison (section 3), plus the plain decisions guard timed the same ways"),
    fused_probs: bool = typer.Option(False, "--fused-probs", help="only measure the renorm's write pass with vs "
                                     "without the fused target_probs fingerprint (kernels/renorm_write_fp.py)"),
):
    """Guard cost per verify step, guard off vs on, in one process (and fused heal vs broadcasts)."""
    from tpguard.bench.guard import Options, main as bench_main

    raise typer.Exit(bench_main(Options(bs=bs, draft_tokens=draft_tokens, vocab=vocab, iters=iters,
                                        json=json_path, profile=profile, config=config, heal_only=heal_only,
                                        fused_probs=fused_probs)) or 0)


@bench_app.command("diagnose")
def bench_diagnose(
    steps: int = typer.Option(1_000_000, "--steps", help="steps per rank (>= 20)"),
    ranks: int = typer.Option(2, "--ranks", help="ranks (>= 2)"),
    layout: str = typer.Option("both", "--layout", callback=one_of("compact", "spaced", "both"),
                               help="compact (tpguard's writer), spaced (json.dumps's default separators), or both"),
    directory: Optional[str] = typer.Option(None, "--dir", help="where to write the traces (default: a temp dir)"),
    keep: bool = typer.Option(False, "--keep", help="keep the generated traces"),
):
    """Diagnose throughput on a generated long trace (1,000,000 steps x 2 ranks by default)."""
    from tpguard.bench.diagnose import main as bench_main

    if steps < 20 or ranks < 2:
        raise click_exc.UsageError(f"--steps must be >= 20 and --ranks >= 2, got {steps} and {ranks}")
    raise typer.Exit(bench_main(steps=steps, ranks=ranks, layout=layout, directory=directory, keep=keep) or 0)


_interrupted = threading.Event()


def _on_sigint(signum, frame):
    """Python's own Ctrl-C (KeyboardInterrupt), remembered: typer turns it into a silent 130."""
    _interrupted.set()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point: usage errors and tpguard errors become one line on stderr and exit code 2."""
    _interrupted.clear()
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)  # (commands that handle SIGINT themselves replace it)
    try:
        rv = int(app(args=argv, standalone_mode=False, prog_name="tpguard") or 0)
        if rv == EXIT_SIGINT and _interrupted.is_set():
            print("tpguard: interrupted", file=sys.stderr)
        return rv
    except typer.Exit as e:
        return int(e.exit_code)
    except typer.Abort:
        print("tpguard: aborted", file=sys.stderr)
        return EXIT_SIGINT
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
        return EXIT_SIGINT
    except OSError as e:  # a path the user gave that cannot be read or written
        where = f"{e.filename}: " if e.filename else ""
        print(f"tpguard: error: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - a bug must not look like exit 1 ("diverged")
        if debug():
            raise
        msg = " ".join(str(e).split())[:300]
        print(f"tpguard: internal error: {type(e).__name__}: {msg} (a tpguard bug; "
              "rerun with TPGUARD_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
