"""The per-site hook functions: what is fingerprinted where, inside sglang 0.5.23's TP workers.

Sites (one guard each, on the target model's TP group): ``dflash.verify``, ``dspark.verify``,
``eagle.verify``, ``uno.verify``, ``sampler``, and the `SpecTpSync` sites outside a verify step
(``dflash.target``, ``dspark.target``, ``dspark.plan``, ``dspark.draft``). docs/sglang-hook-map.md
lists every decision site of sglang 0.5.23 and what each mode does there; the scopes, modes and
the never-break rule are in sglang_runtime.py.

Each hook is ``hook(original, *args, **kwargs)`` (sglang's HookRegistry AROUND hook): `before`
records the step's inputs, `after` its results, both through the open `Scope`; `run_step` calls
sglang's function exactly once and returns its result unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tpguard.hooks import sglang_runtime as runtime_mod
from tpguard.hooks.sglang_runtime import Scope, bind, run_step

logger = logging.getLogger("tpguard.sglang")

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
DECISION_SYNC = {"accept_index", "accept_len", "bonus", "cap_trim_lens", "out_tokens"}

FOLDED_NOTE = ("DSpark's folded accept runs inside the target-verify CUDA graph, and its sampling-accept "
               "region (SGLANG_OPT_DSV41_SAMPLING_ACCEPT_GRAPH) in a graph of its own, each with its KV "
               "inject and history writes: tpguard checks their committed values after the replay; audit "
               "cannot see what a rank computed before the in-graph broadcast, and heal is refused "
               "there (recorded instead; it could not undo the in-graph writes)")


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


def redraw_coins(gen: torch.Generator, rows: int, width: int, device) -> torch.Tensor:
    """The (rows x width) acceptance coins and the rows final coins a sglang accept drew first."""
    coins = torch.rand((rows, width), dtype=torch.float32, device=device, generator=gen)
    final = torch.rand((rows,), dtype=torch.float32, device=device, generator=gen)
    return torch.cat([coins.reshape(-1), final])


def _device(*tensors) -> torch.device | None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return None


def _first(out, i):
    return out[i] if isinstance(out, (tuple, list)) and len(out) > i else None


def _rt():
    return runtime_mod.RUNTIME


# --- SpecTpSync.sync ---------------------------------------------------------------------------

def hook_spec_tp_sync(original, self, *args, **kwargs):
    """A decision handed to sglang's rank-0 broadcast: computed before it, committed after it."""
    rt = _rt()
    if rt is None or rt.passing_through():
        return original(self, *args, **kwargs)
    b = bind(original, (self, *args), kwargs)
    site, values = b.get("site"), b.get("values")
    name = getattr(site, "name", str(site))
    tp_site, names = SYNC_SITES.get(name, (f"spec_tp_sync.{name.lower()}", ("out_tokens",)))
    try:
        broadcast_on = bool(self.enabled(site))
    except Exception:  # noqa: BLE001 - an sglang without enabled(): assume its broadcast is on
        broadcast_on = True
    rt.sync_sites_seen.setdefault(tp_site, set()).add(name)
    if name in rt.forced_sync and not broadcast_on:  # policy fix switched this broadcast on
        sync = original

        def original(self_, *a, **k):
            out = sync(self_, *a, **k)
            runtime_mod.broadcast_from_rank0(rt.guard(tp_site), [values])
            return out

        broadcast_on = True
    if rt.current() is None and not rt.audit and broadcast_on:
        return original(self, *args, **kwargs)  # on, broadcast on: every rank ends with rank 0's

    def which(scope):
        i = scope.sync_calls.get(name, 0)  # the i-th sync of this site in the step
        scope.sync_calls[name] = i + 1
        return names[i % len(names)]

    def put(scope, q, committed):
        if q in DECISION_SYNC:
            scope.decision(q, values, committed=committed)
        else:
            scope.record(q, values, overwrite=committed)

    def before(scope, _):
        q = which(scope)
        put(scope, q, committed=False)
        return q

    def after(scope, _, out, q):
        put(scope, q, committed=True)

    return run_step(tp_site, original, (self, *args), kwargs, before, after, own=False, point="spec_tp_sync")


