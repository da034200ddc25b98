"""TPGUARD_RENORM=deterministic (or a deterministic implementation's name): route every renorm call
site of sglang to deterministic kernels.

sglang binds `top_k_renorm_prob` / `top_p_renorm_prob` by name in four modules
(`sglang_compat.RENORM_MODULES`). On CUDA they are flashinfer's default kernels (float atomicAdd:
two calls on identical input differ in the last bits); on CPU they are None and sglang falls back
to torch. Routing rebinds the name in each of those modules, and in any other loaded module that
holds the same object, to the implementation the renorm registry picks (tpguard/renorm_registry.py:
the one named if it runs here, else the first that does, in this order):

* ``tpguard``: the flashinfer-style drop-in `tpguard.kernels.flashinfer_api` (flashinfer's calling
  convention and parameter checks; Triton on CUDA, its torch reference on CPU);
* ``flashinfer-det``: flashinfer's ``is_deterministic=True`` kernels (integer-histogram AIR top-p,
  fixed-point top-k);
* ``torch``: the same drop-in on tpguard's torch reference (`tpguard.kernels.reference`), for any
  device. tpguard's renorms exist once, in tpguard.kernels.

Tie rule (`TIE_RULE`, `tie_rules()`; `tpguard doctor` prints them): on every path tpguard reroutes,
every entry equal to the cutoff is kept, as flashinfer's CUDA kernels do. sglang's own CPU fallback
(not rerouted) keeps exactly k entries by rank. DFlash's sparse verify path truncates top-k by rank
(torch.topk) before its top-p step: `verify_target_probs` below (on the fused kernel of
kernels/target_probs.py; `RenormRouting.verify_target_probs` with the routing's output hook) is its
replacement with the one rule for both steps.

This is done with setattr, not HookRegistry: a None binding cannot go through HookRegistry, whose
propagation step would replace *every* None attribute of every loaded module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch

from tpguard import renorm_registry, renorm_words
from tpguard.hooks.sglang_compat import RENORM_MODULES, RENORM_NAMES
from tpguard.kernels.renorm import TIE_RULE


def tie_rules(backend: str | None = None) -> list[str]:
    """The tie rule of each renorm path of sglang, for `tpguard doctor` (`backend`: the routed one,
    `renorm_registry.routed_to`, or None when TPGUARD_RENORM is default)."""
    routed = {"tpguard": f"tpguard's kernels: {TIE_RULE}",
              "torch": f"tpguard's torch reference: {TIE_RULE}",
              "flashinfer-det": "flashinfer's is_deterministic kernels: flashinfer's rule (x >= pivot)"}
    lines = [f"routed renorms (top_k_renorm_prob, top_p_renorm_prob): "
             f"{routed.get(backend, 'not routed (TPGUARD_RENORM=default)')}"]
    lines.append("DFlash sparse verify (build_speculative_verify_target_probs with top-k): sglang truncates top-k "
                 "by rank (torch.topk: exactly k, ties by position) before its top-p step; "
                 "where the plugin installs RenormRouting.verify_target_probs in its place, the rule above holds "
                 "for both steps (the same result as the dense path)")
    lines.append("sglang's own torch fallback (CPU, not routed): keeps exactly k by rank")
    return lines


# --- the routed functions ------------------------------------------------------------------------

def make_renorm(kind: str, backend: str, want_fingerprint: Callable[[], bool] | None = None) -> Callable:
    """A function with sglang's calling convention: (probs, top_ks | top_ps) -> probs.

    `want_fingerprint`: asked per call (tpguard backend); when it says yes, the write pass also
    emits the result's fingerprint, attached to it (`tpguard.fingerprint.attach_fingerprint`): the guard records
    target_probs without reading it again."""
    if kind not in ("top_k", "top_p"):
        raise ValueError(f"kind must be top_k or top_p, got {kind!r}")
    if backend in ("tpguard", "torch"):
        from tpguard.fingerprint import call_with_fingerprint
        from tpguard.kernels import flashinfer_api

        # None: the drop-in's pick (flashinfer_api.backend_for: Triton on CUDA and under the interpreter)
        forced = "torch" if backend == "torch" else None

        def drop_in(probs, param, fingerprint_out=None):
            return flashinfer_api.renorm_probs(kind, probs, param, backend=forced, fingerprint_out=fingerprint_out)

        def fn(probs, param):
            # the drop-in checks parameter shapes as flashinfer does and clamps values (no host sync)
            if want_fingerprint is not None and want_fingerprint():
                return call_with_fingerprint(drop_in, probs, param)
            return drop_in(probs, param)
    elif backend == "flashinfer-det":  # the registry's is_deterministic=True kernels (GPU only)
        impl = getattr(renorm_registry.get_backend("flashinfer-det", "cuda", exact=True), kind)

        def fn(probs, param):
            return impl(probs, param)
    else:
        known = ", ".join(renorm_words.DETERMINISTIC_ORDER)
        raise ValueError(f"unknown renorm backend {backend!r} (known: {known})")
    fn.__name__ = f"{kind}_renorm_prob"
    fn.__qualname__ = fn.__name__
    fn.__tpguard_renorm__ = f"{backend}.{kind}"
    return fn


def with_output_hook(fn: Callable, on_output: Callable[[torch.Tensor], None] | None) -> Callable:
    """`fn`, also handing each result to `on_output` (the guard records it as target_probs)."""
    if on_output is None:
        return fn

    def wrapped(probs, param):
        out = fn(probs, param)
        on_output(out)
        return out

    wrapped.__name__ = fn.__name__
    wrapped.__qualname__ = fn.__qualname__
    wrapped.__tpguard_renorm__ = getattr(fn, "__tpguard_renorm__", None)
    wrapped.__wrapped__ = fn
    return wrapped


def make_verify_target_probs(on_output: Callable[[torch.Tensor], None] | None = None,
                             want_fingerprint: Callable[[], bool] | None = None,
                             backend: str = "deterministic") -> Callable:
    """A replacement of sglang 0.5.23's ``build_speculative_verify_target_probs``
    (srt/speculative/dflash_utils.py; DFlash, DSpark's sampled accept, UNO, the sampling mask): the
    same keyword arguments and result (float32 ``[bs, draft_token_num, vocab]``), computed by the
    fused deterministic kernel (kernels/target_probs.py): softmax(logits / T), then top-k when
    ``need_top_k_sampling`` and top-p (within the top-k set) when ``need_top_p_sampling``, with the
    one tie rule (`TIE_RULE`) on both steps. sglang's sparse path instead truncates top-k by rank
    (torch.topk: exactly k, ties broken by position) before a top-p step; here its sparse and dense
    paths give the same result. ``max_top_k`` caps k as sglang's sparse path does (it keeps at most
    max_top_k entries); ``uniform_top_k_value`` is a hint of sglang's and changes nothing.
    `on_output` gets the [rows, vocab] result (the guard's target_probs; the returned tensor is a
    view of it) and, when `want_fingerprint()` says so, it carries its write pass's fingerprint."""

    def verify_target_probs(*, next_token_logits: torch.Tensor, sampling_info, draft_token_num: int, bs: int,
                            max_top_k: int | None = None, uniform_top_k_value: int | None = None,
                            use_sparse_topk: bool = True) -> torch.Tensor:
        from tpguard.fingerprint import call_with_fingerprint
        from tpguard.kernels.target_probs import target_probs

        n = int(draft_token_num)
        need_top_k = bool(getattr(sampling_info, "need_top_k_sampling", True))
        need_top_p = bool(getattr(sampling_info, "need_top_p_sampling", False))
        temperature = torch.repeat_interleave(sampling_info.temperatures, n, dim=0).reshape(-1)
        top_k = top_p = None
        if need_top_k:
            top_k = torch.repeat_interleave(sampling_info.top_ks, n, dim=0).reshape(-1)
            if use_sparse_topk and max_top_k is not None:
                top_k = top_k.clamp(max=max(int(max_top_k), 1))
        if need_top_p:
            top_p = torch.repeat_interleave(sampling_info.top_ps, n, dim=0).reshape(-1)

        def run(logits, fingerprint_out=None):
            return target_probs(logits, temperature, top_k, top_p, backend=backend, validate=False,
                                fingerprint_out=fingerprint_out)

        if want_fingerprint is not None and want_fingerprint():
            probs = call_with_fingerprint(run, next_token_logits)
        else:
            probs = run(next_token_logits)
        if on_output is not None:
            on_output(probs)
        return probs.view(bs, n, -1)

    verify_target_probs.__tpguard_renorm__ = "tpguard.verify_target_probs"
    return verify_target_probs


