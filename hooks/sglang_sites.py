"""The per-site hook functions: what is fingerprinted where, inside sglang's TP workers.

One `StepGuard` per site ("dflash.verify", "dspark.verify", "eagle.verify", "sampler", ...) on the
TP group sglang runs the step under (`get_dp_tp_group()`: attention-TP under DP attention).

A verify step is a *scope*. The outermost hooked function of a step owns it (DFlash
`_accept_block`, DSpark `accept_and_finalize`, `eagle_sample`, `Sampler.forward`); the functions it
calls (`build_speculative_verify_target_probs`, the coins, `SpecTpSync.sync`, the renorms) record
into the open scope. When the owner returns, its guard checks once: one fixed-size all-gather per
checked step. A contributor called with no scope open (a test, a prefill-time sync) opens its own.

Modes (TPGUARD): ``on`` records what each rank ends up with and applies TPGUARD_ON_DIVERGENCE;
``audit`` fingerprints the value each rank computed *before* sglang's rank-0 broadcast
(`SpecTpSync.sync`) overwrites it, and only records: the server stays as safe as sglang makes it,
and the trace says how often, where and in which quantity the ranks would have diverged.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tpguard.config import GuardConfig
from tpguard.quantities import CANONICAL_ORDER

logger = logging.getLogger("tpguard.sglang")

# Canonical order plus the two quantities only DSpark has, at their causal place.
PLUGIN_ORDER: tuple[str, ...] = (
    "rng_state", "seq_lens", "verify_lens", "draft_tokens", "target_logits", "target_probs", "coins",
    "accept_index", "accept_len", "cap_trim_lens", "bonus", "commit_lens", "out_tokens",
)
assert [q for q in PLUGIN_ORDER if q in CANONICAL_ORDER] == list(CANONICAL_ORDER)
_VOCAB_SIZED = ("target_logits", "target_probs")

# SpecTpSyncSite name -> (tpguard site, quantity of the 1st, 2nd, ... sync call of one step).
SYNC_SITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "DFLASH_SELECTOR": ("dflash.verify", ("accept_len", "bonus")),
    "DFLASH_ACCEPT_SAMPLE": ("dflash.verify", ("accept_len", "bonus")),
    "DFLASH_ACCEPT_GREEDY": ("dflash.verify", ("accept_index",)),  # target argmax per position
    "DFLASH_TARGET": ("dflash.target", ("out_tokens",)),
    "DSPARK_ACCEPT_GREEDY": ("dspark.verify", ("accept_len", "bonus", "cap_trim_lens")),
    "DSPARK_ACCEPT_SAMPLE": ("dspark.verify", ("accept_len", "bonus", "cap_trim_lens")),
    "DSPARK_ACCEPT_GRAPH": ("dspark.verify", ("accept_len", "bonus", "cap_trim_lens")),
    "DSPARK_TARGET": ("dspark.target", ("out_tokens",)),
    "DSPARK_PLAN": ("dspark.plan", ("verify_lens",)),
    "DSPARK_DRAFT": ("dspark.draft", ("draft_tokens",)),
}


def algo_of(site: str) -> str:
    return site.split(".", 1)[0]


def capturing() -> bool:
    """Inside CUDA graph capture nothing may sync or all-gather: hooks pass through."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def rng_state(device: torch.device | None) -> torch.Tensor:
    """The state of the generator that draws the step's coins on `device` (host tensor, no sync)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def snapshot_generator(device: torch.device) -> torch.Generator:
    """A copy of the default generator of `device`: redrawing from it gives the same numbers."""
    g = torch.Generator(device=device)
    g.set_state(rng_state(device))
    return g


@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def bind(fn, args, kwargs) -> dict:
    """Arguments by name, however the caller passed them."""
    try:
        return dict(_signature(fn).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)


# --- the runtime: config, group, trace, guards, open scopes ---------------------------------------

@dataclass
class Scope:
    site: str
    guard: object  # StepGuard
    active: bool  # this step is checked (TPGUARD_EVERY / sampling)
    recorded: set = field(default_factory=set)
    sync_calls: dict = field(default_factory=dict)
    heal_extra: list = field(default_factory=list)  # derived tensors rank 0 also sends on heal
    fp_source: object = None  # the renorm output recorded as target_probs with its own fingerprint

    def record(self, name: str, tensor, overwrite: bool = True) -> None:
        if not self.active or name not in self.guard.index:
            return
        if name in self.recorded and not overwrite:
            return
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            return
        self.guard.record(name, tensor)
        self.recorded.add(name)


class Runtime:
    """Everything the hooks share in one process."""

    def __init__(self, config: GuardConfig, group_fn: Callable | None = None, versions: dict | None = None):
        self.config = config
        self.audit = config.mode == "audit"
        self.policy = "record" if self.audit else config.policy
        self.group_fn = group_fn or default_group
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

    # scopes
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
        scope = Scope(site, guard, guard.wants())
        self._stack().append(scope)
        return scope

    def close(self, scope: Scope) -> None:
        stack = self._stack()
        if stack and stack[-1] is scope:
            stack.pop()

    # the group, run id and trace (created at the first checked step: every rank gets there)
    def group(self):
        if self._group is None:
            self._group = self.group_fn()
        return self._group

    def quantities(self) -> tuple[str, ...]:
        allowed = set(self.config.quantities) | {"verify_lens", "cap_trim_lens"}
        if self.config.quantity_set == "decisions":
            allowed -= set(_VOCAB_SIZED)
        return tuple(q for q in PLUGIN_ORDER if q in allowed)

    def _open_trace(self, site: str, info) -> None:
        from tpguard.guard import agree_on_run_id
        from tpguard.records import Header
        from tpguard.trace import TraceWriter, merged_trace_path, rank_trace_path

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
        self.trace = TraceWriter(rank_trace_path(self.config.trace_dir, run_id, info.rank), header,
                                 max_bytes=self.config.max_trace_bytes)
        if self.config.merged and info.rank == 0:
            merged = Header(**{**header.__dict__, "ranks": list(range(info.world_size))})
            self.merged_trace = TraceWriter(merged_trace_path(self.config.trace_dir, run_id), merged,
                                            max_bytes=self.config.max_trace_bytes)

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
            self._open_trace(site, GroupInfo(pg))
        dump_dir = None
        if self.config.dump:
            dump_dir = os.path.join(self.config.trace_dir or ".", "tpguard-dumps")
        cls = StepGuard
        if self.use_device_guard(GroupInfo(pg)):
            from tpguard.device_guard import DeviceStepGuard as cls  # no host sync; lag of one step
        g = cls(pg, site=site, quantities=self.quantities(), policy=self.policy, trace=self.trace,
                merged_trace=self.merged_trace, timeout_s=self.config.timeout_s, dump_dir=dump_dir,
                algo=algo_of(site), run_id=self.run_id, every=self.config.every,
                clean_every=self.config.clean_every, sample_one_in=self.config.sample_one_in,
                metrics=True)
        self.guards[site] = g
        return g

    def use_device_guard(self, info) -> bool:
        """The production guard (no host sync) where it applies: NCCL groups, policy record or
        abort (heal here broadcasts rank 0's values and derived tensors synchronously), no dumps."""
        kind = self.config.guard
        if kind == "auto":
            return "nccl" in info.backend and self.policy != "heal" and not self.config.dump
        return kind == "device"

    def stats(self) -> dict[str, dict]:
        return {site: dict(g.stats, steps=g.step) for site, g in self.guards.items()}

    def on_renorm_output(self, probs) -> None:
        """A renorm's result: the step's target_probs so far (the last renorm wins)."""
        scope = self.current()
        if scope is not None:
            scope.record("target_probs", probs, overwrite=True)
            from tpguard.guard import attached_fingerprint

            has_fp = isinstance(probs, torch.Tensor) and attached_fingerprint(probs) is not None
            scope.fp_source = probs if has_fp and "target_probs" in scope.recorded else None

    def wants_renorm_fingerprint(self) -> bool:
        """Whether a routed renorm should emit its output's fingerprint now: a checked step is
        open and guards target_probs (then the write pass hashes what it writes)."""
        scope = self.current()
        return (scope is not None and scope.active and "target_probs" in scope.guard.index
                and not capturing())

    def close_all(self) -> None:
        for g in self.guards.values():
            g.close()
        for w in (self.trace, self.merged_trace):
            if w is not None:
                w.close()


def default_group():
    """The process group of sglang's TP group for this step (attention-TP under DP attention)."""
    try:
        from sglang.srt.layers.dp_attention import get_dp_tp_group

        return get_dp_tp_group().device_group
    except Exception as e:  # groups not built in this process: compare across the whole world
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            logger.warning("tpguard: sglang's TP group is not available (%s); guarding the default group", e)
        return None


RUNTIME: Runtime | None = None


def runtime() -> Runtime | None:
    return RUNTIME


# --- running a step ---------------------------------------------------------------------------

Before = Callable[[Scope, dict], object]  # returns state handed to After
After = Callable[[Scope, dict, object, object], None]
Heal = Callable[[Scope, dict, object], None]


def run_step(site: str, original, args, kwargs, before: Before | None = None, after: After | None = None,
             own: bool = True, after_heal: Heal | None = None):
    """Call `original` inside a step scope of `site`.

    own=True (an owner): join an open scope of the same site, else open one (and check it).
    own=False (a contributor): join any open scope, else open one of `site` (and check it).
    """
    rt = RUNTIME
    if rt is None or capturing():
        return original(*args, **kwargs)
    outer = rt.current()
    joined = outer is not None and (not own or outer.site == site)
    b = bind(original, args, kwargs)
    if joined:
        state = before(outer, b) if before and outer.active else None
        out = original(*args, **kwargs)
        if after and outer.active:
            after(outer, b, out, state)
        return out
    scope = rt.open(site)
    try:
        state = before(scope, b) if before and scope.active else None
        out = original(*args, **kwargs)
        if after and scope.active:
            after(scope, b, out, state)
    finally:
        rt.close(scope)
    div = scope.guard.check()
    if div is not None and div.action == "healed":
        broadcast_from_rank0(scope.guard, scope.heal_extra)
        if after_heal is not None:
            after_heal(scope, b, out)
    return out


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


def _device(*tensors) -> torch.device | None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return None


def _first(out, i):
    return out[i] if isinstance(out, (tuple, list)) and len(out) > i else None


# --- SpecTpSync.sync ---------------------------------------------------------------------------

def hook_spec_tp_sync(original, self, *args, **kwargs):
    """Fingerprint the value before (audit) or after (on) sglang's rank-0 broadcast of it."""
    rt = RUNTIME
    if rt is None or capturing():
        return original(self, *args, **kwargs)
    b = bind(original, (self, *args), kwargs)
    site, values = b.get("site"), b.get("values")
    name = getattr(site, "name", str(site))
    tp_site, names = SYNC_SITES.get(name, (f"spec_tp_sync.{name.lower()}", ("out_tokens",)))
    if rt.current() is None and not rt.audit and self.enabled(site):
        # on-mode, broadcast on: every rank ends with rank 0's value, nothing to compare here.
        return original(self, *args, **kwargs)

    def before(scope, _):
        i = scope.sync_calls.get(name, 0)  # the i-th sync of this site in the step
        scope.sync_calls[name] = i + 1
        q = names[i % len(names)]
        if rt.audit:
            scope.record(q, values, overwrite=False)
        return q

    def after(scope, _, out, q):
        if not rt.audit:
            scope.record(q, values, overwrite=False)

    return run_step(tp_site, original, (self, *args), kwargs, before, after, own=False)


# --- DFlash ------------------------------------------------------------------------------------

def hook_dflash_accept_block(original, *args, **kwargs):
    def before(scope, b):
        logits = b.get("next_token_logits")
        cand = b.get("candidates")
        scope.record("rng_state", rng_state(_device(cand, logits)))
        scope.record("seq_lens", b.get("prefix_lens"))
        scope.record("draft_tokens", cand)
        scope.record("target_logits", logits)  # None on the greedy deferred-argmax path
        if b.get("target_predict") is not None:
            scope.record("accept_index", b.get("target_predict"), overwrite=False)

    def after(scope, b, out, state):
        accept_len, commit_lens, bonus, out_tokens, new_seq_lens = out
        for name, t in (("accept_len", accept_len), ("commit_lens", commit_lens), ("bonus", bonus),
                        ("out_tokens", out_tokens)):
            scope.record(name, t, overwrite=False)

    def after_heal(scope, b, out):
        _, commit_lens, _, _, new_seq_lens = out
        prefix_lens = b.get("prefix_lens")
        if new_seq_lens is not None and prefix_lens is not None:
            new_seq_lens.copy_(prefix_lens + commit_lens.to(prefix_lens.dtype))

    return run_step("dflash.verify", original, args, kwargs, before, after, own=True, after_heal=after_heal)


def hook_dflash_sampling_accept(original, *args, **kwargs):
    def before(scope, b):
        cand, logits = b.get("candidates"), b.get("next_token_logits")
        dev = _device(cand, logits)
        scope.record("rng_state", rng_state(dev), overwrite=False)
        scope.record("draft_tokens", cand, overwrite=False)
        scope.record("target_logits", logits, overwrite=False)
        if b.get("uniform_samples") is None and isinstance(cand, torch.Tensor) and dev is not None:
            return snapshot_generator(dev)  # the coins are the function's first draws
        return None

    def after(scope, b, out, gen):
        cand = b.get("candidates")
        if gen is not None:
            bs, n = cand.shape
            coins = torch.rand((bs, n), dtype=torch.float32, device=cand.device, generator=gen)
            final = torch.rand((bs,), dtype=torch.float32, device=cand.device, generator=gen)
            scope.record("coins", torch.cat([coins.reshape(-1), final]))
        elif b.get("uniform_samples") is not None:
            parts = [b["uniform_samples"].reshape(-1).float()]
            if b.get("uniform_samples_for_final_sampling") is not None:
                parts.append(b["uniform_samples_for_final_sampling"].reshape(-1).float())
            scope.record("coins", torch.cat(parts))
        scope.record("accept_len", _first(out, 0), overwrite=False)
        scope.record("bonus", _first(out, 1), overwrite=False)

    return run_step("dflash.verify", original, args, kwargs, before, after, own=False)


def hook_target_probs(original, *args, **kwargs):
    """build_speculative_verify_target_probs (DFlash, and DSpark's sampled accept)."""
    def before(scope, b):
        scope.record("target_logits", b.get("next_token_logits"), overwrite=False)

    def after(scope, b, out, state):
        if _same_bytes(scope.fp_source, out):
            return  # out is a view of the last renorm's output, recorded with its own fingerprint
        scope.record("target_probs", out, overwrite=True)

    return run_step("dflash.verify", original, args, kwargs, before, after, own=False)


def _same_bytes(src, out) -> bool:
    """`out` is a reshaped view of `src` (same memory, same elements: DFlash returns
    ``target_probs.view(bs, n, -1).contiguous()`` of the renorm's output), and `src`'s attached
    fingerprint is still valid (not changed in place since)."""
    from tpguard.guard import attached_fingerprint

    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.is_contiguous() and out.is_contiguous() and src.dtype == out.dtype
            and src.numel() == out.numel() and src.data_ptr() == out.data_ptr()
            and src.device == out.device and attached_fingerprint(src) is not None)