# --- DFlash ------------------------------------------------------------------------------------

def hook_dflash_accept_block(original, *args, **kwargs):
    def before(scope, b):
        logits = b.get("next_token_logits")
        cand = b.get("candidates")
        scope.record("rng_state", rng_state(_device(cand, logits)))
        scope.record("seq_lens", b.get("prefix_lens"))
        scope.record("draft_tokens", cand)
        scope.record("target_logits", logits)  # None on the greedy deferred-argmax path
        # target_predict (the deferred argmax) is accept_index before DFLASH_ACCEPT_GREEDY's sync
        scope.decision("accept_index", b.get("target_predict"), committed=False)

    def after(scope, b, out, state):
        accept_len, commit_lens, bonus, out_tokens, new_seq_lens = out
        for name, t in (("accept_len", accept_len), ("commit_lens", commit_lens), ("bonus", bonus),
                        ("out_tokens", out_tokens)):
            scope.decision(name, t, committed=True)
        scope.heal_extra = [new_seq_lens]

    def after_heal(scope, b, out):
        _, commit_lens, _, _, new_seq_lens = out
        prefix_lens = b.get("prefix_lens")
        if new_seq_lens is not None and prefix_lens is not None:
            new_seq_lens.copy_(prefix_lens + commit_lens.to(prefix_lens.dtype))

    return run_step("dflash.verify", original, args, kwargs, before, after, own=True, after_heal=after_heal,
                    point="dflash.accept_block")


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
            scope.record("coins", redraw_coins(gen, cand.shape[0], cand.shape[1], cand.device))
        elif b.get("uniform_samples") is not None:
            parts = [b["uniform_samples"].reshape(-1).float()]
            if b.get("uniform_samples_for_final_sampling") is not None:
                parts.append(b["uniform_samples_for_final_sampling"].reshape(-1).float())
            scope.record("coins", torch.cat(parts))
        scope.decision("accept_len", out[0], committed=False)  # before DFLASH_ACCEPT_SAMPLE's sync
        scope.decision("bonus", out[1], committed=False)

    return run_step("dflash.verify", original, args, kwargs, before, after, own=False,
                    point="dflash.sampling_accept")


def hook_target_probs(original, *args, **kwargs):
    """build_speculative_verify_target_probs (DFlash; DSpark's and UNO's sampled accepts call it
    too, inside their own step). With the renorm routed to tpguard's kernels (TPGUARD_RENORM=
    deterministic, or policy fix's switch), its fused replacement runs in its place: one tie rule
    on the sparse and the dense path (hooks/sglang_renorm.py)."""
    rt = _rt()
    routing = getattr(rt, "renorm_routing", None) if rt is not None else None
    replacement = getattr(routing, "verify_target_probs", None)
    if replacement is not None and not rt.passing_through():
        original = _as_sglang_call(replacement)
    def before(scope, b):
        logits = b.get("next_token_logits")
        scope.record("target_logits", logits, overwrite=False)
        rt = _rt()
        if rt.config.dump and isinstance(logits, torch.Tensor) and b.get("sampling_info") is not None:
            ctx = _best_effort(rt, _dump_context, rt, scope, b, logits)
            if ctx is not None:
                scope.guard.dump_context = lambda step: ctx

    def after(scope, b, out, state):
        if _same_bytes(scope.fp_source, out):
            return  # out is a view of the last renorm's output, recorded with its own fingerprint
        scope.record("target_probs", out, overwrite=True)

    return run_step("dflash.verify", original, args, kwargs, before, after, own=False,
                    point="dflash.target_probs")


