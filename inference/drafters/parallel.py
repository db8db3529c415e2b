"""Parallel drafters: one head forward proposes a token at every depth of the draft.

P-EAGLE (`ParallelDrafter`): the head cache holds the committed pairs as EAGLE's does
(EagleDrafter's lifecycle: catch up on the pairs verified last round, crop the draft positions
afterwards). Each round one forward runs the catch-up pairs plus `parallel_depth - 1` mask
positions (heads/peagle.py) and gives logits [K, Vd], one row per depth.

DFlash (`DFlashDrafter`): the drafter keeps every draft layer's keys/values of the committed
positions' fused features; each round it adds the positions verified last round and runs one
block [pending token, mask x (S - 1)] over them (heads/dflash.py): logits [S - 1, V].

DSpark (`DSparkDrafter`): DFlash's, plus a Markov bias from each node's parent token, so each
depth's candidates are its parent's own (the tree grows depth by depth), and a confidence head
that can size the verify.

In P-EAGLE and DFlash, depth k's distribution is conditioned on the committed text only, never on
the tokens drafted before it, so the tree is Medusa's: a static tree of per-depth top-r candidates
(`choices`; the default is the chain of top-1 tokens, what vLLM and SGLang draft). Any tree of
them is verified exactly like every other, since the rule needs no draft probabilities.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from ..engine.cost import best_node_count, sync_device
from ..engine.drafter import TargetFeatures
from ..engine.tree import DraftTree, best_first, chain_choices, select_top_nodes
from .head_drafters import EagleDrafter, FeatureBuffer, draft_ids_of, static_tree_drafts, static_tree_shape
from .settings import StaticTreeSettings


class StaticTreeMixin:
    """Shared by the parallel drafters: the static tree of per-depth candidates, and the load
    policy's node limit (`limit`)."""

    if TYPE_CHECKING:  # each drafter's own (the head; draft ids to target ids)
        head: Any

        def _to_target(self, ids: torch.Tensor) -> torch.Tensor: ...

    def _init_tree(self, settings: StaticTreeSettings, depth: int, what: str) -> None:
        """The static tree of `settings` at most `depth` deep (`what` names the limit); neither
        choices nor num_draft: the top-1 chain."""
        if settings.num_draft is None:  # the choices given, or the top-1 chain
            self.shape = static_tree_shape(settings.choices or chain_choices(depth), 0, depth, what)
        else:
            self.shape = static_tree_shape(settings.choices, settings.num_draft, depth, what)
        self.num_draft_limit: int | None = None  # the load policy's num_draft for the next round

    @property
    def num_draft(self) -> int:
        return int(self.shape.parents.shape[0]) - 1

    def limit(self, num_draft: int | None) -> None:
        """Draft at most `num_draft` nodes next round (None: the whole static tree)."""
        self.num_draft_limit = num_draft

    def describe(self) -> dict:
        return {"kind": f"{self.head.kind} parallel", "num_draft": self.num_draft, "depth": self.shape.depth}

    def _tree(self, root: torch.Tensor, logits: torch.Tensor) -> DraftTree:
        """root [1, 1] and per-depth logits [1, K, V'] (V' draft ids, mapped by `_to_target`)."""
        drafts = self._to_target(static_tree_drafts(self.shape, logits))  # [1, N - 1]
        tree = DraftTree(torch.cat([root, drafts], dim=1), self.shape.parents.to(root.device))
        if self.num_draft_limit is not None and self.num_draft_limit < tree.num_draft:
            # nodes are ordered by depth, so the first ones are closed under their parents
            tree = tree.subtree(torch.arange(self.num_draft_limit + 1, device=root.device))
        return tree


def root_only(root: torch.Tensor) -> DraftTree:
    """The tree of a round with nothing to draft from (a one-token prompt): the pending token."""
    return DraftTree(root, torch.tensor([-1], device=root.device))