# --- DSpark ------------------------------------------------------------------------------------

def _record_accept_outs(scope: Scope, accept) -> None:
    for name, attr in (("accept_len", "correct_len"), ("cap_trim_lens", "cap_trim_lens"), ("bonus", "bonus"),
                       ("commit_lens", "commit_lens"), ("out_tokens", "out_tokens")):
        scope.record(name, getattr(accept, attr, None), overwrite=False)
    scope.heal_extra = [getattr(accept, "cap_trim_lens", None), getattr(accept, "new_seq_lens", None)]


def hook_dspark_accept_and_finalize(original, *args, **kwargs):
    def before(scope, b):
        ids, logits = b.get("verify_ids_2d"), b.get("target_logits")
        scope.record("rng_state", rng_state(_device(ids, logits)))
        scope.record("seq_lens", b.get("prefix_lens"))
        scope.record("draft_tokens", ids)
        scope.record("target_logits", logits)

    def after(scope, b, out, state):
        _record_accept_outs(scope, out)

    return run_step("dspark.verify", original, args, kwargs, before, after, own=True)


def hook_dspark_accept_draft_tokens(original, *args, **kwargs):
    def before(scope, b):
        cand, logits = b.get("candidates"), b.get("target_logits")
        scope.record("rng_state", rng_state(_device(cand, logits)), overwrite=False)
        scope.record("draft_tokens", cand, overwrite=False)
        scope.record("target_logits", logits, overwrite=False)

    def after(scope, b, out, state):
        scope.record("accept_len", _first(out, 0), overwrite=False)
        scope.record("bonus", _first(out, 1), overwrite=False)
        scope.record("cap_trim_lens", _first(out, 2), overwrite=False)

    return run_step("dspark.verify", original, args, kwargs, before, after, own=True)


