"""`tpguard determinism`: are the renorm kernels found here deterministic and batch-invariant?

Runs every renorm implementation of the registry (tpguard/renorm_registry.py) it can find here
(tpguard's Triton kernels, flashinfer's with and without ``is_deterministic``, sgl_kernel's when
present, the torch reference and the emulated-atomic backend) on identical inputs and prints, per
kernel:

* **repeat**: ``n_calls`` calls on the same bytes; how many calls differ from the first one,
  how many rows ever differ, and the largest difference in ulps (bit patterns of the output's
  dtype: ``dtype`` picks float32, float16 or bfloat16 probabilities).
* **batch**: the same rows placed in other batches (alone, reversed, among other rows at other
  positions); how many rows come out different from the first batch's, and the max ulp.

Works on CPU (torch, emulated atomics, tpguard under the Triton interpreter, which is slow: the
CPU defaults are small) and on GPU with everything. ``measure`` returns the rows; ``print_table``
prints the table.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class DeterminismRow:
    kernel: str  # e.g. "tpguard", "flashinfer", "flashinfer-det", "sgl_kernel", "torch", "emulated-atomic"
    op: str  # top_p | top_k | top_k_top_p | min_p
    calls: int = 0
    calls_differing: Optional[int] = None
    rows_differing: Optional[int] = None
    max_ulp: Optional[int] = None
    batch_layouts: int = 0
    batch_rows_differing: Optional[int] = None
    batch_max_ulp: Optional[int] = None
    note: str = ""

    @property
    def deterministic(self) -> Optional[bool]:
        if self.calls_differing is None:
            return None
        return self.calls_differing == 0 and (self.batch_rows_differing or 0) == 0


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row max distance between the bit patterns of two outputs of one dtype (float32, or the
    16-bit ones: ulps of that dtype; NaN == NaN when the bits agree)."""
    wide = a.element_size() == 4
    ai = a.contiguous().view(torch.int32 if wide else torch.int16).long()
    bi = b.contiguous().view(torch.int32 if wide else torch.int16).long()
    # map to a monotone integer line so -0.0/+0.0 and signs are handled
    magnitude = 0x7FFFFFFF if wide else 0x7FFF
    ai = torch.where(ai < 0, -(ai & magnitude), ai)
    bi = torch.where(bi < 0, -(bi & magnitude), bi)
    return (ai - bi).abs().max(dim=1).values