class ParallelDrafter(StaticTreeMixin, EagleDrafter):
    """P-EAGLE's drafter (module docstring). choices: per-depth rank paths (tree_from_choices),
    at most `head.parallel_depth` deep; else num_draft: the best static tree of that many draft nodes
    under a prior of per-depth accuracies (Medusa's search); neither: the top-1 chain."""

    def __init__(self, head, settings: StaticTreeSettings = StaticTreeSettings()):
        self.head = head
        self.feature_layers = tuple(head.feature_layers)
        self._init_tree(settings, head.parallel_depth, f"the head's parallel_depth {head.parallel_depth}")
        self.confidence_rule = False  # EagleDrafter.commit's confidence-rule bookkeeping is off
        self.draft_ids = draft_ids_of(head)

    def size_by(self, cost, extra_nodes: int = 0) -> None:
        """One forward drafts the whole static tree: nothing to size by confidence."""
        if cost is not None:
            raise ValueError(f"a {self.head.kind} head drafts its static tree in one forward: it does not size its rounds by confidence")

    def propose(self) -> DraftTree:
        root = self.history[:, -1:]
        if not self.unfed:  # a one-token prompt: nothing to read yet
            return root_only(root)
        # commit() crops the mask positions' K/V back to the pairs fed here
        logits = self.head.parallel_draft(*self._catch_up_pairs(), self.cache)  # [1, K, Vd]
        return self._tree(root, logits)


class DFlashDrafter(StaticTreeMixin, FeatureBuffer):
    """DFlash's drafter (module docstring). choices / num_draft as ParallelDrafter's, at most
    `block_size - 1` deep."""

    needs_last_hidden = False

    def __init__(self, head, settings: StaticTreeSettings = StaticTreeSettings()):
        self.head = head
        self.feature_layers = tuple(head.feature_layers)
        depth = head.block_size - 1
        self._init_tree(settings, depth, f"the {depth} tokens a block of {head.block_size} drafts")

    @staticmethod
    def _to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids  # the target's LM head: draft ids are target ids

    def begin(self, tokens, features: TargetFeatures | None, pending) -> None:
        self.history = torch.cat([tokens, pending[:, None]], dim=1)  # [1, L]: committed + pending
        self.context = None  # per draft layer (keys, values) [1, kv_heads, fed, d] of committed positions
        self.fed = 0
        self._start_buffer(features)

    def commit(self, tokens, features: TargetFeatures | None, pending, stats) -> None:
        self.history = torch.cat([self.history, tokens[:, 1:], pending[:, None]], dim=1)
        self._take(features)

    def _catch_up(self) -> None:
        """Add the keys/values of the positions verified since the last round (fed .. fed + n - 1)."""
        fused = self._fuse_unfed()  # [1, n, H]
        n = fused.shape[1]
        new = self.head.context(fused, torch.arange(self.fed, self.fed + n, device=fused.device)[None])
        if self.context is None:
            self.context = new
        else:
            self.context = [(torch.cat([k, k2], dim=2), torch.cat([v, v2], dim=2)) for (k, v), (k2, v2) in zip(self.context, new)]
        self.fed += n

    def propose(self) -> DraftTree:
        root = self.history[:, -1:]
        if self.unfed:
            self._catch_up()
        if self.fed == 0:  # a one-token prompt: no context yet
            return root_only(root)
        return self._tree(root, self.head.draft_logits(root[:, 0], self.fed, self.context))  # logits [1, S - 1, V]


