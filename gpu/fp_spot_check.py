"""GPU fingerprints against the CPU definition on shapes that take the finalize launch (multi-chunk rows),
the top hash fused or not, and the guard's fingerprint_many sets; bit for bit. A quick check after a change
to the fingerprint kernels (session 10: _finalize_kernel inlined its helper).

    python3 gpu/fp_spot_check.py
"""
import sys

import torch

from tpguard.fingerprint import fingerprint, fingerprint_rows
from tpguard.kernels import fingerprint as kfp

bad = 0
g = torch.Generator().manual_seed(0)
for shape, dtype in (((64, 163840), torch.float32), ((3, 70000), torch.bfloat16), ((2000, 4096), torch.float32),
                     ((1, 1 << 20), torch.float32), ((7,), torch.int64)):
    t = torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else torch.randint(0, 9, shape, generator=g)
    want_top, want_rows = fingerprint(t), fingerprint_rows(t)
    tc = t.cuda()
    got_top, got_rows = fingerprint(tc), fingerprint_rows(tc).cpu()
    same = got_top == want_top and torch.equal(got_rows, want_rows)
    bad += not same
    print(f"{tuple(shape)} {dtype}: {'same' if same else 'DIFFER'}")
ts = [torch.randn(64, 163840, generator=g).cuda(), torch.randn(64, 163840, generator=g).cuda(),
      torch.randint(0, 9, (256,), generator=g).cuda()]
want = [fingerprint(t.cpu()) & (2**64 - 1) for t in ts]
for _ in range(3):
    got = [v & (2**64 - 1) for v in kfp.fingerprint_many_triton(ts).cpu().tolist()]
    same = got == want
    bad += not same
    print(f"fingerprint_many (guard-like set): {'same' if same else 'DIFFER'}")
print("all same" if not bad else f"{bad} DIFFER")
sys.exit(1 if bad else 0)
