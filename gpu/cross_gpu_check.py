"""Identical on every GPU of the same model: the same input on two GPUs gives the same
bytes from every tpguard renorm, and the same fingerprints.

    python gpu/cross_gpu_check.py [out.json]        (needs 2 GPUs; gpu/check.sh runs it in its kernels phase)

Inputs are made on the CPU (float64 softmax, then float32) and copied to each GPU, so both get the
same bytes; each op runs on each GPU with the default RenormConfig and the outputs are compared
bit for bit on the host. Prints one line per shape and a final `pass` / `FAIL`.
"""

from __future__ import annotations

import json
import sys

import torch

from tpguard.fingerprint import fingerprint_tensor
from tpguard.kernels import renorm

OPS = {
    "top_p": lambda x: renorm.top_p_renorm(x, 0.9),
    "top_k40": lambda x: renorm.top_k_renorm(x, 40),
    "top_k1024": lambda x: renorm.top_k_renorm(x, 1024),
    "top_k_top_p": lambda x: renorm.top_k_top_p_renorm(x, 40, 0.9),
    "min_p": lambda x: renorm.min_p_renorm(x, 0.1),
}


def cpu_probs(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale, -1).float()


def main(argv: list[str]) -> int:
    if torch.cuda.device_count() < 2:
        print("cross_gpu_check: needs 2 GPUs")
        return 2
    devices = [torch.device("cuda", i) for i in range(2)]
    names = {str(d): torch.cuda.get_device_name(d) for d in devices}
    results, bad = [], 0
    for rows, vocab in ((1, 163840), (8, 163840), (64, 163840), (256, 163840), (256, 128256)):
        for logits, scale in (("flat", 1.0), ("peaky", 5.0)):
            x = cpu_probs(rows, vocab, scale, seed=rows + vocab)
            for op, fn in OPS.items():
                outs, fps = [], []
                for d in devices:
                    with torch.cuda.device(d):
                        y = fn(x.to(d))
                        fps.append(fingerprint_tensor(y))
                        outs.append(y.cpu())
                same = torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
                rows_diff = int((outs[0].view(torch.int32) != outs[1].view(torch.int32)).any(1).sum())
                ok = same and fps[0] == fps[1]
                bad += not ok
                results.append({"rows": rows, "vocab": vocab, "logits": logits, "op": op,
                                "identical": same, "rows_differing": rows_diff, "fingerprints_equal": fps[0] == fps[1]})
            line = " ".join(f"{r['op']}={'same' if r['identical'] else 'DIFF'}" for r in results[-len(OPS):])
            print(f"{rows:>4} x {vocab} {logits:<5}: {line}", flush=True)
    verdict = "pass" if bad == 0 else "FAIL"
    print(f"cross-GPU: {len(results) - bad}/{len(results)} (op, shape) cells bit-identical on {names}: {verdict}")
    if argv:
        with open(argv[0], "w") as f:
            json.dump({"devices": names, "cells": results, "pass": bad == 0}, f, indent=1)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