def _dump_context(rt, scope: Scope, b: dict, logits: torch.Tensor):
    """What `tpguard replay` needs to re-run these target probs: per-row sampling parameters, the
    renorm, the algorithm, and whether sglang took its sparse top-k path (replayed as such)."""
    from tpguard.dump import context_from_sampling_info

    info, n = b["sampling_info"], int(b.get("draft_token_num") or 1)
    vocab = logits.shape[-1]
    max_top_k = b.get("max_top_k")
    if max_top_k is None and getattr(info, "need_top_k_sampling", False):
        max_top_k = int(info.top_ks.max())
    sparse = (b.get("use_sparse_topk", True) and bool(getattr(info, "need_top_k_sampling", False))
              and max_top_k is not None and 0 < int(max_top_k) < vocab)
    algo = {"dflash": "dflash", "dspark": "dflash", "uno": "dflash"}.get(scope.site.split(".")[0], "eagle")
    from sglang.srt.speculative import dflash_utils  # the module whose renorm bindings it calls

    return context_from_sampling_info(info, n, algo=algo, sparse_topk=sparse, device=logits.device.type,
                                      renorm_name=rt.renorm_name(getattr(dflash_utils, "top_p_renorm_prob", None)))


def _as_sglang_call(replacement):
    """`replacement` takes keyword arguments only; sglang calls its function with keywords too."""
    def call(*args, **kwargs):
        if args:
            raise TypeError("build_speculative_verify_target_probs takes keyword arguments only")
        return replacement(**kwargs)

    call.__wrapped__ = replacement
    return call


