"""Renorm call plans (kernels/renorm_plan.py): a cached workspace (and, on a GPU, recorded direct
launches, kernels/direct_launch.py) gives the bits of the plan-free path (a fresh workspace per call),
with the parameters of each call, keyed and bounded as documented.

On CPU the kernels run under the Triton interpreter, where direct launches are off: these tests
check the workspace reuse and the keys; the direct launches are checked where CUDA is present
(test_direct_launches_on_gpu) and by ``python gpu/renorm_host.py --gpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from renorm_setup import DEVICE, GPU_ALL, INTERPRET, SMALL

from tpguard.config import launch_trim
from tpguard.kernels import direct_launch as dl
from tpguard.kernels import renorm_plan as rp

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN rows

VOCAB = 700


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch, request):
    # on a GPU every block shape is a compile: only the direct-launch test runs there unless
    # TPGUARD_RENORM_GPU_TESTS=all (as in test_renorm_kernels.py)
    if DEVICE == "cuda" and not GPU_ALL \
            and request.node.name not in ("test_direct_launches_on_gpu", "test_graph_replays_on_gpu"):
        pytest.skip("GPU: direct-launch test only (TPGUARD_RENORM_GPU_TESTS=all runs every test)")
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "4")
    monkeypatch.setenv("TPGUARD_RENORM_PLAN_MB", "256")
    rp.clear_plans()
    yield
    rp.clear_plans()


def batch(seed: int = 0) -> torch.Tensor:
    """Flat rows (bracket passes), a peaky row (gather path) and a NaN row."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, VOCAB, generator=g, dtype=torch.float64) * torch.tensor([[1.0], [1.0], [5.0], [1.0]])
    x = torch.softmax(logits, -1).float()
    x[3, 7] = float("nan")
    return x.to(DEVICE)


def params(op: str, tensor: bool, k: int = 40, p: float = 0.9):
    """(top_k, top_p) as run() takes them: scalars, or [rows] tensors on the device."""
    rows = 4
    kk = (torch.tensor([k, 3, k, VOCAB], dtype=torch.int32, device=DEVICE) if tensor else k) \
        if op in ("top_k", "top_k_top_p") else None
    pv = p if op != "min_p" else p / 9
    pp = (torch.tensor([pv, pv / 2, pv, 1.0][:rows], dtype=torch.float32, device=DEVICE) if tensor else pv) \
        if op != "top_k" else None
    return kk, pp


