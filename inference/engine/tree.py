"""Token trees and the pure functions that verify them in one target forward (docs/trees.md).

Node 0 is the root: the pending token, whose K/V is not yet in the target cache. Nodes are in
topological order (`parents[i] < i`), so a single forward pass over `tokens` with the tree mask
gives, at node i, the target's distribution for the token after the path root..i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class DraftTree:
    """A draft tree for a batch of sequences sharing one shape.

    tokens:      [B, N] long, tokens[:, 0] is the pending root token.
    parents:     [N] long, parents[0] == -1, 0 <= parents[i] < i.
    draft_probs: [B, N, V] or None. Row i is the draft distribution q at node i from which its
                 children were sampled (without replacement). None: children were chosen
                 deterministically (top-k, lookup), and acceptance treats q as a point mass.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"DraftTree.tokens must be [B, N], got {tuple(self.tokens.shape)}")
        n = self.tokens.shape[1]
        if self.parents.shape != (n,):
            raise ValueError(f"DraftTree.parents must be [{n}], got {tuple(self.parents.shape)}")
        if n == 0 or int(self.parents[0]) != -1:
            raise ValueError("node 0 must be the root (parents[0] == -1)")
        if n > 1:
            idx = torch.arange(1, n, device=self.parents.device)
            rest = self.parents[1:]
            if bool(((rest < 0) | (rest >= idx)).any()):
                raise ValueError("parents must be topological: 0 <= parents[i] < i")

    @property
    def num_nodes(self) -> int:  # every node, the root included: the size a verify forward sees
        return self.tokens.shape[1]

    @property
    def num_draft(self) -> int:  # draft nodes, the root excluded: `--num-draft`'s quantity
        return self.tokens.shape[1] - 1

    def subtree(self, keep: torch.Tensor) -> "DraftTree":
        """Keep the nodes in `keep` ([M] long, starting with 0, closed under ancestors, every node
        after its parent), renumbered in that order."""
        parents = reindex_parents(self.parents, keep)
        probs = None if self.draft_probs is None else self.draft_probs[:, keep]
        return DraftTree(self.tokens[:, keep], parents, probs)


def chain_parents(n_draft: int, device=None) -> torch.Tensor:
    """Parents of a chain root -> d1 -> ... -> d_n: [-1, 0, 1, ..., n-1]."""
    return torch.arange(-1, n_draft, device=device)


def first_chain(parents: torch.Tensor) -> torch.Tensor:
    """[M] long: the root, its first child, that node's first child, ... (drafters list a node's
    children best first), the chain a hybrid target verifies (docs/trees.md "Hybrid targets")."""
    p = parents.tolist()
    chain = [0]
    for i in range(1, len(p)):
        if p[i] == chain[-1]:
            chain.append(i)
    return torch.tensor(chain, dtype=torch.long, device=parents.device)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node, root = 0. [N] long."""
    depths = torch.zeros_like(parents)
    p = parents.tolist()
    d = depths.tolist()
    for i in range(1, len(p)):
        d[i] = d[p[i]] + 1
    return torch.tensor(d, dtype=torch.long, device=parents.device)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: mask[i, j] is True iff j is i or an ancestor of i."""
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    p = parents.tolist()
    for i in range(1, n):
        mask[i] |= mask[p[i]]  # rows of ancestors are final already: parents[i] < i
    return mask


def tree_position_ids(parents: torch.Tensor, past_len: int, batch: int = 1) -> torch.Tensor:
    """[B, N] positions: past_len + depth (the root sits right after the cached prefix)."""
    return (node_depths(parents) + past_len).unsqueeze(0).expand(batch, -1)


