"""The one interface every proposer implements (docs/style.md 3).

The decode loop keeps the target's KV cache holding every committed token except the last one,
the *pending* token (docs/trees.md): its K/V is computed as the root of the next
verified tree. A drafter sees the same sequence:

    drafter.begin(tokens, features, pending)      after prefill of prompt[:-1]; pending = prompt[-1]
    tree = drafter.propose()                      a DraftTree rooted at the pending token
    drafter.commit(tokens, features, pending, stats)  after verification: tokens = root + accepted
                                                  draft nodes (now in the target cache), pending =
                                                  the correction/bonus token.

`features` are the target hidden states at `tokens` (only when the drafter asks for them through
`feature_layers`), so heads such as Medusa/EAGLE never run the target themselves.

Optional: `limit(num_draft | None)`: the load policy (inference/engine/policy.py) says how many draft nodes
the next tree needs, so a drafter that can stop early (EAGLE) drafts less; None lifts the limit.
`size_by(cost | None)`: under sizing "confidence" the engine hands a drafter that sizes its own
rounds the verifier's measured cost (inference/engine/sizing.py); None: it drafts its whole tree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .tree import DraftTree


@dataclass
class TargetFeatures:
    """Target hidden states at committed positions.

    hidden_states[i]: [B, n, H], `transformers`' `output_hidden_states[feature_layers[i]]`
    (0 = embeddings, i = input of block i, L = the final *normed* state: in transformers 5
    `lm_head(hidden_states[L])` are the logits). `last` is that final normed state.
    """

    layers: tuple[int, ...]
    hidden_states: tuple[torch.Tensor, ...]
    last: torch.Tensor | None = None  # [B, n, H] final normed hidden state (input of lm_head)


@dataclass
class RoundStats:
    """What one verification round did, for drafters that adapt (dynamic lookahead)."""

    num_draft: int  # draft nodes in the tree (root excluded): the round's num_draft
    num_accepted: int  # draft tokens accepted (the target's own token excluded)
    depth: int  # deepest node of the tree
    accepted_depths: list[int] = field(default_factory=list)  # depth of each accepted node
    path: list[int] = field(default_factory=list)  # accepted node indices, root (0) first
    # the drafter was not asked to propose this round (the load policy decoded plainly): the tree
    # its state remembers is not the one verified, and the path holds the root only
    skipped: bool = False

    @property
    def accepted_on_path(self) -> int:
        """Draft tokens accepted along `path`, this drafter's own tree (a merged drafter hands each
        sub-drafter the accepted path as far as its tree has it); num_accepted without a path."""
        return len(self.path) - 1 if self.path else self.num_accepted


@runtime_checkable
class Drafter(Protocol):
    """A proposer of draft trees. The verifier never asks which kind it has."""

    # Which target hidden states the drafter needs (indices into output_hidden_states); empty: none.
    feature_layers: tuple[int, ...]
    # Whether it needs the final normed hidden state (what the LM head reads), e.g. Medusa.
    needs_last_hidden: bool

    def begin(self, tokens: torch.Tensor, features: TargetFeatures | None, pending: torch.Tensor) -> None:
        """Start a sequence. tokens: [B, P-1] committed prompt; pending: [B] last prompt token."""

    def propose(self) -> DraftTree:
        """Draft a tree whose root (node 0) is the pending token."""

    def commit(
        self,
        tokens: torch.Tensor,
        features: TargetFeatures | None,
        pending: torch.Tensor,
        stats: RoundStats,
    ) -> None:
        """Advance past a verified round. tokens: [B, 1 + accepted] (old pending + accepted drafts)."""


def fork_drafter(drafter):
    """A drafter for another row of a batch: the same weights and settings, its own sequence state
    (set by `begin`). Drafters holding other drafters define `fork()`; the rest are copied shallowly,
    which shares models and heads and leaves `begin` to make fresh caches and histories."""
    fork = getattr(drafter, "fork", None)
    return fork() if fork is not None else copy.copy(drafter)


class DrafterBase:
    """Defaults for drafters that need no target features and keep only a token history."""

    feature_layers: tuple[int, ...] = ()
    needs_last_hidden: bool = False

    def __init__(self) -> None:
        self.history: torch.Tensor | None = None  # [B, L] committed tokens + pending

    def begin(self, tokens, features, pending) -> None:
        self.history = torch.cat([tokens, pending[:, None]], dim=1)

    def commit(self, tokens, features, pending, stats) -> None:
        # history ends with the old pending token, which is tokens[:, 0]
        assert self.history is not None  # set by begin
        self.history = torch.cat([self.history, tokens[:, 1:], pending[:, None]], dim=1)

    def propose(self) -> DraftTree:  # pragma: no cover - abstract
        raise NotImplementedError


class RootOnlyDrafter(DrafterBase):
    """Drafts nothing: every tree is its root, so the engine decodes plainly (one token a forward)."""

    def describe(self) -> dict:
        return {"kind": "none (plain decoding in our engine)"}

    def propose(self) -> DraftTree:
        assert self.history is not None  # set by begin
        root = self.history[:, -1:]
        return DraftTree(root, torch.tensor([-1], device=root.device))
