"""Several drafters in one tree: their trees are merged into a trie under the shared root.

Typical use: a trained head plus prompt lookup, which wins on text that repeats the prompt or
itself (code, lists, quotes) where a head is unsure. The verifier still sees one DraftTree, so
exactness is unchanged; only deterministic trees (no draft_probs) can be merged.
"""

from __future__ import annotations

import torch

from ..engine.drafter import RoundStats, TargetFeatures, fork_drafter
from ..engine.tree import DraftTree, node_depths


def merge_trees(trees: list[DraftTree], extra_nodes: list[int | None]) -> tuple[DraftTree, list[list[int]]]:
    """Union of trees sharing a root token, as a trie in topological order.

    extra_nodes[i]: at most that many nodes *new to the merged tree* come from tree i (None: all),
    taken shallowest first. An unbudgeted tree's nodes keep their own order (an EAGLE tree's is
    best first, which the load policy's cut relies on: inference/engine/policy.py). Trees follow one
    another. Returns the merged tree and, per input tree, the merged index of each of its nodes
    (-1 where a node was left out by its extra_nodes).
    """
    root = int(trees[0].tokens[0, 0])
    tokens, parents = [root], [-1]
    child: dict[tuple[int, int], int] = {}
    maps: list[list[int]] = []
    for tree, extra in zip(trees, extra_nodes):
        if tree.draft_probs is not None:
            raise ValueError("sampled trees (with draft_probs) cannot be merged")
        if int(tree.tokens[0, 0]) != root:
            raise ValueError("trees to merge must share the root token")
        t, p = tree.tokens[0].tolist(), tree.parents.tolist()
        if extra is None:
            order = list(range(1, len(t)))  # topological: a node's parent is mapped before it
        else:
            depth = node_depths(tree.parents).tolist()
            order = sorted(range(1, len(t)), key=lambda i: (depth[i], i))
        mapping = [0] + [-1] * (len(t) - 1)
        added = 0
        for i in order:
            parent = mapping[p[i]]
            if parent < 0:
                continue
            key = (parent, t[i])
            if key not in child:
                if extra is not None and added >= extra:
                    continue
                child[key] = len(tokens)
                tokens.append(t[i])
                parents.append(parent)
                added += 1
            mapping[i] = child[key]
        maps.append(mapping)
    # appending keeps parents before children, since a node is added after its mapped parent
    device = trees[0].tokens.device
    return DraftTree(torch.tensor([tokens], device=device), torch.tensor(parents, device=device)), maps


class MergedDrafter:
    """Drafts with every sub-drafter and verifies the union. The first is the primary: its whole
    tree goes in; each later one adds at most `extra_nodes` new nodes (None: its whole tree)."""

    def __init__(self, drafters: list, extra_nodes: int | None = 8):
        if len(drafters) < 2:
            raise ValueError("MergedDrafter needs at least two drafters")
        self.drafters = drafters
        self.extra_nodes = extra_nodes
        layers: list[int] = []
        for d in drafters:
            layers += [i for i in d.feature_layers if i not in layers]
        self.feature_layers = tuple(layers)
        self.needs_last_hidden = any(d.needs_last_hidden for d in drafters)
        self.maps: list[list[int]] = []

    def limit(self, num_draft: int | None) -> None:
        """The load policy's num_draft goes to the primary drafter (the later ones add few nodes)."""
        limit = getattr(self.drafters[0], "limit", None)
        if limit is not None:
            limit(num_draft)

    def size_by(self, cost, extra_nodes: int = 0) -> None:
        """Sizing by confidence is the primary drafter's (inference/engine/sizing.py), counting the
        nodes the others add to each round."""
        size_by = getattr(self.drafters[0], "size_by", None)
        if size_by is None:
            if cost is not None:
                raise ValueError(f"sizing 'confidence' needs a primary drafter that sizes its own rounds, not {type(self.drafters[0]).__name__}")
            return
        size_by(cost, extra_nodes + sum(int(getattr(d, "num_draft", 0)) for d in self.drafters[1:]))

    def fork(self) -> "MergedDrafter":
        return MergedDrafter([fork_drafter(d) for d in self.drafters], self.extra_nodes)

    def describe(self) -> dict:
        return {
            "kind": "merged",
            "extra_nodes": self.extra_nodes,
            "drafters": [d.describe() if hasattr(d, "describe") else {"kind": type(d).__name__} for d in self.drafters],
        }

    def _features_for(self, drafter, features: TargetFeatures | None) -> TargetFeatures | None:
        if features is None or not (drafter.feature_layers or drafter.needs_last_hidden):
            return None
        by_layer = dict(zip(features.layers, features.hidden_states))
        return TargetFeatures(
            layers=tuple(drafter.feature_layers),
            hidden_states=tuple(by_layer[i] for i in drafter.feature_layers),
            last=features.last if drafter.needs_last_hidden else None,
        )

    def begin(self, tokens, features, pending) -> None:
        for d in self.drafters:
            d.begin(tokens, self._features_for(d, features), pending)

    def propose(self) -> DraftTree:
        trees = [d.propose() for d in self.drafters]
        extra_nodes = [None] + [self.extra_nodes] * (len(trees) - 1)
        merged, self.maps = merge_trees(trees, extra_nodes)
        return merged

    def commit(self, tokens, features, pending, stats: RoundStats) -> None:
        if stats.skipped:  # no tree was proposed (self.maps is an older round's, or none): the root alone
            for d in self.drafters:
                d.commit(tokens, self._features_for(d, features), pending, stats)
            return
        for d, mapping in zip(self.drafters, self.maps):
            back = {m: i for i, m in enumerate(mapping) if m >= 0}
            own_path = []
            for node in stats.path:  # the accepted path as far as this drafter's tree has it
                if node not in back:
                    break
                own_path.append(back[node])
            own = RoundStats(stats.num_draft, stats.num_accepted, stats.depth, stats.accepted_depths, own_path)
            d.commit(tokens, self._features_for(d, features), pending, own)
