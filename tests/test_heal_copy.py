"""Fused heal's one-launch payload copies (kernels/heal_copy.py) against the per-tensor torch
copies they replace: same payload words, same values back, same capacity error."""

from __future__ import annotations

import pytest
import torch

from tpguard.config import interpreting
from tpguard.kernels import heal_copy as hc

SENTINEL = -0x5A5A5A5A5A5A5A5B
# compiled on a GPU machine (TRITON_INTERPRET=0): the kernel's case is CUDA tensors, and from the
# second call on the same addresses the cached direct launch runs (checked below)
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def _tensor(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)


CASES = [  # [(dtype, numel or None = absent)], capacity slack per tensor
    ([(torch.int32, 16), (torch.int32, 4), (torch.int64, 4), (torch.int32, 4), (torch.int64, 16)], 0),
    ([(torch.int64, 1), (torch.int16, 0), (torch.uint8, 7), (torch.int8, 5), (torch.bool, 9)], 3),
    ([(torch.int32, 1500), None, (torch.int64, 2049), None, (torch.int32, 0)], 1),
    ([None, None, (torch.int32, 3), None, None], 0),
]


def _layout(case, slack: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    layout, tensors, offset = [], {}, 3 + 2 * 11  # after a header and 11 quantities
    for k, spec in enumerate(case):
        name = f"q{k}"
        cap = (spec[1] if spec else 4) + slack
        layout.append((name, offset, cap))
        offset += cap
        if spec is not None:
            dtype, n = spec
            t = _tensor(dtype, n, g).view(-1, 1) if n > 1 else _tensor(dtype, n, g)
            tensors[name] = t.to(DEVICE)
    return layout, tensors, offset


@pytest.mark.parametrize("case,slack", CASES)
def test_pack_and_unpack_match_the_torch_copies(case, slack):
    layout, tensors, length = _layout(case, slack, seed=slack)
    assert hc.kernel_applies(torch.empty(length, dtype=torch.int64, device=DEVICE),
                             [(t, 0) for t in tensors.values()]) == bool(tensors)
    want = torch.full((length,), SENTINEL, dtype=torch.int64, device=DEVICE)
    hc.heal_pack_torch(want, layout, tensors)
    for _ in range(3):  # on a GPU: Triton's launch, then the direct launch set up and checked, then used
        vec = torch.full((length,), SENTINEL, dtype=torch.int64, device=DEVICE)
        hc.heal_pack(vec, layout, tensors)
        assert torch.equal(vec, want)  # payload words identical, nothing else touched

    g = torch.Generator().manual_seed(slack + 7)
    gathered = torch.randint(-2**63, 2**63 - 1, (3, length), generator=g).to(DEVICE)
    gathered[0] = vec
    gathered[0, 0] = 99  # row 0 = rank 0's vector; later rows must not be read
    mine = {n: t.clone() for n, t in tensors.items()}
    ref = {n: t.clone() for n, t in tensors.items()}
    for _ in range(3):
        hc.heal_unpack(gathered, layout, mine)
        hc.heal_unpack_torch(gathered, layout, ref)
        for n in tensors:
            assert torch.equal(mine[n], ref[n]) and torch.equal(mine[n], tensors[n])  # round trip

    rank0 = torch.randint(-2**63, 2**63 - 1, (length,), generator=g).to(DEVICE)  # out-of-range words truncate
    for _ in range(3):
        hc.heal_unpack(rank0, layout, mine)
        hc.heal_unpack_torch(rank0, layout, ref)
        assert all(torch.equal(mine[n], ref[n]) for n in tensors)
    assert not hc._kernel_failed  # the kernel ran, not the fallback
    if DEVICE == "cuda" and tensors:  # the direct launches were set up and passed their check
        assert any(launch.ready for launch in hc._LAUNCHES.values()), hc._LAUNCHES


def test_capacity_overflow_error_is_unchanged():
    layout = [("bonus", 25, 3)]
    vec = torch.zeros(28, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^heal_capacity\['bonus'\] = 3 < 4 elements this step$"):
        hc.heal_pack(vec, layout, {"bonus": torch.arange(4)})
    assert not vec.any()  # checked before anything is written


def test_outside_the_kernel_case_the_torch_copies_run():
    """Non-contiguous or float tensors (not decision dtypes): the per-tensor copies, same bytes."""
    layout = [("a", 0, 16), ("b", 16, 4)]
    tensors = {"a": torch.arange(16, dtype=torch.int32).view(4, 4).t(), "b": torch.rand(4) * 100}
    assert not hc.kernel_applies(torch.empty(20, dtype=torch.int64), [(tensors["a"], 0)])
    vec, want = torch.zeros(20, dtype=torch.int64), torch.zeros(20, dtype=torch.int64)
    hc.heal_pack(vec, layout, tensors)
    hc.heal_pack_torch(want, layout, tensors)
    assert torch.equal(vec, want)


def test_guard_heals_one_rank_through_the_kernel():
    """DeviceStepGuard(policy='heal') on one process (the vector is its own gathered row 0):
    the recorded decisions survive the pack/unpack round trip; over capacity: the one-line error."""
    from test_guard import make_step
    from tpguard.device_guard import DeviceStepGuard, decisions_capacity

    guard = DeviceStepGuard(site="heal.one", policy="heal", run_id="h", watchdog=False, device="cpu",
                            heal_capacity=decisions_capacity(4, 4))
    t = make_step(0, 0)
    want = {n: t[n].clone() for n, _, _ in guard.heal_layout}
    for name, tensor in t.items():
        guard.record(name, tensor)
    assert guard.check(0) is None and guard.drain() is None
    assert all(torch.equal(t[n], want[n]) for n in want)
    vec = guard._slots[0]["vec"]
    for name, offset, _ in guard.heal_layout:  # the payload encoding: the values as int64 words
        assert vec[offset:offset + t[name].numel()].tolist() == t[name].reshape(-1).tolist()
    big = make_step(1, 0)
    big["bonus"] = torch.arange(5)
    for name, tensor in big.items():
        guard.record(name, tensor)
    with pytest.raises(ValueError, match=r"heal_capacity\['bonus'\] = 4 < 5"):
        guard.check(1)
    guard.close()
