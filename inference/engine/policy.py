"""Speculation by load (`--sizing policy`): how many draft nodes each row verifies this round,
down to none (plain decoding), so that the batch emits the most tokens per second.

A batch's trees are padded to one node count N (inference/engine/tree.py `pad_trees`), so a round costs

    fixed + drafting + verify(B * N)        (B rows; drafting is skipped when N = 1)

whatever each row's own tree holds: below the longest tree, extra nodes are free. So the rule
picks one N for all rows, and every row keeps the first N - 1 nodes of its tree:

    N* = argmax_N  (B + sum_b G_b(N - 1)) / (fixed + [N > 1] drafting + verify(B * N))

G_b(n) is the expected number of draft tokens row b accepts when its tree is cut to its first n
draft nodes. It is learned from the rounds themselves, for any drafter: a round's accepted path
tells what a cut tree would have accepted (`accepted_within`), for every cut up to the tree's size.
verify() is the target's measured forward cost at that many tokens (inference/engine/cost.py). On a CPU
verify rises with the token count from a few dozen tokens on, so a large batch gets small trees or
none; where verify is flat (a GPU at small batch) the whole tree is kept.

Cut trees only show G up to their cut, so every `probe_every`-th round drafts and verifies the
drafters' whole trees, which keeps the larger cuts measured. Under plain decoding a probe checks
whether drafting pays again. Each probe after which plain decoding still wins doubles the gap to
the next (up to `max_probe_every`). The gap is also never shorter than the probe's own cost, in
plain rounds, divided by `probe_budget`. So while plain decoding wins, probes take at most about
that share of the time, however costly a whole-tree round is at this batch size.

A probe's trees are themselves capped (`probe_size`): at most the node count N whose verify(B * N)
costs `probe_ratio` plain rounds. A larger N could only win with more than probe_ratio - 1
accepted drafts per row and round, which no drafter we measure reaches. Without the cap, the first
probe of a batch of 16 on a CPU verified ~1,000 tokens, about 8 plain rounds of time in one round.
docs/trees.md "Batches" has the derivation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .tree import DraftTree

PROBE_NODES_MAX = 256  # nodes per row from which a probe no longer limits the drafters


def accepted_within(path: Sequence[int], cut: int) -> int:
    """Draft tokens the round would have accepted had its tree kept only draft nodes 1..cut.

    path: accepted node indices, root (0) first. Nodes are in topological order, so along a path
    indices increase, and under greedy acceptance a cut tree accepts exactly the path's prefix
    that survives the cut (under sampling this is an estimate)."""
    return sum(1 for node in path[1:] if node <= cut)


def best_batch_node_count(
    gains: Sequence[Sequence[float]],
    verify_cost: Callable[[int], float],
    fixed_cost: float,
    draft_cost: float | Callable[[int], float],
    max_nodes: int,
) -> int:
    """N (1 <= N <= max_nodes) maximising the batch's expected tokens per second (module docstring).

    gains[b][n]: expected draft tokens row b accepts with n draft nodes (gains[b][0] == 0; past the
    end of a row's list, its last value); verify_cost(T): seconds of a target forward over T tokens;
    fixed_cost: seconds of a round besides verifying and drafting; draft_cost: seconds of drafting
    for the whole batch, or a function of N (drafters that stop early draft small trees faster);
    0 when it is already spent. N = 1 means plain decoding. Ties go to the smaller N.
    """
    batch = len(gains)
    if batch == 0 or max_nodes < 1:
        raise ValueError("need at least one row and max_nodes >= 1")
    drafting = draft_cost if callable(draft_cost) else (lambda n: draft_cost)
    best_n, best_rate = 1, batch / (fixed_cost + verify_cost(batch))
    for n in range(2, max_nodes + 1):
        expected = batch + sum(g[min(n - 1, len(g) - 1)] for g in gains)
        rate = expected / (fixed_cost + drafting(n) + verify_cost(batch * n))
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
    return best_n


def cut_tree(tree: DraftTree, num_nodes: int) -> DraftTree:
    """The tree's first `num_nodes` nodes (root included); topological order keeps it a tree."""
    if tree.num_nodes <= num_nodes:
        return tree
    return tree.subtree(torch.arange(num_nodes, device=tree.tokens.device))


@dataclass
class SpeculationPolicy:
    """The load rule with its running estimates (decayed averages over rounds, kept across calls).

    verify_cost: the target's forward seconds by token count (cost.CostCurve from
    `measure_verify_cost` over the token counts a batch reaches). Each round:

        n = plan(B)      0: probe (whole trees), 1: decode plainly (no drafting), else draft for n nodes
        keep = cut(trees)  after drafting: the node count every tree is cut to
        observe(...)     what the round verified, accepted and cost
    """

    verify_cost: Callable[[int], float]
    probe_every: int = 16
    max_probe_every: int = 128
    probe_budget: float = 0.02  # the share of time probes may cost while plain decoding wins
    probe_ratio: float = 4.0  # a probe verifies at most the nodes that cost this many plain rounds
    decay: float = 0.9
    gain: list[float] = field(default_factory=lambda: [0.0])  # G(n), pooled over rows: [0] = 0 drafts
    weight: list[float] = field(default_factory=lambda: [1.0])
    fixed_seconds: float = 0.0
    # drafting seconds per row, by the node count planned (0: a probe's whole tree)
    draft_seconds: dict[int, float] = field(default_factory=dict)
    rounds: int = 0
    decisions: list[int] = field(default_factory=list)  # nodes verified per row and round (for reports)
    next_probe: int = 0  # the round of the next probe
    probe_gap: int = 0  # rounds between probes now (0: probe_every)
    last_probe: int = -1
    probe_nodes: int = 1  # nodes per row the last probe verified

    def probing(self) -> bool:
        """Whether this round drafts and verifies whole trees (always before any estimate exists)."""
        return 0 not in self.draft_seconds or self.rounds >= self.next_probe

    def probe_size(self, batch: int, largest: int) -> int:
        """Nodes per row a probe keeps (root included, at most `largest`): the most whose verify
        over the batch costs at most probe_ratio times a plain round's."""
        allowed_seconds = self.probe_ratio * self.verify_cost(batch)
        n = 1
        while n < largest and self.verify_cost(batch * (n + 1)) <= allowed_seconds:
            n += 1
        return max(2, n) if largest >= 2 else largest

    def draft_limit(self, batch: int, planned: int) -> int | None:
        """Nodes per row (root included) the drafters need to draft for `plan`'s answer: the
        planned N, a probe's `probe_size`, or None (no limit: a probe that keeps the largest
        trees drafters make, PROBE_NODES_MAX or more)."""
        if planned > 1:
            return planned
        size = self.probe_size(batch, PROBE_NODES_MAX)
        return size if size < PROBE_NODES_MAX else None

    def _draft_cost(self, batch: int) -> Callable[[int], float]:
        whole = self.draft_seconds[0]
        return lambda n: batch * self.draft_seconds.get(n, whole)  # unmeasured sizes: the whole tree's cost

    def plan(self, batch: int) -> int:
        """Before drafting: 0 (probe: whole trees), 1 (decode plainly, drafters skipped) or the node
        count N to draft for (drafters with `limit` stop at N - 1 draft nodes)."""
        if self.probing():
            return 0
        n = best_batch_node_count([self.gain] * batch, self.verify_cost, self.fixed_seconds, self._draft_cost(batch), len(self.gain))
        if self.rounds == self.last_probe + 1:  # the first decision after a probe sets the next gap
            gap = self.probe_gap or self.probe_every
            self.probe_gap = self.probe_every if n > 1 else min(self.max_probe_every, 2 * gap)
            if n == 1:  # a probe costs this many plain rounds more than the plain round it replaces
                plain = self.fixed_seconds + self.verify_cost(batch)
                probe = self.fixed_seconds + batch * self.draft_seconds[0] + self.verify_cost(batch * self.probe_nodes)
                self.probe_gap = max(self.probe_gap, math.ceil((probe / plain - 1) / self.probe_budget))
            self.next_probe = self.last_probe + self.probe_gap
        return n

    def cut(self, trees: list[DraftTree]) -> int:
        """After drafting (its cost spent): the node count every row's tree is cut to."""
        largest = max(t.num_nodes for t in trees)
        if self.probing():
            return self.probe_size(len(trees), largest)
        return best_batch_node_count([self.gain] * len(trees), self.verify_cost, self.fixed_seconds, 0.0, largest)

    def observe(
        self, sizes: Sequence[int], paths: Sequence[Sequence[int]], fixed_seconds: float, draft_seconds: float | None, planned: int = 0
    ) -> None:
        """After a round: row b verified sizes[b] nodes and accepted paths[b]; the round spent
        fixed_seconds outside verify and drafting, and draft_seconds drafting for `planned` nodes
        (None: it did not draft)."""
        for size, path in zip(sizes, paths):
            for n in range(1, size):
                if n >= len(self.gain):
                    self.gain.append(self.gain[-1])
                    self.weight.append(0.0)
                # decayed mean: a cut first seen now starts from its own observation
                self.weight[n] = self.decay * self.weight[n] + 1.0
                self.gain[n] += (accepted_within(path, n) - self.gain[n]) / self.weight[n]
        # G must not fall with n (a larger cut keeps every node of a smaller one)
        for n in range(1, len(self.gain)):
            self.gain[n] = max(self.gain[n], self.gain[n - 1])
        self.fixed_seconds = fixed_seconds if self.rounds == 0 else 0.9 * self.fixed_seconds + 0.1 * fixed_seconds
        if draft_seconds is not None:
            per_row = draft_seconds / max(1, len(sizes))
            old = self.draft_seconds.get(planned)
            self.draft_seconds[planned] = per_row if old is None else 0.9 * old + 0.1 * per_row
        if planned == 0 and draft_seconds is not None:  # this round was a probe
            self.last_probe = self.rounds
            self.probe_nodes = max(sizes)
            self.next_probe = self.rounds + (self.probe_gap or self.probe_every)
        self.decisions.append(max(sizes))
        self.rounds += 1
