"""The words that name a renorm implementation, one vocabulary for every surface: ``TPGUARD_RENORM``
and `tpguard serve --renorm` (the SGLang plugin), the harness's ``--renorm``, `tpguard replay`,
`tpguard determinism`, and the kernels' ``backend=`` (kernels/renorm_args.py, a subset: the kernels
import nothing above them). What each word loads and where it runs: tpguard/renorm_registry.py.
It imports nothing: tpguard.config, which the kernels read, checks the environment against it.

Words (one meaning each):

* ``default``: SGLang's renorm as it ships, flashinfer's default kernels (float atomicAdd sums:
  two calls on the same bytes may differ in the last bits). The plugin leaves sglang's binding
  alone; the harness runs ``flashinfer`` where it can (a GPU with flashinfer), else
  ``emulated-atomic``.
* ``deterministic``: the first deterministic implementation that runs here, in the order
  ``tpguard``, ``flashinfer-det``, ``torch`` (the kernels' ``backend=``: tpguard's Triton kernels
  on CUDA tensors, the torch reference elsewhere).
* ``tpguard``: tpguard's deterministic, batch-invariant Triton kernels (tpguard.kernels.renorm);
  where Triton does not run they fall back to their torch reference (``exact``: not at all).
* ``flashinfer-det``: flashinfer's ``is_deterministic=True`` kernels (GPU).
* ``torch``: the torch reference (tpguard.kernels.reference), deterministic, any device.
* ``flashinfer``: flashinfer's default kernels by name (GPU).
* ``emulated-atomic``: flashinfer's multi-CTA float atomicAdd sums emulated on any device
  (tpguard.kernels.emulated_atomic).
* ``sgl_kernel``: sgl_kernel's renorms (GPU; the determinism table only).

Old spellings, still accepted: ``--renorm auto`` = ``default``; ``TPGUARD_RENORM_BACKEND=NAME``
with ``TPGUARD_RENORM=deterministic`` = ``TPGUARD_RENORM=NAME``, its value ``flashinfer`` meaning
``flashinfer-det``.
"""

from __future__ import annotations

DEFAULT = "default"
DETERMINISTIC = "deterministic"
# deterministic implementations, in the order `deterministic` tries them
DETERMINISTIC_ORDER = ("tpguard", "flashinfer-det", "torch")

# The words each surface takes (canonical spellings), and its old spellings.
HARNESS_RENORMS = (DEFAULT, DETERMINISTIC, "tpguard", "flashinfer-det", "torch", "flashinfer", "emulated-atomic")
HARNESS_ALIASES = {"auto": DEFAULT}
PLUGIN_RENORMS = (DEFAULT, DETERMINISTIC, "tpguard", "flashinfer-det", "torch")  # TPGUARD_RENORM
RENORM_BACKEND_VALUES = ("", "tpguard", "flashinfer-det", "torch")  # TPGUARD_RENORM_BACKEND ("": the first)
RENORM_BACKEND_ALIASES = {"flashinfer": "flashinfer-det"}


def harness_renorm(text: str) -> str:
    """A `--renorm` value in its canonical spelling (``auto`` -> ``default``); unknown words stay as
    typed, for the option check to refuse."""
    word = text.strip().lower()
    return HARNESS_ALIASES.get(word, word)


def plugin_choice(renorm: str, renorm_backend: str = "") -> str:
    """What the plugin routes sglang's renorms to, from TPGUARD_RENORM and the older
    TPGUARD_RENORM_BACKEND (both checked by tpguard.config): ``default`` (nothing routed),
    ``deterministic`` (the first that runs) or an implementation's name (preferred: the first that
    runs where it does not)."""
    if renorm == DETERMINISTIC and renorm_backend:
        return RENORM_BACKEND_ALIASES.get(renorm_backend, renorm_backend)
    return renorm
