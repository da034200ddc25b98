"""The harness's options: one argparse parser, one dataclass, and every check in one place.

Bad options are a one-line `OptionsError` (exit code 2 in `python -m tpguard.launch`,
`tpguard launch` and `tpguard demo`), never a traceback. Checks that need the world size
(an injection's rank, world size 1) take it as an argument, so `tpguard launch` can run them
before any process starts. Nothing here imports torch: rejecting bad arguments is instant.
"""

from __future__ import annotations

import argparse
import glob
import math
import re
from pathlib import Path
from dataclasses import dataclass, field

from tpguard.config import POLICIES
from tpguard.quantities import CANONICAL_ORDER, DECISIONS_MODE
from tpguard.renorm_registry import HARNESS_RENORMS, harness_renorm

ALGOS = ("dflash", "eagle")
LOGITS = ("flat", "peaky", "mixed")
RENORMS = HARNESS_RENORMS  # tpguard/renorm_registry.py: the words and what each means
DEVICES = ("cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
QUANTITY_SETS = {"full": CANONICAL_ORDER, "decisions": DECISIONS_MODE}


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


class _Parser(argparse.ArgumentParser):
    """argparse that raises OptionsError instead of printing usage and exiting."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        raise OptionsError(message)


_INJECT = re.compile(r"^(?P<q>[A-Za-z_][A-Za-z0-9_]*)@(?P<step>-?\d+):(?P<rank>-?\d+)$")


def parse_injection(text: str) -> Injection:
    m = _INJECT.match(text.strip())
    if not m:
        raise OptionsError(f"--inject {text!r}: expected QUANTITY@STEP:RANK, e.g. bonus@5:1")
    q = m.group("q")
    if q not in CANONICAL_ORDER:
        raise OptionsError(f"--inject {text!r}: unknown quantity {q!r} (known: {', '.join(CANONICAL_ORDER)})")
    return Injection(q, int(m.group("step")), int(m.group("rank")))


def build_parser(prog: str = "python -m tpguard.launch") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="tpguard TP harness: a seeded speculative verify workload on N ranks "
                "(run under torchrun; options: docs/harness.md).", allow_abbrev=False)
    w = p.add_argument_group("workload")
    w.add_argument("--steps", type=int, default=100, help="verify steps to run (default 100)")
    w.add_argument("--bs", type=int, default=8, help="requests per step (default 8)")
    w.add_argument("--draft-tokens", type=int, default=4,
                   help="verify positions per request, the root token included (default 4)")
    w.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    w.add_argument("--algo", choices=ALGOS, default="dflash",
                   help="dflash: chain accept; eagle: tree accept (default dflash)")
    w.add_argument("--logits", choices=LOGITS, default="mixed",
                   help="target logits entropy: flat, peaky, or mixed per row (default mixed)")
    w.add_argument("--seed", type=int, default=0, help="workload seed, the same on every rank (default 0)")
    w.add_argument("--cache-block", type=int, default=8, help="prefix-cache block size in tokens (default 8)")
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=1.0, help="> 0 (default 1.0)")
    s.add_argument("--top-p", type=float, default=0.9, help="in (0, 1]; 1 disables top-p (default 0.9)")
    s.add_argument("--top-k", type=int, default=0, help="0 disables top-k (default 0)")
    s.add_argument("--min-p", type=float, default=0.0, help="in [0, 1); 0 disables min-p (default 0)")
    s.add_argument("--mixed-params", action="store_true",
                   help="draw temperature/top-p/top-k/min-p per request from a seeded menu")
    s.add_argument("--renorm", choices=RENORMS, default="default", type=harness_renorm,
                   help="default (flashinfer's kernels on GPU when installed, emulated-atomic otherwise; old "
                        "spelling: auto), deterministic (the first of tpguard, flashinfer-det, torch), or a name")
    d = p.add_argument_group("devices")
    d.add_argument("--device", choices=DEVICES, default="cpu", help="where the pipeline runs (default cpu)")
    d.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="process group backend (default auto: nccl when each rank has its own GPU, else gloo)")
    g = p.add_argument_group("guard")
    g.add_argument("--trace", metavar="DIR", default=None, help="write per-rank trace files to DIR")
    g.add_argument("--merged", action="store_true", help="rank 0 also writes a merged trace")
    g.add_argument("--on-divergence", choices=POLICIES, default="record",
                   help="record (default), heal (rank-0 broadcast of decisions), abort (exit 3), or fix "
                        "(heal, then switch the cause off: deterministic renorm or a decision broadcast)")
    g.add_argument("--dump", action="store_true", help="save each rank's tensors of a divergent step (needs --trace)")
    g.add_argument("--no-guard", action="store_true", help="run without the guard")
    g.add_argument("--every", type=int, default=1, help="check every N steps (default 1)")
    g.add_argument("--quantities", choices=tuple(QUANTITY_SETS), default="full",
                   help="full, or decisions (skip the vocab-sized logits and probs)")
    g.add_argument("--timeout", type=float, default=30.0,
                   help="seconds any wait (guard or harness collective) may take before exit 4 (default 30)")
    g.add_argument("--run-id", default=None, help="run id in the trace (default: generated by rank 0)")
    f = p.add_argument_group("faults and output")
    f.add_argument("--inject", action="append", default=[], metavar="QUANTITY@STEP:RANK",
                   help="perturb QUANTITY on RANK at STEP, minimally (repeatable)")
    f.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="progress bar on rank 0 (default: when stderr is a terminal)")
    f.add_argument("--no-progress", dest="progress", action="store_false")
    f.add_argument("--summary-json", metavar="FILE", default=None, help="rank 0 writes the summary as JSON")
    f.add_argument("--quiet", action="store_true", help="no summary text (errors are still printed)")
    f.add_argument("--warmup-steps", type=int, default=3, metavar="N",
                   help="the first N steps (compilation, caches) are timed apart from the steady state "
                        "(default 3; at most half the steps)")
    return p


def parse_options(argv: list[str], world_size: int | None = None) -> HarnessOptions:
    """Parse and check; `world_size` (when known) also checks ranks and rejects 1."""
    ns = build_parser().parse_args(argv)
    opts = HarnessOptions(**{k: v for k, v in vars(ns).items() if k != "inject"})
    opts.inject = [parse_injection(t) for t in ns.inject]
    validate(opts, world_size)
    return opts


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
