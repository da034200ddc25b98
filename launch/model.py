"""A synthetic target and draft model whose outputs depend on the context, like real ones.

Every verify node (root = the request's last committed token, then its draft tokens) has a
context hash: the hash of the request's committed history and position, chained through the
node's ancestors' tokens. From it:

* the draft model proposes each node's first child as the target's peak token with probability
  `DRAFT_HIT` (else a hashed random token); further children (EAGLE) are hashed random tokens;
* the target's logits at a node are seeded noise (the step's "forward pass") plus, on a peaky row,
  a peak at that node's peak token high enough to hold ~80% of the mass. `--logits mixed` picks
  flat or peaky per row from the hash.

So a rank whose committed tokens differ from the others' gets other drafts, other peaks and other
acceptance lengths: its state drifts, as a real server's does. Hashes are integer arithmetic on
the host (numpy uint64 wraps), identical on every rank and device; only the noise is generated
on the pipeline's device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tpguard.launch.tree import Tree

_U64 = np.uint64
SALT_ROOT = _U64(0x243F6A8885A308D3)
SALT_TOKEN = _U64(0x13198A2E03707344)
SALT_PEAK = _U64(0xA4093822299F31D0)
SALT_HIT = _U64(0x082EFA98EC4E6C89)
SALT_RAND = _U64(0x452821E638D01377)
SALT_MODE = _U64(0xBE5466CF34E90C6C)
DRAFT_HIT = 0.8  # how often the draft's first guess is the target's peak
PEAK_MASS = 0.8  # share of a peaky row's probability on its peak (before renorm)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wraps modulo 2**64)."""
    x = np.asarray(x, dtype=np.uint64)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def mix64_int(x: int) -> int:
    """The same finaliser on a Python int (for incremental history hashes)."""
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def extend_history_hash(h: int, token: int) -> int:
    return mix64_int(h ^ ((int(token) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)))


@dataclass
class SyntheticModel:
    vocab: int
    tree: Tree
    logits_mode: str  # flat | peaky | mixed

    @property
    def peak_height(self) -> float:
        # N(0,1) logits: E[exp(x)] = e^0.5, so the other tokens hold ~1.65 * vocab;
        # a peak of exp(h) = PEAK_MASS / (1 - PEAK_MASS) * that holds ~PEAK_MASS of the row.
        return math.log(PEAK_MASS / (1 - PEAK_MASS) * math.exp(0.5) * self.vocab)

    def root_hashes(self, history_hash: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        return mix64(np.asarray(history_hash, np.uint64) ^ mix64(np.asarray(seq_lens, np.uint64) ^ SALT_ROOT))

    def _child(self, parent_hash: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return mix64(parent_hash ^ mix64(tokens.astype(np.uint64) ^ SALT_TOKEN))

    def node_hashes(self, roots: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """[bs, nodes] context hash of every verify node, from the candidates actually verified."""
        bs, n = candidates.shape
        h = np.empty((bs, n), dtype=np.uint64)
        h[:, 0] = roots
        for k in range(1, n):
            h[:, k] = self._child(h[:, self.tree.parent[k]], candidates[:, k])
        return h

    def peaks(self, hashes: np.ndarray) -> np.ndarray:
        return (mix64(hashes ^ SALT_PEAK) % _U64(self.vocab)).astype(np.int64)

    def peaky(self, hashes: np.ndarray) -> np.ndarray:
        if self.logits_mode == "flat":
            return np.zeros(hashes.shape, dtype=bool)
        if self.logits_mode == "peaky":
            return np.ones(hashes.shape, dtype=bool)
        return (mix64(hashes ^ SALT_MODE) & _U64(1)).astype(bool)

    def propose_drafts(self, roots: np.ndarray, last_tokens: np.ndarray) -> np.ndarray:
        """[bs, nodes] int64 candidates: the root token, then the draft model's proposals."""
        bs = len(roots)
        n = self.tree.nodes
        cand = np.zeros((bs, n), dtype=np.int64)
        h = np.empty((bs, n), dtype=np.uint64)
        cand[:, 0] = last_tokens
        h[:, 0] = roots
        for k in range(1, n):
            hp = h[:, self.tree.parent[k]]
            rank = self.tree.child_rank[k]
            guess = (mix64(hp ^ SALT_RAND ^ _U64(rank)) % _U64(self.vocab)).astype(np.int64)
            if rank == 0:
                hit = (mix64(hp ^ SALT_HIT) % _U64(1 << 20)).astype(np.int64) < int(DRAFT_HIT * (1 << 20))
                cand[:, k] = np.where(hit, self.peaks(hp), guess)
            else:
                cand[:, k] = guess
            h[:, k] = self._child(hp, cand[:, k])
        return cand

    def target_logits(self, hashes: np.ndarray, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """[bs * nodes, vocab] fp32: seeded noise plus the peaks of the peaky rows."""
        rows = hashes.size
        logits = torch.randn(rows, self.vocab, generator=generator, device=device, dtype=torch.float32)
        flat_hashes = hashes.reshape(-1)
        peaky = self.peaky(flat_hashes)
        if peaky.any():
            idx = torch.from_numpy(np.nonzero(peaky)[0]).to(device)
            cols = torch.from_numpy(self.peaks(flat_hashes[peaky])).to(device)
            logits[idx, cols] += self.peak_height
        return logits
