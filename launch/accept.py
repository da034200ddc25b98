"""Target-only speculative verification over a draft tree, vectorised over requests in torch.

A transcription of sglang's `TreeSpeculativeSamplingTargetOnly` kernel
(sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh), which DFlash calls on a chain
(`compute_dflash_sampling_correct_drafts_and_bonus`) and EAGLE on a tree:

* walk from the root: at each level try the current node's children in sibling order, adding
  each child's target probability to `prob_acc`; accept the first child with mass whose
  ``coin < prob_acc / threshold_acc`` (or ``p >= threshold_single``), then move to its row and its
  coin; a rejected child's probability is copied into `draft_probs` of the current row;
* the bonus token is sampled from ``relu(target - draft)`` of the last accepted row with the
  final coin (inverse CDF; the last valid token when rounding leaves the coin past the end).

Outputs are SGLang's: `predicts` [bs * nodes] int32, `accept_index` [bs, spec_tokens] int32
(-1 where unused), `accept_len` [bs] int32. The bonus token is read back as SGLang does:
``predicts[accept_index[i, accept_len[i]]]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpguard.launch.tree import Tree


@dataclass
class AcceptResult:
    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_len: torch.Tensor


def verify_target_only(candidates: torch.Tensor, tree: Tree, coins: torch.Tensor, final_coins: torch.Tensor,
                       target_probs: torch.Tensor, threshold_single: float = 1.0,
                       threshold_acc: float = 1.0) -> AcceptResult:
    """candidates [bs, n] int64, coins [bs, n] f32, final_coins [bs] f32, target_probs [bs, n, V] f32."""
    bs, n = candidates.shape
    vocab = target_probs.shape[-1]
    dev = candidates.device
    spec = tree.spec_tokens
    threshold_acc = max(float(threshold_acc), 1e-9)
    ar = torch.arange(bs, device=dev)
    next_token = torch.tensor(tree.next_token, dtype=torch.int64, device=dev)
    next_sibling = torch.tensor(tree.next_sibling, dtype=torch.int64, device=dev)

    predicts = torch.zeros(bs * n, dtype=torch.int32, device=dev)
    accept_index = torch.full((bs, spec), -1, dtype=torch.int32, device=dev)
    accept_index[:, 0] = (ar * n).to(torch.int32)
    num_acc = torch.zeros(bs, dtype=torch.int64, device=dev)
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)  # last accepted node
    coin = coins[:, 0].clone()
    prob_acc = torch.zeros(bs, dtype=target_probs.dtype, device=dev)
    rejected = torch.zeros(bs, n, dtype=torch.bool, device=dev)  # nodes rejected at the current row
    active = torch.ones(bs, dtype=torch.bool, device=dev)

    for _level in range(1, spec):
        child = next_token[cur]
        active = active & (child >= 0)
        accepted_here = torch.zeros(bs, dtype=torch.bool, device=dev)
        for _sibling in range(tree.max_children):
            valid = active & ~accepted_here & (child >= 0)
            node = child.clamp(min=0)
            token = candidates[ar, node]
            p = target_probs[ar, cur, token]
            prob_acc = torch.where(valid, prob_acc + p, prob_acc)
            acc = valid & (p > 0) & ((coin < prob_acc / threshold_acc) | (p >= threshold_single))
            rej = valid & ~acc
            rejected[ar, node] |= rej
            slot = ar * n + cur
            predicts[slot] = torch.where(acc, token.to(torch.int32), predicts[slot])
            num_acc = num_acc + acc.to(torch.int64)
            accept_index[ar, num_acc] = torch.where(acc, (ar * n + node).to(torch.int32), accept_index[ar, num_acc])
            cur = torch.where(acc, node, cur)
            coin = torch.where(acc, coins[ar, node], coin)
            prob_acc = torch.where(acc, torch.zeros_like(prob_acc), prob_acc)
            rejected &= ~acc.unsqueeze(1)
            accepted_here |= acc
            child = torch.where(rej, next_sibling[node], child)
        active = active & accepted_here

    # Bonus: sample relu(q - p) of the last accepted row; p is q itself at the rejected tokens.
    q = target_probs[ar, cur]
    full = num_acc == spec - 1
    rej_tokens = torch.where(rejected & ~full.unsqueeze(1), candidates, torch.full_like(candidates, vocab))
    drop = torch.zeros(bs, vocab + 1, dtype=torch.bool, device=dev).scatter_(1, rej_tokens, True)[:, :vocab]
    q = q.masked_fill(drop, 0.0)
    u = final_coins * q.sum(dim=-1)
    cdf = q.cumsum(dim=-1)
    sampled = (cdf <= u.unsqueeze(1)).sum(dim=-1)  # first index whose cumulative mass exceeds u
    last_valid = vocab - 1 - (q > 0).flip(-1).float().argmax(dim=-1)  # first max: the last positive entry
    sampled = torch.where(sampled >= vocab, last_valid, sampled)
    predicts[ar * n + cur] = sampled.to(torch.int32)
    return AcceptResult(predicts, accept_index, num_acc.to(torch.int32))


def bonus_tokens(predicts: torch.Tensor, accept_index: torch.Tensor, accept_len: torch.Tensor) -> torch.Tensor:
    """SGLang's read-back: ``predicts[accept_index[i, accept_len[i]]]`` as int64 [bs]."""
    bs, spec = accept_index.shape
    ar = torch.arange(bs, device=accept_index.device)
    pos = accept_index[ar, accept_len.to(torch.int64).clamp(0, spec - 1)].to(torch.int64)
    return predicts[pos.clamp(0, predicts.numel() - 1)].to(torch.int64)


def output_tokens(candidates: torch.Tensor, accept_index: torch.Tensor, accept_len: torch.Tensor,
                  bonus: torch.Tensor) -> torch.Tensor:
    """[bs, spec_tokens] int64: the accepted draft tokens in order, then the bonus token, then 0."""
    bs, n = candidates.shape
    spec = accept_index.shape[1]
    dev = candidates.device
    pos = torch.arange(spec, device=dev).unsqueeze(0)
    alen = accept_len.to(torch.int64).clamp(0, spec - 1).unsqueeze(1)
    # accept_index[i, k + 1] is the k-th accepted node's global slot i * n + node.
    nxt = torch.cat([accept_index[:, 1:], torch.full((bs, 1), -1, dtype=accept_index.dtype, device=dev)], 1)
    node = (nxt.to(torch.int64) - torch.arange(bs, device=dev).unsqueeze(1) * n).clamp(0, n - 1)
    drafts = candidates.gather(1, node)
    out = torch.where(pos < alen, drafts, torch.zeros_like(drafts))
    return torch.where(pos == alen, bonus.unsqueeze(1).expand(-1, spec), out)