def hook_dspark_build_accept_outs(original, *args, **kwargs):
    def before(scope, b):
        scope.record("seq_lens", b.get("prefix_lens"), overwrite=False)

    def after(scope, b, out, state):
        _record_accept_outs(scope, out)

    return run_step("dspark.verify", original, args, kwargs, before, after, own=True)


def hook_dspark_accept_sampling_core(original, *args, **kwargs):
    def before(scope, b):
        cand = b.get("candidates")
        dev = _device(cand, b.get("target_logits"))
        scope.record("rng_state", rng_state(dev), overwrite=False)
        return snapshot_generator(dev) if dev is not None else None

    def after(scope, b, out, gen):
        cand = b.get("candidates")
        if gen is not None and isinstance(cand, torch.Tensor):
            bs = cand.shape[0]
            coins = torch.rand((bs, int(b.get("gamma"))), dtype=torch.float32, device=cand.device, generator=gen)
            final = torch.rand((bs,), dtype=torch.float32, device=cand.device, generator=gen)
            scope.record("coins", torch.cat([coins.reshape(-1), final]))
        scope.record("accept_len", _first(out, 0), overwrite=False)
        scope.record("cap_trim_lens", _first(out, 1), overwrite=False)
        scope.record("accept_index", _first(out, 2), overwrite=False)

    return run_step("dspark.verify", original, args, kwargs, before, after, own=False)