class DSparkDrafter(DFlashDrafter):
    """DSpark's drafter (heads/dspark.py): DFlash's cached context and one block forward a round,
    then the static tree grown depth by depth, since the Markov bias makes each node's
    distribution its parent's: a node at depth d takes rank r of U_{d-1} + W2 W1[parent token].
    At most `block_size` deep (every slot drafts).

    Sized by confidence (`size_by(cost)`, which the engine calls under sizing "confidence"): the
    confidence head sets the verify length. Each node's chance of
    acceptance is the product of c along its path (c from its slot's state and its parent token);
    the round keeps the best nodes, as many as maximise expected tokens per second under the
    target's measured `verify_cost` (inference/engine/cost.py best_node_count, the paper's
    prefix scheduler for one sequence). Which nodes are verified never changes what is accepted."""

    def __init__(self, head, settings: StaticTreeSettings = StaticTreeSettings()):
        """settings: the static tree; sized by confidence, its nodes are the candidates."""
        self.head = head
        self.feature_layers = tuple(head.feature_layers)
        depth = head.block_size
        self._init_tree(settings, depth, f"the {depth} tokens a block of {head.block_size} drafts")
        self.confidence_rule = False
        self.verify_cost, self.extra_nodes = None, 0  # extra_nodes: nodes other drafters add
        self.draft_seconds: float | None = None
        self.last_confidence: list[float] = []  # the kept nodes' path confidences, last round (best first)

    def size_by(self, cost, extra_nodes: int = 0) -> None:
        """Let the confidence head size each round against `cost` (a cost.CostCurve of the
        verifier's forward), counting `extra_nodes` other drafters add; None: the whole tree."""
        if cost is not None and self.head.confidence_head is None:
            raise ValueError("sizing 'confidence' needs a dspark head with a confidence head")
        self.confidence_rule, self.verify_cost, self.extra_nodes = cost is not None, cost, extra_nodes

    def describe(self) -> dict:
        out = super().describe()
        out["sizing"] = "confidence" if self.confidence_rule else "fixed"
        return out

    def propose(self) -> DraftTree:
        started = time.perf_counter()
        root = self.history[:, -1:]
        if self.unfed:
            self._catch_up()
        if self.fed == 0:  # a one-token prompt: no context yet
            return root_only(root)
        h, base = self.head.block_states(root[:, 0], self.fed, self.context)  # [1, S, H], [1, S, V]
        tokens, score = self._grow(root[0, 0], h[0], base[0])
        tree = DraftTree(tokens[None], self.shape.parents.to(root.device))
        if self.confidence_rule:
            keep = self._confident_nodes(score, started)
        elif self.num_draft_limit is not None and self.num_draft_limit < tree.num_draft:
            keep = torch.arange(self.num_draft_limit + 1)  # nodes are ordered by depth: closed under parents
        else:
            return tree
        return tree.subtree(keep.to(root.device))

    def _grow(self, root: torch.Tensor, h: torch.Tensor, base: torch.Tensor):
        """The tree's tokens [N] (root first) and, with the confidence rule, each node's path
        confidence [N] (root 1), depth by depth: h [S, H], base logits [S, V] of the block."""
        shape = self.shape
        parents, depth_of, rank = shape.parents.tolist(), shape.head.tolist(), shape.rank.tolist()
        tokens = [int(root)] + [0] * (len(parents) - 1)
        score = [1.0] * len(parents)
        nodes_at: dict[int, list[int]] = {}
        for n in range(1, len(parents)):
            nodes_at.setdefault(depth_of[n], []).append(n)
        device = base.device
        for d in sorted(nodes_at):
            nodes = nodes_at[d]
            above = sorted({parents[n] for n in nodes})  # this depth's parents, one bias each
            prev = torch.tensor([tokens[p] for p in above], device=device)
            logits = self.head.corrected_logits(base[d].expand(len(above), -1), prev)  # [P, V]
            top = torch.topk(logits, max(rank[n] for n in nodes) + 1, dim=-1).indices.tolist()
            if self.confidence_rule:
                c = torch.sigmoid(self.head.confidence_logit(h[d].expand(len(above), -1), prev).float()).tolist()
            row = {p: i for i, p in enumerate(above)}
            for n in nodes:
                i = row[parents[n]]
                tokens[n] = top[i][rank[n]]
                if self.confidence_rule:
                    score[n] = score[parents[n]] * c[i]
        return torch.tensor(tokens, device=device), score

    def _confident_nodes(self, score: list[float], started: float) -> torch.Tensor:
        """The nodes to verify under the confidence rule (class docstring), root first, best first."""
        sync_device(self.history.device)
        elapsed = time.perf_counter() - started
        self.draft_seconds = elapsed if self.draft_seconds is None else 0.9 * self.draft_seconds + 0.1 * elapsed
        parents = self.shape.parents
        scores = torch.tensor([0.0] + [math.log(max(s, 1e-30)) for s in score[1:]])
        order = sorted(score[1:], reverse=True)
        n = best_node_count(order, self.verify_cost, self.draft_seconds, self.extra_nodes)
        self.last_confidence = order[:n]
        return best_first(parents, scores, select_top_nodes(parents, scores, n))