def fresh(op, x, k, p, fp=None):
    """The plan-free path: a fresh workspace, Triton's launches."""
    return rp._run_op(op, x, k, p, SMALL, fp, None)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def slot():
    return torch.zeros((), dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("tensor, with_fp, op", [
    pytest.param(tensor, with_fp, op, id=f"{'tensor-fp' if tensor else 'scalar'}-{op}",
                 marks=[pytest.mark.slow] if op == "top_k_top_p" else [])
    for op in rp.OPS for tensor, with_fp in ((False, False), (True, True))])
def test_plan_gives_the_fresh_path_bits(op, tensor, with_fp):
    x = batch()
    k, p = params(op, tensor)
    fp_fresh, fp_plan = (slot(), slot()) if with_fp else (None, None)
    expect = fresh(op, x, k, p, fp_fresh)
    for i in range(3):  # new plan, reused, reused after garbage in every workspace buffer
        if i == 2:
            rp.plans()[-1][1].poison()
        out = rp.run(op, x, k, p, SMALL, fp_plan)
        assert torch.equal(bits(out), bits(expect)), (op, i)
        if with_fp:
            assert int(fp_plan) == int(fp_fresh), (op, i)
        assert out.data_ptr() != expect.data_ptr()
    assert len(rp.plans()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("op", rp.OPS)
def test_new_parameters_on_the_same_plan(op):
    x = batch(1)
    for k_val, p_val in ((40, 0.9), (7, 0.5)):  # 40 and 7: the same int specialisation
        k, p = params(op, False, k_val, p_val)
        out = rp.run(op, x, k, p, SMALL)
        assert torch.equal(bits(out), bits(fresh(op, x, k, p))), (op, k_val, p_val)
    # the same tensor objects refilled in place between calls: read again, not remembered
    k, p = params(op, True)
    rp.run(op, x, k, p, SMALL)
    if p is not None:
        p.fill_(0.2 if op != "min_p" else 0.02)
    if k is not None:
        k.fill_(5)
    assert torch.equal(bits(rp.run(op, x, k, p, SMALL)), bits(fresh(op, x, k, p)))
    assert len(rp.plans()) == 2, [key for key, _ in rp.plans()]  # one per parameter kind


@pytest.mark.slow
def test_keys_separate_what_the_launches_depend_on():
    x = batch()
    k40, p = params("top_k_top_p", False)
    cases = [
        ("top_k_top_p", x, 40, 0.9, SMALL, None),
        ("top_k_top_p", x, 32, 0.9, SMALL, None),  # k % 16 == 0: another Triton specialisation
        ("top_k_top_p", x, 1, 0.9, SMALL, None),  # k == 1: a constant in the kernel
        ("top_k_top_p", x, VOCAB, 0.9, SMALL, None),  # k >= vocab: the bracket passes run
        ("top_k_top_p", x, *params("top_k_top_p", True), SMALL, None),  # tensor parameters
        ("top_k_top_p", x, 40, 0.9, SMALL, slot()),  # fingerprint slot
        ("top_k_top_p", x, 40, 0.9, SMALL.replace(z=4.0), None),  # config
        ("top_k_top_p", x[:2], 40, 0.9, SMALL, None),  # rows
        ("top_k_top_p", x[:, :600].contiguous(), 40, 0.9, SMALL, None),  # vocab
        ("top_p", x, None, 0.9, SMALL, None),  # op
    ]
    keys = {rp.plan_key(op, xx, *rp._scalars(xx, k, pp), cfg, fp) for op, xx, k, pp, cfg, fp in cases}
    assert len(keys) == len(cases)
    # what the launches do not depend on shares a plan: a float's value, an int of the same class
    assert rp.plan_key("top_k_top_p", x, 40, 0.9, SMALL, None) == rp.plan_key("top_k_top_p", x, 7, 0.1, SMALL, None)
    # and each of those cases gives its fresh-path bits through its plan
    for op, xx, k, pp, cfg, fp in (cases[1], cases[3]):
        assert torch.equal(bits(rp.run(op, xx, k, pp, cfg, fp)), bits(rp._run_op(op, xx, k, pp, cfg, None, None)))
    assert len(rp.plans()) == 2


@pytest.mark.slow
def test_lru_and_byte_cap(monkeypatch):
    x = batch()
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "2")
    for rows in (1, 2, 3):
        rp.run("top_k", x[:rows], 40, None, SMALL)
    assert [key[1] for key, _ in rp.plans()] == [2, 3]  # rows 1 evicted
    rp.run("top_k", x[:2], 40, None, SMALL)  # used: now the most recent
    rp.run("top_k", x[:4], 40, None, SMALL)
    assert [key[1] for key, _ in rp.plans()] == [2, 4]
    one = rp.plans()[-1][1].nbytes
    monkeypatch.setenv("TPGUARD_RENORM_PLAN_MB", repr(one / (1 << 20)))  # room for one such plan
    rp.run("top_k", x[:3], 40, None, SMALL)
    assert [key[1] for key, _ in rp.plans()] == [3] and rp.plan_bytes() <= one
    out = rp.run("top_p", x, None, 0.9, SMALL)  # larger than the cap alone: used once, not kept
    assert torch.equal(bits(out), bits(fresh("top_p", x, None, 0.9)))
    assert [key[1] for key, _ in rp.plans()] == [3]
    rp.clear_plans()
    assert rp.plans() == [] and rp.plan_bytes() == 0
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "0")  # switched off: the plan-free path, nothing cached
    assert torch.equal(bits(rp.run("top_k", x, 40, None, SMALL)), bits(fresh("top_k", x, 40, None)))
    assert rp.plans() == []


