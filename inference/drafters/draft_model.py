"""A draft language model sharing the target's tokenizer, drafting a chain or a static tree.

The draft model keeps its own KV cache with the target's convention: it holds the committed
tokens but the pending one. Drafting feeds the tree level by level (one forward per depth, with a
tree mask), so after verification the cache keeps the accepted, already-fed nodes (`keep_path`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache

from ..engine.cache import cache_kwargs, keep_path, new_cache
from ..engine.drafter import DrafterBase, RoundStats
from ..engine.recurrent import has_recurrent_layers
from ..engine.sampling import SamplingConfig, apply_repetition_penalty, logits_to_probs, seen_mask
from ..engine.tree import DraftTree, chain_choices, tree_from_choices
from ..engine.verify import attention_masks


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k distinct tokens drawn one after another from probs [V] (each from the renormalised rest)."""
    k = min(k, int((probs > 0).sum()))
    return torch.multinomial(probs.float().cpu(), k, replacement=False, generator=generator).to(probs.device)


class DraftModelDrafter(DrafterBase):
    """Drafts with a small causal LM.

    choices: static tree shape (Medusa-style rank paths); default a chain of `num_draft`.
    sampling: the same processing the target uses; with temperature > 0 children are sampled
    without replacement and their distribution q is returned for exact rejection sampling.
    dynamic: for chains, adapt the depth each round (one deeper after a fully accepted round,
    one shallower otherwise, as transformers' "heuristic" schedule), within [1, max_draft].
    """

    def __init__(
        self,
        model,
        num_draft: int = 4,
        choices: Sequence[Sequence[int]] | None = None,
        sampling: SamplingConfig | None = None,
        dynamic: bool = False,
        max_draft: int = 12,
        seed: int | None = None,
    ):
        super().__init__()
        if has_recurrent_layers(model.config):
            raise ValueError(
                f"a draft model with recurrent layers ({model.config.model_type}) cannot draft a tree "
                "from its own cache; use an attention-only draft model, a head or prompt lookup"
            )
        self.model = model
        self.sampling = sampling or SamplingConfig()
        self.fixed_choices = [tuple(c) for c in choices] if choices else None
        self.num_draft = num_draft
        self.dynamic = dynamic and self.fixed_choices is None
        self.max_draft = max_draft
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.cache: Cache | None = None
        self.cache_slot: list[int | None] = []  # per node of the last tree: its K/V offset past the history
        vocab = model.config.get_text_config().vocab_size
        self.vocab_size = vocab

    def describe(self) -> dict:
        shape = {"choices": len(self.fixed_choices)} if self.fixed_choices else {"num_draft": self.num_draft, "dynamic": self.dynamic}
        return {"kind": "draft-model", "model": getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__, **shape}

    # -- lifecycle ---------------------------------------------------------------------------

    def begin(self, tokens, features, pending) -> None:
        super().begin(tokens, features, pending)
        self.cache = new_cache()
        self.cache_slot = []
        self.cached = 0  # history tokens whose K/V are in self.cache

    def commit(self, tokens, features, pending, stats: RoundStats) -> None:
        assert self.history is not None  # set by begin
        before = self.history.shape[1] - 1  # committed tokens before this round, old pending excluded
        super().commit(tokens, features, pending, stats)
        if stats.skipped:  # nothing was drafted or fed: the next propose catches the cache up
            return
        # The cache holds `before` history tokens + the fed tree nodes; keep those on the path.
        # Fed nodes are the shallower ones, so they form a prefix of the accepted path.
        slots = [slot for node in stats.path if (slot := self.cache_slot[node]) is not None]
        assert self.cache is not None  # made by begin
        keep_path(self.cache, before, slots)
        self.cached = before + len(slots)
        if self.dynamic:
            if stats.num_accepted == stats.num_draft and stats.num_draft > 0:
                self.num_draft = min(self.max_draft, self.num_draft + 1)
            else:
                self.num_draft = max(1, self.num_draft - 1)

    # -- drafting ----------------------------------------------------------------------------

    def _tree_shape(self):
        return tree_from_choices(self.fixed_choices or chain_choices(self.num_draft))

    def propose(self) -> DraftTree:
        history = self.history
        assert history is not None  # set by begin
        model, device = self.model, history.device
        shape = self._tree_shape()
        parents, head, rank = shape.parents.tolist(), shape.head.tolist(), shape.rank.tolist()
        n = len(parents)
        # 1. catch up: feed committed tokens the cache lacks (all but the pending one)
        missing = history[:, self.cached : history.shape[1] - 1]
        if missing.shape[1] > 0:
            model(input_ids=missing, **cache_kwargs(model, self.cache), use_cache=True, logits_to_keep=1)
            self.cached += missing.shape[1]
        past = self.cached
        tokens = [int(history[0, -1])] + [0] * (n - 1)
        q_rows: dict[int, torch.Tensor] = {}
        track_seen = self.sampling.repetition_penalty != 1.0
        base_seen = seen_mask(history, self.vocab_size) if track_seen else None
        depth_of = [0] + [h + 1 for h in head[1:]]
        max_depth = max(depth_of)
        fed = 0
        for depth in range(max_depth):
            # 2. feed every node at this depth (they have children), get their next-token logits
            level = [i for i in range(n) if depth_of[i] == depth]
            end = max(level) + 1
            parents_t = torch.tensor(parents[:end], device=device)
            mask_full = attention_masks(model.config, parents_t, past, next(model.parameters()).dtype, 1)
            rows = torch.tensor(level, device=device)
            mask = _rows(mask_full, rows, past + end)
            positions = (torch.tensor([depth] * len(level), device=device) + past)[None]
            out = model(
                input_ids=torch.tensor([[tokens[i] for i in level]], device=device),
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(model, self.cache),
                use_cache=True,
            )
            fed = end
            logits = out.logits[0]  # [len(level), V]
            for row, node in enumerate(level):
                kids = [c for c in range(n) if parents[c] == node]
                if not kids:
                    continue
                seen = None
                if base_seen is not None:  # exactly when track_seen
                    seen = base_seen[0].clone()
                    path = node
                    while path > 0:
                        seen[tokens[path]] = True
                        path = parents[path]
                probs = logits_to_probs(logits[row], self.sampling, seen)
                k = max(rank[c] for c in kids) + 1
                if self.sampling.greedy:
                    # rank by the processed logits: the greedy distribution is a point mass
                    processed = logits[row] if seen is None else apply_repetition_penalty(logits[row], seen, self.sampling.repetition_penalty)
                    picks = torch.topk(processed, k).indices
                else:
                    picks = sample_without_replacement(probs, k, self.generator)
                    q_rows[node] = probs
                for c in kids:
                    tokens[c] = int(picks[rank[c]]) if rank[c] < picks.numel() else -1
            # nodes the distribution could not fill (fewer than k tokens with mass) are pruned below
        keep = [i for i in range(n) if _valid(i, tokens, parents)]
        tree = DraftTree(torch.tensor([tokens], device=device).clamp(min=0), torch.tensor(parents, device=device))
        if q_rows:
            probs = torch.zeros(1, n, self.vocab_size, device=device)
            for node, q in q_rows.items():
                probs[0, node] = q
            tree.draft_probs = probs
        if len(keep) < n:
            tree = tree.subtree(torch.tensor(keep, device=device))
        self.cache_slot = [i if i < fed else None for i in keep]
        return tree


def _rows(mask, rows: torch.Tensor, width: int):
    """Select query rows of a mask (or of each mask in a {type: mask} dict), all key columns."""
    if isinstance(mask, dict):
        return {k: v[:, :, rows, :width] for k, v in mask.items()}
    return mask[:, :, rows, :width]


def _valid(i: int, tokens: list[int], parents: list[int]) -> bool:
    while i > 0:
        if tokens[i] < 0:
            return False
        i = parents[i]
    return True
