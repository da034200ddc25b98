"""The flashinfer-style drop-in (kernels/flashinfer_api.py): flashinfer 0.7.2.post1's names,
signatures, parameter conversions and parameter-shape errors, on tpguard's kernels (Triton under
the interpreter here, the torch reference with backend "torch")."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from renorm_setup import DEVICE

from tpguard import fingerprint as fp_host
from tpguard.kernels import flashinfer_api as fi
from tpguard.kernels import reference as ref
from tpguard.kernels.renorm import TIE_RULE, top_k_renorm, top_p_renorm


def probs_rows(rows: int, vocab: int, scale: float = 2.0, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale, -1).to(dtype).to(DEVICE)


def test_names_and_signatures_are_flashinfers():
    assert fi.top_k_renorm_prob is fi.top_k_renorm_probs and fi.top_p_renorm_prob is fi.top_p_renorm_probs
    for fn, params in ((fi.top_p_renorm_probs, ["probs", "top_p", "is_deterministic"]),
                       (fi.top_k_renorm_probs, ["probs", "top_k", "is_deterministic"]),
                       (fi.top_k_mask_logits, ["logits", "top_k"])):
        sig = inspect.signature(fn)
        positional = [n for n, p in sig.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional == params, fn.__name__
        if "is_deterministic" in sig.parameters:
            assert sig.parameters["is_deterministic"].default is False


@pytest.mark.parametrize("fn, value", [(fi.top_p_renorm_probs, 0.5), (fi.top_k_renorm_probs, 10),
                                       (fi.top_k_mask_logits, 10)])
def test_parameter_shape_errors_word_for_word(fn, value):
    x = probs_rows(3, 50)
    with pytest.raises(ValueError, match=r"^Expected a 1D tensor or scalar for the sampling parameter, "
                                         r"but got a 2D tensor\.$"):
        fn(x, torch.full((3, 50), value, device=DEVICE))
    with pytest.raises(ValueError, match=r"^Expected a 1D tensor of shape \(batch_size,\) or scalar for the "
                                         r"sampling parameter, but got a 0-dimensional tensor\.$"):
        fn(x, torch.tensor(value, device=DEVICE))
    with pytest.raises(ValueError, match=r"^Sampling parameter tensor batch size mismatch: expected length 3 "
                                         r"to match the reference tensor batch size, but got length 2\.$"):
        fn(x, torch.full((2,), value, device=DEVICE))
    with pytest.raises(ValueError, match="2D tensor"):
        fn(x[0], value)
    assert fn(x, torch.full((3,), value, device=DEVICE)).shape == x.shape


def test_parameter_conversions_as_flashinfer():
    x = probs_rows(4, 300, seed=1)
    # top_p as an int tensor: .float() (flashinfer's test_check_tensor_param_top_p passes int tensors)
    p_int = torch.tensor([0, 1, 0, 1], dtype=torch.int32, device=DEVICE)
    out = fi.top_p_renorm_probs(x, p_int)
    assert torch.equal(ref.bits(out), ref.bits(ref.top_p_renorm_reference(x, p_int.float())))
    assert ((out > 0).sum(1)[[0, 2]] == 1).all() and ((out > 0).sum(1)[[1, 3]] == 300).all()
    # top_k as a float tensor: .int() (truncated)
    k_float = torch.tensor([2.7, 40.0, 1.0, 1e9], device=DEVICE)
    out = fi.top_k_renorm_probs(x, k_float)
    assert torch.equal(ref.bits(out), ref.bits(ref.top_k_renorm_reference(x, torch.tensor([2, 40, 1, 300]))))
    # values are not checked (flashinfer checks none): clamped like the kernels
    assert torch.equal(ref.bits(fi.top_p_renorm_probs(x, 1.5)), ref.bits(ref.top_p_renorm_reference(x, 1.0)))
    assert torch.equal(ref.bits(fi.top_k_renorm_probs(x, 0)), ref.bits(ref.top_k_renorm_reference(x, 1)))
    assert torch.equal(fi.top_k_renorm_probs(x, 5, is_deterministic=True), fi.top_k_renorm_probs(x, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_output_dtype_and_values(dtype):
    x = probs_rows(3, 700, seed=2, dtype=dtype)
    k = torch.tensor([1, 40, 700], dtype=torch.int64, device=DEVICE)
    p = torch.tensor([0.3, 0.9, 1.0], device=DEVICE)
    a = fi.top_k_renorm_probs(x, k)
    b = fi.top_p_renorm_probs(x, p)
    assert a.dtype == b.dtype == dtype
    assert torch.equal(ref.bits(a), ref.bits(top_k_renorm(x, k, backend="torch")))
    assert torch.equal(ref.bits(b), ref.bits(top_p_renorm(x, p, backend="torch")))
    # the explicit backends agree bit for bit
    assert torch.equal(ref.bits(fi.renorm_probs("top_k", x, k, backend="torch")), ref.bits(a))


def test_other_dtypes():
    x = probs_rows(2, 100, seed=3)
    out = fi.top_p_renorm_probs(x.double(), 0.8)  # flashinfer's top-p casts to float32 first
    assert out.dtype == torch.float32 and torch.equal(out, fi.top_p_renorm_probs(x, 0.8))
    with pytest.raises(ValueError, match="Unsupported dtype torch.float64"):
        fi.top_k_renorm_probs(x.double(), 5)
    with pytest.raises(ValueError, match="Unsupported dtype"):
        fi.top_k_mask_logits(x.double(), 5)
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        fi.top_k_renorm_probs([[0.5, 0.5]], 1)
    with pytest.raises(ValueError, match="must be a number or a tensor"):
        fi.top_k_renorm_probs(x, "5")
    with pytest.raises(ValueError, match="must be a number or a tensor"):
        fi.top_k_renorm_probs(x, True)


def test_numpy_scalar_parameters():
    """Parameters read from numpy arrays (np.int64, np.float32) are numbers, as Python's are."""
    x = probs_rows(2, 100, seed=5)
    assert torch.equal(fi.top_k_renorm_probs(x, np.int64(5)), fi.top_k_renorm_probs(x, 5))
    assert torch.equal(fi.top_p_renorm_probs(x, np.float32(0.5)), fi.top_p_renorm_probs(x, float(np.float32(0.5))))
    assert torch.equal(fi.top_k_mask_logits(x, np.int32(7)), fi.top_k_mask_logits(x, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_out_extension(dtype):
    x = probs_rows(3, 500, seed=4, dtype=dtype)
    for fn, param in ((fi.top_k_renorm_probs, 20), (fi.top_p_renorm_probs, 0.9)):
        slot = torch.zeros((), dtype=torch.int64, device=DEVICE)
        out = fn(x, param, fingerprint_out=slot)
        assert fp_host.to_unsigned(int(slot)) == fp_host.fingerprint_tensor(out.cpu())


def test_tie_rule_keeps_ties():
    x = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]], device=DEVICE)
    assert fi.top_k_renorm_probs(x, 2).cpu().tolist() == [[0.5, 0.25, 0.25, 0.0, 0.0]]
    assert "ties at the cutoff are kept" in TIE_RULE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_top_k_mask_logits(dtype):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(5, 300, generator=g) * 4).to(dtype)
    logits[1, :] = torch.round(logits[1, :])  # many ties
    logits[2, ::3] = float("-inf")
    logits[3, :250] = float("-inf")  # fewer finite entries than k
    logits[4, 7] = float("nan")
    logits = logits.to(DEVICE)
    k = torch.tensor([10, 10, 10, 100, 10], device=DEVICE)
    out = fi.top_k_mask_logits(logits, k)
    assert out.dtype == dtype
    x = logits.float().cpu()
    for r in range(4):
        pivot = torch.sort(x[r], descending=True).values[int(k[r]) - 1]
        keep = x[r] >= pivot
        got = out[r].float().cpu()
        assert torch.equal(got[keep], x[r][keep]) and torch.isneginf(got[~keep]).all(), r
    assert (out[1] > float("-inf")).sum() >= 10  # the tie at the pivot kept whole
    assert torch.isnan(out[4]).all()
    same = fi.top_k_mask_logits(logits, 300)  # k >= vocab keeps the row
    assert torch.equal(torch.nan_to_num(same[:4].float()), torch.nan_to_num(logits[:4].float()))
    # batch-invariant: a row alone gives the same bits
    assert torch.equal(ref.bits(fi.top_k_mask_logits(logits[1:2], 10)), ref.bits(out[1:2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_mask_logits_any_search_width_same_bits(dtype):
    """The whole-row search a CUDA graph capture takes gives the eager search's bits (ties, -inf, NaN rows)."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(6, 500, generator=g) * 3).to(dtype)
    logits[1] = torch.round(logits[1])
    logits[2, ::2] = float("-inf")
    logits[3, :495] = float("-inf")
    logits[4, 9] = float("nan")
    logits = logits.to(DEVICE)
    k = torch.tensor([1, 17, 40, 200, 3, 400], dtype=torch.int64, device=DEVICE)
    narrow = fi._mask_below_kth(logits, k, int(k.max()))
    for width in (int(k.max()) + 1, 499, 500):
        assert torch.equal(ref.bits(fi._mask_below_kth(logits, k, width)), ref.bits(narrow)), width
    assert torch.equal(ref.bits(fi.top_k_mask_logits(logits, k)), ref.bits(narrow))
    assert torch.equal(ref.bits(fi.top_k_mask_logits(logits, 17)), ref.bits(fi._mask_below_kth(logits, k * 0 + 17, 500)))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graph capture")
def test_top_k_mask_logits_in_a_cuda_graph():
    logits = (torch.randn(8, 32000, device="cuda") * 4).to(torch.bfloat16)
    k = torch.tensor([1, 5, 40, 40, 100, 1000, 31999, 32000], dtype=torch.int32, device="cuda")
    eager = fi.top_k_mask_logits(logits, k)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fi.top_k_mask_logits(logits, k)  # warm-up off the default stream, as capture wants
        fi.top_k_mask_logits(logits, 40)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_tensor_k = fi.top_k_mask_logits(logits, k)
        out_int_k = fi.top_k_mask_logits(logits, 40)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ref.bits(out_tensor_k), ref.bits(eager))
    assert torch.equal(ref.bits(out_int_k), ref.bits(fi.top_k_mask_logits(logits, 40)))
