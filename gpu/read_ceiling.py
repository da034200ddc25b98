"""Probe (GPU): the read bandwidth ceiling for one 256 x 163840 fp32 tensor (168 MB) on this GPU,
to judge the fingerprint kernel (target <= 48 us = 3.5 TB/s) against what a plain read can do.

Each Triton variant reads the tensor once as int32 words and xor/add-reduces them (one ALU op per
word, so it is load-bound), one partial per program. Variants: block (words per step), warps,
programs (a grid of whole chunks, or a persistent grid-stride grid of SMs x k programs).
Timed by CUDA-graph replay (median); also torch.sum and a device copy (read + write).

Usage: python -P gpu/read_ceiling.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpguard.bench.timing import time_graph


@triton.jit
def _chunk_sum(x_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for k in range(0, CHUNK, BLOCK):
        offs = base + k + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _stride_sum(x_ptr, out_ptr, n, n_blocks, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(pid, n_blocks, nprog):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def main():
    rows, vocab = 256, 163840
    x = torch.randn(rows, vocab, device="cuda")
    w = x.view(torch.int32).reshape(-1)
    n = w.numel()
    nbytes = x.numel() * 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = []

    def report(name, us, moved=nbytes):
        res.append((name, us))
        print(f"{name:44s} {us:7.1f} us  {moved / us / 1e6:6.2f} TB/s", flush=True)

    report("torch.sum", time_graph(lambda: x.sum(), 50))
    report("torch.sum(dim=1)", time_graph(lambda: x.sum(dim=1), 50))
    y = torch.empty_like(x)
    report("copy (read+write)", time_graph(lambda: y.copy_(x), 50), 2 * nbytes)
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 4), (8192, 8)):
        for chunk in (16384, 32768, 65536, 131072):
            if chunk < block:
                continue
            grid = triton.cdiv(n, chunk)
            out = torch.empty(grid, dtype=torch.int32, device="cuda")
            fn = lambda: _chunk_sum[(grid,)](w, out, n, CHUNK=chunk, BLOCK=block, num_warps=warps)
            report(f"chunk {chunk} block {block} w{warps} ({grid} progs)", time_graph(fn, 50))
        for k in (4, 8, 16):
            grid = sms * k
            nb = triton.cdiv(n, block)
            out = torch.empty(grid, dtype=torch.int32, device="cuda")
            fn = lambda: _stride_sum[(grid,)](w, out, n, nb, BLOCK=block, num_warps=warps)
            report(f"stride block {block} w{warps} ({k}/SM)", time_graph(fn, 50))
    best = min(res[3:], key=lambda r: r[1])
    print(f"best triton read: {best[0]} {best[1]:.1f} us ({nbytes / best[1] / 1e6:.2f} TB/s)")


if __name__ == "__main__":
    main()
