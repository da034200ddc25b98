"""`tpguard determinism` on CPU: the emulated flashinfer atomics show differences; the torch reference and
tpguard's kernels (Triton interpreter) show none, over repeated calls and batch compositions."""

from __future__ import annotations

import io

import pytest

from tpguard.determinism import DeterminismRow, main, measure, print_table
from tpguard.config import interpreting

# tpguard's kernels on CPU tensors need the interpreter (conftest.py sets it where there is no CUDA);
# on a GPU machine the table runs on CUDA: `python -m tpguard.determinism --device cuda`, docs/benchmarks.md
INTERPRETER = interpreting()
NO_INTERPRETER = "TRITON_INTERPRET=0 in the environment: tpguard's kernels cannot run on CPU"


def by_key(rows: list[DeterminismRow]) -> dict[tuple[str, str], DeterminismRow]:
    return {(r.kernel, r.op): r for r in rows}


def test_emulated_atomic_differs_between_calls():
    rows = by_key(measure(n_calls=12, device="cpu", rows=4, vocab=8192, kernels=["emulated-atomic"],
                          ops=["top_p", "min_p"]))
    for op in ("top_p", "min_p"):
        r = rows[("emulated-atomic", op)]
        assert r.calls_differing and r.calls_differing > 0, r
        assert r.max_ulp >= 1 and r.deterministic is False


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETER, reason=NO_INTERPRETER)
def test_reference_and_tpguard_kernels_are_deterministic_and_batch_invariant():
    rows = measure(n_calls=3, device="cpu", rows=2, vocab=1024, kernels=["tpguard", "torch"])
    assert {r.kernel for r in rows} == {"tpguard", "torch"}
    for r in rows:
        assert r.note in ("", "Triton interpreter"), r
        assert r.calls_differing == 0 and r.rows_differing == 0 and r.max_ulp == 0, r
        assert r.batch_layouts >= 4 and r.batch_rows_differing == 0 and r.batch_max_ulp == 0, r
        assert r.deterministic is True


def test_missing_kernels_are_reported_not_raised():
    rows = by_key(measure(n_calls=2, device="cpu", rows=1, vocab=64, kernels=["flashinfer", "sgl_kernel"]))
    assert rows[("flashinfer", "top_p")].note == "not available here"
    out = io.StringIO()
    print_table(list(rows.values()), file=out)
    assert "| flashinfer | top_p |" in out.getvalue()


def test_main_bad_device_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert main(n_calls=2, device="cuda") == 2
    err = capsys.readouterr().err
    assert err.startswith("tpguard determinism:") and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETER, reason=NO_INTERPRETER)
def test_16_bit_probabilities():
    """bfloat16 input: tpguard's kernels and the reference deterministic (ulps of bfloat16), the emulated atomics
    not; a bad dtype is one line."""
    import torch

    from tpguard.determinism import ulp_distance

    rows = by_key(measure(n_calls=3, device="cpu", rows=2, vocab=1024, kernels=["tpguard", "torch"], ops=["top_p"],
                          dtype="bf16"))
    assert rows[("tpguard", "top_p")].deterministic is True and rows[("torch", "top_p")].deterministic is True
    a = torch.tensor([[1.0, 0.5]], dtype=torch.bfloat16)
    b = torch.tensor([[1.0, 0.5]], dtype=torch.bfloat16).view(torch.int16).add(3).view(torch.bfloat16)
    assert int(ulp_distance(a, b)[0]) == 3
    assert main(n_calls=2, device="cpu", dtype="fp64") == 2
