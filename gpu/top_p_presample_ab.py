"""A/B (GPU, one process): top-p through the default pipeline vs the one-read variant
(RenormConfig.top_p_presample=1, kernels/renorm_top_p_presample.py), and any other config text.

For each input (flat = logits N(0, 1), mid = N(0, 1) x 4, peaky = N(0, 1) x 5; 256 x 163840 float32
unless told) and each config: us per call eagerly (3 batches of --iters back-to-back calls, the
median) and from a CUDA graph, whether the output bits equal the first config's, and the bracket's
size (entries copied per row, mean / max) where the config brackets. Config texts as
TPGUARD_RENORM_CONFIG's (kernels/renorm_config.config_from_env), ';'-separated, "" = the default.

Usage: python -P gpu/top_p_presample_ab.py [--rows 256] [--vocab 163840] [--p 0.9] [--dtype fp32]
         [--configs ";top_p_presample=1;top_p_presample=1,bracket_pass_maxnreg=96"] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

from tpguard.bench.timing import time_batched, time_graph
from tpguard.kernels.reference import bits
from tpguard.kernels.renorm_config import default_config
from tpguard.kernels.renorm_top_p import top_p_renorm_triton
from tpguard.kernels.renorm_workspace import shapes_for, workspace_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config(text: str):
    from tpguard.config import replace_from_text

    base = default_config()
    return replace_from_text(base, text, "--configs") if text.strip() else base


def probs(rows: int, vocab: int, scale: float, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g, device="cuda").double() * scale
    return torch.softmax(z, dim=-1).to(dtype).contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--p", type=float, default=0.9)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--configs", default=";top_p_presample=1")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    texts = a.configs.split(";")
    inputs = {"flat": 1.0, "mid": 4.0, "peaky": 5.0}
    print(f"# top-p {a.p}, {a.rows} x {a.vocab} {a.dtype}, {torch.cuda.get_device_name()}")
    print("| input | config | eager us | graph us | same bits as first | bracket entries per row (mean / max) |")
    print("|---|---|---|---|---|---|")
    results = []
    for name, scale in inputs.items():
        x = probs(a.rows, a.vocab, scale, DTYPES[a.dtype])
        first = None
        for text in texts:
            cfg = config(text)
            fn = lambda cfg=cfg: top_p_renorm_triton(x, a.p, config=cfg)  # noqa: E731
            out = fn()
            same = first is None or torch.equal(bits(out), bits(first))
            first = out if first is None else first
            ws = workspace_for(shapes_for(a.rows, a.vocab, cfg), cfg, x.device, True, True)
            top_p_renorm_triton(x, a.p, config=cfg, workspace=ws)
            status = ws.plan[:, 0]
            cnt = torch.where(status[:, None] == 2, ws.cnt.view(a.rows, -1), 0).sum(1).float()
            eager = time_batched(fn, a.iters, rounds=3)
            graph = time_graph(fn, a.iters, strict=False)
            row = {"input": name, "config": text or "default", "eager_us": eager, "graph_us": graph, "same": same,
                   "bracket_mean": float(cnt.mean()), "bracket_max": float(cnt.max())}
            results.append(row)
            print(f"| {name} | {row['config']} | {eager:.1f} | {'-' if graph is None else f'{graph:.1f}'} | {same} | "
                  f"{row['bracket_mean']:.0f} / {row['bracket_max']:.0f} |", flush=True)
        del x
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