def _best_effort(rt, fn, *args):
    """A dump's replay context is extra: failing to build it leaves the dump without one (replay
    then says it cannot re-run), said once, and never stops the guard."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        rt.say_once(f"dump-context:{fn.__name__}", logging.WARNING,
                    "tpguard: dumps carry no replay context here (%s: %s)", type(e).__name__, e)
        return None


def _eagle_dump_context(rt, verify_input, info, logits):
    """Replay's context of an EAGLE step where its re-run holds: a chain (topk 1) verified
    target-only (no draft probs), no logit adjustments; else None (replay then says it cannot
    re-run, rather than re-run another accept)."""
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative import eagle_utils

    from tpguard.dump import context_from_sampling_info

    spec = get_spec()
    if (info is None or getattr(verify_input, "topk", 1) != 1 or spec.speculative_use_rejection_sampling
            or spec.speculative_accept_threshold_single != 1.0 or spec.speculative_accept_threshold_acc != 1.0
            or info.acc_additive_penalties is not None or info.acc_scaling_penalties is not None
            or info.logit_bias is not None):
        return None
    n, bs = int(verify_input.draft_token_num), int(info.temperatures.shape[0])
    coins = [[bs, n], [bs]] if getattr(info, "sampling_seed", None) is None else None
    return context_from_sampling_info(
        info, n, algo="eagle", renorm_name=rt.renorm_name(getattr(eagle_utils, "top_p_renorm_prob", None)),
        coins_shapes=coins, device=logits.device.type)


def _same_bytes(src, out) -> bool:
    """`out` is a reshaped view of `src` (same memory, same elements: DFlash returns
    ``target_probs.view(bs, n, -1).contiguous()`` of the renorm's output), and `src`'s attached
    fingerprint is still valid (not changed in place since)."""
    from tpguard.fingerprint import attached_fingerprint

    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.is_contiguous() and out.is_contiguous() and src.dtype == out.dtype
            and src.numel() == out.numel() and src.data_ptr() == out.data_ptr()
            and src.device == out.device and attached_fingerprint(src) is not None)


def hook_pause(original, *args, **kwargs):
    """sglang's sampling prewarm (inside its peak-memory measurement) and the sampling-mask rebuild
    after acceptance: no tpguard work or collective inside, whatever they call."""
    rt = _rt()
    if rt is None:
        return original(*args, **kwargs)
    with rt.suspend():
        return original(*args, **kwargs)


# --- DSpark ------------------------------------------------------------------------------------

def _record_accept_outs(scope: Scope, accept) -> None:
    for name, attr in (("accept_len", "correct_len"), ("cap_trim_lens", "cap_trim_lens"), ("bonus", "bonus"),
                       ("commit_lens", "commit_lens"), ("out_tokens", "out_tokens")):
        scope.decision(name, getattr(accept, attr, None), committed=True)
    scope.heal_extra = [getattr(accept, "new_seq_lens", None)]


def hook_dspark_accept_and_finalize(original, *args, **kwargs):
    def before(scope, b):
        ids, logits = b.get("verify_ids_2d"), b.get("target_logits")
        scope.record("rng_state", rng_state(_device(ids, logits)))
        scope.record("seq_lens", b.get("prefix_lens"))
        scope.record("draft_tokens", ids)
        scope.record("target_logits", logits)
        if b.get("folded_accept"):
            scope.heal_refused = f"dspark.verify: {FOLDED_NOTE}"

    def after(scope, b, out, state):
        _record_accept_outs(scope, out)

    return run_step("dspark.verify", original, args, kwargs, before, after, own=True,
                    point="dspark.accept_and_finalize")


def hook_dspark_sampling_accept_graph(original, *args, **kwargs):
    """DsparkSamplingAcceptGraph.run (SGLANG_OPT_DSV41_SAMPLING_ACCEPT_GRAPH): the worker skips
    accept_and_finalize on these steps. Every step is checked once, after the region ran (eagerly
    on a key's first step, captured on its second, replayed after): its accept outputs. Returns
    None when the step takes the eager path, which accept_and_finalize then checks."""
    def before(scope, b):
        logits = b.get("target_logits")
        scope.record("rng_state", rng_state(_device(logits)))
        scope.record("target_logits", logits)
        scope.heal_refused = f"dspark.verify: {FOLDED_NOTE}"  # the region commits KV and history

    def after(scope, b, out, state):
        if out is not None:
            _record_accept_outs(scope, out)

    def region(*a, **k):
        out = original(*a, **k)
        scope = _rt().current()
        if out is None and scope is not None:  # the step takes the eager accept_and_finalize,
            scope.void = True  # which checks it (host state: the same on every rank)
        return out

    return run_step("dspark.verify", region, args, kwargs, before, after, own=True,
                    point="dspark.sampling_accept_graph")


def hook_dspark_accept_draft_tokens(original, *args, **kwargs):
    def before(scope, b):
        cand, logits = b.get("candidates"), b.get("target_logits")
        scope.record("rng_state", rng_state(_device(cand, logits)), overwrite=False)
        scope.record("draft_tokens", cand, overwrite=False)
        scope.record("target_logits", logits, overwrite=False)

    def after(scope, b, out, state):  # before build_accept_outs' three syncs
        scope.decision("accept_len", out[0], committed=False)
        scope.decision("bonus", out[1], committed=False)
        scope.decision("cap_trim_lens", out[2], committed=False)

    return run_step("dspark.verify", original, args, kwargs, before, after, own=True,
                    point="dspark.accept_draft_tokens")


def hook_dspark_build_accept_outs(original, *args, **kwargs):
    def before(scope, b):
        scope.record("seq_lens", b.get("prefix_lens"), overwrite=False)

    def after(scope, b, out, state):
        _record_accept_outs(scope, out)

    return run_step("dspark.verify", original, args, kwargs, before, after, own=True,
                    point="dspark.build_accept_outs")


def hook_dspark_accept_sampling_core(original, *args, **kwargs):
    def before(scope, b):
        cand = b.get("candidates")
        dev = _device(cand, b.get("target_logits"))
        scope.record("rng_state", rng_state(dev), overwrite=False)
        scope.flags.add("accept_core")  # its SoftmaxTemp call makes the target probs
        return snapshot_generator(dev) if dev is not None else None

    def after(scope, b, out, gen):
        scope.flags.discard("accept_core")
        cand = b.get("candidates")
        if gen is not None and isinstance(cand, torch.Tensor):
            scope.record("coins", redraw_coins(gen, cand.shape[0], int(b.get("gamma")), cand.device))
        correct_len, cap_trim_lens, accept_index = out[0], out[1], out[2]
        scope.decision("accept_len", correct_len, committed=False)
        scope.decision("cap_trim_lens", cap_trim_lens, committed=False)
        # the kernel writes each row's accept_index up to its accept length only (a reused buffer)
        cols = torch.arange(accept_index.shape[-1], device=accept_index.device)
        valid = cols[None, :] <= correct_len.reshape(-1, 1).to(cols.dtype)
        scope.decision("accept_index", torch.where(valid, accept_index, -1), committed=False)

    return run_step("dspark.verify", original, args, kwargs, before, after, own=False,
                    point="dspark.accept_sampling_core")


def hook_dspark_softmax_temp(original, *args, **kwargs):
    """SoftmaxTemp.execute: the target probs when _accept_sampling_core calls it (no top-k/top-p;
    its draft-probs calls happen outside that function)."""
    rt = _rt()
    scope = rt.current() if rt is not None else None
    if scope is None or "accept_core" not in scope.flags or rt.passing_through(scope.site):
        return original(*args, **kwargs)

    def after(scope, b, out, state):
        scope.record("target_probs", out, overwrite=True)

    return run_step(scope.site, original, args, kwargs, None, after, own=False, point="dspark.softmax_temp")


def hook_dspark_blockwise_rejection(original, *args, **kwargs):
    """BlockwiseRejection.execute: its target probs live only inside the kernel (softmax of the
    logits at the target temperatures, recorded here as torch computes them), its coins come from
    the RejectionNoise key and device step counter (recorded before the call advances it)."""
    def before(scope, b):
        noise = b.get("noise")
        counter = getattr(noise, "counter", None)
        if isinstance(counter, torch.Tensor):
            key = torch.tensor([int(getattr(noise, "key", 0))], dtype=torch.int64, device=counter.device)
            scope.record("coins", torch.cat([key, counter.reshape(-1).to(torch.int64)]))
        logits, temps = b.get("target_logits"), b.get("target_temperatures")
        if "target_probs" in scope.guard.index and isinstance(logits, torch.Tensor) and temps is not None:
            rows = logits.shape[0]
            t = temps.reshape(-1, 1).to(torch.float32)
            t = t.repeat_interleave(rows // t.shape[0], dim=0) if t.shape[0] != rows else t
            scope.record("target_probs", torch.softmax(logits.float() / t, dim=-1))

    def after(scope, b, out, state):
        scope.decision("accept_len", out[0], committed=False)
        scope.decision("bonus", out[1], committed=False)
        scope.decision("cap_trim_lens", out[2], committed=False)

    return run_step("dspark.verify", original, args, kwargs, before, after, own=False,
                    point="dspark.blockwise_rejection")


# --- EAGLE -------------------------------------------------------------------------------------

def hook_eagle_sample(original, *args, **kwargs):
    rt = _rt()
    if rt is None or rt.passing_through("eagle.verify"):
        return original(*args, **kwargs)
    b0 = bind(original, args, kwargs)
    batch = b0.get("batch")
    mode = getattr(batch, "forward_mode", None)
    try:
        idle = mode is not None and mode.is_idle()
    except Exception:  # noqa: BLE001
        idle = False
    if idle:
        return original(*args, **kwargs)

    def before(scope, b):
        vi, lo = b.get("verify_input"), b.get("logits_output")
        logits = getattr(lo, "next_token_logits", None)
        draft = getattr(vi, "draft_token", None)
        scope.record("rng_state", rng_state(_device(draft, logits)))
        scope.record("seq_lens", getattr(batch, "seq_lens", None))
        scope.record("draft_tokens", draft)
        scope.record("target_logits", logits)
        if rt.config.dump and isinstance(logits, torch.Tensor):
            ctx = _best_effort(rt, _eagle_dump_context, rt, vi, getattr(batch, "sampling_info", None), logits)
            if ctx is not None:
                scope.guard.dump_context = lambda step: ctx

    def after(scope, b, out, state):
        predict, accept_lens, accept_index = out
        scope.decision("accept_index", accept_index, committed=True)
        scope.decision("accept_len", accept_lens, committed=True)
        scope.decision("out_tokens", predict, committed=True)

    # heal adds the rank-0 broadcast the greedy CUDA branch lacks (accept_index, accept_len, predict).
    return run_step("eagle.verify", original, args, kwargs, before, after, own=True, point="eagle.sample")


def hook_eagle_verify_coins(original, *args, **kwargs):
    def after(scope, b, out, state):
        coins, final = out
        scope.record("coins", torch.cat([coins.reshape(-1).float(), final.reshape(-1).float()]))

    return run_step("eagle.verify", original, args, kwargs, None, after, own=False, point="eagle.verify_coins")


def hook_target_softmax(original, *args, **kwargs):
    """sglang.kernels.ops.sampling.softmax inside an open EAGLE step: its target probs when no
    top-k / top-p renorm follows (a renorm's output replaces them). Opens no step of its own."""
    rt = _rt()
    scope = rt.current() if rt is not None else None
    if scope is None or scope.site != "eagle.verify" or rt.passing_through(scope.site):
        return original(*args, **kwargs)

    def after(scope, b, out, state):
        scope.record("target_probs", out, overwrite=True)

    return run_step(scope.site, original, args, kwargs, None, after, own=False, point="eagle.target_softmax")


def hook_eagle_watermark_record(original, *args, **kwargs):
    """WatermarkState.record_speculative inside a checked EAGLE step under policy heal: deferred
    until after the step's check, so that it records the healed accept_index / accept_lens (the
    same tensors, which heal overwrites in place) rather than this rank's own."""
    rt = _rt()
    scope = rt.current() if rt is not None else None
    if (scope is None or scope.site != "eagle.verify" or not scope.active or rt.policy != "heal"
            or rt.passing_through(scope.site)):
        return original(*args, **kwargs)
    scope.deferred.append(lambda: original(*args, **kwargs))
    return None


# --- UNO (linear verify) -----------------------------------------------------------------------

def hook_uno_accept_and_pack(original, *args, **kwargs):
    """UnoWorkerV2._accept_and_pack: UNO's greedy linear verify (no sglang broadcast)."""
    def before(scope, b):
        cand = b.get("candidates")
        scope.record("rng_state", rng_state(_device(cand)))
        scope.record("seq_lens", b.get("committed_seq_lens"))
        scope.record("draft_tokens", cand)
        scope.decision("accept_index", b.get("target_top1"), committed=True)  # UNO has no broadcast

    def after(scope, b, out, state):
        output_ids, accept_lens, new_seq_lens, correction = out
        scope.decision("commit_lens", accept_lens, committed=True)
        scope.decision("bonus", correction, committed=True)
        scope.decision("out_tokens", output_ids, committed=True)
        scope.heal_extra = [new_seq_lens]

    def after_heal(scope, b, out):
        _, accept_lens, new_seq_lens, _ = out
        committed = b.get("committed_seq_lens")
        if committed is not None:
            new_seq_lens.copy_(committed + accept_lens.to(committed.dtype))

    return run_step("uno.verify", original, args, kwargs, before, after, own=True, after_heal=after_heal,
                    point="uno.accept_and_pack")


def hook_uno_run_sampling(original, *args, **kwargs):
    """uno_utils.run_uno_sampling: UNO's sampled linear verify (its own torch.rand coins, no sglang
    broadcast; its target probs come from build_speculative_verify_target_probs)."""
    def before(scope, b):
        cand, logits = b.get("candidates"), b.get("next_token_logits")
        scope.record("rng_state", rng_state(_device(cand, logits)))
        scope.record("seq_lens", b.get("committed_frontiers"))
        scope.record("draft_tokens", cand)
        scope.record("target_logits", logits)

    def after(scope, b, out, state):
        scope.decision("commit_lens", out.accept_lens, committed=True)
        scope.decision("bonus", out.next_seed_tokens, committed=True)
        scope.decision("out_tokens", out.output_ids, committed=True)
        scope.heal_extra = [out.new_seq_lens]

    def after_heal(scope, b, out):
        committed = b.get("committed_frontiers")
        if committed is not None:
            out.new_seq_lens.copy_(committed + out.accept_lens.to(committed.dtype))

    return run_step("uno.verify", original, args, kwargs, before, after, own=True, after_heal=after_heal,
                    point="uno.run_sampling")


def hook_uno_rejection(original, *args, **kwargs):
    """_run_dense_rejection / _run_sparse_rejection: their coins are their torch.rand draws (the
    dense one builds its target probs first, which draws nothing)."""
    def before(scope, b):
        cand = b.get("candidates")
        dev = _device(cand, b.get("next_token_logits"))
        return snapshot_generator(dev) if dev is not None else None

    def after(scope, b, out, gen):
        cand = b.get("candidates")
        if gen is not None and isinstance(cand, torch.Tensor):
            scope.record("coins", redraw_coins(gen, cand.shape[0], cand.shape[1], cand.device))
        scope.decision("accept_len", out[0], committed=True)  # UNO has no broadcast: what it commits
        scope.decision("bonus", out[1], committed=True)

    return run_step("uno.verify", original, args, kwargs, before, after, own=False)


# --- the plain sampler -------------------------------------------------------------------------

def hook_sampler_forward(original, *args, **kwargs):
    def before(scope, b):
        logits = getattr(b.get("logits_output"), "next_token_logits", None)
        scope.record("rng_state", rng_state(_device(logits)))
        # Fingerprinted now: the sampler divides and softmaxes these logits in place.
        scope.record("target_logits", logits)

    def after(scope, b, out, state):
        scope.decision("out_tokens", out, committed=True)

    return run_step("sampler", original, args, kwargs, before, after, own=True, point="sampler.forward")


# hook point name (sglang_compat.HOOK_POINTS) -> hook function
HOOKS: dict[str, Callable] = {
    "spec_tp_sync": hook_spec_tp_sync,
    "dflash.accept_block": hook_dflash_accept_block,
    "dflash.sampling_accept": hook_dflash_sampling_accept,
    "dflash.target_probs": hook_target_probs,
    "dflash.prewarm_sampling": hook_pause,
    "spec.sampling_mask_capture": hook_pause,
    "dspark.accept_and_finalize": hook_dspark_accept_and_finalize,
    "dspark.sampling_accept_graph": hook_dspark_sampling_accept_graph,
    "dspark.accept_draft_tokens": hook_dspark_accept_draft_tokens,
    "dspark.build_accept_outs": hook_dspark_build_accept_outs,
    "dspark.accept_sampling_core": hook_dspark_accept_sampling_core,
    "dspark.softmax_temp": hook_dspark_softmax_temp,
    "dspark.blockwise_rejection": hook_dspark_blockwise_rejection,
    "eagle.sample": hook_eagle_sample,
    "eagle.verify_coins": hook_eagle_verify_coins,
    "eagle.target_softmax": hook_target_softmax,
    "eagle.watermark_record": hook_eagle_watermark_record,
    "uno.accept_and_pack": hook_uno_accept_and_pack,
    "uno.run_sampling": hook_uno_run_sampling,
    "uno.dense_rejection": hook_uno_rejection,
    "uno.sparse_rejection": hook_uno_rejection,
    "sampler.forward": hook_sampler_forward,
}


def hook_renorm_output(original, probs, param, *args, **kwargs):
    """AROUND hook on a renorm binding (default renorm): record its result as target_probs."""
    out = original(probs, param, *args, **kwargs)
    rt = _rt()
    if rt is not None:
        rt.on_renorm_output(out)
    return out