# --- EAGLE -------------------------------------------------------------------------------------

def hook_eagle_sample(original, *args, **kwargs):
    b0 = bind(original, args, kwargs)
    batch = b0.get("batch")
    mode = getattr(batch, "forward_mode", None)
    if mode is not None and mode.is_idle():
        return original(*args, **kwargs)

    def before(scope, b):
        vi, lo = b.get("verify_input"), b.get("logits_output")
        logits = getattr(lo, "next_token_logits", None)
        draft = getattr(vi, "draft_token", None)
        scope.record("rng_state", rng_state(_device(draft, logits)))
        scope.record("seq_lens", getattr(batch, "seq_lens", None))
        scope.record("draft_tokens", draft)
        scope.record("target_logits", logits)

    def after(scope, b, out, state):
        predict, accept_lens, accept_index = out
        scope.record("accept_index", accept_index, overwrite=False)
        scope.record("accept_len", accept_lens, overwrite=False)
        scope.record("out_tokens", predict, overwrite=False)

    # heal adds the rank-0 broadcast the greedy CUDA branch lacks (accept_index, accept_len, predict).
    return run_step("eagle.verify", original, args, kwargs, before, after, own=True)


def hook_eagle_verify_coins(original, *args, **kwargs):
    def after(scope, b, out, state):
        coins, final = out
        scope.record("coins", torch.cat([coins.reshape(-1).float(), final.reshape(-1).float()]))

    return run_step("eagle.verify", original, args, kwargs, None, after, own=False)


