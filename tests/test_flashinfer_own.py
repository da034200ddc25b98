"""flashinfer's own renorm tests, run unchanged with `tpguard.kernels.flashinfer_api` in place of
``flashinfer.sampling``.

The functions are flashinfer's (``tests/utils/test_sampling.py`` of flashinfer 0.7.2.post1, Apache-2.0),
read from a copy outside this repository: ``TPGUARD_FLASHINFER_TESTS`` (default
``.gpu/flashinfer/test_sampling.py``, an ignored folder; the whole file or just its renorm functions).
Without it every case here skips, saying so. The file's ``import flashinfer`` gets a module whose
``sampling`` is the drop-in; nothing else of the file changes on a GPU: with CUDA and
``TRITON_INTERPRET=0`` every parametrization runs at flashinfer's sizes (``RUN``, below).

On CPU (Triton interpreter) the cases are GPU-sized, so the source is read with ``"cuda:0"`` as
``"cpu"``, the parametrized batch sizes above 8 replaced by 5 and the vocabularies above 4500 by 4500
(one full 4096-entry chunk and a tail), and the two mixed-k tests' ``batch_size = 1024`` and
``vocab_size = 128 * 1024`` lines by 8 and 4500.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import types
from pathlib import Path

import pytest
from renorm_setup import DEVICE

from tpguard.kernels import flashinfer_api

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(os.environ.get("TPGUARD_FLASHINFER_TESTS", ROOT / ".gpu" / "flashinfer" / "test_sampling.py"))
RUN = ("test_top_p_renorm_probs", "test_top_p_renorm_probs_per_request", "test_top_k_renorm_probs",
       "test_top_k_renorm_probs_mixed_k_persistent_loop", "test_top_k_mask_logits",
       "test_top_k_mask_logits_mixed_k_persistent_loop", "test_check_tensor_param_top_p",
       "test_check_tensor_param_top_k")
CPU_BATCH, CPU_VOCAB = 5, 4500  # the CPU stand-ins for GPU-sized batch sizes and vocabularies


def _cpu_source(text: str) -> str:
    text = text.replace('"cuda:0"', '"cpu"')
    text = re.sub(r"^(\s*)batch_size = 1024\b", r"\g<1>batch_size = 8", text, flags=re.M)
    return re.sub(r"^(\s*)vocab_size = 128 \* 1024\b", rf"\g<1>vocab_size = {CPU_VOCAB}", text, flags=re.M)


def load_flashinfer_tests():
    """flashinfer's test module with `flashinfer.sampling` = the drop-in, or None (no copy here)."""
    if not SOURCE.is_file():
        return None
    text = SOURCE.read_text()
    if DEVICE == "cpu":
        text = _cpu_source(text)
    shim = types.ModuleType("flashinfer")
    shim.sampling = flashinfer_api
    module = types.ModuleType("flashinfer_test_sampling")
    module.__file__ = str(SOURCE)
    saved = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = shim  # the file's `import flashinfer`
    try:
        exec(compile(text, str(SOURCE), "exec"), module.__dict__)
    finally:
        if saved is None:
            sys.modules.pop("flashinfer", None)
        else:
            sys.modules["flashinfer"] = saved
    return module


def _cpu_values(name: str, values: list) -> list:
    if name == "batch_size":
        return sorted({v if v <= 8 else CPU_BATCH for v in values})
    if name == "vocab_size":
        return sorted({min(v, CPU_VOCAB) for v in values})
    return values


def cases(module) -> list:
    """(function name, kwargs) of every parametrization of the RUN functions (pytest marks read from them)."""
    out = []
    for fname in RUN:
        fn = getattr(module, fname, None)
        if fn is None:
            continue
        grid = []
        for mark in getattr(fn, "pytestmark", []):
            if mark.name == "parametrize":
                names, values = mark.args[0], list(mark.args[1])
                if DEVICE == "cpu":
                    values = _cpu_values(names, values)
                grid.append([(names, v) for v in values])
        for combo in itertools.product(*grid):
            out.append((fname, dict(combo)))
    return out


def _case_id(case) -> str:
    fname, kwargs = case
    parts = [getattr(v, "__name__", None) or str(v).replace("torch.", "") for v in kwargs.values()]
    return f"{fname}[{'-'.join(parts)}]"


MODULE = load_flashinfer_tests()
CASES = cases(MODULE) if MODULE is not None else [("none", {})]


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) if MODULE is not None else "none" for c in CASES])
def test_flashinfer_renorm_tests_pass_on_the_drop_in(case):
    if MODULE is None:
        pytest.skip(f"flashinfer's tests/utils/test_sampling.py is not at {SOURCE} (set TPGUARD_FLASHINFER_TESTS)")
    fname, kwargs = case
    getattr(MODULE, fname)(**kwargs)


def test_every_named_function_is_there():
    if MODULE is None:
        pytest.skip(f"flashinfer's tests/utils/test_sampling.py is not at {SOURCE}")
    missing = [f for f in RUN if not hasattr(MODULE, f)]
    assert not missing, f"not in {SOURCE}: {missing}"
