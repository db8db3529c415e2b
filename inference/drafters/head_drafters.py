"""Drafters that run trained heads: Medusa (static tree) and EAGLE-1/3 (dynamic EAGLE-2 tree).

Both read the target's hidden states from the verification forward (`TargetFeatures`), so they
never run the target themselves.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Any, Sequence

import torch

from ..engine.cache import crop
from ..engine.cost import best_node_count, sync_device
from ..engine.drafter import RoundStats, TargetFeatures
from ..engine.tree import DraftTree, best_first, select_top_nodes, tree_from_choices
from .settings import StaticTreeSettings, TreeSettings


# ---------------------------------------------------------------------------------------------
# Static tree shapes
# ---------------------------------------------------------------------------------------------


def best_static_tree(rank_accuracy: torch.Tensor, num_draft: int) -> list[tuple[int, ...]]:
    """The `num_draft` choices with the highest expected acceptance (Medusa's tree search).

    rank_accuracy: [K, R], the chance that step k's rank-r candidate is the target's token. A
    node's value is the product along its path; best-first expansion keeps the tree closed under
    parents because a child is never worth more than its parent.
    """
    K, R = rank_accuracy.shape
    acc = rank_accuracy.tolist()
    heap: list[tuple[float, tuple[int, ...]]] = [(-acc[0][r], (r,)) for r in range(R)]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_draft:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        depth = len(path)
        if depth < K:
            for r in range(R):
                heapq.heappush(heap, (neg * acc[depth][r], path + (r,)))
    return chosen


def default_rank_accuracy(num_steps: int, ranks: int = 4) -> torch.Tensor:
    """A prior for heads without measured accuracies: step k top-1 ~ 0.6 * 0.8^k, rank r ~ 1/(r+2)."""
    top1 = torch.tensor([0.6 * 0.8**k for k in range(num_steps)])
    rank = torch.tensor([1.0] + [1.0 / (r + 2) for r in range(1, ranks)])
    return top1[:, None] * rank[None, :]


def static_tree_shape(choices: Sequence[Sequence[int]] | None, num_draft: int, depth: int, what: str):
    """A StaticTree of per-depth candidates at most `depth` deep: `choices` (tree_from_choices), or
    else the `num_draft` best under the default prior of per-depth accuracies. `what` names the
    depth limit in the error (e.g. "the 4 Medusa heads")."""
    if choices is None:
        choices = best_static_tree(default_rank_accuracy(depth), num_draft)
    shape = tree_from_choices(choices)
    if shape.depth > depth:
        raise ValueError(f"tree depth {shape.depth} exceeds {what}")
    return shape


def static_tree_drafts(shape, logits: torch.Tensor) -> torch.Tensor:
    """The draft tokens of a static tree's nodes 1..N-1, in node order: node n is candidate
    `shape.rank[n]` of depth `shape.head[n]`. logits: [B, K, V] per depth -> [B, N - 1]."""
    top = torch.topk(logits, shape.max_rank, dim=-1).indices  # [B, K, R]
    return top[:, shape.head[1:].to(top.device), shape.rank[1:].to(top.device)]


def draft_ids_of(head) -> torch.Tensor | None:
    """[Vd] target id of each draft id, or None for a head over the target's whole vocabulary."""
    d2t = head.draft_to_target
    return None if d2t is None else torch.arange(d2t.shape[0], device=d2t.device) + d2t


class MedusaDrafter:
    """Medusa-1/2: head k on the last committed hidden state proposes the token k + 1 steps after
    the pending one; a static tree of per-step top-k candidates (Cai et al. 2024, sec. 2.1.2)."""

    feature_layers: tuple[int, ...] = ()
    needs_last_hidden = True

    def __init__(self, head, settings: StaticTreeSettings = StaticTreeSettings()):
        """settings: the static tree (default: the 24 best nodes under the prior)."""
        self.head = head
        num_draft = 24 if settings.num_draft is None else settings.num_draft
        self.shape = static_tree_shape(settings.choices, num_draft, head.num_heads, f"the {head.num_heads} Medusa heads")
        self.last_hidden: torch.Tensor | None = None  # [B, H]
        self.pending: torch.Tensor | None = None

    @property
    def num_draft(self) -> int:
        return int(self.shape.parents.shape[0]) - 1

    def describe(self) -> dict:
        return {"kind": f"{self.head.kind} static tree", "num_draft": self.num_draft, "depth": self.shape.depth}

    def begin(self, tokens, features: TargetFeatures | None, pending) -> None:
        last = None if features is None else features.last
        assert features is None or last is not None  # needs_last_hidden: the engine passes it
        self.last_hidden = None if last is None or last.shape[1] == 0 else last[:, -1]
        self.pending = pending

    def commit(self, tokens, features: TargetFeatures | None, pending, stats: RoundStats) -> None:
        assert features is not None and features.last is not None  # needs_last_hidden: the engine passes it
        self.last_hidden = features.last[:, -1]
        self.pending = pending

    def propose(self) -> DraftTree:
        assert self.pending is not None  # set by begin
        root = self.pending[:, None]
        if self.last_hidden is None:  # a one-token prompt: nothing to read yet
            return DraftTree(root, torch.tensor([-1], device=root.device))
        logits = self.head.draft_logits(self.last_hidden)  # [K, B, V]
        drafts = static_tree_drafts(self.shape, logits.transpose(0, 1))  # [B, N-1]
        return DraftTree(torch.cat([root, drafts], dim=1), self.shape.parents.to(root.device))


class HydraDrafter(MedusaDrafter):
    """Hydra (heads/hydra.py): Medusa's static tree, grown depth by depth, since head k reads the
    path a node sits on (the pending token, then the drafts above it). One head call per depth,
    batched over that depth's parents."""

    def describe(self) -> dict:
        return {**super().describe(), "kind": f"{self.head.kind} static tree (sequential heads)"}

    def propose(self) -> DraftTree:
        assert self.pending is not None  # set by begin
        root = self.pending[:, None]  # [1, 1]
        parents = self.shape.parents.to(root.device)
        if self.last_hidden is None:  # a one-token prompt: nothing to read yet
            return DraftTree(root, torch.tensor([-1], device=root.device))
        depth_of = self.shape.head + 1  # node 0, the root, is depth 0
        tokens = root.new_zeros(1, parents.numel())
        tokens[0, 0] = root[0, 0]
        paths = {0: [0]}  # node -> the nodes from the root down to it
        for d in range(self.shape.depth):  # head d drafts the nodes at depth d + 1
            children = (depth_of == d + 1).nonzero().flatten().tolist()
            above = sorted({int(parents[c]) for c in children})
            path_ids = tokens[0, torch.tensor([paths[p] for p in above], device=root.device)]  # [n, d + 1]
            embeds = self.head.refs.embed_tokens(path_ids, self.head.dtype)
            logits = self.head.path_logits(self.last_hidden.expand(len(above), -1), embeds, d)  # [n, V]
            top = torch.topk(logits, self.shape.max_rank, dim=-1).indices
            row = {p: i for i, p in enumerate(above)}
            for c in children:
                p = int(parents[c])
                tokens[0, c] = top[row[p], int(self.shape.rank[c])]
                paths[c] = paths[p] + [c]
        return DraftTree(tokens, parents)


# ---------------------------------------------------------------------------------------------
# EAGLE: a one-layer draft model over (feature_t, token_{t+1}) pairs, with its own KV cache
# ---------------------------------------------------------------------------------------------


class FeatureBuffer:
    """The target features of committed positions a head has not read yet: kept per round and
    fused in one call at the next propose (rounds decoded plainly by the load policy only append).
    Shared by the EAGLE-family and DFlash drafters; `self.head.fuse` does the fusing."""

    head: Any  # the subclass's head

    def _start_buffer(self, features: TargetFeatures | None) -> None:
        self.unfed: list[tuple[torch.Tensor, ...]] = []
        self._take(features)

    def _take(self, features: TargetFeatures | None) -> None:
        if features is not None and features.hidden_states[0].shape[1] > 0:
            self.unfed.append(tuple(features.hidden_states))

    def _fuse_unfed(self) -> torch.Tensor:
        """[1, n, H]: the head's fused input over the n positions taken since the last call."""
        fused = self.head.fuse([torch.cat(layer, dim=1) for layer in zip(*self.unfed)])
        self.unfed = []
        return fused


class EagleDrafter(FeatureBuffer):
    """EAGLE-1/EAGLE-3 drafting with EAGLE-2's dynamic tree (Li et al. 2024b, sec. 4).

    The head's cache holds the pairs (target feature at t, token t+1) of committed positions.
    Each round: feed the pairs the cache lacks, then grow the tree `depth` times, each time
    expanding the `branch` frontier nodes of best cumulative log-probability into their `branch`
    best children (one head forward per depth, tree-masked), and finally keep the `num_draft` best
    nodes. The draft tree nodes are cropped from the cache before the next round.

    Sized by confidence (`size_by(cost)`, which the engine calls under sizing "confidence"): each
    round keeps the number of best candidates, up to num_draft (default: all of them), that
    maximises expected tokens per second under the verifier's measured cost, counting the nodes
    other drafters add (`extra_nodes`).
    """

    needs_last_hidden = False

    def __init__(self, head, settings: TreeSettings = TreeSettings()):
        self.head = head
        self.feature_layers = tuple(head.feature_layers)
        self.settings = settings
        self.depth, self.branch = settings.depth, settings.branch
        self.confidence_rule = False
        self.verify_cost, self.extra_nodes = None, 0
        self.num_draft_limit: int | None = None  # the load policy's num_draft for the next round (`limit`)
        # auto sizing: calibration of the draft's path probabilities against what was accepted,
        # as decayed sums over rounds (kept across sequences), and the time drafting takes
        self.predicted_sum, self.accepted_sum, self.predicted = 1.0, 1.0, 0.0
        self.draft_seconds: float | None = None
        self.draft_ids = draft_ids_of(head)

    @property
    def num_draft(self) -> int:
        """Draft nodes a round keeps at most: the settings', else 24, or every candidate when sized by confidence."""
        if self.settings.num_draft is not None:
            return self.settings.num_draft
        return self.branch + (self.depth - 1) * self.branch * self.branch if self.confidence_rule else 24

    def size_by(self, cost, extra_nodes: int = 0) -> None:
        """Size each round by the draft's confidence against `cost` (a cost.CostCurve of the
        verifier's forward; inference/engine/sizing.py), counting `extra_nodes` other drafters
        add; None: draft the settings' tree."""
        self.confidence_rule, self.verify_cost, self.extra_nodes = cost is not None, cost, extra_nodes

    def describe(self) -> dict:
        return {
            "kind": f"{self.head.kind} tree",
            "num_draft": self.num_draft,
            "sizing": "confidence" if self.confidence_rule else "fixed",
            "depth": self.depth,
            "branch": self.branch,
        }

    def limit(self, num_draft: int | None) -> None:
        """Draft at most `num_draft` nodes next round (None: the configured tree). Best-first nodes
        lie at most `num_draft` deep, so fewer head steps run: the load policy's small trees cost less."""
        self.num_draft_limit = num_draft

    # -- lifecycle ---------------------------------------------------------------------------

    def begin(self, tokens, features: TargetFeatures | None, pending) -> None:
        self.cache = self.head.new_cache()
        self.history = torch.cat([tokens, pending[:, None]], dim=1)  # [B, L] committed + pending
        self.fed = 0  # pairs (t, t+1) in the head cache, t = 0..fed-1
        self._start_buffer(features)

    def commit(self, tokens, features: TargetFeatures | None, pending, stats: RoundStats) -> None:
        crop(self.cache, self.fed)  # drop the draft-tree nodes: only committed pairs stay
        if self.confidence_rule and not stats.skipped:
            self.predicted_sum = _DECAY * self.predicted_sum + self.predicted
            self.accepted_sum = _DECAY * self.accepted_sum + stats.accepted_on_path
        self.history = torch.cat([self.history, tokens[:, 1:], pending[:, None]], dim=1)
        self._take(features)

    # -- drafting ----------------------------------------------------------------------------

    def _frontier_mask(self, nodes: list[int], fed_nodes: list[int], cand_parent: list[int], device) -> torch.Tensor:
        """Additive [1, 1, F, fed + len(fed_nodes) + F] mask for feeding frontier `nodes`: each sees
        every committed pair, its ancestors among the tree nodes already in the cache, and itself.
        Built from parent walks (depth <= self.depth) rather than the whole tree's ancestor matrix."""
        column = {node: j for j, node in enumerate(fed_nodes + nodes)}
        allowed = torch.zeros(len(nodes), len(column), dtype=torch.bool)
        for row, node in enumerate(nodes):
            while node > 0:  # node n is candidate n - 1; the root lives in the committed pairs
                allowed[row, column[node]] = True
                node = cand_parent[node - 1]
        mask = torch.zeros(len(nodes), self.fed + len(column), dtype=self.head.dtype)
        mask[:, self.fed :].masked_fill_(~allowed, torch.finfo(self.head.dtype).min)
        return mask.to(device)[None, None]

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.draft_ids is None else self.draft_ids[ids]

    def _catch_up_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The committed pairs (f_t, x_{t+1}) the head cache lacks, t = fed .. L-2: fused features
        [1, n, H], tokens [1, n] and position ids t [1, n]; from now on they count as fed."""
        L = self.history.shape[1]
        fused = self._fuse_unfed()
        tokens = self.history[:, self.fed + 1 : L]
        positions = torch.arange(self.fed, L - 1, device=self.history.device)[None]
        self.fed = L - 1
        return fused, tokens, positions

    def propose(self) -> DraftTree:
        started = time.perf_counter()
        device = self.history.device
        L = self.history.shape[1]
        root = self.history[:, -1:]
        if not self.unfed:
            self.predicted = 0.0
            return DraftTree(root, torch.tensor([-1], device=device))
        # 1. catch up: pairs (f_t, x_{t+1}) for t = fed .. L-2, at position ids t
        hidden, logits = self.head.step(*self._catch_up_pairs(), self.cache, None, last_only=True)
        # 2. grow the tree: candidates carry (token, parent, cumulative log-prob, hidden)
        logp = torch.log_softmax(logits[0, -1].float(), dim=-1)
        top = torch.topk(logp, self.branch)
        cand_tokens = [int(t) for t in self._to_target(top.indices)]
        cand_parent = [0] * self.branch
        cand_score = top.values.tolist()
        cand_hidden = [hidden[0, -1]] * self.branch  # the parent's output feeds its children
        frontier = list(range(self.branch))  # candidate indices (node = index + 1)
        fed_nodes: list[int] = []  # tree nodes whose K/V the head cache holds, in feeding order
        steps = self.depth if self.num_draft_limit is None else max(1, min(self.depth, self.num_draft_limit))
        for depth in range(1, steps):
            # feed the frontier nodes: they sit at position (L - 2) + depth
            nodes = [c + 1 for c in frontier]
            step_mask = self._frontier_mask(nodes, fed_nodes, cand_parent, device)
            h_in = torch.stack([cand_hidden[c] for c in frontier])[None]
            tok_in = torch.tensor([[cand_tokens[c] for c in frontier]], device=device)
            pos = torch.full((1, len(nodes)), L - 2 + depth, device=device)
            h_out, lg = self.head.step(h_in, tok_in, pos, self.cache, step_mask)
            fed_nodes += nodes
            lp = torch.log_softmax(lg[0].float(), dim=-1)  # [F, Vd]
            child = torch.topk(lp, self.branch, dim=-1)  # [F, k]
            scores = torch.tensor([cand_score[c] for c in frontier], device=device)[:, None] + child.values
            best = torch.topk(scores.flatten(), self.branch)  # EAGLE-2: next frontier = best k of k*k
            ids, score_rows = self._to_target(child.indices).tolist(), scores.tolist()
            for f_row in range(len(frontier)):
                for j in range(self.branch):
                    cand_tokens.append(ids[f_row][j])
                    cand_parent.append(frontier[f_row] + 1)
                    cand_score.append(score_rows[f_row][j])
                    cand_hidden.append(h_out[0, f_row])
            base = len(cand_tokens) - len(frontier) * self.branch
            frontier = [base + int(i) for i in best.indices]
        # 3. rerank: keep the num_draft best candidates (closed under ancestors)
        parents = torch.tensor([-1] + cand_parent)
        scores = torch.tensor([0.0] + cand_score)
        num_draft = self._confidence_num_draft(cand_score, started, device) if self.confidence_rule else self.num_draft
        if self.num_draft_limit is not None:
            num_draft = min(num_draft, self.num_draft_limit)
        # best first: a cut to the first n nodes keeps the n likeliest (the load policy's cut)
        keep = best_first(parents, scores, select_top_nodes(parents, scores, num_draft))
        tree = DraftTree(torch.tensor([[int(root[0, 0])] + cand_tokens], device=device), parents.to(device))
        return tree.subtree(keep.to(device))

    def _confidence_num_draft(self, cand_score: list[float], started: float, device: torch.device) -> int:
        """Draft nodes to keep this round (module cost.py): candidates' path probabilities, scaled by how
        the draft's confidence has compared with acceptance so far, against the measured cost."""
        # the .tolist() reads above already waited for the draft steps; the explicit sync keeps the
        # timing right on CUDA should they ever go (a no-op on CPU)
        sync_device(device)
        elapsed = time.perf_counter() - started
        self.draft_seconds = elapsed if self.draft_seconds is None else 0.9 * self.draft_seconds + 0.1 * elapsed
        calibration = self.accepted_sum / self.predicted_sum
        probs = sorted((math.exp(x) for x in cand_score), reverse=True)
        n = best_node_count([min(1.0, calibration * p) for p in probs], self.verify_cost, self.draft_seconds, self.extra_nodes)
        self.predicted = sum(probs[:n])
        return n


_DECAY = 0.98  # per round, for the calibration sums of confidence sizing (~50 rounds of memory)