# --- the plain sampler -------------------------------------------------------------------------

def hook_sampler_forward(original, *args, **kwargs):
    def before(scope, b):
        logits = getattr(b.get("logits_output"), "next_token_logits", None)
        scope.record("rng_state", rng_state(_device(logits)))
        # Fingerprinted now: the sampler divides and softmaxes these logits in place.
        scope.record("target_logits", logits)

    def after(scope, b, out, state):
        scope.record("out_tokens", out if isinstance(out, torch.Tensor) else None, overwrite=False)

    return run_step("sampler", original, args, kwargs, before, after, own=True)


# hook point name (sglang_compat.HOOK_POINTS) -> hook function
HOOKS: dict[str, Callable] = {
    "spec_tp_sync": hook_spec_tp_sync,
    "dflash.accept_block": hook_dflash_accept_block,
    "dflash.sampling_accept": hook_dflash_sampling_accept,
    "dflash.target_probs": hook_target_probs,
    "dspark.accept_and_finalize": hook_dspark_accept_and_finalize,
    "dspark.accept_draft_tokens": hook_dspark_accept_draft_tokens,
    "dspark.build_accept_outs": hook_dspark_build_accept_outs,
    "dspark.accept_sampling_core": hook_dspark_accept_sampling_core,
    "eagle.sample": hook_eagle_sample,
    "eagle.verify_coins": hook_eagle_verify_coins,
    "sampler.forward": hook_sampler_forward,
}


def hook_renorm_output(original, probs, param, *args, **kwargs):
    """AROUND hook on a renorm binding (default renorm): record its result as target_probs."""
    out = original(probs, param, *args, **kwargs)
    rt = RUNTIME
    if rt is not None and not capturing():
        rt.on_renorm_output(out)
    return out
