"""The torch references (kernels/reference.py) against first-principles definitions, flashinfer's
and SGLang's ground truths, and the emulated-atomic backend. Torch only, CPU, fast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpguard.kernels import emulated_atomic as ea
from tpguard.kernels import reference as ref
from tpguard.kernels.renorm import min_p_renorm, top_k_renorm, top_k_top_p_renorm, top_p_renorm


def probs_rows(rows: int, vocab: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale, dim=-1).float()


def ulp_gap(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


# --- first principles (python loops over one row) ---------------------------------------

def keep_top_k_loop(row: list[float], k: int) -> list[bool]:
    pivot = sorted(row, reverse=True)[min(k, len(row)) - 1]
    return [v >= pivot and v > 0 for v in row]


def keep_top_p_loop(row: list[float], p: float) -> list[bool]:
    if p >= 1:
        return [v > 0 for v in row]
    target = float(torch.tensor(p, dtype=torch.float32)) * sum(row)
    running = 0.0
    for v in sorted(row, reverse=True):
        running += v
        if running >= target:
            return [x >= v and x > 0 for x in row]
    return [x > 0 for x in row]


@pytest.mark.parametrize("k", [1, 3, 7, 50])
def test_top_k_matches_definition_and_keeps_ties(k):
    x = torch.tensor([[0.1, 0.2, 0.2, 0.05, 0.2, 0.0, 0.15, 0.1]])
    out = ref.top_k_renorm_reference(x, k)
    assert (out[0] > 0).tolist() == keep_top_k_loop(x[0].tolist(), k)
    assert torch.allclose(out.sum(), torch.tensor(1.0))
    if k == 1:  # three entries tie at the max: all kept (flashinfer's >= pivot)
        assert int((out > 0).sum()) == 3


@pytest.mark.parametrize("p", [1e-6, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_top_p_matches_definition(p):
    x = probs_rows(6, 300, scale=2.0, seed=1)
    out = ref.top_p_renorm_reference(x, p)
    for r in range(x.shape[0]):
        assert (out[r] > 0).tolist() == keep_top_p_loop(x[r].double().tolist(), p)
    kept_sum = out.double().sum(dim=1)
    assert torch.allclose(kept_sum, torch.ones_like(kept_sum), atol=1e-6)


def test_top_p_tie_at_cutoff_keeps_every_tied_entry():
    x = torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0]])
    out = ref.top_p_renorm_reference(x, 0.5)  # cutoff crosses inside the 0.2 tie
    assert (out[0] > 0).tolist() == [True, True, True, True, False]


def test_top_p_matches_flashinfer_ground_truth_without_ties():
    # flashinfer tests/utils/test_sampling.py: keep where the ascending cdf >= 1 - p
    x = probs_rows(8, 2500, seed=3)
    for p in (0.1, 0.5, 0.9):
        sorted_prob, indices = torch.sort(x.double(), descending=False)
        cdf = torch.cumsum(sorted_prob, dim=-1)
        mask = torch.zeros_like(x, dtype=torch.int32).scatter_add_(1, indices, (cdf >= (1 - p)).int())
        truth = torch.where(mask == 1, x.double(), 0.0)
        truth = truth / truth.sum(dim=1, keepdim=True)
        out = ref.top_p_renorm_reference(x, p)
        assert torch.equal(out > 0, mask == 1)
        torch.testing.assert_close(out.double(), truth, rtol=1e-6, atol=1e-9)


def sglang_top_p_normalize_probs_torch(probs, top_ps):
    # sglang 0.5.23 python/sglang/srt/layers/sampler.py, copied for comparison
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[(probs_sum - probs_sort) > top_ps.view(-1, 1)] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    return torch.zeros_like(probs_sort).scatter_(-1, probs_idx, probs_sort)


def test_top_p_close_to_sglang_torch_path():
    x = probs_rows(16, 3000, seed=4)
    p = torch.full((16,), 0.9)
    ours = ref.top_p_renorm_reference(x, p)
    theirs = sglang_top_p_normalize_probs_torch(x.clone(), p)
    assert torch.equal(ours > 0, theirs > 0)
    # SGLang divides by a float32 sum of ~2,700 entries (a few ulp of rounding of its own);
    # ours is within 1 ulp of the exact quotient
    exact = torch.where(ours > 0, x.double() / torch.where(ours > 0, x.double(), 0.0).sum(1, keepdim=True), 0.0)
    assert ulp_gap(ours, exact.float()) <= 1
    assert ulp_gap(ours, theirs) <= 4


def test_min_p_definition():
    x = torch.tensor([[0.5, 0.05, 0.049, 0.2, 0.201, 0.0]])
    out = ref.min_p_renorm_reference(x, 0.1)  # cutoff fp32(0.5 * 0.1) = 0.05
    assert (out[0] > 0).tolist() == [True, True, False, True, True, False]


def test_top_k_top_p_is_composition_and_large_k_skips_top_k():
    x = probs_rows(5, 400, seed=5)
    k = torch.tensor([1, 10, 40, 400, 10**9])
    out = ref.top_k_top_p_renorm_reference(x, k, 0.8)
    composed = ref.top_p_renorm_reference(ref.top_k_renorm_reference(x, k), 0.8)
    assert torch.equal(out[:3], composed[:3])
    assert torch.equal(out[3:], ref.top_p_renorm_reference(x[3:], 0.8))
    assert ulp_gap(out[3:], composed[3:]) <= 2


def test_special_rows():
    x = torch.zeros(5, 64)
    x[0, 7] = 1.0  # one non-zero entry
    x[1] = 1.0 / 64  # all tied
    x[2, 3] = float("nan")  # NaN row
    x[3] = -1.0  # negative entries count as 0: an empty row
    x[3, 5] = 0.5
    # row 4: all zeros
    for out in (ref.top_k_renorm_reference(x, 5), ref.top_p_renorm_reference(x, 0.5),
                ref.min_p_renorm_reference(x, 0.2), ref.top_k_top_p_renorm_reference(x, 5, 0.5)):
        assert out[0, 7] == 1.0 and int((out[0] != 0).sum()) == 1
        assert torch.equal(out[1], torch.full((64,), 1.0 / 64))  # every tied entry is kept
        assert torch.isnan(out[2]).all()
        assert out[3, 5] == 1.0 and int((out[3] != 0).sum()) == 1
        assert torch.equal(out[4], torch.zeros(64))


def test_emulated_atomic_keeps_reference_set_and_varies():
    x = probs_rows(16, 8192, seed=6)
    outs = [ea.top_p_renorm_emulated_atomic(x, 0.9) for _ in range(6)]
    expect = ref.top_p_renorm_reference(x, 0.9)
    for o in outs:
        assert torch.equal(o > 0, expect > 0)
        assert ulp_gap(o, expect) <= 8
    assert any(not torch.equal(outs[0], o) for o in outs[1:])
    k_outs = [ea.top_k_renorm_emulated_atomic(x, 1000) for _ in range(6)]
    assert any(not torch.equal(k_outs[0], o) for o in k_outs[1:])
    assert torch.equal(k_outs[0] > 0, ref.top_k_renorm_reference(x, 1000) > 0)
    m = ea.min_p_renorm_emulated_atomic(x, 0.05)
    assert torch.equal(m > 0, ref.min_p_renorm_reference(x, 0.05) > 0)
    kp = ea.top_k_top_p_renorm_emulated_atomic(x, 100, 0.9)
    assert torch.equal(kp > 0, ref.top_p_renorm_reference(ref.top_k_renorm_reference(x, 100), 0.9) > 0)


def test_api_torch_backend_matches_reference():
    x = probs_rows(3, 100, seed=7)
    assert torch.equal(top_k_renorm(x, 5, backend="torch"), ref.top_k_renorm_reference(x, 5))
    assert torch.equal(top_p_renorm(x, 0.7), ref.top_p_renorm_reference(x, 0.7))  # auto on CPU: torch
    assert torch.equal(min_p_renorm(x, 0.3), ref.min_p_renorm_reference(x, 0.3))
    assert torch.equal(top_k_top_p_renorm(x, 5, 0.7), ref.top_k_top_p_renorm_reference(x, 5, 0.7))


def test_numpy_scalars_are_numbers():
    """Parameters read from numpy arrays (np.int64, np.float32) act as the Python numbers they equal."""
    x = probs_rows(3, 100, seed=8)
    assert torch.equal(top_k_renorm(x, np.int64(5)), top_k_renorm(x, 5))
    assert torch.equal(top_p_renorm(x, np.float32(0.7)), top_p_renorm(x, float(np.float32(0.7))))
    assert torch.equal(min_p_renorm(x, np.float32(0.3)), min_p_renorm(x, float(np.float32(0.3))))
    assert torch.equal(top_k_top_p_renorm(x, np.int32(5), np.float64(0.7)), top_k_top_p_renorm(x, 5, 0.7))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda x: top_k_renorm(x.double(), 5), "float32"),
        (lambda x: top_k_renorm(x[0], 5), "2-D"),
        (lambda x: top_k_renorm(x[:, :0], 5), "empty vocabulary"),
        (lambda x: top_k_renorm(x, 0), ">= 1"),
        (lambda x: top_k_renorm(x, torch.tensor([3, 0, 2])), ">= 1"),
        (lambda x: top_k_renorm(x, torch.tensor([3, 4])), "2 values for 3 rows"),
        (lambda x: top_k_renorm(x, 2.5), "integer"),
        (lambda x: top_p_renorm(x, 0.0), "(0, 1]"),
        (lambda x: top_p_renorm(x, 1.5), "(0, 1]"),
        (lambda x: top_p_renorm(x, float("nan")), "(0, 1]"),
        (lambda x: top_p_renorm(x, torch.tensor([0.5, -0.1, 0.2])), "(0, 1]"),
        (lambda x: top_p_renorm(x, torch.ones(4)), "4 values for 3 rows"),
        (lambda x: min_p_renorm(x, -0.1), "[0, 1]"),
        (lambda x: top_k_top_p_renorm(x, 5, 2.0), "(0, 1]"),
        (lambda x: top_p_renorm(x, 0.5, backend="cuda"), "backend"),
        (lambda x: top_p_renorm("probs", 0.5), "torch.Tensor"),
        (lambda x: top_k_renorm(x, True), "a number or a tensor"),
        (lambda x: top_p_renorm(x, np.float64(1.5)), "(0, 1]"),
        (lambda x: top_k_renorm(x, np.float32(2.5)), "integer"),
    ],
)
def test_bad_input_is_one_line_value_error(call, message):
    x = probs_rows(3, 16)
    with pytest.raises(ValueError) as info:
        call(x)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("call, same_as", [
    (lambda x: top_k_renorm(x, -3), lambda x: top_k_renorm(x, np.int64(-3))),
    (lambda x: top_p_renorm(x, 1.5), lambda x: top_p_renorm(x, np.float64(1.5))),
    (lambda x: top_p_renorm(x, float("nan")), lambda x: top_p_renorm(x, np.float32("nan"))),
    (lambda x: top_k_top_p_renorm(x, 0, 0.5), lambda x: top_k_top_p_renorm(x, np.int32(0), 0.5)),
])
def test_plain_int_and_float_checks_say_what_the_general_ones_say(call, same_as):
    # a Python int / float parameter takes a short path through the checks (host time per call)
    x = probs_rows(3, 16)
    messages = []
    for fn in (call, same_as):
        with pytest.raises(ValueError) as info:
            fn(x)
        messages.append(str(info.value).split(", got")[0])
    assert messages[0] == messages[1]


def test_plain_int_and_float_parameters_give_the_same_bits():
    x = probs_rows(4, 300, seed=9)
    assert torch.equal(top_k_renorm(x, 1 << 40), top_k_renorm(x, np.int64(1 << 40)))  # clamped to the vocab
    assert torch.equal(top_k_top_p_renorm(x, 7, 0.8), top_k_top_p_renorm(x, np.int64(7), np.float64(0.8)))
