"""Draft topologies: a chain (DFlash) or a tree (EAGLE), as SGLang's retrive_* arrays describe them.

Node 0 is the root (the last verified token); every other node is a draft token. `next_token[k]`
is k's first child, `next_sibling[k]` its next sibling (-1: none), exactly the layout that
sglang's `tree_speculative_sampling_target_only` walks. `spec_tokens` is the width of
`accept_index` (the longest root-to-leaf path, root included).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tree:
    algo: str
    nodes: int
    parent: tuple[int, ...]
    next_token: tuple[int, ...]
    next_sibling: tuple[int, ...]
    depth: tuple[int, ...]
    child_rank: tuple[int, ...]  # 0 for a first child, 1 for the second, ...

    @property
    def spec_tokens(self) -> int:
        return max(self.depth) + 1

    @property
    def max_children(self) -> int:
        return max(self.child_rank) + 1


def from_parents(algo: str, parent: list[int]) -> Tree:
    """Build the arrays from parent links; children keep their index order (nodes in BFS order)."""
    n = len(parent)
    next_token, next_sibling = [-1] * n, [-1] * n
    depth, child_rank = [0] * n, [0] * n
    last_child: dict[int, int] = {}
    for k in range(1, n):
        p = parent[k]
        if not 0 <= p < k:
            raise ValueError(f"node {k}: parent {p} must come before it")
        depth[k] = depth[p] + 1
        if p in last_child:
            prev = last_child[p]
            next_sibling[prev] = k
            child_rank[k] = child_rank[prev] + 1
        else:
            next_token[p] = k
        last_child[p] = k
    return Tree(algo, n, tuple(parent), tuple(next_token), tuple(next_sibling), tuple(depth), tuple(child_rank))


def chain(nodes: int) -> Tree:
    """DFlash: root followed by nodes-1 draft tokens in a line."""
    return from_parents("dflash", [-1] + list(range(nodes - 1)))


def eagle_tree(nodes: int, topk: int = 2) -> Tree:
    """EAGLE: each node proposes `topk` children, breadth first, until `nodes` nodes exist."""
    return from_parents("eagle", [-1] + [(k - 1) // topk for k in range(1, nodes)])


def for_algo(algo: str, nodes: int) -> Tree:
    return chain(nodes) if algo == "dflash" else eagle_tree(nodes)