verify_target_probs = make_verify_target_probs()


class RenormRouting:
    """What `route()` rebound, so that `restore()` can put it back (tests, `tpguard doctor`), and
    `verify_target_probs`: the replacement of sglang's build_speculative_verify_target_probs with the
    routing's output hook (`make_verify_target_probs`; None unless the backend is tpguard's)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.previous: list[tuple[object, str, object, bool]] = []  # (module, name, old, existed)
        self.verify_target_probs: Callable | None = None

    def set(self, module, name: str, value) -> None:
        existed = hasattr(module, name)
        self.previous.append((module, name, getattr(module, name, None), existed))
        setattr(module, name, value)

    def restore(self) -> None:
        for module, name, old, existed in reversed(self.previous):
            if existed:
                setattr(module, name, old)
            else:
                delattr(module, name)
        self.previous.clear()


def route(choice: str | None = None, on_output: Callable | None = None,
          want_fingerprint: Callable[[], bool] | None = None) -> RenormRouting:
    """Rebind the renorm names at every call site to deterministic kernels; returns the routing.
    `choice`: ``deterministic`` (or None) or an implementation's name, as TPGUARD_RENORM takes it
    (`renorm_registry.routed_to` picks what runs here). `want_fingerprint` (default: the
    ``wants_renorm_fingerprint`` method of the object that `on_output` is bound to, if any): whether
    this call's output should carry its fingerprint."""
    backend = renorm_registry.routed_to(choice or renorm_words.DETERMINISTIC, renorm_registry.here())
    routing = RenormRouting(backend)
    if want_fingerprint is None:
        want_fingerprint = getattr(getattr(on_output, "__self__", None), "wants_renorm_fingerprint", None)
    funcs = {f"{k}_renorm_prob": with_output_hook(make_renorm(k, backend, want_fingerprint), on_output)
             for k in ("top_k", "top_p")}
    if backend in ("tpguard", "torch"):
        routing.verify_target_probs = make_verify_target_probs(on_output, want_fingerprint,
                                                               "torch" if backend == "torch" else "deterministic")
    originals: dict[str, set[int]] = {n: set() for n in RENORM_NAMES}
    for mod_name in RENORM_MODULES:
        module = importlib.import_module(mod_name)
        for name in RENORM_NAMES:
            old = getattr(module, name, None)
            if old is not None:
                originals[name].add(id(old))
            # Set even where the name is absent (sampler on CPU imports none): then every call
            # site that exists on any platform is bound the same way.
            routing.set(module, name, funcs[name])
    # Other modules that did `from X import top_k_renorm_prob` of the same (non-None) object.
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith("sglang"):
            continue
        for name in RENORM_NAMES:
            value = getattr(module, name, None) if isinstance(getattr(module, "__dict__", None), dict) else None
            if value is not None and id(value) in originals[name] and value is not funcs[name]:
                routing.set(module, name, funcs[name])
    return routing


def bound_names() -> dict[str, dict[str, str]]:
    """module -> name -> what the name is bound to now (for tests and `tpguard doctor`)."""
    from tpguard.hooks.sglang_compat import describe_binding

    out = {}
    for mod_name in RENORM_MODULES:
        module = sys.modules.get(mod_name)
        if module is None:
            continue
        out[mod_name] = {n: describe_binding(getattr(module, n)) if hasattr(module, n) else "absent"
                         for n in RENORM_NAMES}
    return out
