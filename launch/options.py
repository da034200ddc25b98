"""The harness's options: one typer declaration, one dataclass, and every check in one place.

`python -m tpguard.launch` (each rank, under torchrun) parses them with `parse_options`; `tpguard
launch` declares the same ones (`with_harness_options`) and hands them to its ranks (`to_argv`).
Bad options are a one-line `OptionsError` (exit code 2 in `python -m tpguard.launch`,
`tpguard launch` and `tpguard demo`), never a traceback. Checks that need the world size
(an injection's rank, world size 1) take it as an argument, so `tpguard launch` can run them
before any process starts. Nothing here imports torch: rejecting bad arguments is instant.
"""

from __future__ import annotations

import functools
import glob
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import List, Optional

import typer
from typer import Option as Opt

try:  # typer >= 0.20 vendors click as typer._click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as click_exc

from tpguard.cli_types import one_of
from tpguard.config import POLICIES
from tpguard.quantities import CANONICAL_ORDER, DECISIONS_MODE
from tpguard.renorm_words import HARNESS_RENORMS, harness_renorm

ALGOS = ("dflash", "eagle")
LOGITS = ("flat", "peaky", "mixed")
RENORMS = HARNESS_RENORMS  # tpguard/renorm_words.py: the words and what each means
DEVICES = ("cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
QUANTITY_SETS = {"full": CANONICAL_ORDER, "decisions": DECISIONS_MODE}
PROG = "python -m tpguard.launch"


class OptionsError(ValueError):
    """A bad harness argument; the message is one line."""


@dataclass(frozen=True)
class Injection:
    """`--inject QUANTITY@STEP:RANK`: perturb QUANTITY on RANK at STEP, minimally."""

    quantity: str
    step: int
    rank: int

    def __str__(self) -> str:
        return f"{self.quantity}@{self.step}:{self.rank}"


@dataclass
class HarnessOptions:
    steps: int = 100
    bs: int = 8
    draft_tokens: int = 4
    vocab: int = 4096
    algo: str = "dflash"
    logits: str = "mixed"
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    mixed_params: bool = False
    renorm: str = "default"
    seed: int = 0
    device: str = "cpu"
    backend: str = "auto"
    trace: str | None = None
    merged: bool = False
    on_divergence: str = "record"
    dump: bool = False
    inject: list[Injection] = field(default_factory=list)
    timeout: float = 30.0
    no_guard: bool = False
    every: int = 1
    quantities: str = "full"
    progress: bool | None = None  # None: on when stderr is a terminal and the run is long
    run_id: str | None = None
    summary_json: str | None = None
    cache_block: int = 8
    quiet: bool = False
    warmup_steps: int = 3

    @property
    def guarded_quantities(self) -> tuple[str, ...]:
        return QUANTITY_SETS[self.quantities]

    def config(self) -> dict:
        """What goes into the trace header's `config`."""
        return {
            "steps": self.steps, "bs": self.bs, "draft_tokens": self.draft_tokens, "vocab": self.vocab,
            "algo": self.algo, "logits": self.logits, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "mixed_params": self.mixed_params, "renorm": self.renorm, "seed": self.seed,
            "device": self.device, "on_divergence": self.on_divergence, "every": self.every,
            "quantities": self.quantities, "inject": [str(i) for i in self.inject],
            "cache_block": self.cache_block, "guard": not self.no_guard,
        }


_INJECT = re.compile(r"^(?P<q>[A-Za-z_][A-Za-z0-9_]*)@(?P<step>-?\d+):(?P<rank>-?\d+)$")


def parse_injection(text: str) -> Injection:
    m = _INJECT.match(text.strip())
    if not m:
        raise OptionsError(f"--inject {text!r}: expected QUANTITY@STEP:RANK, e.g. bonus@5:1")
    q = m.group("q")
    if q not in CANONICAL_ORDER:
        raise OptionsError(f"--inject {text!r}: unknown quantity {q!r} (known: {', '.join(CANONICAL_ORDER)})")
    return Injection(q, int(m.group("step")), int(m.group("rank")))


def _injections(texts: list[str] | None) -> list[Injection]:
    try:
        return [parse_injection(t) for t in texts or ()]
    except OptionsError as e:
        raise typer.BadParameter(str(e).removeprefix("--inject "), param_hint="'--inject'") from None


def _renorm_word(value: str | None) -> str | None:
    """A `--renorm` word in the registry's spelling (old spellings mapped), or a usage error."""
    return None if value is None else one_of(*RENORMS)(harness_renorm(value))


DESCRIPTION = ("tpguard TP harness: a seeded speculative verify workload on N ranks (run under torchrun; "
               "options: docs/harness.md).")
WORKLOAD, SAMPLING, DEVICES_PANEL, GUARD, FAULTS = "workload", "sampling", "devices", "guard", "faults and output"


def harness_options(
    steps: int = Opt(100, "--steps", help="verify steps to run", rich_help_panel=WORKLOAD),
    bs: int = Opt(8, "--bs", help="requests per step", rich_help_panel=WORKLOAD),
    draft_tokens: int = Opt(4, "--draft-tokens", help="verify positions per request, the root token included",
                            rich_help_panel=WORKLOAD),
    vocab: int = Opt(4096, "--vocab", help="vocabulary size", rich_help_panel=WORKLOAD),
    algo: str = Opt("dflash", "--algo", callback=one_of(*ALGOS), help="dflash: chain accept; eagle: tree accept",
                    rich_help_panel=WORKLOAD),
    logits: str = Opt("mixed", "--logits", callback=one_of(*LOGITS),
                      help="target logits entropy: flat, peaky, or mixed per row", rich_help_panel=WORKLOAD),
    seed: int = Opt(0, "--seed", help="workload seed, the same on every rank", rich_help_panel=WORKLOAD),
    cache_block: int = Opt(8, "--cache-block", help="prefix-cache block size in tokens", rich_help_panel=WORKLOAD),
    temperature: float = Opt(1.0, "--temperature", help="> 0", rich_help_panel=SAMPLING),
    top_p: float = Opt(0.9, "--top-p", help="in (0, 1]; 1 disables top-p", rich_help_panel=SAMPLING),
    top_k: int = Opt(0, "--top-k", help="0 disables top-k", rich_help_panel=SAMPLING),
    min_p: float = Opt(0.0, "--min-p", help="in [0, 1); 0 disables min-p", rich_help_panel=SAMPLING),
    mixed_params: bool = Opt(False, "--mixed-params",
                             help="draw temperature/top-p/top-k/min-p per request from a seeded menu",
                             rich_help_panel=SAMPLING),
    renorm: str = Opt("default", "--renorm", callback=_renorm_word,
                      help=f"renorm backend: {' | '.join(RENORMS)} (default: flashinfer's kernels on GPU when "
                           "installed, emulated-atomic otherwise; old spelling: auto; deterministic: the first of "
                           "tpguard, flashinfer-det, torch)", rich_help_panel=SAMPLING),
    device: str = Opt("cpu", "--device", callback=one_of(*DEVICES), help="where the pipeline runs: cpu | cuda",
                      rich_help_panel=DEVICES_PANEL),
    backend: str = Opt("auto", "--backend", callback=one_of(*BACKENDS),
                       help="process group backend: auto (nccl when each rank has its own GPU, else gloo) | gloo "
                            "| nccl", rich_help_panel=DEVICES_PANEL),
    trace: Optional[str] = Opt(None, "--trace", metavar="DIR", help="write per-rank trace files to DIR",
                               rich_help_panel=GUARD),
    merged: bool = Opt(False, "--merged", help="rank 0 also writes a merged trace", rich_help_panel=GUARD),
    on_divergence: str = Opt("record", "--on-divergence", callback=one_of(*POLICIES),
                             help="record, heal (rank-0 broadcast of decisions), abort (exit 3), or fix (heal, then "
                                  "switch the cause off: deterministic renorm or a decision broadcast)",
                             rich_help_panel=GUARD),
    dump: bool = Opt(False, "--dump", help="save each rank's tensors of a divergent step (needs --trace)",
                     rich_help_panel=GUARD),
    no_guard: bool = Opt(False, "--no-guard", help="run without the guard", rich_help_panel=GUARD),
    every: int = Opt(1, "--every", help="check every N steps", rich_help_panel=GUARD),
    quantities: str = Opt("full", "--quantities", callback=one_of(*QUANTITY_SETS),
                          help="full, or decisions (skip the vocab-sized logits and probs)", rich_help_panel=GUARD),
    timeout: float = Opt(30.0, "--timeout",
                         help="seconds any wait (guard or harness collective) may take before exit 4",
                         rich_help_panel=GUARD),
    run_id: Optional[str] = Opt(None, "--run-id", help="run id in the trace (default: generated by rank 0)",
                                rich_help_panel=GUARD),
    inject: List[str] = Opt([], "--inject", metavar="QUANTITY@STEP:RANK",
                            help="perturb QUANTITY on RANK at STEP, minimally (repeatable)", rich_help_panel=FAULTS),
    progress: Optional[bool] = Opt(None, "--progress/--no-progress",
                                   help="progress bar on rank 0 (default: when stderr is a terminal)",
                                   show_default=False, rich_help_panel=FAULTS),
    summary_json: Optional[str] = Opt(None, "--summary-json", metavar="FILE",
                                      help="rank 0 writes the summary as JSON", rich_help_panel=FAULTS),
    quiet: bool = Opt(False, "--quiet", help="no summary text (errors are still printed)", rich_help_panel=FAULTS),
    warmup_steps: int = Opt(3, "--warmup-steps", metavar="N",
                            help="the first N steps (compilation, caches) are timed apart from the steady state "
                                 "(at most half the steps)", rich_help_panel=FAULTS),
) -> HarnessOptions:
    """The harness's options, declared once for typer (`python -m tpguard.launch`, and `tpguard
    launch` through `with_harness_options`); not yet checked (`validate`)."""
    return HarnessOptions(
        steps=steps, bs=bs, draft_tokens=draft_tokens, vocab=vocab, algo=algo, logits=logits,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, mixed_params=mixed_params,
        renorm=renorm, seed=seed, device=device, backend=backend, trace=trace, merged=merged,
        on_divergence=on_divergence, dump=dump, inject=_injections(inject), timeout=timeout, no_guard=no_guard,
        every=every, quantities=quantities, progress=progress, run_id=run_id, summary_json=summary_json,
        cache_block=cache_block, quiet=quiet, warmup_steps=warmup_steps)


_HARNESS_PARAMS = tuple(inspect.signature(harness_options, eval_str=True).parameters.values())


def with_harness_options(command: Callable) -> Callable:
    """A typer command that takes the harness's options after its own: typer sees both sets,
    `command` gets its own by name and the harness's as one `harness` (HarnessOptions, not yet
    checked). So the options are declared once, here, for `tpguard launch` too."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "harness"]
    names = {p.name for p in _HARNESS_PARAMS}

    @functools.wraps(command)
    def wrapped(**kwargs):
        harness = harness_options(**{k: kwargs.pop(k) for k in names})
        return command(harness=harness, **kwargs)

    params = own + list(_HARNESS_PARAMS)
    wrapped.__signature__ = inspect.Signature(params)
    wrapped.__annotations__ = {p.name: p.annotation for p in params}
    return wrapped


@functools.lru_cache(maxsize=1)
def _harness_command():
    """The click command typer makes of `harness_options` (what `typer.run` would run)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(help=DESCRIPTION)(harness_options)
    return typer.main.get_command(app)


def parse_options(argv: list[str], world_size: int | None = None) -> HarnessOptions:
    """Parse and check; `world_size` (when known) also checks ranks and rejects 1. --help prints
    the options and raises SystemExit(0)."""
    try:
        got = _harness_command().main(args=list(argv), prog_name=PROG, standalone_mode=False)
    except click_exc.ClickException as e:
        raise OptionsError(e.format_message()) from None
    if not isinstance(got, HarnessOptions):  # --help was printed
        raise SystemExit(got or 0)
    validate(got, world_size)
    return got


def to_argv(o: HarnessOptions) -> list[str]:
    """The command line that parses back to `o`: what `tpguard launch` hands its ranks (each runs
    `python -m tpguard.launch`, as under torchrun). Only values other than the defaults."""
    out: list[str] = []
    for f in fields(HarnessOptions):
        value, flag = getattr(o, f.name), "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if value == default:
            continue
        if f.name == "inject":
            out += [f"--inject={i}" for i in value]
        elif f.name == "progress":
            out.append("--progress" if value else "--no-progress")
        elif isinstance(value, bool):
            out.append(flag)
        else:
            out.append(f"{flag}={value!r}" if isinstance(value, float) else f"{flag}={value}")
    return out


def check_paths(o: HarnessOptions, reused_run_id: bool = True) -> None:
    """Checks on the file system (run before any rank starts): --trace DIR can be written, an
    explicit --run-id would not reuse a trace already there (`reused_run_id`: only where no rank
    has started, else it races with rank 0's own file), --summary-json FILE can be written."""
    from tpguard.config import output_file_problem, trace_dir_problem

    if o.trace:
        problem = trace_dir_problem(o.trace)
        if problem:
            raise OptionsError(f"--trace: {problem}")
        if reused_run_id and o.run_id and any(Path(o.trace).glob(f"{glob.escape(o.run_id)}.*jsonl*")):
            raise OptionsError(f"--trace {o.trace} already holds a trace of run {o.run_id!r}: "
                               "choose another --run-id or directory")
    problem = output_file_problem(o.summary_json) if o.summary_json else None
    if problem:
        raise OptionsError(f"--summary-json {o.summary_json}: {problem}")


def validate(o: HarnessOptions, world_size: int | None = None) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise OptionsError(msg)

    need(o.steps >= 1, f"--steps must be >= 1, got {o.steps}")
    need(o.bs >= 1, f"--bs must be >= 1, got {o.bs}")
    need(2 <= o.draft_tokens <= 64, f"--draft-tokens must be in [2, 64], got {o.draft_tokens}")
    need(16 <= o.vocab <= 1 << 24, f"--vocab must be in [16, 16777216], got {o.vocab}")
    need(o.temperature > 0 and math.isfinite(o.temperature),
         f"--temperature must be > 0 and finite, got {o.temperature} (greedy verify is not simulated)")
    need(0 < o.top_p <= 1, f"--top-p must be in (0, 1], got {o.top_p}")
    need(0 <= o.top_k < o.vocab, f"--top-k must be in [0, vocab), got {o.top_k} (0 disables it)")
    need(0 <= o.min_p < 1, f"--min-p must be in [0, 1), got {o.min_p}")
    need(o.every >= 1, f"--every must be >= 1, got {o.every}")
    need(o.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {o.warmup_steps}")
    need(o.timeout > 0 and math.isfinite(o.timeout), f"--timeout must be > 0 seconds and finite, got {o.timeout}")
    if o.run_id is not None:
        from tpguard.config import check_run_id

        try:
            check_run_id(o.run_id, "--run-id")
        except ValueError as e:
            raise OptionsError(str(e)) from None
    need(1 <= o.cache_block <= 4096, f"--cache-block must be in [1, 4096], got {o.cache_block}")
    need(not (o.dump and not o.trace), "--dump needs --trace DIR (dumps are written under the trace directory)")
    need(not (o.merged and not o.trace), "--merged needs --trace DIR")
    need(not (o.no_guard and o.trace), "--trace needs the guard (drop --no-guard): without it nothing is recorded")
    need(not (o.no_guard and o.on_divergence != "record"),
         f"--on-divergence {o.on_divergence} needs the guard (drop --no-guard)")
    need(not (o.backend == "nccl" and o.device != "cuda"), "--backend nccl needs --device cuda")
    need(not (o.renorm in ("flashinfer", "flashinfer-det") and o.device != "cuda"),
         f"--renorm {o.renorm} runs on GPUs only: add --device cuda, or use --renorm emulated-atomic on CPU")
    if world_size is not None:
        need(world_size >= 2, f"the harness compares ranks: it needs a world size >= 2, got {world_size} "
             "(run it with torchrun --nproc-per-node N or tpguard launch --nproc-per-node N, N >= 2)")
    seen = set()
    for inj in o.inject:
        need(0 <= inj.step < o.steps, f"--inject {inj}: step {inj.step} is out of range [0, {o.steps})")
        need(inj.rank >= 0, f"--inject {inj}: rank must be >= 0")
        if world_size is not None:
            need(inj.rank < world_size, f"--inject {inj}: rank {inj.rank} >= world size {world_size}")
        need((inj.quantity, inj.step, inj.rank) not in seen, f"--inject {inj} is given twice")
        seen.add((inj.quantity, inj.step, inj.rank))
        if not o.no_guard:
            need(inj.quantity in o.guarded_quantities,
                 f"--inject {inj}: {inj.quantity} is not recorded with --quantities {o.quantities}")
            need(inj.step % o.every == 0,
                 f"--inject {inj}: step {inj.step} is not a checked step with --every {o.every}")
