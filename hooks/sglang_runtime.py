"""What the plugin's hooks share in one sglang process: config, the target TP group, the guards, the
open verify-step scopes, and the rule that tpguard never breaks a verify step.

A verify step is a *scope*. The outermost hooked function of a step owns it (DFlash `_accept_block`,
DSpark `accept_and_finalize`, `eagle_sample`, UNO's accept, `Sampler.forward`); the functions it
calls (target probs, coins, the accept kernels, `SpecTpSync.sync`, the renorms) record into the open
scope. When the owner returns, its guard checks once: one fixed-size all-gather per checked step.

What a scope records for a decision (accept_index, accept_len, bonus, cap_trim_lens, commit_lens,
out_tokens) depends on the mode:

* ``on``: what the rank *commits*: the value after sglang's rank-0 broadcast where the site has one
  (`SpecTpSync.sync`), else the owner's result. A difference that sglang's broadcast aligned is
  no divergence and never aborts.
* ``audit``: what the rank *computed* before that broadcast (a contributor's result, or the value
  handed to `SpecTpSync.sync`): a difference there is a divergence sglang's broadcast hid ("would
  have diverged"); audit only records.

Never breaking a step: an exception in tpguard's own part of a hook (binding arguments,
fingerprinting, a result of an unexpected shape, the group, the trace) is caught; sglang's function
always runs once and its result is returned unchanged. The failing rank flags it in the step's
gathered vector (`tpguard.guard.FAILED_BIT`), so every rank stops guarding that site at the same
step and the group's collectives stay paired; one error line names the site and sglang's version.
Only tpguard's deliberate errors go through: `RankDivergenceError` (policy abort) and
`RankTimeoutError` (a rank stopped answering).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tpguard.config import GuardConfig
from tpguard.errors import TPGuardError

logger = logging.getLogger("tpguard.sglang")

# Canonical order plus the two quantities only DSpark has, at their causal place.
PLUGIN_ORDER: tuple[str, ...] = (
    "rng_state", "seq_lens", "verify_lens", "draft_tokens", "target_logits", "target_probs", "coins",
    "accept_index", "accept_len", "cap_trim_lens", "bonus", "commit_lens", "out_tokens",
)
VOCAB_SIZED = ("target_logits", "target_probs")
DECISIONS = ("accept_index", "accept_len", "cap_trim_lens", "bonus", "commit_lens", "out_tokens")


def algo_of(site: str) -> str:
    return site.split(".", 1)[0]


def capturing() -> bool:
    """CUDA graph capture, or sglang's capture phase (its warm-up runs included): tpguard does no
    work and no collective there."""
    capture_mode = sys.modules.get("sglang.srt.model_executor.runner_utils.capture_mode")
    if capture_mode is not None and getattr(capture_mode, "is_capture_mode", False):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def bind(fn, args, kwargs) -> dict:
    """Arguments by name, however the caller passed them (a ``**kwargs`` parameter's entries too:
    sglang's ``execute(cls, *args, **kwargs)`` dispatchers)."""
    try:
        sig = _signature(fn)
        bound = dict(sig.bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(p.name), dict):
            bound.update(bound.pop(p.name))
    return bound


# --- a verify step's scope ---------------------------------------------------------------------

@dataclass
class Scope:
    site: str
    guard: object  # StepGuard or DeviceStepGuard
    active: bool  # this step is checked (TPGUARD_EVERY / sampling)
    prefer: str = "committed"  # which decision value counts: "committed" (on) or "computed" (audit)
    recorded: dict = field(default_factory=dict)  # name -> "input" | "computed" | "committed"
    sync_calls: dict = field(default_factory=dict)
    heal_extra: list = field(default_factory=list)  # derived tensors rank 0 also sends on heal
    fp_source: object = None  # the renorm output recorded as target_probs with its own fingerprint
    deferred: list = field(default_factory=list)  # sglang calls that must see the healed decisions
    heal_refused: str | None = None  # why this step cannot be healed (said once in the log)
    failure: str | None = None  # the first exception in tpguard's own work this step
    void: bool = False  # no verify step happened here after all (every rank alike): no check
    flags: set = field(default_factory=set)  # where in the step we are ("accept_core", ...)

    def record(self, name: str, tensor, overwrite: bool = True) -> None:
        """An input of the step (state, logits, probs, coins)."""
        if not self._wanted(name, tensor):
            return
        if name in self.recorded and not overwrite:
            return
        self._put(name, tensor, "input")

    def decision(self, name: str, tensor, committed: bool) -> None:
        """A decision: `committed` (after sglang's broadcast, or the owner's result: what the rank
        goes on with) or computed (before a broadcast; intermediates such as DSpark's accept_index
        are never committed). `on` counts committed values only; `audit` prefers computed ones and
        falls back to committed. A computed value keeps the first (nothing can have changed it
        yet), a committed one the last (what the rank ends with)."""
        if not self._wanted(name, tensor):
            return
        if self.prefer == "committed" and not committed:
            return
        kind = "committed" if committed else "computed"
        have = self.recorded.get(name)
        if have == "computed" and (kind == "committed" or have == kind):
            return
        self._put(name, tensor, kind)

    def _wanted(self, name: str, tensor) -> bool:
        return (self.active and name in self.guard.index
                and (tensor is None or isinstance(tensor, torch.Tensor)))

    def _put(self, name: str, tensor, kind: str) -> None:
        self.guard.record(name, tensor)
        self.recorded[name] = kind


# --- the runtime -------------------------------------------------------------------------------

class Runtime:
    """Everything the hooks share in one process."""

    def __init__(self, config: GuardConfig, group_fn: Callable | None = None, versions: dict | None = None):
        self.config = config
        self.audit = config.mode == "audit"
        self.policy = "record" if self.audit else config.policy
        self.group_fn = group_fn
        self.versions = versions or {}
        self.guards: dict[str, object] = {}
        self.run_id: str | None = config.run_id
        self.trace = None
        self.merged_trace = None
        self._group = None
        self._local = threading.local()
        self.hooks_installed: list[str] = []
        self.hooks_missing: list[str] = []
        self.renorm_backend: str | None = None
        self.renorm_routing = None
        self.disabled: dict[str, str] = {}  # site -> why tpguard stopped guarding it
        self._said: set[str] = set()  # one-time log lines already written
        # policy fix: SpecTpSync sites tpguard broadcasts even where SGLANG_SPEC_TP_SYNC left them
        # off, the SpecTpSync sites each tpguard site was seen to use, and whether a renorm ran
        # inside a captured CUDA graph (rebinding cannot reach it)
        self.forced_sync: set[str] = set()
        self.sync_sites_seen: dict[str, set[str]] = {}
        self.renorm_in_graph = False

    # scopes ------------------------------------------------------------------------------------
    def _stack(self) -> list[Scope]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current(self) -> Scope | None:
        stack = self._stack()
        return stack[-1] if stack else None

    def open(self, site: str) -> Scope:
        guard = self.guard(site)
        guard.dump_context = None  # set by the step's target-probs hook when dumps are on
        scope = Scope(site, guard, guard.wants(), prefer="computed" if self.audit else "committed")
        self._stack().append(scope)
        return scope

    def close(self, scope: Scope) -> None:
        stack = self._stack()
        if stack and stack[-1] is scope:
            stack.pop()

    def suspended(self) -> bool:
        return getattr(self._local, "suspend", 0) > 0

    def suspend(self):
        """A context in which every hook passes straight through (sglang's prewarm, its mask
        rebuild after acceptance): no tpguard work, no collective."""
        rt = self

        class _Suspend:
            def __enter__(self):
                rt._local.suspend = getattr(rt._local, "suspend", 0) + 1

            def __exit__(self, *exc):
                rt._local.suspend -= 1
                return False

        return _Suspend()

    def passing_through(self, site: str | None = None) -> bool:
        return self.suspended() or capturing() or (site is not None and site in self.disabled)

    # the target model's TP group, the run id and the trace (at the first checked step) -----------
    def group(self):
        if self._group is None:
            from tpguard.hooks.sglang_compat import target_tp_group

            group = (self.group_fn or target_tp_group)()
            if group is None:  # groups not built in this process: the whole world, said once
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    self.say_once("group", logging.WARNING,
                                  "tpguard: sglang's TP group is not available; guarding the default group")
                return None
            self._group = group
        return self._group

    def quantities(self) -> tuple[str, ...]:
        allowed = set(self.config.quantities) | {"verify_lens", "cap_trim_lens"}
        if self.config.quantity_set == "decisions":
            allowed -= set(VOCAB_SIZED)
        return tuple(q for q in PLUGIN_ORDER if q in allowed)

    def _start_run(self, site: str, info) -> None:
        """Agree on the run id with the group's other ranks, then open this rank's trace writers."""
        from tpguard.guard import agree_on_run_id
        from tpguard.records import Header
        from tpguard.trace import open_trace_writers

        run_id = agree_on_run_id(info, self.run_id, self.config.timeout_s)
        if info.distributed:
            import torch.distributed as dist

            if info.world_size < dist.get_world_size():  # several TP groups (DP attention): one run each
                run_id = f"{run_id}-g{info.global_ranks[0]}"
        self.run_id = run_id
        if not self.config.trace_dir:
            return
        header = Header(run_id=run_id, world_size=info.world_size, ranks=[info.rank],
                        quantities=list(self.quantities()), algo=algo_of(site),
                        versions=self.versions, config=self.config_dict())
        try:
            self.trace, self.merged_trace = open_trace_writers(self.config.trace_dir, header, info.rank,
                                                               self.config.merged, self.config.max_trace_bytes)
        except OSError as e:  # this rank's disk: no trace here; checks go on (collectives stay paired)
            logger.error("tpguard: trace directory %s cannot be written (%s); this rank writes no trace "
                         "(checks go on)", self.config.trace_dir, e.strerror or e)

    def config_dict(self) -> dict:
        c = self.config
        return {"mode": c.mode, "policy": self.policy, "every": c.every, "renorm": c.renorm,
                "renorm_backend": self.renorm_backend, "quantities": c.quantity_set,
                "sample_one_in": c.sample_one_in, "hooks": self.hooks_installed,
                "missing_hooks": self.hooks_missing,
                "spec_tp_sync": os.environ.get("SGLANG_SPEC_TP_SYNC", "all")}

    def guard(self, site: str):
        g = self.guards.get(site)
        if g is not None:
            return g
        from tpguard.guard import GroupInfo, StepGuard

        pg = self.group()
        if not self.guards:  # the first guard of this process: agree on the run id, open the trace
            self._start_run(site, GroupInfo(pg))
        dump_dir = None
        if self.config.dump:
            from tpguard.optional import missing, say_once

            if missing("safetensors", "dumps"):
                say_once("safetensors", "TPGUARD_DUMP's dumps")
                self.config.dump = False
        if self.config.dump:  # the layout `tpguard replay` reads: <trace dir>/dumps/
            from tpguard.dump import dumps_dir

            dump_dir = dumps_dir(self.config.trace_dir or ".")
        cls = StepGuard
        if self.use_device_guard(GroupInfo(pg)):
            from tpguard.device_guard import DeviceStepGuard as cls  # no host sync; lag of one step
        g = cls(pg, site=site, quantities=self.quantities(), policy=self.policy, trace=self.trace,
                merged_trace=self.merged_trace, timeout_s=self.config.timeout_s, dump_dir=dump_dir,
                algo=algo_of(site), run_id=self.run_id, every=self.config.every,
                clean_every=self.config.clean_every, sample_one_in=self.config.sample_one_in,
                metrics=True, trace_optional=True)
        if self.policy == "fix":
            g.switchers.append(self.apply_switch)
        self.guards[site] = g
        return g

    def apply_switch(self, sw) -> str:
        """Policy fix (tpguard.fix): switch the cause off from the next step on; every rank runs
        this at the same step. Returns what was done, for the trace event and the log."""
        from tpguard import fix

        if sw.kind == fix.RENORM:
            from tpguard.hooks import sglang_renorm

            routing = sglang_renorm.route("tpguard", on_output=self.on_renorm_output)
            self.renorm_backend, self.renorm_routing = routing.backend, routing
            note = f"every renorm call site of this process now runs {routing.backend}'s deterministic kernels"
            if self.renorm_in_graph:
                note += ("; a renorm captured inside a CUDA graph keeps its kernels until sglang captures "
                         "again, so heal goes on at every divergent step")
            return note
        seen = self.sync_sites_seen.get(sw.site, set())
        if seen:
            self.forced_sync |= seen
            return f"SGLang's own broadcast forced on for {', '.join(sorted(seen))}"
        guard = self.guards.get(sw.site)
        if guard is not None:
            guard.always_broadcast = True
            guard.every, guard.sample_one_in = 1, 0  # every step checked, and its decisions sent
        return f"tpguard broadcasts rank 0's decisions at {sw.site} every step (SGLang has no broadcast there)"

    def renorm_name(self, binding=None) -> str:
        """The renorm the target probs come from, in the renorm words (tpguard/renorm_words.py,
        as `tpguard replay` loads them): routed (TPGUARD_RENORM other than default, or policy fix), else
        read off sglang's `top_p_renorm_prob` binding (`binding`: flashinfer's kernels on CUDA). sglang's
        own torch fallback (a None binding) is none of replay's backends: "sglang-torch", which replay
        says it cannot re-run."""
        if self.config.renorm_choice != "default" or self.renorm_routing is not None:
            return self.renorm_backend or "torch"
        return renorm_name_of(binding)

    def use_device_guard(self, info) -> bool:
        """The production guard (no host sync) where it applies: NCCL groups, policy record or
        abort (heal and fix broadcast rank 0's values and derived tensors synchronously), no dumps."""
        kind = self.config.guard
        if kind == "auto":
            return "nccl" in info.backend and self.policy not in ("heal", "fix") and not self.config.dump
        return kind == "device"

    def stats(self) -> dict[str, dict]:
        out = {site: dict(g.stats, steps=g.step) for site, g in self.guards.items()}
        for site, why in self.disabled.items():
            out.setdefault(site, {})["disabled"] = why
        return out

    # never breaking a step ---------------------------------------------------------------------
    def say_once(self, key: str, level: int, message: str, *args) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.log(level, message, *args)

    def disable(self, site: str, why: str) -> None:
        """Stop guarding `site` in this process (every rank does it at the same step)."""
        if site in self.disabled:
            return
        self.disabled[site] = why
        logger.error("tpguard: site %s is no longer guarded (sglang %s): %s; sglang's verify step is "
                     "unaffected", site, self.versions.get("sglang") or "?", why)

    def guarded(self, scope: Scope | None, fn: Callable, *args):
        """Run tpguard's own `fn`; an exception marks the step failed and is not raised."""
        try:
            return fn(*args)
        except TPGuardError:
            raise
        except Exception as e:  # noqa: BLE001 - tpguard must never break sglang's step
            if scope is not None and scope.failure is None:
                scope.failure = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            return None

    def finish(self, scope: Scope, after_heal: Callable | None) -> None:
        """The step's one check, its heal, then the sglang calls deferred until after it."""
        guard = scope.guard
        if scope.void:
            guard.discard()
            return
        try:
            guard.local_failure = scope.failure is not None
            heal_ok = scope.heal_refused is None
            if not heal_ok and self.policy == "heal":
                self.say_once(f"heal-refused:{scope.site}", logging.ERROR, "tpguard: %s", scope.heal_refused)
            guard.check(heal=heal_ok)
            if guard.last_healed:
                broadcast_from_rank0(guard, scope.heal_extra)
                if after_heal is not None:
                    after_heal()
        except TPGuardError:
            raise
        except Exception as e:  # noqa: BLE001 - the collective, a trace write, a dump
            self.disable(scope.site, f"{type(e).__name__}: {e}".splitlines()[0][:300])
        finally:
            guard.local_failure = False
            if scope.failure is not None:
                self.disable(scope.site, f"this rank: {scope.failure}")
            elif getattr(guard, "failed_ranks", None):
                self.disable(scope.site, f"tpguard's work failed on rank(s) {guard.failed_ranks}")
        for call in scope.deferred:  # sglang's own calls: their errors are sglang's
            call()

    def close_all(self) -> None:
        for g in self.guards.values():
            try:
                g.close()
            except Exception:  # noqa: BLE001 - shutting down
                pass
        for w in (self.trace, self.merged_trace):
            if w is not None:
                try:
                    w.close()
                except Exception:  # noqa: BLE001
                    pass

    # renorm outputs (TPGUARD_RENORM) -------------------------------------------------------------
    def on_renorm_output(self, probs) -> None:
        """A renorm's result: the step's target_probs so far (the last renorm wins)."""
        scope = self.current()
        if capturing():
            self.renorm_in_graph = True  # a later renorm switch cannot reach that graph
        if scope is None or self.passing_through(scope.site):
            return

        def note():
            from tpguard.fingerprint import attached_fingerprint

            scope.record("target_probs", probs, overwrite=True)
            has_fp = isinstance(probs, torch.Tensor) and attached_fingerprint(probs) is not None
            scope.fp_source = probs if has_fp and "target_probs" in scope.recorded else None

        self.guarded(scope, note)

    def wants_renorm_fingerprint(self) -> bool:
        """Whether a routed renorm should emit its output's fingerprint now: a checked step is
        open and guards target_probs (then the write pass hashes what it writes)."""
        scope = self.current()
        return (scope is not None and scope.active and "target_probs" in scope.guard.index
                and not self.passing_through(scope.site))


def renorm_name_of(binding) -> str:
    """A renorm binding of sglang's, as `tpguard replay` names backends."""
    while binding is not None and hasattr(binding, "__wrapped__"):  # HookRegistry's wrapper of it
        binding = binding.__wrapped__
    if binding is None:
        return "sglang-torch"
    attrs = vars(binding) if hasattr(binding, "__dict__") else {}
    where = f"{attrs.get('module_name', '')} {getattr(binding, '__module__', '')} {getattr(binding, '__qualname__', '')}"
    if "emulated_atomic" in where:
        return "emulated-atomic"
    if "flashinfer" in where or "sgl_kernel" in where:
        return "flashinfer"
    return where.strip() or type(binding).__name__


RUNTIME: Runtime | None = None


def runtime() -> Runtime | None:
    return RUNTIME


# --- running a step ---------------------------------------------------------------------------

Before = Callable[[Scope, dict], object]  # returns state handed to After
After = Callable[[Scope, dict, object, object], None]
Heal = Callable[[Scope, dict, object], None]


def run_step(site: str, original, args, kwargs, before: Before | None = None, after: After | None = None,
             own: bool = True, after_heal: Heal | None = None, point: str | None = None):
    """Call `original` inside a step scope of `site`; its result is always returned unchanged.

    own=True (an owner): join an open scope of the same site, else open one (and check it).
    own=False (a contributor): join any open scope, else open one of `site` (and check it).
    `point`: the hook point's name, whose result shape is checked (sglang_compat.HookPoint.returns).
    """
    rt = RUNTIME
    if rt is None or rt.passing_through(site):
        return original(*args, **kwargs)
    outer = rt.current()
    if outer is not None and rt.passing_through(outer.site):
        return original(*args, **kwargs)
    joined = outer is not None and (not own or outer.site == site)
    scope = outer if joined else None
    if scope is None:
        try:
            scope = rt.open(site)
        except TPGuardError:
            raise
        except Exception as e:  # noqa: BLE001 - the group, the trace, the guard
            rt.disable(site, f"{type(e).__name__}: {e}".splitlines()[0][:300])
            return original(*args, **kwargs)
    b = rt.guarded(scope, bind, original, args, kwargs) or {}
    try:
        state = rt.guarded(scope, before, scope, b) if before and scope.active else None
        out = original(*args, **kwargs)
        if scope.active:
            problem = rt.guarded(scope, _shape_problem, point, out) if point else None
            if problem:
                scope.failure = scope.failure or problem
            elif after is not None:
                rt.guarded(scope, after, scope, b, out, state)
    finally:
        if not joined:
            rt.close(scope)
    if not joined:
        heal = (lambda: rt.guarded(None, after_heal, scope, b, out)) if after_heal else None
        rt.finish(scope, heal)
    return out


def _shape_problem(point: str, out) -> str | None:
    from tpguard.hooks.sglang_compat import HOOK_POINTS_BY_NAME

    hp = HOOK_POINTS_BY_NAME.get(point)
    return hp.result_problem(out) if hp is not None else None


def broadcast_from_rank0(guard, tensors) -> None:
    """Rank 0's values of derived tensors a heal must also align (new_seq_lens, cap_trim_lens)."""
    import torch.distributed as dist

    info = guard.info
    if info.world_size == 1:
        return
    for t in tensors:
        if t is None:
            continue
        buf = t if t.device == info.device else t.to(info.device)
        dist.broadcast(buf, src=info.src0(), group=info.group)
        if buf is not t:
            t.copy_(buf)
