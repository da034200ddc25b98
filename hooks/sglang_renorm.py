"""TPGUARD_RENORM=deterministic: route every renorm call site of sglang to deterministic kernels.

sglang binds `top_k_renorm_prob` / `top_p_renorm_prob` by name in four modules
(`sglang_compat.RENORM_MODULES`). On CUDA they are flashinfer's default kernels (float atomicAdd:
two calls on identical input differ in the last bits); on CPU they are None and sglang falls back
to torch. Routing rebinds the name in each of those modules, and in any other loaded module that
holds the same object, to one of (first available):

* ``tpguard``: `tpguard.kernels.renorm` (Triton on CUDA, its torch reference on CPU);
* ``flashinfer``: flashinfer's ``is_deterministic=True`` kernels (integer-histogram AIR top-p,
  fixed-point top-k);
* ``torch``: a sort-based torch implementation (CPU or anything else).

This is done with setattr, not HookRegistry: a None binding cannot go through HookRegistry, whose
propagation step would replace *every* None attribute of every loaded module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch

from tpguard.hooks.sglang_compat import RENORM_MODULES, RENORM_NAMES

BACKENDS = ("tpguard", "flashinfer", "torch")


def pick_backend(preferred: str | None = None) -> str:
    """The first deterministic backend available here (or `preferred` if given and available)."""
    order = [preferred] if preferred else []
    order += [b for b in BACKENDS if b not in order]
    for name in order:
        if name == "tpguard" and _importable("tpguard.kernels.renorm"):
            return name
        if name == "flashinfer" and torch.cuda.is_available() and _importable("flashinfer.sampling"):
            return name
        if name == "torch":
            return name
    return "torch"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


# --- torch fallback (deterministic: sort + cumsum in a fixed order) ----------------------------

def torch_top_k_renorm(probs: torch.Tensor, top_ks: torch.Tensor | int) -> torch.Tensor:
    vocab = probs.shape[-1]
    k = torch.as_tensor(top_ks, device=probs.device).reshape(-1).to(torch.int64).clamp(1, vocab)
    k = k.expand(probs.shape[0]) if k.numel() == 1 else k
    sorted_p, _ = torch.sort(probs, dim=-1, descending=True)
    kth = sorted_p.gather(-1, (k - 1).unsqueeze(-1))  # ties with the k-th value are kept
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def torch_top_p_renorm(probs: torch.Tensor, top_ps: torch.Tensor | float) -> torch.Tensor:
    p = torch.as_tensor(top_ps, device=probs.device, dtype=probs.dtype).reshape(-1, 1)
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each entry
    keep_sorted = before < p * sorted_p.sum(dim=-1, keepdim=True)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, idx, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


# --- the routed functions ------------------------------------------------------------------------

def _as_float32(probs: torch.Tensor) -> torch.Tensor:
    return probs if probs.dtype == torch.float32 else probs.float()


def make_renorm(kind: str, backend: str, want_fingerprint: Callable[[], bool] | None = None) -> Callable:
    """A function with sglang's calling convention: (probs, top_ks | top_ps) -> probs.

    `want_fingerprint`: asked per call (tpguard backend); when it says yes, the write pass also
    emits the result's fingerprint, attached to it (`tpguard.guard.attach_fingerprint`): the guard records
    target_probs without reading it again."""
    if kind not in ("top_k", "top_p"):
        raise ValueError(f"kind must be top_k or top_p, got {kind!r}")
    if backend == "tpguard":
        from tpguard.guard import call_with_fingerprint
        from tpguard.kernels import renorm as tk

        impl = tk.top_k_renorm if kind == "top_k" else tk.top_p_renorm

        def fn(probs, param):
            # validate=False on GPU: no host sync (the kernels clamp instead).
            if want_fingerprint is not None and want_fingerprint():
                return call_with_fingerprint(impl, _as_float32(probs), param, validate=not probs.is_cuda)
            return impl(_as_float32(probs), param, validate=not probs.is_cuda)
    elif backend == "flashinfer":
        import flashinfer.sampling as fs

        impl = fs.top_k_renorm_probs if kind == "top_k" else fs.top_p_renorm_probs

        def fn(probs, param):
            return impl(probs, param, is_deterministic=True)
    elif backend == "torch":
        impl = torch_top_k_renorm if kind == "top_k" else torch_top_p_renorm

        def fn(probs, param):
            return impl(_as_float32(probs), param)
    else:
        raise ValueError(f"unknown renorm backend {backend!r} (known: {', '.join(BACKENDS)})")
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


class RenormRouting:
    """What `route()` rebound, so that `restore()` can put it back (tests, `tpguard doctor`)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.previous: list[tuple[object, str, object, bool]] = []  # (module, name, old, existed)

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


def route(backend: str | None = None, on_output: Callable | None = None,
          want_fingerprint: Callable[[], bool] | None = None) -> RenormRouting:
    """Rebind the renorm names at every call site to deterministic kernels; returns the routing.
    `want_fingerprint` (default: the ``wants_renorm_fingerprint`` method of the object that
    `on_output` is bound to, if any): whether this call's output should carry its fingerprint."""
    backend = pick_backend(backend)
    routing = RenormRouting(backend)
    if want_fingerprint is None:
        want_fingerprint = getattr(getattr(on_output, "__self__", None), "wants_renorm_fingerprint", None)
    funcs = {f"{k}_renorm_prob": with_output_hook(make_renorm(k, backend, want_fingerprint), on_output)
             for k in ("top_k", "top_p")}
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