def make_probs(rows: int, vocab: int, device, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale
    return torch.softmax(z, dim=-1).to(dtype).to(device)


# --- the kernels we can find -------------------------------------------------------------------

# the table's kernels, in its order: implementations of the renorm registry (tpguard/renorm_registry.py)
KERNELS = ("tpguard", "flashinfer", "flashinfer-det", "sgl_kernel", "torch", "emulated-atomic")
OPS = ("top_p", "top_k", "top_k_top_p", "min_p")


def _ops(backend) -> Optional[dict]:
    """{op: fn(x, k, p, min_p)} of the ops a loaded backend has."""
    calls = {
        "top_p": backend.top_p and (lambda x, k, p, m: backend.top_p(x, p)),
        "top_k": backend.top_k and (lambda x, k, p, m: backend.top_k(x, k)),
        "top_k_top_p": backend.top_k_top_p and (lambda x, k, p, m: backend.top_k_top_p(x, k, p)),
        "min_p": backend.min_p and (lambda x, k, p, m: backend.min_p(x, m)),
    }
    return {op: fn for op, fn in calls.items() if fn} or None


def find_kernels(device: torch.device, include: Optional[list[str]] = None) -> dict[str, Optional[dict]]:
    """kernel name -> {op: fn(x, k, p, min_p)} (None: not available here): each implementation itself
    (the registry's ``exact`` form: no stand-in where one cannot run or lacks an op)."""
    from tpguard.renorm_registry import get_backend

    found = {}
    for name in KERNELS:
        if include is not None and name not in include:
            continue
        if name == "tpguard" and device.type == "cpu" and "tpguard.kernels.renorm_top_p" not in sys.modules:
            # on CPU the Triton interpreter (Triton reads it when the kernels are defined)
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            found[name] = _ops(get_backend(name, device.type, exact=True))
        except Exception:  # noqa: BLE001 - unavailable, or a kernel that cannot even load: "not here"
            found[name] = None
    return found


# --- the table ----------------------------------------------------------------------------------

def _repeat(fn, x, k, p, m, n_calls):
    first = fn(x, k, p, m).clone()
    calls_diff, rows_diff, max_ulp = 0, torch.zeros(x.shape[0], dtype=torch.bool, device=x.device), 0
    for _ in range(n_calls - 1):
        out = fn(x, k, p, m)
        dist = ulp_distance(out, first)
        differs = dist > 0
        rows_diff |= differs
        calls_diff += int(differs.any())
        max_ulp = max(max_ulp, int(dist.max()))
    return calls_diff, int(rows_diff.sum()), max_ulp


def _layouts(x: torch.Tensor, others: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(batch, positions, rows of x at those positions): the same rows in other compositions."""
    rows = x.shape[0]
    idx = torch.arange(rows, device=x.device)
    half = others.shape[0] // 2
    layouts = [
        (x.flip(0), idx, idx.flip(0)),  # reversed
        (torch.cat([others[:half], x, others[half:]]), idx + half, idx),  # among other rows
        (torch.cat([x, others]), idx, idx),  # a larger batch
    ]
    for i in range(min(rows, 2)):  # alone
        one = torch.tensor([i], device=x.device)
        layouts.append((x[i : i + 1], torch.zeros(1, dtype=torch.long, device=x.device), one))
    return layouts


def _batch_invariance(fn, x, others, k, p, m):
    reference = fn(x, k, p, m).clone()
    rows_diff = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    max_ulp = 0
    layouts = _layouts(x, others)
    for batch, pos, src in layouts:
        dist = ulp_distance(fn(batch, k, p, m)[pos], reference[src])
        rows_diff[src] |= dist > 0
        max_ulp = max(max_ulp, int(dist.max()))
    return len(layouts), int(rows_diff.sum()), max_ulp


def measure(n_calls: int = 20, device: str = "auto", rows: Optional[int] = None, vocab: Optional[int] = None,
            top_k: int = 40, top_p: float = 0.9, min_p: float = 0.1, kernels: Optional[list[str]] = None,
            ops: Optional[list[str]] = None, seed: int = 0, dtype: str = "fp32") -> list[DeterminismRow]:
    """Measure every kernel found on ``device`` ("auto", "cpu", "cuda") on probabilities of ``dtype``
    (fp32, fp16, bf16); see the module doc."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA device is available")
    on_gpu = dev.type == "cuda"
    rows = rows or (64 if on_gpu else 4)
    vocab = vocab or (128256 if on_gpu else 4096)
    if n_calls < 2:
        raise ValueError(f"n_calls must be >= 2, got {n_calls}")
    x = make_probs(rows, vocab, dev, seed, dtype=DTYPES[dtype])
    others = make_probs(6, vocab, dev, seed + 1, scale=4.0, dtype=DTYPES[dtype])
    result = []
    for name, table in find_kernels(dev, kernels).items():
        for op in ops or OPS:
            row = DeterminismRow(kernel=name, op=op)
            fn = (table or {}).get(op)
            if fn is None:
                row.note = "not available here" if table is None else "no such op"
                result.append(row)
                continue
            calls = n_calls
            if name == "tpguard" and not on_gpu:
                calls = min(n_calls, 3)  # the Triton interpreter is slow
                row.note = "Triton interpreter"
            try:
                row.calls = calls
                row.calls_differing, row.rows_differing, row.max_ulp = _repeat(fn, x, top_k, top_p, min_p, calls)
                row.batch_layouts, row.batch_rows_differing, row.batch_max_ulp = _batch_invariance(
                    fn, x, others, top_k, top_p, min_p)
            except Exception as e:  # noqa: BLE001 - one broken kernel must not hide the others
                row.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
            result.append(row)
    return result


def print_table(rows: list[DeterminismRow], file=None) -> None:
    file = file or sys.stdout
    head = ["kernel", "op", "calls differing", "rows differing", "max ulp", "batch rows differing",
            "batch max ulp", "verdict", "note"]
    print("| " + " | ".join(head) + " |", file=file)
    print("|" + "---|" * len(head), file=file)
    for r in rows:
        def f(v):
            return "-" if v is None else str(v)

        calls = "-" if r.calls_differing is None else f"{r.calls_differing}/{max(r.calls - 1, 0)}"
        verdict = {None: "-", True: "deterministic", False: "NON-DETERMINISTIC"}[r.deterministic]
        print("| " + " | ".join([r.kernel, r.op, calls, f(r.rows_differing), f(r.max_ulp),
                                 f(r.batch_rows_differing), f(r.batch_max_ulp), verdict, r.note]) + " |", file=file)


def main(**kwargs) -> int:
    """`tpguard determinism`: keyword arguments of ``measure``; prints the table, returns an exit code
    (0 whatever the verdicts: the table reports, it does not judge)."""
    try:
        device = kwargs.get("device", "auto")
        rows = measure(**kwargs)
    except ValueError as e:
        print(f"tpguard determinism: {e}", file=sys.stderr)
        return 2
    where = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    n_calls = kwargs.get("n_calls", 20)
    print(f"# tpguard determinism on {where}: {n_calls} calls per kernel on identical input (fewer under the "
          f"Triton interpreter), and the same rows in other batches")
    print_table(rows)
    return 0


if __name__ == "__main__":  # `python -m tpguard.determinism` is `tpguard determinism`
    from tpguard.cli import main as cli_main

    sys.exit(cli_main(["determinism", *sys.argv[1:]]))
