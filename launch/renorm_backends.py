"""The renorm step's backends (`--renorm`): top-k, top-p and min-p renormalisation of fp32 probs.

* ``torch``: sort-based reference (`tpguard.kernels.reference`), deterministic.
* ``emulated-atomic``: flashinfer's multi-CTA float atomicAdd sums emulated on any device
  (`tpguard.kernels.emulated_atomic`): two calls on the same bytes may differ in the last bits.
* ``flashinfer`` / ``flashinfer-det``: flashinfer's kernels, default or ``is_deterministic=True``
  (GPU only). flashinfer has no min-p renorm; min-p uses the torch reference there.
* ``tpguard``: the deterministic Triton kernels of the kernels issue (`tpguard.kernels.renorm`).
* ``auto``: what SGLang runs in production on this hardware: flashinfer on GPU when installed,
  emulated-atomic otherwise, so a plain run shows the real failure.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

NAMES = ("torch", "emulated-atomic", "flashinfer", "flashinfer-det", "tpguard")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (one line; exit code 2)."""


@dataclass
class RenormBackend:
    name: str
    top_k: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (probs, top_k int [rows])
    top_p: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (probs, top_p float [rows])
    min_p: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (probs, min_p float [rows])
    deterministic: bool
    source: str  # module the kernels come from
    # logits -> target probs in one pass family (tpguard's kernels/target_probs.py), or None: softmax
    # then the renorms one by one
    fused: Callable | None = None

    def describe(self) -> str:
        return f"{self.name} ({self.source})"

    def target_probs(self, logits: torch.Tensor, temperature: torch.Tensor, params: dict[str, torch.Tensor],
                     fingerprint: bool = False, upto: int | None = None) -> torch.Tensor:
        """Temperature, softmax, then the renorm stages in `params` (top_k, top_p, min_p: per-row
        tensors, in that order; SGLang's dense verify path). `fingerprint`: the result comes with its
        fingerprint attached where the kernels can write it. `upto`: only the first stages, one by
        one (replay's search for the stage that differs)."""
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

    def call(self, kind: str, probs: torch.Tensor, param: torch.Tensor, fingerprint: bool = False) -> torch.Tensor:
        """``kind`` in top_k / top_p / min_p; with `fingerprint`, a kernel that takes
        ``fingerprint_out=`` (tpguard's) returns the result with its fingerprint attached
        (`tpguard.fingerprint.call_with_fingerprint`; the others are called plainly)."""
        fn = getattr(self, kind)
        if fingerprint:
            from tpguard.fingerprint import call_with_fingerprint

            return call_with_fingerprint(fn, probs, param)
        return fn(probs, param)


def flashinfer_available() -> bool:
    try:
        importlib.import_module("flashinfer.sampling")
        return True
    except Exception:
        return False


def resolve_name(name: str, device: str) -> str:
    if name != "auto":
        return name
    if device == "cuda" and flashinfer_available():
        return "flashinfer"
    return "emulated-atomic"


def _torch_backend() -> RenormBackend:
    from tpguard.kernels import reference as ref

    return RenormBackend("torch", ref.top_k_renorm_reference, ref.top_p_renorm_reference,
                         ref.min_p_renorm_reference, True, "tpguard.kernels.reference")


def _emulated_backend() -> RenormBackend:
    from tpguard.kernels import emulated_atomic as emu

    return RenormBackend("emulated-atomic", emu.top_k_renorm_emulated_atomic, emu.top_p_renorm_emulated_atomic,
                         emu.min_p_renorm_emulated_atomic, False, "tpguard.kernels.emulated_atomic")


def _flashinfer_backend(deterministic: bool) -> RenormBackend:
    if not flashinfer_available():
        raise BackendUnavailable("flashinfer is not installed here (pip install flashinfer-python; GPU only)")
    from flashinfer import sampling

    ref = _torch_backend()

    def top_k(probs, k):
        return sampling.top_k_renorm_probs(probs, k.to(torch.int32), is_deterministic=deterministic)

    def top_p(probs, p):
        return sampling.top_p_renorm_probs(probs, p.to(torch.float32), is_deterministic=deterministic)

    name = "flashinfer-det" if deterministic else "flashinfer"
    return RenormBackend(name, top_k, top_p, ref.min_p, deterministic, "flashinfer.sampling")


def _tpguard_backend() -> RenormBackend:
    try:
        mod = importlib.import_module("tpguard.kernels.renorm")
    except ImportError:
        raise BackendUnavailable("the tpguard renorm kernels (tpguard.kernels.renorm) are not installed yet: "
                                 "use --renorm torch for a deterministic run") from None
    from tpguard.kernels.target_probs import target_probs

    return RenormBackend("tpguard", mod.top_k_renorm, mod.top_p_renorm, mod.min_p_renorm, True,
                         "tpguard.kernels.renorm", fused=target_probs)


def get_backend(name: str, device: str) -> RenormBackend:
    """The backend for `--renorm name` on `device` ("cpu" or "cuda"); raises BackendUnavailable."""
    name = resolve_name(name, device)
    if name == "torch":
        return _torch_backend()
    if name == "emulated-atomic":
        return _emulated_backend()
    if name in ("flashinfer", "flashinfer-det"):
        if device != "cuda":
            raise BackendUnavailable(f"--renorm {name} runs on GPUs only")
        return _flashinfer_backend(name == "flashinfer-det")
    if name == "tpguard":
        b = _tpguard_backend()
        if device != "cuda":  # its "auto" backend runs Triton on CUDA tensors, the torch reference elsewhere
            b.source += ": torch reference on CPU"
        return b
    raise BackendUnavailable(f"unknown renorm backend {name!r} (known: {', '.join(NAMES)})")
