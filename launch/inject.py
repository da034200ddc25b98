"""Fault injection: `--inject QUANTITY@STEP:RANK` perturbs one quantity on one rank at one step.

The perturbation is the smallest change the quantity allows, always in request 0:

* floats (target_logits, target_probs, coins): one ULP of one element (towards +inf);
  target_probs' element is row 0's largest, so the change is inside the kept set;
* integer tokens (draft_tokens, bonus, out_tokens): one token id, +1 (or -1 at the top of the vocab);
* lengths and indices (seq_lens, accept_len, commit_lens, accept_index): one, kept in range;
* rng_state: the step's generator is moved one draw ahead (CPU) or one philox offset step (CUDA)
  before its state is recorded, so the coins drawn from it differ.

The pipeline applies the perturbation where the quantity is produced, before it is recorded and
before anything downstream reads it, so the first differing quantity in causal order is the
injected one and the rest of the step (and, without a fix, later steps) follows from it.
"""

from __future__ import annotations

import torch

from tpguard.launch.options import Injection

# Where each integer perturbation is made (index into the flattened tensor) and its valid range,
# given (vocab, spec_tokens, nodes, bs).
_INT_SITES = {
    "seq_lens": lambda v, s, n, b: (0, 1, 1 << 62),
    "draft_tokens": lambda v, s, n, b: (1, 0, v - 1),  # candidates[0, 1], the first draft token
    "accept_index": lambda v, s, n, b: (0, 0, b * n - 1),
    "accept_len": lambda v, s, n, b: (0, 0, s - 1),
    "bonus": lambda v, s, n, b: (0, 0, v - 1),
    "commit_lens": lambda v, s, n, b: (0, 1, s),
    "out_tokens": lambda v, s, n, b: (0, 0, v - 1),
}


def one_ulp(t: torch.Tensor, index: int) -> torch.Tensor:
    out = t.clone()
    flat = out.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=t.dtype, device=t.device))
    return out


def one_step(t: torch.Tensor, index: int, lo: int, hi: int) -> torch.Tensor:
    out = t.clone()
    flat = out.view(-1)
    value = int(flat[index].item())
    flat[index] = value + 1 if value + 1 <= hi else max(lo, value - 1)
    return out


def shift_generator(g: torch.Generator) -> None:
    if g.device.type == "cuda":
        g.set_offset(g.get_offset() + 4)  # philox offsets advance in steps of 4
    else:
        torch.rand(1, generator=g)


class Injector:
    """The injections for this rank, applied by the pipeline as quantities are produced."""

    def __init__(self, injections: list[Injection], rank: int, vocab: int, spec_tokens: int, nodes: int, bs: int):
        self.mine = {(i.step, i.quantity) for i in injections if i.rank == rank}
        self.shape = (vocab, spec_tokens, nodes, bs)
        self.applied: list[tuple[int, str]] = []

    def wants(self, step: int, quantity: str) -> bool:
        return (step, quantity) in self.mine

    def generator(self, step: int, g: torch.Generator) -> None:
        if self.wants(step, "rng_state"):
            shift_generator(g)
            self.applied.append((step, "rng_state"))

    def __call__(self, step: int, quantity: str, t: torch.Tensor) -> torch.Tensor:
        if not self.wants(step, quantity):
            return t
        self.applied.append((step, quantity))
        if t.is_floating_point():
            index = 0
            if quantity == "target_probs":
                index = int(t.reshape(t.shape[0], -1)[0].argmax().item())
            return one_ulp(t, index)
        index, lo, hi = _INT_SITES[quantity](*self.shape)
        return one_step(t, index, lo, hi)
