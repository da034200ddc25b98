"""launch_write_fp (kernels/renorm_write_fp.py): the renorm's write pass with its output's
fingerprint. Output bit-identical to launch_write; fingerprints equal to the numpy reference."""

import pytest
import torch

from tpguard import fingerprint as fp_host
from tpguard.kernels import renorm as renorm_api
from tpguard.kernels.fingerprint_reference import fingerprint_rows_reference

pytestmark = pytest.mark.skipif(not renorm_api.triton_available(), reason="needs triton (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows, vocab, chunk, seed, nan_rows=(), zero_rows=()):
    from tpguard.kernels.renorm_config import default_config
    from tpguard.kernels.renorm_workspace import shapes_for, workspace_for

    cfg = default_config().replace(chunk=chunk)
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, vocab, generator=g) ** 4
    probs[:, :: max(1, vocab // 7)] = 0.0  # zeros: dropped by the x > 0 test
    for r in zero_rows:
        probs[r] = 0.0
    probs = probs / probs.sum(1, keepdim=True).clamp_min(1e-30)
    s = shapes_for(rows, vocab, cfg)
    ws = workspace_for(s, cfg, torch.device(DEVICE), with_sample=False, with_bracket=False)
    # per row: thr1 (a quantile), r1, thr2, r2 as a select kernel would leave them
    q = torch.rand(rows, generator=g) * 0.9
    idx = (q * vocab).long().clamp(max=vocab - 1).unsqueeze(1)
    thr1 = probs.sort(dim=1).values.gather(1, idx).squeeze(1)
    params = torch.stack([thr1, 1.0 + torch.rand(rows, generator=g),
                          torch.rand(rows, generator=g) * 1e-4, 1.0 + torch.rand(rows, generator=g)], 1)
    flag = torch.zeros(rows, dtype=torch.int32)
    for r in nan_rows:
        flag[r] = 1
    ws.params.copy_(params.reshape(-1).float().to(DEVICE))
    ws.flag.copy_(flag.to(DEVICE))
    return probs.to(DEVICE), s, ws, cfg


CASES = [
    # rows, vocab, chunk, nan rows, zero rows
    (1, 1, 64, (), ()),
    (1, 100, 64, (), ()),
    (3, 2047, 8192, (1,), ()),
    (5, 2049, 512, (), (2,)),
    (2, 4096, 1024, (), ()),  # a multiple of the chunk
    (7, 5000, 1024, (0, 6), (3,)),
    (64, 300, 128, (5,), (9, 10)),
    (17, 9001, 8192, (), (16,)),  # 2 chunks of the default size, ragged tail
    (2, 10692, 8192, (1,), ()),  # a tail of 3 blocks (TAIL_BLOCK = 1024), the last one partial
]


@pytest.mark.parametrize("rows,vocab,chunk,nan_rows,zero_rows", CASES)
def test_write_fp_matches_write_and_reference(rows, vocab, chunk, nan_rows, zero_rows):
    from tpguard.kernels.renorm_passes import launch_write
    from tpguard.kernels.renorm_write_fp import launch_write_fp

    probs, s, ws, cfg = _case(rows, vocab, chunk, seed=rows * 1000 + vocab, nan_rows=nan_rows,
                              zero_rows=zero_rows)
    want = torch.empty_like(probs)
    launch_write(probs, want, s, ws, cfg)
    got = torch.full_like(probs, 7.0)
    slot = torch.zeros(3, dtype=torch.int64, device=DEVICE)  # the guard's vector: write slot 1 only
    rows_out = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    ret = launch_write_fp(probs, got, s, ws, cfg, fp_out=slot[1], rows_out=rows_out)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, NaNs included
    assert fp_host.to_unsigned(int(slot[1])) == fp_host.fingerprint_tensor(want)
    assert int(slot[0]) == 0 and int(slot[2]) == 0
    assert ret.data_ptr() == slot[1].data_ptr()
    assert torch.equal(rows_out.cpu(), fingerprint_rows_reference(want.cpu()))


def test_many_rows_top_hash_unfused():
    """More rows than one finalize program holds: the top hash takes the two-level path."""
    from tpguard.kernels import fingerprint as fpk
    from tpguard.kernels.renorm_write_fp import launch_write_fp

    probs, s, ws, cfg = _case(9, 70, 64, seed=3, nan_rows=(4,))
    out = torch.empty_like(probs)
    fp = launch_write_fp(probs, out, s, ws, cfg, fp_config=fpk.KernelConfig(finalize_rows=4))
    assert fp.dim() == 0 and fp_host.to_unsigned(int(fp)) == fp_host.fingerprint_tensor(out)


def test_bad_slot_is_a_clear_error():
    from tpguard.kernels.renorm_write_fp import launch_write_fp

    probs, s, ws, cfg = _case(2, 100, 64, seed=1)
    with pytest.raises(ValueError, match="1-element int64"):
        launch_write_fp(probs, torch.empty_like(probs), s, ws, cfg, fp_out=torch.zeros(2, dtype=torch.int64))


# --- the consumer side: a producer's fingerprint travels with its output to the guard ----------

def _fp_producer(probs, p, fingerprint_out=None):
    """A renorm that honours the ``fingerprint_out=`` contract (the torch path of the renorm API
    does the same: it fills the slot from its result)."""
    from tpguard.kernels.reference import top_p_renorm_reference

    out = top_p_renorm_reference(probs, p)
    if fingerprint_out is not None:
        fingerprint_out.copy_(fp_host.fingerprint_device(out))
    return out


def test_attached_fingerprint_is_used_until_the_tensor_changes():
    from tpguard.fingerprint import attached_fingerprint, call_with_fingerprint

    probs = torch.softmax(torch.randn(6, 50), -1)
    plain = call_with_fingerprint(lambda x, p: _fp_producer(x, p), probs, 0.9)  # no keyword: plain call
    assert attached_fingerprint(plain) is None
    out = call_with_fingerprint(_fp_producer, probs, 0.9)
    fp = attached_fingerprint(out)
    assert fp is not None and fp_host.to_unsigned(int(fp)) == fp_host.fingerprint_tensor(out)
    out.view(-1)[0] += 1.0  # changed in place: the attached value is stale, so it is ignored
    assert attached_fingerprint(out) is None


def test_guards_record_the_attached_fingerprint_without_rehashing():
    from tpguard.device_guard import DeviceStepGuard
    from tpguard.fingerprint import attach_fingerprint
    from tpguard.guard import StepGuard

    out = torch.softmax(torch.randn(4, 40), -1)
    true_fp = fp_host.fingerprint_device(out)
    marker = torch.tensor(0x1234, dtype=torch.int64)  # not out's value: shows which one is used
    guard = StepGuard(site="synthetic.verify", run_id="wfp", quantities=("target_probs", "out_tokens"))
    guard.record("target_probs", attach_fingerprint(out.clone(), marker))
    assert int(guard._fps["target_probs"]) == 0x1234
    guard.record("target_probs", out)
    assert int(guard._fps["target_probs"]) == int(true_fp)
    guard.close()

    dguard = DeviceStepGuard(site="synthetic.verify", run_id="wfp2", watchdog=False, device="cpu",
                             quantities=("target_probs", "out_tokens"))
    dguard.record("target_probs", attach_fingerprint(out.clone(), marker))
    dguard.record("out_tokens", torch.arange(4))
    vec = dguard._device_vector(0, dguard._next_slot())
    q = len(dguard.quantities)
    assert int(vec[3 + dguard.index["target_probs"]]) == 0x1234
    assert int(vec[3 + dguard.index["out_tokens"]]) == int(fp_host.fingerprint_device(torch.arange(4)))
    assert int(vec[3 + q + dguard.index["target_probs"]]) == out.numel()
    assert dguard.check() is None and dguard.drain() is None
    dguard.close()


def test_pipeline_emits_target_probs_fingerprint_from_the_last_renorm():
    from dataclasses import replace

    from tpguard.launch.inject import Injector
    from tpguard.launch.model import SyntheticModel
    from tpguard.launch.pipeline import VerifyPipeline
    from tpguard.launch.tree import chain
    from tpguard.launch.workload import SamplingParams, Workload
    from tpguard.fingerprint import attached_fingerprint
    from tpguard.renorm_registry import get_backend

    tree = chain(4)
    backend = replace(get_backend("torch", "cpu"), top_p=_fp_producer)
    pipe = VerifyPipeline(SyntheticModel(512, tree, "mixed"), tree, backend,
                          Injector([], 0, 512, tree.spec_tokens, tree.nodes, 4), torch.device("cpu"), seed=3)
    wl = Workload(4, 512, 3, 4, SamplingParams(1.0, 0.9, 0, 0.0), False)
    got = {}
    pipe.run(0, wl.inputs(), lambda name, t: got.__setitem__(name, t))
    fp = attached_fingerprint(got["target_probs"])
    assert fp is not None and fp_host.to_unsigned(int(fp)) == fp_host.fingerprint_tensor(got["target_probs"])
    pipe.fingerprint_probs = False
    pipe.run(1, wl.inputs(), lambda name, t: got.__setitem__(name, t))
    assert attached_fingerprint(got["target_probs"]) is None


def test_fill_fingerprint_for_paths_without_a_write_pass():
    from tpguard.kernels.renorm_args import fill_fingerprint

    for out in (torch.empty(0, 10), torch.rand(3, 7)):
        slot = torch.zeros(2, dtype=torch.int64)
        fill_fingerprint(out, slot[1])
        assert fp_host.to_unsigned(int(slot[1])) == fp_host.fingerprint_tensor(out) and int(slot[0]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tpguard", "torch"])
def test_public_api_fingerprint_out(backend):
    """Every public renorm honours `fingerprint_out` on both paths: the slot holds fingerprint(out)."""
    from tpguard.fingerprint import fingerprint_tensor, to_unsigned
    from tpguard.kernels import renorm

    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(3, 2500, generator=g), -1).to(DEVICE)
    calls = {
        "top_k": lambda **kw: renorm.top_k_renorm(probs, 40, **kw),
        "top_p": lambda **kw: renorm.top_p_renorm(probs, torch.tensor([0.5, 0.9, 1.0], device=DEVICE), **kw),
        "top_k_top_p": lambda **kw: renorm.top_k_top_p_renorm(probs, 300, 0.9, **kw),
        "min_p": lambda **kw: renorm.min_p_renorm(probs, 0.1, **kw),
    }
    for name, call in calls.items():
        slot = torch.zeros(3, dtype=torch.int64, device=DEVICE)
        out = call(backend=backend, fingerprint_out=slot[1:2])
        assert torch.equal(out, call(backend=backend)), name
        assert to_unsigned(int(slot[1])) == fingerprint_tensor(out), name
        assert int(slot[0]) == int(slot[2]) == 0, name
    with pytest.raises(ValueError, match="fingerprint_out"):
        renorm.top_p_renorm(probs, 0.9, backend=backend,
                            fingerprint_out=torch.zeros(2, dtype=torch.int64, device=DEVICE))


def test_inference_tensors_are_fingerprinted_the_usual_way():
    """Under torch.inference_mode (SGLANG_ENABLE_TORCH_INFERENCE_MODE=1) a tensor has no version
    counter: nothing is attached (no crash) and the guard hashes the tensor itself."""
    from tpguard.fingerprint import (attach_fingerprint, attached_fingerprint, call_with_fingerprint,
                                     fingerprint_tensor, to_unsigned)
    from tpguard.kernels import renorm

    with torch.inference_mode():
        probs = torch.softmax(torch.randn(2, 300, generator=torch.Generator().manual_seed(3)), -1)
        out = call_with_fingerprint(renorm.top_p_renorm, probs, 0.9, backend="torch")
        assert attached_fingerprint(out) is None
        assert attach_fingerprint(out, torch.zeros((), dtype=torch.int64)) is out
        assert attached_fingerprint(out) is None
        assert to_unsigned(int(fp_host.fingerprint_device(out))) == fingerprint_tensor(out)
