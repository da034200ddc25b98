"""The fingerprint's definition and its host reference (numpy): a 64-bit hash of a tensor's dtype,
shape and bytes (trace format v1; definition ``tpguard.fp/2``, recorded in a trace header's
``versions.fingerprint``). The public API is `tpguard.fingerprint`; the Triton kernels
(`tpguard.kernels.fingerprint`) and the renorm write pass must match this module bit for bit.

Definition (the numpy code below is the reference):

* A tensor is viewed as rows: ``R = shape[0]`` rows of ``shape[1:]`` (a 0-d tensor is one row).
* Each row is a sequence of 32-bit words: one word per element for 1- and 2-byte dtypes
  (zero-extended), ``itemsize / 4`` little-endian words per element otherwise.
* Row hash, for words ``w_j`` at position ``j`` and a seed ``s`` (64 bits, from dtype and
  row shape; ``s_lo`` its low 32 bits), all arithmetic modulo 2**32 / 2**64::

      h_j = fmix32((w_j * C1) ^ (j * C2 + s_lo))
      L1 = sum_j h_j ; L2 = sum_j h_j * h_j         (uint64: h_j * h_j is the exact 64-bit
                                                     square; the sums wrap)
      row_fp = fmix64(L1 ^ fmix64(L2 ^ s))

  Sums are modular integer sums, so any reduction order gives the same bits; the position
  ``j`` enters every term, so a permutation changes the value; ``h`` is a bijection of ``w``
  at a fixed ``j`` and L1 cannot wrap (n < 2**32 words), so any single-word change always
  changes L1; two changed words keep both L1 and L2 only if their h values are swapped
  (equal sums and equal squares of two integers), save rare wraps of L2.
  ``tpguard.fp/1`` had L2 = sum_j fmix32(h_j + s_hi): the same properties at ~1.6x the integer
  work per word, which kept the GPU kernel below the memory bandwidth (docs/design-fingerprint.md,
  "The definition, and why one hash per word").
* ``fingerprint_rows(t)[r]`` is the row hash of row ``r`` with ``s = seed(dtype, shape[1:])``.
* ``fingerprint_tensor(t)`` is the row hash of the row fingerprints themselves (each as two words,
  low then high) with ``s = seed(dtype, shape, "top")``: it covers dtype, full shape and
  every byte, and costs one pass over the data plus a tiny second one.

Fingerprints are held as int64 tensors carrying the uint64 bits (torch's uint64 has few ops);
`tpguard.fingerprint.fingerprint_rows` returns a ``torch.uint64`` view for callers.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import xxhash

FORMAT_VERSION = "tpguard.fp/2"  # the seeds include it: a new definition, new values

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
C1 = 0x9E3779B1  # golden-ratio multiplier, spreads the value word
C2 = 0x85EBCA77  # spreads the position
FMIX32_A = 0x85EBCA6B  # murmur3 32-bit finaliser
FMIX32_B = 0xC2B2AE35
FMIX64_A = 0xFF51AFD7ED558CCD  # murmur3 64-bit finaliser
FMIX64_B = 0xC4CEB9FE1A85EC53


# --- seeds (host side, from dtype and shape; never from data) -------------------------------

@lru_cache(maxsize=4096)
def _seed(dtype: str, shape: tuple[int, ...], kind: str) -> int:
    text = f"{FORMAT_VERSION}:{kind}:{dtype}:{','.join(str(int(d)) for d in shape)}"
    return xxhash.xxh64_intdigest(text.encode())


def row_seed(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Seed of each row of a tensor of this dtype and full shape."""
    return _seed(str(dtype), tuple(shape[1:]), "row")


def top_seed(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Seed of the hash over the row fingerprints."""
    return _seed(str(dtype), tuple(shape), "top")


def split_seed(seed: int) -> tuple[int, int]:
    return seed & M32, (seed >> 32) & M32


def to_signed(value: int) -> int:
    """uint64 bits as the int64 a torch tensor stores."""
    value &= M64
    return value - (1 << 64) if value >= (1 << 63) else value


def to_unsigned(value: int) -> int:
    return int(value) & M64


# --- words ---------------------------------------------------------------------------------

def row_words(t: torch.Tensor) -> np.ndarray:
    """The tensor as a [rows, words] uint32 array (host copy; reference path)."""
    t = t.detach().resolve_conj().resolve_neg()  # hash the values a lazy view stands for
    rows = t.shape[0] if t.dim() >= 1 else 1
    flat = t.reshape(-1).contiguous().cpu()
    size = flat.element_size()
    if size == 1:
        words = flat.view(torch.uint8).numpy().astype(np.uint32)
    elif size == 2:
        words = flat.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    else:
        words = flat.view(torch.uint8).numpy().view(np.uint32)
    return words.reshape(rows, -1) if rows else words.reshape(0, 0)


# --- the hash (numpy reference: uint32/uint64 arrays wrap modulo 2**32 / 2**64) -----------

def _fmix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(FMIX32_A)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(FMIX32_B)
    return x ^ (x >> np.uint32(16))


def _fmix64(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(FMIX64_A)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(FMIX64_B)
    return x ^ (x >> np.uint64(33))


def hash_rows_reference(words: np.ndarray, seed: int) -> np.ndarray:
    """Row hash of a [rows, n] uint32 array -> [rows] uint64."""
    s_lo, _ = split_seed(seed)
    n = words.shape[1]
    with np.errstate(over="ignore"):
        pos = np.arange(n, dtype=np.uint32) * np.uint32(C2) + np.uint32(s_lo)
        h = _fmix32((words * np.uint32(C1)) ^ pos).astype(np.uint64)
        lane1 = h.sum(axis=1, dtype=np.uint64)
        lane2 = (h * h).sum(axis=1, dtype=np.uint64)
        return _fmix64(lane1 ^ _fmix64(lane2 ^ np.uint64(seed)))


def fingerprint_rows_reference(t: torch.Tensor) -> torch.Tensor:
    """int64 [rows] (uint64 bits), computed on the host with numpy."""
    out = hash_rows_reference(row_words(t), row_seed(t.dtype, tuple(t.shape)))
    return torch.from_numpy(out.view(np.int64).copy())


def combine_rows_reference(rows_fp: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    words = rows_fp.detach().cpu().contiguous().view(torch.int64).numpy().view(np.uint32)
    out = hash_rows_reference(words.reshape(1, -1), top_seed(dtype, tuple(shape)))
    return int(out[0])


def fingerprint_reference(t: torch.Tensor) -> int:
    """The fingerprint of `t` as a Python int in [0, 2**64), on the host."""
    return combine_rows_reference(fingerprint_rows_reference(t), t.dtype, tuple(t.shape))


def fingerprint_device_reference(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint of `t` computed on the host, as a 0-d int64 tensor (uint64 bits) on `t`'s device."""
    return torch.tensor(to_signed(fingerprint_reference(t)), dtype=torch.int64, device=t.device)


def empty_hash(seed: int) -> int:
    """Row hash of zero words, as the int64 a tensor stores (a constant of the seed: no data)."""
    return to_signed(int(hash_rows_reference(np.zeros((1, 0), dtype=np.uint32), seed)[0]))


def fingerprint_many_reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64 [n] on the host: the fingerprint of each tensor."""
    return torch.tensor([to_signed(fingerprint_reference(t)) for t in tensors], dtype=torch.int64)