def test_capture_rule(monkeypatch):
    assert rp.plan_allowed(capturing=False)
    assert not rp.plan_allowed(capturing=True)
    monkeypatch.setenv("TPGUARD_RENORM_PLANS", "0")
    assert not rp.plan_allowed(capturing=False)


def test_ops_do_no_other_torch_work(monkeypatch):
    # direct launches replay only Triton launches: an op that also ran a torch kernel per call
    # (a fill_, a copy_) would lose it, so the recording refuses such a run. Here the op's host
    # code alone, with the interpreter's launches stubbed (as gpu/renorm_host.py does).
    import triton.runtime.interpreter as interp

    if not INTERPRET:
        pytest.skip("stubs the interpreter's launches")
    monkeypatch.setattr(interp.InterpretedFunction, "__getitem__", lambda self, grid: (lambda *a, **k: None))
    x = batch()
    for op in rp.OPS:
        for tensor, fp in ((False, None), (True, slot())):
            k, p = params(op, tensor)
            rp.run(op, x, k, p, SMALL, fp)
            ws = rp.plans()[-1][1].ws
            work = dl._TorchWork()
            with work.mode:
                rp._run_op(op, x, k, p, SMALL, fp, ws)
            assert work.seen == [], (op, tensor, work.seen)


def test_torch_work_watcher_names_calls_that_may_do_gpu_work():
    # the watcher behind the refusal above: a fill_, a copy_, a reshape (may copy) are named;
    # allocations, views and metadata are not
    work = dl._TorchWork()
    x = torch.zeros(4, 6)
    with work.mode:
        y = torch.empty_like(x).view(6, 4)
        _ = (y.shape, y.stride(), y.data_ptr(), y.is_cuda, y.numel())
        y.fill_(1.0)
        x.copy_(y.view(4, 6))
        x.t().reshape(24)
    assert work.seen == ["fill_", "copy_", "reshape"], work.seen


def test_int_class_is_tritons_specialisation():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    seen = {}
    for v in (1, 2, 7, 16, 32, 40, 163840, 2 ** 31 - 1, 2 ** 31):
        spec = native_specialize_impl(BaseBackend, v, False, True, True)
        seen.setdefault(dl.int_class(v), set()).add(spec)
    assert all(len(specs) == 1 for specs in seen.values()), seen


@pytest.mark.skipif(DEVICE != "cuda" or not dl.enabled(), reason="direct launches need CUDA")
def test_direct_launches_on_gpu():
    x = batch()
    for op in rp.OPS:
        for tensor, fp in ((False, None), (True, slot())):
            k, p = params(op, tensor)
            fp_fresh = slot() if fp is not None else None
            expect = fresh(op, x, k, p, fp_fresh)
            for _ in range(3):
                out = rp.run(op, x, k, p, SMALL, fp)
                assert torch.equal(bits(out), bits(expect)), op
                if fp is not None:
                    assert int(fp) == int(fp_fresh)
            plan = rp.plans()[-1][1]
            assert plan.state == "on", (op, plan.refusal)
            k2, p2 = params(op, tensor, 7, 0.5)
            assert torch.equal(bits(rp.run(op, x, k2, p2, SMALL)), bits(fresh(op, x, k2, p2)))
            # the trimmed templates: addresses, no tensors, no hook chains to call
            for launch in plan.direct.launches:
                assert not launch_trim() or not any(isinstance(a, torch.Tensor) for a in launch.template), launch.name
            if launch_trim() and triton.__version__ == "3.6.0":  # the GPU machine's: its C launch, called directly
                assert all(launch.run is not launch.compiled.run for launch in plan.direct.launches), dl.LAUNCHERS


