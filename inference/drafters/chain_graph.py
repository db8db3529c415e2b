"""An EAGLE head drafting a chain of top-1 drafts with its steps recorded as one CUDA graph
(inference/engine/graphs.py; docs/trees.md "Captured steps").

The same drafts as EagleDrafter with `chain_settings(kind, k)` (depth k, top-1, k nodes), whose
rounds read every candidate back to the host and so cannot be recorded. Here a round is one
CapturedStep over static buffers and a static head cache:

    catch-up    the pairs (f_t, x_{t+1}) the head lacks, padded to WIDTH = k + 1 (a chain round
                commits the root and at most k drafts), at positions start + [0, WIDTH), the
                head cache written from slot `start`; the last real pair's logits give draft 1
    draft j     (hidden_{j-1}, draft_{j-1}) at the next position, j = 2..k

Slot t of the head cache holds pair t, so every mask is causal in slots (`causal_in_slots`). The
padded pairs write slots after the real ones; the write position is set back to the end of the
real ones inside the step, so draft 1's K/V overwrites the first of them. A catch-up longer than
WIDTH (the prompt, rounds the load policy decoded plainly) runs the same body unpadded, eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, StaticLayer

from ...heads.config import head_kind
from ..engine.cache import crop, new_cache
from ..engine.compiled import CAPACITY_STEP
from ..engine.drafter import RoundStats, TargetFeatures
from ..engine.graphs import GRAPH, CapturedStep, additive, cache_address, step_mode
from ..engine.tree import DraftTree, chain_parents
from .head_drafters import FeatureBuffer, draft_ids_of


def causal_in_slots(positions: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, T, slots]: query i (at `positions[0, i]`, its own slot) sees slots <= it."""
    seen = torch.arange(slots, device=positions.device)[None, :] <= positions[0][:, None]  # [T, slots]
    return additive(seen[None, None], dtype)


def head_layer(cache: Cache) -> StaticLayer:
    """The head cache's one layer (new_cache(1, capacity) makes a static one)."""
    layer = cache.layers[0]
    assert isinstance(layer, StaticLayer)  # made by new_cache with a capacity
    return layer


@dataclass
class ChainInputs:
    """A round's inputs to `_chain`: the pairs' features [1, T, H] per feature layer and tokens
    [1, T] from slot `start` [1], the first `count` [1] of them real (the rest padding)."""

    features: list[torch.Tensor]
    tokens: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor


