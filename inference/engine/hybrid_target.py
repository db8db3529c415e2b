"""The torch backend for hybrid targets: decoders whose layers are partly linear attention,
state-space or short convolutions with a recurrent state (Qwen3-Next, Qwen3.5, Granite 4,
Nemotron-H, Falcon-H1, Jamba, Bamba, LFM2, OLMo hybrid; docs/trees.md "Hybrid targets").

The same five steps as TorchTarget, with three differences:

    start            prefills row by row: right padding would run into a short row's recurrent state
    cut_to_capacity  cuts each tree to a chain (its first child at every depth): one state per row
    verify           records the states the chain passes through (recurrent.py), so that `keep`
                     sets each row to the state after its own accepted count

The attention layers' K/V are kept exactly as TorchTarget keeps them (cache.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .cache import cache_kwargs, keep_paths, select_rows
from .recurrent import hybrid_cache, keep_states, record, rewind, select_state_rows, stack_rows
from .torch_target import TorchTarget
from .tree import DraftTree, first_chain
from .verify import Verification


class HybridTarget(TorchTarget):
    recurrent = True  # check_tree_mask_support: recurrent layer types verify chains here

    def start(self, prompts: list[torch.Tensor], feature_layers, need_last: bool, max_new_tokens: int = 0, images=None):
        """Prefill every prompt but its last token, one row at a time, then stack the rows: K/V
        right-padded to the longest (TorchTarget's layout), recurrent states side by side.
        Returns the forwards' hidden states (all L + 1, [B, P - 1, H], zero past a row's end) or None."""
        if images is not None and any(row is not None for row in images):
            raise ValueError("images in the prompt are not built for hybrid targets")
        longest = max(p.numel() for p in prompts)
        self.slots = longest - 1
        want_hidden = bool(feature_layers) or need_last
        caches: list[Cache] = []
        hidden: list[tuple[torch.Tensor, ...] | None] = []  # per row: its forward's L + 1 hidden states
        for p in prompts:
            cache = hybrid_cache(self.model.config)
            caches.append(cache)
            if p.numel() == 1:
                hidden.append(None)
                continue
            out = self.model(
                input_ids=p[None, :-1], **cache_kwargs(self.model, cache), use_cache=True, output_hidden_states=want_hidden, logits_to_keep=1
            )
            hidden.append(out.hidden_states)
        self.cache = stack_rows(caches, self.slots)
        if self.slots == 0 or not want_hidden:
            return None
        like = next(h for h in hidden if h is not None)
        return tuple(
            torch.cat(
                [
                    torch.nn.functional.pad(h[i], (0, 0, 0, self.slots - h[i].shape[1]))
                    if h is not None
                    else like[i].new_zeros(1, self.slots, like[i].shape[-1])
                    for h in hidden
                ]
            )
            for i in range(len(like))
        )

    def cut_to_capacity(self, tree: DraftTree, rows: int) -> DraftTree:
        """The tree's chain through every depth's first child: a recurrent state follows one path."""
        return tree.subtree(first_chain(tree.parents))

    def verify(self, trees: list[DraftTree], lengths: list[int], want_hidden: bool) -> Verification:
        assert self.cache is not None  # made by start
        record(self.cache, max(t.num_nodes for t in trees))
        return super().verify(trees, lengths, want_hidden)

    def keep(self, paths: list[list[int]], lengths: list[int]) -> None:
        for path in paths:  # a chain's accepted nodes are its first ones
            if path != list(range(len(path))):
                raise ValueError(f"a hybrid target keeps a chain's first nodes, got path {path}")
        assert self.cache is not None  # made by start
        keep_states(self.cache, [len(path) for path in paths])
        self.slots = keep_paths(self.cache, lengths, self.slots, paths)

    def discard(self, length: int) -> None:
        assert self.cache is not None  # made by start
        rewind(self.cache)
        super().discard(length)

    def select_rows(self, keep: list[int], lengths: list[int]) -> None:
        assert self.cache is not None  # made by start
        select_state_rows(self.cache, keep)
        self.slots = max(lengths)
        select_rows(self.cache, keep, self.slots)