def test_one_tensor_in_two_roles_is_recorded_as_two():
    """The fused op may get one tensor as top-p and min-p (SGLang's parameters go to the kernels as
    they are): the recording sees two objects over the same memory, so each role gets its own
    argument slot (a later call may pass two tensors); distinct tensors stay as they are."""
    from tpguard.kernels.renorm_graph import MP, P, PROBS, T

    x, p, t = torch.rand(2, 5), torch.rand(2), torch.rand(2)
    values = [x, None, None, p, None, p, t]
    got = rp.distinct_roles(values)
    assert got is not values and values[MP] is p  # the caller's list untouched
    assert got[P] is p and got[MP] is not p and got[MP].data_ptr() == p.data_ptr()
    assert got[PROBS] is x and got[T] is t
    assert len({id(v) for v in got if isinstance(v, torch.Tensor)}) == 4
    assert rp.distinct_roles([x, None, 7, 0.5, None, None, 0.8])[2:] == [7, 0.5, None, None, 0.8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.uint8])
def test_aligned_like_keeps_the_16_byte_alignment(dtype):
    """The plan's scratch outputs (the direct launches' check, the graphs' check) sit at the
    caller's address mod 16: the recorded launches accept only the alignment Triton compiled for."""
    from tpguard.kernels.renorm_graph import aligned_like

    base = torch.zeros(64, dtype=dtype)
    for off in range(16 // base.element_size()):
        for shape in ((), (1,), (5,), (2, 3)):
            n = max(1, int(torch.tensor(shape).prod()))
            t = base[off:off + n].view(shape)
            a = aligned_like(t)
            assert a.shape == t.shape and a.dtype == t.dtype and a.device == t.device
            assert a.data_ptr() % 16 == t.data_ptr() % 16, (dtype, off, shape)
            assert a.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert aligned_like(None) is None


def test_graph_placeholders_follow_the_recorded_roles():
    """A plan graph is captured over placeholders (kernels/renorm_graph.py): one per tensor role, each
    at the 16-byte alignment its role was recorded with, at distinct addresses (a pointer argument is
    bound to its role by its value, and a call may pass one tensor in two roles); scalar roles have
    none (they key the graphs). (Capture and replay: on a GPU, test_graph_replays_on_gpu and
    tests/test_target_probs.py's test_direct_launches_on_gpu.)"""
    from tpguard.kernels import renorm_graph as rg

    recorded = dl.LaunchSet([], tensor_roles=((rg.PROBS, 0), (rg.OUT, 0), (rg.K, 4), (rg.P, 4), (rg.T, 8)))
    graphs = rg.PlanGraphs("target_probs", recorded, torch.device("cpu"))
    held = graphs.placeholders
    assert [r for r in rg.ROLES if held[r] is not None] == [rg.PROBS, rg.OUT, rg.K, rg.P, rg.T]
    assert [held[r].data_ptr() % 16 for r in (rg.PROBS, rg.OUT, rg.K, rg.P, rg.T)] == [0, 0, 4, 4, 8]
    addresses = [held[r].data_ptr() for r in rg.ROLES if held[r] is not None]
    assert len(set(addresses)) == len(addresses)
    storage = graphs._scratch.untyped_storage()
    assert all(held[r].untyped_storage().data_ptr() == storage.data_ptr() for r in rg.ROLES if held[r] is not None)
    assert max(addresses) < storage.data_ptr() + storage.nbytes()


@pytest.mark.skipif(not INTERPRET, reason="counts the interpreter's launches")
def test_default_graph_rule_counts_launches(monkeypatch):
    """By default a plan replays a graph of its own (renorm_graph.worth_graph) where it replaces >= 3
    launches at <= 1024 rows: top-p and min-p, and top-k and top-k + top-p above the rows of their one
    launch (renorm_top_k_fused.py; two launches here, under the interpreter), which a graph launch costs
    about as much as."""
    import triton.runtime.interpreter as interp

    from tpguard.config import renorm_graph_rows
    from tpguard.kernels import renorm_graph

    launches = []
    real = interp.InterpretedFunction.__getitem__
    monkeypatch.setattr(interp.InterpretedFunction, "__getitem__",
                        lambda self, grid: (launches.append(self), real(self, grid))[1])
    x = batch()[:1]
    for op, want in (("top_p", True), ("min_p", True), ("top_k", False), ("top_k_top_p", False)):
        k, p = params(op, False)
        launches.clear()
        fresh(op, x, k, p)
        assert renorm_graph.worth_graph(1, len(launches)) is want, (op, len(launches))
        assert renorm_graph.worth_graph(renorm_graph_rows(), len(launches)) is want, op
        assert not renorm_graph.worth_graph(renorm_graph_rows() + 1, len(launches)), op


@pytest.mark.skipif(DEVICE != "cuda" or not dl.enabled(), reason="plan graphs replay direct launches: CUDA")
def test_graph_replays_on_gpu(monkeypatch):
    """Plans replaying their own CUDA graph with the call's tensors as its pointer arguments
    (kernels/renorm_graph.py): the fresh path's bits for every op and parameter kind, new scalar values
    (a graph each), tensor parameters refilled in place, the fingerprint slot; outputs never alias each
    other; probs at the recorded alignment and off it in turn (the graph, then Triton's launches); a
    user's capture still takes the fresh-workspace path."""
    from tpguard.kernels import renorm_graph

    monkeypatch.setenv("TPGUARD_RENORM_GRAPH_ROWS", "64")
    monkeypatch.setattr(renorm_graph, "GRAPH_MIN_LAUNCHES", 0)  # the mechanism for every op
    x = batch(2)
    for op in rp.OPS:
        for tensor, fp in ((False, None), (True, slot()), (False, slot())):
            k, p = params(op, tensor)
            fp_fresh = slot() if fp is not None else None
            expect = fresh(op, x, k, p, fp_fresh)
            outs = [rp.run(op, x, k, p, SMALL, fp) for _ in range(5)]
            for out in outs:
                assert torch.equal(bits(out), bits(expect)), op
            assert len({out.data_ptr() for out in outs}) == len(outs)
            if fp is not None:
                assert int(fp) == int(fp_fresh)
            plan = rp.plans()[-1][1]
            assert plan.graphs is not None and plan.graphs.state == "on", (op, plan.graphs and plan.graphs.refusal)
            assert plan.graphs.captures == 1
            if tensor:  # the same tensors refilled: copied in per call
                if p is not None:
                    p.fill_(0.3 if op != "min_p" else 0.03)
                if k is not None:
                    k.fill_(9)
                assert torch.equal(bits(rp.run(op, x, k, p, SMALL, fp)), bits(fresh(op, x, k, p))), op
            else:  # a new scalar value: a graph of its own
                k2, p2 = params(op, False, 7, 0.5)
                for _ in range(2):
                    assert torch.equal(bits(rp.run(op, x, k2, p2, SMALL, fp)), bits(fresh(op, x, k2, p2))), op
                assert plan.graphs.captures == 2
    # probs 4 bytes off 16-byte alignment: recorded so, and replayed so
    k, p = params("top_p", False)
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    x_off = buf[1:].view(x.shape)
    x_off.copy_(x)
    expect = fresh("top_p", x_off, k, p)
    for _ in range(4):
        assert torch.equal(bits(rp.run("top_p", x_off, k, p, SMALL)), bits(expect))
    plan = rp.plans()[-1][1]
    assert plan.graphs is not None and plan.graphs.state == "on", plan.graphs and plan.graphs.refusal
    # the same plan with probs at the recorded alignment and off it, in turn: the graph, then Triton's
    # launches (the graph stays)
    x2 = x_off.clone()
    x2[0] = x2[0].flip(0)
    expect2 = fresh("top_p", x2, k, p)
    buf2 = torch.empty_like(buf)
    x2_off = buf2[1:].view(x.shape)
    x2_off.copy_(x2)
    for _ in range(2):
        assert torch.equal(bits(rp.run("top_p", x2_off, k, p, SMALL)), bits(expect2))
        assert torch.equal(bits(rp.run("top_p", x2, k, p, SMALL)), bits(expect2))
        assert torch.equal(bits(rp.run("top_p", x_off, k, p, SMALL)), bits(expect))
    assert plan.graphs.state == "on" and plan.graphs.captures == 1, plan.graphs.refusal
    # another plan of the same launches (3 rows): its graph is not checked again (no sync), same bits
    def checked_key(plan):
        return tuple(launch.variant for launch in plan.direct.launches), plan.direct.tensor_roles

    before = set(renorm_graph.CHECKED)  # the 4-row plans' launches above (probs aligned)
    x3 = x[:3].clone()
    expect3 = fresh("top_p", x3, k, p)
    for _ in range(4):
        assert torch.equal(bits(rp.run("top_p", x3, k, p, SMALL)), bits(expect3))
    plan3 = rp.plans()[-1][1]
    assert plan3.graphs is not None and plan3.graphs.captures == 1, plan3.graphs and plan3.graphs.refusal
    assert checked_key(plan3) in renorm_graph.CHECKED
    assert checked_key(plan3) in before and renorm_graph.CHECKED == before
    # a capture of the caller's own never replays (or builds) a plan graph: the capture stream's plan
    # has its graph from the warm-up, and the capture leaves it alone
    expect = fresh("top_p", x, k, p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    holder = {}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for _ in range(4):  # warm-up on the capture stream: plan, direct launches, plan graph
            rp.run("top_p", x, k, p, SMALL)
        side_plan = rp.plans()[-1][1]
        assert side_plan.graphs is not None and side_plan.graphs.captures == 1
        with torch.cuda.graph(graph, stream=side):
            holder["out"] = rp.run("top_p", x, k, p, SMALL)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(holder["out"]), bits(expect))
    assert side_plan.graphs.captures == 1
    # a plan (and its graph's placeholders) made under inference mode, then called outside it
    rp.clear_plans()
    k, p = params("top_k", True)
    with torch.inference_mode():
        for _ in range(4):
            rp.run("top_k", x, k, p, SMALL)
    out = rp.run("top_k", x, k, p, SMALL)
    assert torch.equal(bits(out), bits(fresh("top_k", x, k, p)))
    assert rp.plans()[-1][1].graphs.state == "on"
    # scalar values that keep changing: the graphs go off for good after 4 are dropped
    k, p = params("top_p", False)
    for i in range(12):
        rp.run("top_p", x, k, 0.3 + i / 100, SMALL)
    plan = rp.plans()[-1][1]
    assert plan.graphs is None and plan.graphs_tried, plan.graphs and plan.graphs.refusal
    assert "graphs off" in dl.FAILURES["renorm graph top_p"]
    assert torch.equal(bits(rp.run("top_p", x, k, 0.5, SMALL)), bits(fresh("top_p", x, k, 0.5)))


def test_plan_made_under_inference_mode_is_used_outside_it():
    """SGLang samples under torch.inference_mode(): a plan made there keeps ordinary workspace
    tensors, which the direct launches' one-time check fills in place (`poison`), maybe outside it."""
    x = batch()
    k, p = params("top_p", False)
    with torch.inference_mode():
        rp.run("top_p", x, k, p, SMALL)
    plan = rp.plans()[-1][1]
    plan.poison()
    assert torch.equal(bits(rp.run("top_p", x, k, p, SMALL)), bits(fresh("top_p", x, k, p)))


def test_host_layers_cpu_mode_prints_its_layers():
    """`TRITON_INTERPRET=1 python gpu/host_layers.py --cpu` (docs/benchmarks.md, "Small vocabularies"); without
    ``--cpu`` on a machine without CUDA, one line and exit 2."""
    if not INTERPRET:
        pytest.skip("the script's CPU mode runs under the interpreter")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, str(root / "gpu" / "host_layers.py"), "--cpu"], capture_output=True,
                         text=True, env=env, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    for op in ("top_k", "top_p"):
        assert f"{op} 1 x 32000 on the CPU" in run.stdout
    for layer in ("  public call", "  drop-in surface, a tensor parameter"):
        lines = [line.split() for line in run.stdout.splitlines() if line.startswith(layer)]
        assert len(lines) == 2 and all(0 < float(line[-1]) < 1000 for line in lines), run.stdout
    if not torch.cuda.is_available():  # its GPU mode says in one line where to go instead
        run = subprocess.run([sys.executable, str(root / "gpu" / "host_layers.py")], capture_output=True,
                             text=True, env=env, timeout=300, cwd=root)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--cpu" in run.stderr, run.stderr[-2000:]
