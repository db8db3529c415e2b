"""The target's forward in torch: a transformers causal LM and its KV cache, behind the same
five steps as the llama.cpp backend (inference/llamacpp/target.py), which is what the decode
loop (inference/engine/generate.py) calls:

    start(prompts)               prefill every prompt but its last token; the drafters' features
    join(prompts)                more rows after the active ones, prefilled the same way
    cut_to_capacity(tree, rows)  the tree cut to what the cache has room for
    verify(trees, lengths)       one forward over every row's tree -> Verification
    keep(paths, lengths)         keep each row's accepted nodes, drop the rest
    select_rows(keep, ...)       rows that finished leave the cache
    discard(length)              forget the last trees and every position from `length` on (row 0):
                                 what timing a forward needs after each try (cost.py)
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import Cache

from .cache import cache_capacity, cache_kwargs, crop, keep_paths, new_cache, select_rows
from .compiled import StaticDecoding, static_capacity
from .policy import cut_tree
from .recurrent import stack_rows
from ..kernels.target_linears import engine_linears, invariant_linears
from .invariant import invariant_attention
from ...ground.target.media import deepstack_inputs, prefill_inputs, with_deepstack
from .tree import DraftTree, pad_trees
from .verify import Verification, check_tree_mask_support, forward_trees


class TorchTarget:
    recurrent = False  # whether recurrent layer types may verify (HybridTarget's chains)

    def __init__(self, model, static: StaticDecoding | None = None, row_invariant: bool = False):
        check_tree_mask_support(model.config, recurrent=self.recurrent)
        self.model = model
        self.row_invariant = row_invariant  # verify forwards row by row invariant (inference/engine/invariant.py)
        self.config = model.config
        self.static = static
        self.cache: Cache | None = None
        self.slots = 0  # cache slots per row (the longest row's committed length)
        self.rows = 0  # rows in the cache
        self._features: tuple[tuple[int, ...], bool] = ((), False)  # what start's prefill returns: (feature layers, need_last)
        self.offsets: torch.Tensor | None = None  # [B] per row: its positions past the prompt are token index + offset (ground/target/media.py)
        self.max_new_tokens = 0

    def engine_context(self, enabled: bool):
        if self.row_invariant:
            return invariant_linears(self.model)
        return engine_linears(self.model, enabled)

    def start(self, prompts: list[torch.Tensor], feature_layers, need_last: bool, max_new_tokens: int = 0, images=None):
        """Prefill every prompt but its last token at once, right-padded to the longest: row b's
        K/V land in slots [0, P_b - 1) and a causal mask never lets them see the padding after them.
        images: one media.PromptImages or None per prompt, for a vision-language target.
        Returns the forward's hidden states (all L + 1, [B, P - 1, H]) or None."""
        longest = max(p.numel() for p in prompts)
        self.rows = len(prompts)
        self._features = (tuple(feature_layers), need_last)
        if self.static is None:
            self.cache = new_cache()
        else:
            self.cache = self.static.cache(len(prompts), static_capacity(longest, max_new_tokens))
        self.slots = longest - 1
        media, self.offsets = prefill_inputs(self.model, prompts, images, self.slots)
        if self.slots == 0:
            return None
        padded = torch.zeros(len(prompts), self.slots, dtype=torch.long, device=prompts[0].device)
        for b, p in enumerate(prompts):
            padded[b, : p.numel() - 1] = p[:-1]
        want_hidden = bool(feature_layers) or need_last
        with deepstack_inputs(self.model) as deepstack, self._attention():
            out = self.model(
                input_ids=padded, **media, **cache_kwargs(self.model, self.cache), use_cache=True, output_hidden_states=want_hidden, logits_to_keep=1
            )
        return with_deepstack(out.hidden_states, deepstack)

    def open(self, rows: int, cells: int, feature_layers, need_last: bool, streams: bool = False) -> None:
        """No rows yet; rows that join later prefill with these features (the cache grows as they
        come: `rows`, `cells` and `streams` change nothing here: each row's K/V are its own)."""
        self.cache, self.slots, self.rows, self.offsets = None, 0, 0, None
        self._features = (tuple(feature_layers), need_last)

    def join(self, prompts: list[torch.Tensor], max_new_tokens: int = 0, images=None):
        """Prefill `prompts` as new rows after the active ones (continuous batching): they prefill
        alone, as `start` would, then the two caches are stacked, K/V right-padded to the longer
        slot count (hidden by the mask, as a ragged batch's are). Returns the new rows' hidden
        states as `start` does."""
        if self.rows == 0:
            return self.start(prompts, *self._features, max_new_tokens, images=images)
        if self.static is not None:
            raise NotImplementedError("rows join a dynamic cache only: drop --static-cache / --compile to batch continuously")
        old, old_slots, old_rows, old_offsets = self.cache, self.slots, self.rows, self.offsets
        hidden = self.start(prompts, *self._features, max_new_tokens, images=images)
        assert old is not None and self.cache is not None  # set by start
        self.slots = max(old_slots, self.slots)
        self.cache = stack_rows([old, self.cache], self.slots, [old_rows, len(prompts)])
        if old_offsets is not None and self.offsets is not None:  # a hybrid target keeps none
            self.offsets = torch.cat([old_offsets, self.offsets])
        self.rows = old_rows + len(prompts)
        return hidden

    def cut_to_capacity(self, tree: DraftTree, rows: int) -> DraftTree:
        """A static cache has room for one tree of capacity - slots nodes (TREE_ROOM at the least):
        a bigger tree keeps its first nodes, as the policy's cut does."""
        if self.static is None:
            return tree
        assert self.cache is not None  # made by start
        capacity = cache_capacity(self.cache)
        assert capacity is not None  # a static cache's
        return cut_tree(tree, capacity - self.slots)

    def _attention(self):
        """Row-invariant attention in every forward, the prefill's too: a prompt token's K/V are
        then the bits its own one-token forward gives, whatever the prompt's length, padding or
        batch (inference/engine/invariant.py)."""
        return invariant_attention(self.model) if self.row_invariant else contextlib.nullcontext()

    def verify(self, trees: list[DraftTree], lengths: list[int], want_hidden: bool) -> Verification:
        prefix = torch.tensor(lengths, device=trees[0].tokens.device)
        with self._attention():
            return forward_trees(
                self.model,
                self.cache,
                pad_trees(trees),
                prefix,
                self.slots,
                want_hidden,
                forward=None if self.static is None else self.static.forward,
                position_offsets=self.offsets,
            )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    def keep(self, paths: list[list[int]], lengths: list[int]) -> None:
        assert self.cache is not None  # made by start
        self.slots = keep_paths(self.cache, lengths, self.slots, paths)

    def discard(self, length: int) -> None:
        assert self.cache is not None  # made by start
        crop(self.cache, length)

    def select_rows(self, keep: list[int], lengths: list[int]) -> None:
        """Rows `keep` stay, whose committed lengths are `lengths`; the cache is cut to the longest.
        No rows left: the cache is dropped."""
        if not keep:
            self.cache, self.slots, self.rows, self.offsets = None, 0, 0, None
            return
        assert self.cache is not None  # made by start
        self.rows = len(keep)
        self.slots = max(lengths)
        select_rows(self.cache, keep, self.slots)
        if self.offsets is not None:
            self.offsets = self.offsets[torch.tensor(keep, device=self.offsets.device)]
