"""Exact acceptance rules (docs/acceptance.md), as pure functions on tensors.

Notation follows the papers: `p` is the target's processed next-token distribution at a node,
`q` the drafter's, `x` a drafted token. Every function returns the accepted path (node indices,
root first) and the one token the target adds after it (correction or bonus).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .tree import ancestor_mask, node_depths


@dataclass
class Acceptance:
    path: list[int]  # node indices from the root (0) to the last accepted node
    next_token: int  # the target's token after the path: correction or bonus

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (the root is the pending token, not a draft)."""
        return len(self.path) - 1


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor) -> Acceptance:
    """Greedy tree acceptance (temperature 0).

    tokens: [N] node tokens (tokens[0] the root); parents: [N]; target_argmax: [N] argmax of the
    target at every node. A node is accepted iff every node on its path from the root equals the
    target's argmax at its parent. The deepest accepted node ends the path (among equal depths the
    first, which only matters when a tree repeats a token among siblings).
    """
    match = tokens == target_argmax[parents.clamp(min=0)]  # [N]: node i agrees with its parent's argmax
    best, path = deepest_passing_path(match, parents)
    return Acceptance(path=path, next_token=int(target_argmax[best]))


def deepest_passing_path(passes: torch.Tensor, parents: torch.Tensor) -> tuple[int, list[int]]:
    """passes [N] bool: node i's token passes the rule at its parent (the root's entry is ignored).
    -> (the deepest node whose whole path passes, first index among equal depths; that path, root
    first)."""
    passes = passes.clone()
    passes[0] = True
    anc = ancestor_mask(parents)  # [N, N]
    accepted = ~(anc & ~passes[None, :]).any(dim=1)  # all of i's ancestors-or-self pass
    depth = node_depths(parents)
    best = int(torch.argmax(torch.where(accepted, depth, torch.full_like(depth, -1))))
    return best, anc[best].nonzero().flatten().tolist()  # ancestors in index order == root-to-node order


def _normalise(p: torch.Tensor) -> torch.Tensor:
    total = p.sum()
    return p / total if total > 0 else p


def speculative_sample_chain(
    p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Chain speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    p: [gamma+1, V] target distributions (row i: after i draft tokens); q: [gamma, V] draft
    distributions; draft_tokens: [gamma], y_i ~ q_i. Returns (n accepted, next token).
    """
    gamma = draft_tokens.shape[0]
    u = torch.rand(gamma, generator=generator, device=p.device, dtype=torch.float64)
    for i in range(gamma):
        y = int(draft_tokens[i])
        p_y, q_y = float(p[i, y]), float(q[i, y])
        if q_y > 0 and float(u[i]) < min(1.0, p_y / q_y):
            continue
        residual = _normalise((p[i] - q[i]).clamp(min=0))
        if residual.sum() <= 0:  # p == q up to rounding: rejection had probability ~0
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return gamma, int(torch.multinomial(p[gamma], 1, generator=generator))


def accept_probability(p: torch.Tensor, q: torch.Tensor | None, x: int) -> float:
    """The chance that draft token x is accepted at a node whose target law is p [V] (the
    residual left by the children rejected before it) and whose draft law is q [V] (its children
    drawn from it without replacement; None: chosen deterministically, a point mass on x)."""
    if q is None:
        return float(p[x])
    q_x = float(q[x])
    return min(1.0, float(p[x]) / q_x) if q_x > 0 else 0.0


def after_rejection(p: torch.Tensor, q: torch.Tensor | None, x: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(p, q) for the node's next child once x is rejected: the residual norm(max(0, p - q)) and
    q without x, renormalised; for a point-mass draft, p without x, renormalised."""
    if q is None:
        rest = p.clone()
        rest[x] = 0.0
        return _normalise(rest), None
    residual = (p - q).clamp(min=0)
    q_rest = q.clone()
    q_rest[x] = 0.0
    return (_normalise(residual) if residual.sum() > 0 else p), _normalise(q_rest)


def tree_rejection_sample(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Recursive rejection sampling over a tree (SpecInfer; EAGLE's sampling mode).

    tokens: [N]; parents: [N]; p: [N, V] target distributions at each node; q: [N, V] draft
    distribution at each node from which its children were drawn without replacement, or None
    when children were chosen deterministically (q is then a point mass on each child).
    Children are tried in index order. The emitted sequence is distributed exactly as the target's.
    """

    def accept(probability: float) -> bool:  # one uniform draw per child tried
        return float(torch.rand(1, generator=generator, dtype=torch.float64)) < probability

    def emit(law: torch.Tensor) -> int:
        return int(torch.multinomial(law.float(), 1, generator=generator))

    return tree_rejection_walk(tokens, parents, p, q, accept, emit)


def tree_rejection_walk(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    accept: Callable[[float], bool],
    emit: Callable[[torch.Tensor], int],
) -> Acceptance:
    """tree_rejection_sample's walk, its chance moves given: accept(probability) decides a child,
    emit(law) draws the token after the path from a law [V] (float64, normalised unless it is
    all zeros). The exact-law test drives every branch through these two (tests/test_acceptance.py)."""
    children: list[list[int]] = [[] for _ in range(tokens.shape[0])]
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            children[parent].append(i)
    node, path = 0, [0]
    while True:
        p_cur = p[node].double()
        q_cur = None if q is None else q[node].double()
        chosen = None
        for child in children[node]:
            x = int(tokens[child])
            if accept(accept_probability(p_cur, q_cur, x)):
                chosen = child
                break
            p_cur, q_cur = after_rejection(p_cur, q_cur, x)
        if chosen is None:
            # every child rejected (or a leaf): one token from the current (residual) p
            return Acceptance(path=path, next_token=emit(p_cur))
        node = chosen
        path.append(node)


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance (Cai et al. 2024, sec. 3.3.1). **LOSSY**: the output is no
    longer distributed as the target's; opt-in only, and every result made with it says so.

    A drafted token x below node n is accepted when p_n(x) > min(epsilon, delta * exp(-H(p_n))),
    H the entropy of the target's processed distribution at n: confident positions demand a likely
    token, uncertain ones accept any reasonably plausible one. Medusa's defaults.
    """

    epsilon: float = 0.09  # hard threshold (Medusa's posterior_threshold)
    delta: float = 0.3  # entropy-scaled threshold (Medusa's posterior_alpha)

    def __post_init__(self) -> None:
        if not (0 < self.epsilon <= 1 and self.delta > 0):
            raise ValueError(f"typical acceptance needs 0 < epsilon <= 1 and delta > 0, got {self.epsilon}, {self.delta}")


def typical_accept(
    tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, rule: TypicalAcceptance, generator: torch.Generator | None = None
) -> Acceptance:
    """LOSSY tree acceptance by `TypicalAcceptance`. tokens, parents: [N]; p: [N, V] the target's
    processed distributions at the nodes. The deepest node whose whole path passes is kept (first
    index among equals); the token after it is sampled from p there."""
    p = p.double()
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [N]
    threshold = torch.minimum(torch.full_like(entropy, rule.epsilon), rule.delta * torch.exp(-entropy))  # [N]
    parent = parents.clamp(min=0)
    passes = p[parent, tokens] > threshold[parent]  # [N]: node i's token is typical at its parent
    best, path = deepest_passing_path(passes, parents)
    return Acceptance(path=path, next_token=int(torch.multinomial(p[best].float(), 1, generator=generator)))
