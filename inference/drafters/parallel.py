"""P-EAGLE drafting: one head forward proposes a token at each of `parallel_depth` depths.

The head cache holds the committed pairs as EAGLE's does (EagleDrafter's lifecycle: catch up on
the pairs verified last round, crop the draft positions afterwards). Each round one forward runs
the catch-up pairs plus `parallel_depth - 1` mask positions (heads/peagle.py) and gives logits
[K, Vd], one row per depth. Depth k's distribution is conditioned on the committed text only,
never on the tokens drafted before it, so the tree is Medusa's: a static tree of per-depth top-r
candidates (`choices`; the default is the chain of top-1 tokens, what vLLM drafts). Any tree of
them is verified exactly like every other, since the rule needs no draft probabilities.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..tree import DraftTree, chain_choices
from .heads import EagleDrafter, draft_ids_of, static_tree_shape


class ParallelDrafter(EagleDrafter):
    """P-EAGLE's drafter (module docstring). choices: per-depth rank paths (tree_from_choices),
    at most `head.parallel_depth` deep; else num_nodes: the best static tree of that many nodes
    under a prior of per-depth accuracies (Medusa's search); neither: the top-1 chain."""

    def __init__(self, head, choices: Sequence[Sequence[int]] | None = None, num_nodes: int | None = None):
        self.head = head
        self.feature_layers = tuple(head.feature_layers)
        if choices is None and num_nodes is None:
            choices = chain_choices(head.parallel_depth)
        self.shape = static_tree_shape(choices, num_nodes, head.parallel_depth,
                                       f"the head's parallel_depth {head.parallel_depth}")
        self.auto = False  # EagleDrafter.commit's auto-sizing bookkeeping is off
        self.node_limit: int | None = None
        self.draft_ids = draft_ids_of(head)

    def describe(self) -> dict:
        return {"kind": f"{self.head.kind} parallel", "nodes": int(self.shape.parents.shape[0]) - 1,
                "depth": self.shape.depth}

    def propose(self) -> DraftTree:
        device = self.history.device
        root = self.history[:, -1:]
        if not self.unfed:  # a one-token prompt: nothing to read yet
            return DraftTree(root, torch.tensor([-1], device=device))
        # commit() crops the mask positions' K/V back to the pairs fed here
        logits = self.head.parallel_draft(*self._catch_up_pairs(), self.cache)  # [1, K, Vd]
        top = torch.topk(logits[0], self.shape.max_rank, dim=-1).indices  # [K, R]
        depth, rank = self.shape.head[1:].to(device), self.shape.rank[1:].to(device)
        drafts = self._to_target(top[depth, rank])[None]  # [1, N - 1]
        tree = DraftTree(torch.cat([root, drafts], dim=1), self.shape.parents.to(device))
        if self.node_limit is not None and self.node_limit < tree.num_nodes - 1:
            # nodes are ordered by depth, so the first ones are closed under their parents
            tree = tree.subtree(torch.arange(self.node_limit + 1, device=device))
        return tree
