"""One speculative verify step, in SGLang's order, recording each quantity as it is produced.

target logits (seeded) -> temperature / softmax -> top-k renorm -> top-p renorm -> min-p renorm
-> coins -> chain accept (DFlash) or tree accept (EAGLE) -> bonus token -> commit lens -> output
tokens. (sglang: `build_speculative_verify_target_probs` dense path, then
`tree_speculative_sampling_target_only`, then `predicts[accept_index[i, accept_len[i]]]`.)

`record(name, tensor)` is called for every canonical quantity in causal order; the decision
tensors recorded (accept_index, accept_len, bonus, commit_lens, out_tokens) are the very tensors
the commit reads, so a guard with policy heal can overwrite them in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpguard.launch.accept import bonus_tokens, output_tokens, verify_target_only
from tpguard.launch.inject import Injector
from tpguard.launch.model import SyntheticModel, mix64_int
from tpguard.renorm_registry import RenormBackend
from tpguard.launch.tree import Tree
from tpguard.launch.workload import StepInputs

Record = Callable[[str, "torch.Tensor | None"], None]


def broadcast_from_rank0(*tensors: torch.Tensor) -> None:
    """Rank 0's values into every rank's tensors, in place (the default group)."""
    import torch.distributed as dist

    for t in tensors:
        dist.broadcast(t, src=0)


def step_seed(seed: int, step: int, salt: int) -> int:
    return mix64_int((seed * 0x9E3779B97F4A7C15) ^ (step * 0xD1B54A32D192ED03) ^ salt) >> 1


SALT_SAMPLING = 0x5A17
SALT_FORWARD = 0xF0F0


@dataclass
class StepOutputs:
    candidates: torch.Tensor
    target_probs: torch.Tensor
    accept_index: torch.Tensor
    accept_len: torch.Tensor
    bonus: torch.Tensor
    commit_lens: torch.Tensor
    out_tokens: torch.Tensor


class VerifyPipeline:
    def __init__(self, model: SyntheticModel, tree: Tree, renorm: RenormBackend, injector: Injector,
                 device: torch.device, seed: int, threshold_single: float = 1.0, threshold_acc: float = 1.0):
        self.model, self.tree, self.renorm, self.inject = model, tree, renorm, injector
        self.device, self.seed = device, seed
        self.threshold_single, self.threshold_acc = threshold_single, threshold_acc
        # The last renorm emits target_probs' fingerprint when the backend can (set False when
        # target_probs is not guarded: --quantities decisions)
        self.fingerprint_probs = True
        # Policy fix's broadcast switch: rank 0's accept decisions and bonus broadcast every step,
        # before anything reads them (SGLang's SpecTpSync broadcast, DFLASH_ACCEPT_SAMPLE's place)
        self.broadcast_decisions = False

    def target_probs(self, logits: torch.Tensor, inp: StepInputs, fingerprint: bool = False) -> torch.Tensor:
        """Temperature, softmax, then the renorms the batch needs (SGLang's dense verify path; the
        backend's fused kernel where it has one). `fingerprint`: the result comes back with its
        fingerprint attached (`tpguard.fingerprint.attach_fingerprint`), where the backend can."""
        n = self.tree.nodes
        dev = self.device

        def rows(x, dtype):
            return torch.from_numpy(x).to(dev, dtype).repeat_interleave(n)

        vocab = logits.shape[1]
        params = {}
        if (inp.top_k > 0).any():
            top_k = rows(inp.top_k, torch.int64)
            params["top_k"] = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        for kind in ("top_p", "min_p"):
            if (getattr(inp, kind) < 1 if kind == "top_p" else getattr(inp, kind) > 0).any():
                params[kind] = rows(getattr(inp, kind), torch.float32)
        return self.renorm.target_probs(logits, rows(inp.temperature, torch.float32), params, fingerprint)

    def run(self, step: int, inp: StepInputs, record: Record) -> StepOutputs:
        dev, n, inject = self.device, self.tree.nodes, self.inject
        bs = len(inp.seq_lens)
        sampling = torch.Generator(device=dev).manual_seed(step_seed(self.seed, step, SALT_SAMPLING))
        inject.generator(step, sampling)
        record("rng_state", sampling.get_state())

        seq_lens = inject(step, "seq_lens", torch.from_numpy(inp.seq_lens).to(dev))
        record("seq_lens", seq_lens)
        roots = self.model.root_hashes(inp.history_hash, seq_lens.cpu().numpy())

        candidates = torch.from_numpy(self.model.propose_drafts(roots, inp.last_tokens)).to(dev)
        candidates = inject(step, "draft_tokens", candidates)
        record("draft_tokens", candidates)

        forward = torch.Generator(device=dev).manual_seed(step_seed(self.seed, step, SALT_FORWARD))
        hashes = self.model.node_hashes(roots, candidates.cpu().numpy())
        logits = inject(step, "target_logits", self.model.target_logits(hashes, forward, dev))
        record("target_logits", logits)

        # an injected value is a new tensor (no fingerprint attached): recorded the usual way
        emit = self.fingerprint_probs and getattr(record, "__name__", "") != "_no_record"
        probs = inject(step, "target_probs", self.target_probs(logits, inp, fingerprint=emit))
        record("target_probs", probs)

        coins = inject(step, "coins", torch.rand(bs, n + 1, generator=sampling, device=dev))
        record("coins", coins)

        res = verify_target_only(candidates, self.tree, coins[:, :n], coins[:, n], probs.view(bs, n, -1),
                                 self.threshold_single, self.threshold_acc)
        if self.broadcast_decisions:
            broadcast_from_rank0(res.accept_index, res.accept_len, res.predicts)
        accept_index = inject(step, "accept_index", res.accept_index)
        record("accept_index", accept_index)
        accept_len = inject(step, "accept_len", res.accept_len)
        record("accept_len", accept_len)
        bonus = inject(step, "bonus", bonus_tokens(res.predicts, accept_index, accept_len))
        record("bonus", bonus)
        commit_lens = inject(step, "commit_lens", accept_len + 1)
        record("commit_lens", commit_lens)
        out_tokens = inject(step, "out_tokens", output_tokens(candidates, accept_index, accept_len, bonus))
        record("out_tokens", out_tokens)
        return StepOutputs(candidates, probs, accept_index, accept_len, bonus, commit_lens, out_tokens)
