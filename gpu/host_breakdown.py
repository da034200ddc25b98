"""Where an eager top-k(40) call at 1 row spends its host time (session 11): each layer of the public call
timed alone (no sync inside a batch of calls; the GPU queue drained between batches), then a cProfile.

    python3 gpu/host_breakdown.py
"""
import cProfile
import pstats
import time

import torch

from tpguard.kernels import direct_launch as dl
from tpguard.kernels import renorm, renorm_plan

x = torch.softmax(torch.randn(1, 163840, device="cuda"), -1)
out = torch.empty_like(x)


def host_us(fn, n=400, batch=20):
    fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(n // batch):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        total += time.perf_counter() - t0
        torch.cuda.synchronize()
    return total / n * 1e6


for _ in range(3):
    renorm.top_k_renorm(x, 40)
key, plan = renorm_plan.plans()[-1]
launch = plan.direct.launches[0]
values = [x, out, 40, None, None]
stream = dl.current_stream()
steps = {
    "public top_k_renorm(x, 40)": lambda: renorm.top_k_renorm(x, 40),
    "public, validate=False": lambda: renorm.top_k_renorm(x, 40, validate=False),
    "renorm_plan.run": lambda: renorm_plan.run("top_k", x, 40),
    "plan(...) (no key, no lock)": lambda: plan(x, 40, None, None),
    "direct(values) (given out)": lambda: plan.direct(values),
    "launch.launch (one C launch)": lambda: launch.launch(stream, values),
    "accepts(values)": lambda: plan.direct.accepts(values),
    "torch.empty_like": lambda: torch.empty_like(x),
    "plan_key": lambda: renorm_plan.plan_key("top_k", x, 40, None, plan.cfg, None),
    "is_current_stream_capturing": lambda: torch.cuda.is_current_stream_capturing(),
    "dl.current_stream": lambda: dl.current_stream(),
    "torch.cuda.current_device": lambda: torch.cuda.current_device(),
    "hooks_idle": lambda: dl.hooks_idle(*plan.direct.hooks),
}
try:
    import flashinfer.sampling as fs
    steps["flashinfer top_k_renorm_probs"] = lambda: fs.top_k_renorm_probs(x, 40)
except Exception as e:  # noqa: BLE001
    print("flashinfer unavailable:", e)
for name, fn in steps.items():
    print(f"{name:34s} {host_us(fn):7.2f} us")
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    renorm.top_k_renorm(x, 40)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