def tree_attention_mask(
    parents: torch.Tensor,
    past_len: int,
    dtype: torch.dtype,
    batch: int = 1,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Additive 4-D mask [B, 1, N, past_len + N] for one tree shared by the batch, after `past_len`
    cached positions that every row holds in full (see `batch_tree_mask`)."""
    n = parents.shape[0]
    ancestors = ancestor_mask(parents)[None].expand(batch, n, n)
    depths = node_depths(parents)[None].expand(batch, n)
    lengths = torch.full((batch,), past_len, dtype=torch.long, device=parents.device)
    return batch_tree_mask(ancestors, depths, lengths, past_len, dtype, sliding_window, chunk_size=chunk_size)


def batch_tree_mask(
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    prefix_lengths: torch.Tensor,
    past_len: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    kv_length: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Additive 4-D mask [B, 1, N, past_len + N]: 0 where a node may attend, dtype-min elsewhere.
    With `kv_length` (a static cache's slot count) it is [B, 1, N, kv_length], the slots after the
    tree masked.

    ancestors: [B, N, N] bool (`ancestor_mask` of each row's tree); depths: [B, N];
    prefix_lengths: [B], row b's committed tokens, held in cache slots [0, prefix_lengths[b]) of
    the `past_len` cached ones (slots past a row's own length are stale, docs/trees.md "Batches").
    Each node sees its row's prefix, its ancestors and itself. With `sliding_window` w, a query at
    absolute position t sees keys at positions > t - w (the usual local-attention rule). With
    `chunk_size` c (Llama 4's chunked layers) it sees only keys in its own chunk: k // c == t // c.
    Positions count from each row's first real token, as slots do (docs/families.md). The
    minimum is finite, so a row that sees nothing stays finite instead of NaN.
    """
    batch, n, _ = ancestors.shape
    device = ancestors.device
    slots = torch.arange(past_len, device=device)
    prefix = (slots[None, :] < prefix_lengths[:, None])[:, None, :].expand(batch, n, past_len)  # [B, N, past]
    allowed = torch.cat([prefix, ancestors], dim=2)  # [B, N, past + N]
    if sliding_window is not None or chunk_size is not None:
        q_pos = (prefix_lengths[:, None] + depths)[:, :, None]  # [B, N, 1]
        k_pos = torch.cat([slots[None, :].expand(batch, past_len), q_pos[:, :, 0]], dim=1)[:, None, :]  # [B, 1, past + N]
        if sliding_window is not None:
            allowed = allowed & (k_pos > q_pos - sliding_window)
        if chunk_size is not None:
            allowed = allowed & (k_pos // chunk_size == q_pos // chunk_size)
    width = past_len + n if kv_length is None else kv_length
    if width < past_len + n:
        raise ValueError(f"kv_length {kv_length} cannot hold {past_len} cached slots and {n} tree nodes")
    mask = torch.full((batch, n, width), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, :, : past_len + n].masked_fill_(allowed, 0.0)
    return mask[:, None]


@dataclass
class TreeBatch:
    """Each row's own tree, padded to one node count for one verification forward.

    tokens: [B, N] long; ancestors: [B, N, N] bool; depths: [B, N] long; sizes[b]: row b's real
    node count. Padding nodes (index >= sizes[b]) repeat the root token at depth 0 and see only
    themselves: their logits are never read and their K/V never kept.
    """

    tokens: torch.Tensor
    ancestors: torch.Tensor
    depths: torch.Tensor
    sizes: list[int]


def pad_trees(trees: Sequence[DraftTree]) -> TreeBatch:
    """Stack batch-1 trees (one per row) into a TreeBatch."""
    n = max(t.num_nodes for t in trees)
    device = trees[0].tokens.device
    tokens = torch.empty(len(trees), n, dtype=torch.long, device=device)
    ancestors = torch.eye(n, dtype=torch.bool, device=device).repeat(len(trees), 1, 1)
    depths = torch.zeros(len(trees), n, dtype=torch.long, device=device)
    for b, tree in enumerate(trees):
        size = tree.num_nodes
        tokens[b, :size] = tree.tokens[0]
        tokens[b, size:] = tree.tokens[0, 0]
        ancestors[b, :size, :size] = ancestor_mask(tree.parents)
        depths[b, :size] = node_depths(tree.parents)
    return TreeBatch(tokens, ancestors, depths, [t.num_nodes for t in trees])


def retrieve_indices(parents: torch.Tensor) -> torch.Tensor:
    """[num_leaves, max_depth + 1] long: each row the node indices of one root-to-leaf path,
    root first, padded with -1 (Medusa's `retrieve_indices`)."""
    n = parents.shape[0]
    p = parents.tolist()
    has_child = [False] * n
    for i in range(1, n):
        has_child[p[i]] = True
    paths = []
    for leaf in range(n):
        if has_child[leaf]:
            continue
        path = [leaf]
        while p[path[-1]] >= 0:
            path.append(p[path[-1]])
        paths.append(path[::-1])
    width = max(len(x) for x in paths)
    out = torch.full((len(paths), width), -1, dtype=torch.long)
    for r, path in enumerate(paths):
        out[r, : len(path)] = torch.tensor(path)
    return out.to(parents.device)


def reindex_parents(parents: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Parents of the sub-tree made of nodes `keep` (closed under ancestors, parents first), renumbered."""
    new_index = torch.full_like(parents, -1)
    new_index[keep] = torch.arange(keep.numel(), device=parents.device)
    old_parents = parents[keep]
    out = torch.where(old_parents >= 0, new_index[old_parents.clamp(min=0)], old_parents)
    if bool((out[1:] < 0).any()):
        raise ValueError("kept nodes are not closed under ancestors")
    return out


# ---------------------------------------------------------------------------------------------
# Static trees (Medusa "choices")
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StaticTree:
    """A tree shape from Medusa-style choices.

    parents: [N] with the root at 0. For node i > 0: `head[i]` is the draft step (0 = the first
    token after the root) and `rank[i]` which of that step's top-k candidates fills it.
    """

    parents: torch.Tensor
    head: torch.Tensor
    rank: torch.Tensor

    @property
    def max_rank(self) -> int:
        return int(self.rank.max()) + 1 if self.rank.numel() > 1 else 1

    @property
    def depth(self) -> int:
        return int(self.head.max()) + 1 if self.head.numel() > 1 else 0


def tree_from_choices(choices: Sequence[Sequence[int]]) -> StaticTree:
    """Build a static tree from choices: each choice is a path of per-step top-k ranks, e.g.
    (0,) = top-1 at step 0, (0, 1) = its child holding step 1's 2nd candidate. Every prefix of
    a choice must itself be a choice. Nodes are ordered by depth, then lexicographically."""
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    if any(len(c) == 0 for c in paths):
        raise ValueError("empty choice: the root is implicit")
    if any(r < 0 for c in paths for r in c):
        raise ValueError("choices hold non-negative ranks")
    index: dict[tuple[int, ...], int] = {(): 0}
    parents, head, rank = [-1], [-1], [-1]
    for c in paths:
        if c[:-1] not in index:
            raise ValueError(f"choice {list(c)} has no parent choice {list(c[:-1])}")
        index[c] = len(parents)
        parents.append(index[c[:-1]])
        head.append(len(c) - 1)
        rank.append(c[-1])
    return StaticTree(torch.tensor(parents), torch.tensor(head), torch.tensor(rank))


def chain_choices(depth: int) -> list[tuple[int, ...]]:
    """Choices of a chain of `depth` top-1 tokens."""
    return [tuple([0] * d) for d in range(1, depth + 1)]


# ---------------------------------------------------------------------------------------------
# Dynamic trees (EAGLE-2): keep the best nodes by cumulative draft log-probability
# ---------------------------------------------------------------------------------------------


def select_top_nodes(parents: torch.Tensor, scores: torch.Tensor, num_draft: int) -> torch.Tensor:
    """Keep the root plus the `num_draft` best draft nodes by score (EAGLE-2 sec. 4.2, rerank).

    parents: [N] candidate tree; scores: [N] cumulative log-probabilities (scores[0] ignored).
    A cumulative log-probability never rises along a path, so the best nodes are closed under
    ancestors; ties are broken towards shallower, then earlier nodes, which keeps that true.
    Returns the kept node indices, sorted (a valid `DraftTree.subtree` argument).
    """
    n = parents.shape[0]
    if n - 1 <= num_draft:
        return torch.arange(n, device=parents.device)
    depth = node_depths(parents)
    s = scores.tolist()
    d = depth.tolist()
    order = sorted(range(1, n), key=lambda i: (-s[i], d[i], i))[:num_draft]
    keep = sorted([0] + order)
    kept = set(keep)
    p = parents.tolist()
    for i in keep[1:]:  # defensive closure: scores from a drafter may not be monotone
        j = p[i]
        while j > 0 and j not in kept:
            kept.add(j)
            j = p[j]
    return torch.tensor(sorted(kept), dtype=torch.long, device=parents.device)


def best_first(parents: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The nodes `keep` (containing 0, closed under ancestors) reordered best score first, root
    first and every node after its parent, so that any prefix of the order is itself a tree of
    the best nodes: what the load policy's cut keeps (inference/engine/policy.py). Ties go to shallower,
    then earlier nodes; a node whose parent scores lower (a non-monotone drafter) waits for it."""
    p = parents.tolist()
    s = scores.tolist()
    depth = node_depths(parents).tolist()
    order = sorted(keep.tolist()[1:] if int(keep[0]) == 0 else keep.tolist(), key=lambda i: (-s[i], depth[i], i))
    placed, out = {0}, [0]
    for node in order:
        chain = []
        while node not in placed:
            chain.append(node)
            node = p[node]
        for n in reversed(chain):
            placed.add(n)
            out.append(n)
    return torch.tensor(out, dtype=torch.long, device=parents.device)