class GraphedChainDrafter(FeatureBuffer):
    """EAGLE-1/3 (a head with `fuse` and `step`) drafting `k` top-1 drafts a round, one batch
    row (the engine forks one per row). mode: graphs.step_mode's (None: graphs on a GPU)."""

    needs_last_hidden = False

    def __init__(self, head, k: int = 3, mode: str | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"a chain drafts k >= 1 tokens, got {k!r}")
        if not head_kind(str(head.kind)).grows_tree:
            raise ValueError(f"a {head.kind} head does not draft step by step (EagleDrafter's heads do)")
        self.head, self.k, self.mode = head, k, mode
        self.width = k + 1
        self.feature_layers = tuple(head.feature_layers)
        self.draft_ids = draft_ids_of(head)
        self.replays = 0  # rounds drafted by a recorded graph (mode "graph")

    def describe(self) -> dict:
        return {"kind": f"{self.head.kind} chain, captured steps", "num_draft": self.k}

    def begin(self, tokens, features: TargetFeatures | None, pending) -> None:
        self.history = torch.cat([tokens, pending[:, None]], dim=1)  # [1, L] committed + pending
        self.fed = 0  # pairs in the head cache
        self._start_buffer(features)
        self.cache = new_cache(1, self._capacity(self.history.shape[1]))
        self._steps: dict[tuple[int, ...], tuple[CapturedStep, ChainInputs]] = {}  # per cache address
        self.parents = chain_parents(self.k, tokens.device)

    def commit(self, tokens, features: TargetFeatures | None, pending, stats: RoundStats) -> None:
        crop(self.cache, self.fed)  # the drafts leave the head cache: only committed pairs stay
        self.history = torch.cat([self.history, tokens[:, 1:], pending[:, None]], dim=1)
        self._take(features)

    def propose(self) -> DraftTree:
        root = self.history[:, -1:]
        if not self.unfed:  # nothing to read yet (a one-token prompt)
            return DraftTree(root, torch.tensor([-1], device=root.device))
        L = self.history.shape[1]
        count = L - 1 - self.fed  # pairs to catch up: t = fed .. L - 2
        features = [torch.cat(layer, dim=1) for layer in zip(*self.unfed)]  # [1, count, H] per feature layer
        self.unfed = []
        tokens = self.history[:, self.fed + 1 : L]
        self._make_room(L + self.width + self.k)
        if count <= self.width and head_layer(self.cache).is_initialized:
            drafts = self._replayed(features, tokens, count)
        else:
            at = torch.full((1,), self.fed, dtype=torch.long, device=root.device)
            drafts = self._chain(self.cache, ChainInputs(features, tokens, at, torch.full_like(at, count)))
        self.fed = L - 1
        return DraftTree(torch.cat([root, drafts], dim=1), self.parents)

    def _chain(self, cache: Cache, inputs: ChainInputs) -> torch.Tensor:
        """The round's k drafts [1, k] (target ids), after catching up on `inputs`."""
        head, tokens = self.head, inputs.tokens
        slots = head_layer(cache).max_cache_len
        positions = inputs.start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)[None]  # [1, T]
        hidden, logits = head.step(head.fuse(inputs.features), tokens, positions, cache, causal_in_slots(positions, slots, head.dtype))
        last = inputs.count - 1
        hidden, logits = hidden.index_select(1, last), logits.index_select(1, last)  # [1, 1, H], [1, 1, Vd]
        head_layer(cache).cumulative_length.copy_((inputs.start + inputs.count)[0])  # past the real pairs, not the padding
        position = inputs.start + last  # [1]
        drafts = []
        for j in range(self.k):
            # as EagleDrafter ranks: top-1 of the log-probabilities, a draft-vocab id -> the target's
            draft = torch.topk(torch.log_softmax(logits[:, -1].float(), dim=-1), 1).indices  # [1, 1]
            draft = draft if self.draft_ids is None else self.draft_ids[draft]
            drafts.append(draft)
            if j + 1 < self.k:
                position = position + 1
                hidden, logits = head.step(hidden, draft, position[:, None], cache, causal_in_slots(position[:, None], slots, head.dtype))
        return torch.cat(drafts, dim=1)  # [1, k]

    def _replayed(self, features, tokens, count: int) -> torch.Tensor:
        """The round through the cache's recorded step, the inputs padded to `width` pairs."""
        address = cache_address(self.cache)
        if address not in self._steps:
            cache = self.cache
            device = tokens.device
            buffers = ChainInputs(
                [torch.zeros(1, self.width, f.shape[-1], dtype=f.dtype, device=device) for f in features],
                torch.zeros(1, self.width, dtype=torch.long, device=device),
                torch.zeros(1, dtype=torch.long, device=device),
                torch.ones(1, dtype=torch.long, device=device),
            )
            step = CapturedStep(lambda: self._chain(cache, buffers), step_mode(device, self.mode), keep=[head_layer(cache).cumulative_length])
            self._steps[address] = (step, buffers)
        step, buffers = self._steps[address]
        # the padding keeps whatever the buffers held: any finite features and valid ids will do
        for buffer, f in zip(buffers.features, features):
            buffer[:, :count].copy_(f)
        buffers.tokens[:, :count].copy_(tokens)
        buffers.start.fill_(self.fed)
        buffers.count.fill_(count)
        self.replays += step.mode == GRAPH
        return step().clone()

    def _capacity(self, need: int) -> int:
        return -(-(need + CAPACITY_STEP) // CAPACITY_STEP) * CAPACITY_STEP

    def _make_room(self, need: int) -> None:
        """A head cache of at least `need` slots: a larger one, the committed pairs copied over,
        when the text outgrows it (its recorded steps go with the old one)."""
        old = head_layer(self.cache)
        if need <= old.max_cache_len:
            return
        self.cache = new_cache(1, self._capacity(need))
        if old.is_initialized:
            layer = head_layer(self.cache)
            assert old.keys is not None and old.values is not None  # initialized
            layer.lazy_initialization(old.keys, old.values)
            assert layer.keys is not None and layer.values is not None  # just allocated
            layer.keys[:, :, : self.fed].copy_(old.keys[:, :, : self.fed])
            layer.values[:, :, : self.fed].copy_(old.values[:, :, : self.fed])
            layer.cumulative_length.fill_(self.fed)
        self._steps.clear()
