"""The renorm choice, one front door: for each word that names a renorm implementation (the
words and what each means: tpguard/renorm_words.py), where it runs and how its functions load. Used
by every place that picks one: the SGLang plugin (``TPGUARD_RENORM``, `tpguard serve --renorm`:
hooks/sglang_renorm.py), the harness (``--renorm``: launch/), `tpguard replay` and `tpguard
determinism`.

Nothing here imports torch, triton or flashinfer until a backend is loaded: option checks stay
instant.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from tpguard.renorm_words import DEFAULT, DETERMINISTIC, DETERMINISTIC_ORDER, HARNESS_RENORMS


class BackendUnavailable(RuntimeError):
    """The requested renorm cannot run here (one line; the harness's exit code 2)."""


@dataclass
class RenormBackend:
    """An implementation's functions, loaded for one device: ``fn(probs, param)`` with a per-row tensor
    or a number (top_k: int, top_p and min_p: float). None: the implementation has no such op."""

    name: str
    top_k: Callable | None
    top_p: Callable | None
    min_p: Callable | None
    deterministic: bool
    source: str  # module the kernels come from
    top_k_top_p: Callable | None = None  # (probs, top_k, top_p): top-k then top-p
    # logits -> target probs in one pass family (tpguard's kernels/target_probs.py), or None: softmax
    # then the renorms one by one
    fused: Callable | None = None

    def describe(self) -> str:
        return f"{self.name} ({self.source})"

    def target_probs(self, logits, temperature, params: dict, fingerprint: bool = False,
                     upto: int | None = None):
        """Temperature, softmax, then the renorm stages in `params` (top_k, top_p, min_p: per-row
        tensors, in that order; SGLang's dense verify path). `fingerprint`: the result comes with its
        fingerprint attached where the kernels can write it. `upto`: only the first stages, one by
        one (replay's search for the stage that differs)."""
        import torch

        stages = [k for k in ("top_k", "top_p", "min_p") if k in params]
        if self.fused is not None and upto is None:
            from tpguard.fingerprint import attach_fingerprint

            slot = torch.empty((), dtype=torch.int64, device=logits.device) if fingerprint else None
            out = self.fused(logits, temperature, params.get("top_k"), params.get("top_p"), params.get("min_p"),
                             validate=False, fingerprint_out=slot)
            return attach_fingerprint(out, slot) if fingerprint else out
        probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
        for kind in stages[:upto]:
            probs = self.call(kind, probs, params[kind], fingerprint=fingerprint and kind == stages[-1])
        return probs

    def call(self, kind: str, probs, param, fingerprint: bool = False):
        """``kind`` in top_k / top_p / min_p; with `fingerprint`, a kernel that takes
        ``fingerprint_out=`` (tpguard's) returns the result with its fingerprint attached
        (`tpguard.fingerprint.call_with_fingerprint`; the others are called plainly)."""
        fn = getattr(self, kind)
        if fingerprint:
            from tpguard.fingerprint import call_with_fingerprint

            return call_with_fingerprint(fn, probs, param)
        return fn(probs, param)


@dataclass(frozen=True)
class BackendSpec:
    """One renorm implementation: what it is, where it runs, how its functions load."""

    name: str
    deterministic: bool
    module: str  # importable where it is installed
    gpu_only: bool
    load: Callable[[str, bool], RenormBackend] = field(repr=False)

    def available(self, device: str) -> bool:
        """Installed, and able to run on `device` ("cpu" or "cuda")."""
        return (device == "cuda" or not self.gpu_only) and importable(self.module)


# --- the loaders: (device, exact) -> RenormBackend ------------------------------------------------
# exact: the implementation itself, never a stand-in (the determinism table measures it); else the
# harness's form: tpguard falls back to its torch reference where Triton does not run, flashinfer
# takes the torch reference's min-p (it has none).

def _torch(device: str, exact: bool) -> RenormBackend:
    from tpguard.kernels import reference as ref

    return RenormBackend("torch", ref.top_k_renorm_reference, ref.top_p_renorm_reference, ref.min_p_renorm_reference,
                         True, "tpguard.kernels.reference", top_k_top_p=ref.top_k_top_p_renorm_reference)


def _emulated(device: str, exact: bool) -> RenormBackend:
    from tpguard.kernels import emulated_atomic as emu

    return RenormBackend("emulated-atomic", emu.top_k_renorm_emulated_atomic, emu.top_p_renorm_emulated_atomic,
                         emu.min_p_renorm_emulated_atomic, False, "tpguard.kernels.emulated_atomic",
                         top_k_top_p=emu.top_k_top_p_renorm_emulated_atomic)


def _tpguard(device: str, exact: bool) -> RenormBackend:
    try:
        mod = importlib.import_module("tpguard.kernels.renorm")
    except ImportError:
        raise BackendUnavailable("tpguard's renorm kernels (tpguard.kernels.renorm) do not import here: "
                                 "torch is the deterministic choice") from None
    if exact:  # the Triton kernels themselves (a CPU tensor: only under TRITON_INTERPRET=1)
        from functools import partial

        from tpguard.config import interpreting

        if not mod.triton_available() or (device != "cuda" and not interpreting()):
            raise BackendUnavailable("tpguard's Triton kernels need triton and CUDA (or TRITON_INTERPRET=1 on CPU)")
        kw = {"backend": "tpguard", "validate": False}
        return RenormBackend("tpguard", partial(mod.top_k_renorm, **kw), partial(mod.top_p_renorm, **kw),
                             partial(mod.min_p_renorm, **kw), True, "tpguard.kernels.renorm",
                             top_k_top_p=partial(mod.top_k_top_p_renorm, **kw))
    from tpguard.kernels.target_probs import target_probs

    # the kernels' own pick (backend "deterministic"): Triton on CUDA tensors, the torch reference elsewhere
    source = "tpguard.kernels.renorm" + ("" if device == "cuda" else ": torch reference on CPU")
    return RenormBackend("tpguard", mod.top_k_renorm, mod.top_p_renorm, mod.min_p_renorm, True, source,
                         top_k_top_p=mod.top_k_top_p_renorm, fused=target_probs)


def _flashinfer(deterministic: bool) -> Callable[[str, bool], RenormBackend]:
    name = "flashinfer-det" if deterministic else "flashinfer"

    def load(device: str, exact: bool) -> RenormBackend:
        if device != "cuda":
            raise BackendUnavailable(f"{name} runs on GPUs only")
        if not importable("flashinfer.sampling"):
            raise BackendUnavailable("flashinfer is not installed here (pip install flashinfer-python; GPU only)")
        import torch
        from flashinfer import sampling

        def top_k(probs, k):
            k = k.to(torch.int32) if isinstance(k, torch.Tensor) else k
            return sampling.top_k_renorm_probs(probs, k, is_deterministic=deterministic)

        def top_p(probs, p):
            p = p.to(torch.float32) if isinstance(p, torch.Tensor) else p
            return sampling.top_p_renorm_probs(probs, p, is_deterministic=deterministic)

        def top_k_top_p(probs, k, p):
            return top_p(top_k(probs, k), p)

        min_p = None
        if not exact:  # flashinfer has no min-p renorm: the torch reference's
            from tpguard.kernels.reference import min_p_renorm_reference as min_p
        return RenormBackend(name, top_k, top_p, min_p, deterministic, "flashinfer.sampling", top_k_top_p=top_k_top_p)

    return load


def _sgl_kernel(device: str, exact: bool) -> RenormBackend:
    if device != "cuda" or not importable("sgl_kernel"):
        raise BackendUnavailable("sgl_kernel runs on GPUs only, where it is installed")
    import sgl_kernel

    top_k = getattr(sgl_kernel, "top_k_renorm_prob", None)
    top_p = getattr(sgl_kernel, "top_p_renorm_prob", None)
    if top_k is None and top_p is None:
        raise BackendUnavailable("this sgl_kernel has no renorm")
    return RenormBackend("sgl_kernel", top_k, top_p, None, False, "sgl_kernel")


SPECS = {s.name: s for s in (
    BackendSpec("tpguard", True, "tpguard.kernels.renorm", False, _tpguard),
    BackendSpec("flashinfer-det", True, "flashinfer.sampling", True, _flashinfer(True)),
    BackendSpec("torch", True, "tpguard.kernels.reference", False, _torch),
    BackendSpec("flashinfer", False, "flashinfer.sampling", True, _flashinfer(False)),
    BackendSpec("emulated-atomic", False, "tpguard.kernels.emulated_atomic", False, _emulated),
    BackendSpec("sgl_kernel", False, "sgl_kernel", True, _sgl_kernel),
)}
NAMES = tuple(SPECS)


# --- words -> implementations ----------------------------------------------------------------------

def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:  # noqa: BLE001 - a package that fails to import is not here
        return False


def here() -> str:
    """This process's device for the renorm: "cuda" where torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def available(name: str, device: str) -> bool:
    return name in SPECS and SPECS[name].available(device)


def deterministic_names(device: str) -> list[str]:
    """The deterministic implementations that run on `device`, in `deterministic`'s order."""
    return [n for n in DETERMINISTIC_ORDER if available(n, device)]


def pick_deterministic(device: str, preferred: str | None = None) -> str:
    """`preferred` (a deterministic implementation) if it runs on `device`, else the first that does."""
    for name in ([preferred] if preferred else []) + list(DETERMINISTIC_ORDER):
        if name in DETERMINISTIC_ORDER and available(name, device):
            return name
    return "torch"


def routed_to(choice: str, device: str) -> str | None:
    """The implementation the plugin routes sglang's renorms to for `choice` (`renorm_words.plugin_choice`) on
    `device`: None for ``default`` (sglang's own), else `pick_deterministic`."""
    if choice == DEFAULT:
        return None
    return pick_deterministic(device, None if choice == DETERMINISTIC else choice)


def resolve(word: str, device: str) -> str:
    """The implementation a word names on `device`: ``default`` -> flashinfer where it runs, else
    emulated-atomic; ``deterministic`` -> `pick_deterministic`; a name -> itself."""
    if word == DEFAULT:
        return "flashinfer" if available("flashinfer", device) else "emulated-atomic"
    if word == DETERMINISTIC:
        return pick_deterministic(device)
    return word


def get_backend(word: str, device: str, exact: bool = False) -> RenormBackend:
    """The functions of the implementation `word` names on `device` ("cpu" or "cuda"); raises
    BackendUnavailable (one line). `exact`: the implementation itself, no stand-in (loaders above)."""
    name = resolve(word, device)
    spec = SPECS.get(name)
    if spec is None:
        raise BackendUnavailable(f"unknown renorm backend {word!r} (known: {', '.join(HARNESS_RENORMS)})")
    return spec.load(device, exact)


__all__ = ["BackendSpec", "BackendUnavailable", "NAMES", "RenormBackend", "SPECS", "available", "deterministic_names",
           "get_backend", "here", "importable", "pick_deterministic", "resolve", "routed_to"]
