"""Which tau search is wrong on the GPU, and is it flaky? (tests/test_renorm_kernels.py
::test_tps_split_tau_search_exact failed on an H200 in run 26 at 1 warp; run 23 at 4 warps.)

Runs the test's kernel (kth_largest_block over one [256] block vs kth_largest_split over the same
160 entries as [4, 32] + [1, 32]) `--repeats` times per (warps, trial, k), against the exact answer
computed here on the host, and prints every mismatch: which search, how often, the values. Writes
the kernel's TTGIR / PTX per num_warps to --dump for reading offline.

    python3 -P gpu/tau_split_probe.py --dump /tmp/res/tau_split
"""
import argparse
import os

import torch
import triton
import triton.language as tl

from tpguard.kernels.radix_select import kth_largest_block
from tpguard.kernels.renorm_top_p import kth_largest_split


@triton.jit
def _pair_kernel(b_ptr, n, k, out_ptr, BLOCK: tl.constexpr, REM: tl.constexpr):
    # (the test's kernel, tests/test_renorm_kernels.py::_kth_largest_pair_kernel)
    i = tl.arange(0, BLOCK)
    rows = tl.arange(0, BLOCK // 2 // REM)[:, None] * REM
    j = tl.arange(0, REM)[None, :]
    bm = tl.load(b_ptr + rows + j, mask=rows + j < n, other=0)
    br = tl.load(b_ptr + BLOCK // 2 + j, mask=BLOCK // 2 + j < n, other=0)
    tl.store(out_ptr, kth_largest_block(tl.load(b_ptr + i, mask=i < n, other=0), k, 0, 0, 8))
    tl.store(out_ptr + 1, kth_largest_split(bm, br, k, 8))


def exact(b: torch.Tensor, k: int) -> int:
    """Largest t = x with low 16 bits 0 (8 rounds of 2 bits from bit 30) and #{b >= t} >= k, t >= 1 << 16 (else 0)."""
    s = sorted(b.tolist(), reverse=True)
    if k > len(s):
        return 0
    t = (s[k - 1] >> 16) << 16
    return t if t >= (1 << 16) else 0


def inputs():
    g = torch.Generator().manual_seed(61)  # the test's inputs, in its order
    for trial in range(3):
        v = torch.rand(160, generator=g) ** 8
        v[::7] = v[3]
        if trial == 2:
            v[:100] = 0.0
        yield trial, v.view(torch.int32).clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--dump", default="")
    ap.add_argument("--device", default="cuda")  # cpu: under TRITON_INTERPRET=1
    a = ap.parse_args()
    out = torch.zeros(2, dtype=torch.int32, device=a.device)
    bad = 0
    for warps in [int(w) for w in a.warps.split(",")]:
        for trial, b in inputs():
            bd = b.to(a.device)
            for k in (1, 4, 37, 150, 160, 161):
                want = exact(b, k)
                seen = {}
                for _ in range(a.repeats):
                    h = _pair_kernel[(1,)](bd, 160, k, out, BLOCK=256, REM=32, num_warps=warps)
                    key = tuple(out.tolist())
                    seen[key] = seen.get(key, 0) + 1
                for (blk, spl), n in seen.items():
                    if blk != want or spl != want:
                        bad += 1
                        print(f"MISMATCH warps={warps} trial={trial} k={k} exact={want:#x} block={blk:#x}"
                              f" split={spl:#x} ({n}/{a.repeats} calls)", flush=True)
                if len(seen) > 1:
                    print(f"FLAKY warps={warps} trial={trial} k={k}: {len(seen)} different outputs", flush=True)
        if a.dump and a.device == "cuda":
            os.makedirs(a.dump, exist_ok=True)
            for ext in ("ttgir", "llir", "ptx"):
                with open(os.path.join(a.dump, f"pair_w{warps}.{ext}"), "w") as f:
                    f.write(h.asm[ext])
    print(f"tau split probe: {bad} mismatching (warps, trial, k, output) cells", flush=True)


if __name__ == "__main__":
    main()
