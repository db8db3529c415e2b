"""Exact acceptance rules (docs/acceptance.md), as pure functions on tensors.

Notation follows the papers: `p` is the target's processed next-token distribution at a node,
`q` the drafter's, `x` a drafted token. Every function returns the accepted path (node indices,
root first) and the one token the target adds after it (correction or bonus).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    children: list[list[int]] = [[] for _ in range(tokens.shape[0])]
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            children[parent].append(i)
    node, path = 0, [0]
    while True:
        p_cur = p[node].double().clone()
        q_cur = None if q is None else q[node].double().clone()
        chosen = None
        for child in children[node]:
            x = int(tokens[child])
            u = float(torch.rand(1, generator=generator, dtype=torch.float64))
            if q_cur is None:
                # point-mass draft: accept with p(x); on rejection p(x) <- 0, renormalise
                if u < float(p_cur[x]):
                    chosen = child
                    break
                p_cur[x] = 0.0
                p_cur = _normalise(p_cur)
            else:
                q_x = float(q_cur[x])
                if q_x > 0 and u < min(1.0, float(p_cur[x]) / q_x):
                    chosen = child
                    break
                residual = (p_cur - q_cur).clamp(min=0)
                p_cur = _normalise(residual) if residual.sum() > 0 else p_cur
                q_cur[x] = 0.0
                q_cur = _normalise(q_cur)
        if chosen is None:
            # every child rejected (or a leaf): one token from the current (residual) p
            return Acceptance(path=path, next_token=int(torch.multinomial(p_cur.float(), 1, generator=generator)))
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
