"""An import stand-in for flashinfer, for the UNO tests only (imported by their zygote, never on
sys.path as `flashinfer`): sglang's uno_utils and uno_tree import `flashinfer.top_k` at module
level, and flashinfer cannot run on this CPU machine. The UNO paths the tests drive (greedy pack,
dense rejection) never call it; if anything does, it raises."""

import importlib.machinery
import sys
import types


def _unavailable(*args, **kwargs):
    raise RuntimeError("flashinfer is not available on this machine (tests/flashinfer_stand_in.py)")


if "flashinfer" not in sys.modules:
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.top_k = _unavailable
    sys.modules["flashinfer"] = module
