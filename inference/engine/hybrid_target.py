"""The torch backend for hybrid targets: decoders whose layers are partly linear attention,
state-space or short convolutions with a recurrent state (Qwen3-Next, Qwen3.5, Granite 4,
Nemotron-H, Falcon-H1, Jamba, Bamba, LFM2, OLMo hybrid; docs/trees.md "Hybrid targets").

The same five steps as TorchTarget, with three differences:

    start            prefills the prompts of each length together: right padding would run into a
                     short row's recurrent state
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
        """Prefill every prompt but its last token, the prompts of each length together (no padding
        runs into a row's recurrent state), then stack the rows: K/V right-padded to the longest
        (TorchTarget's layout), recurrent states side by side, in the prompts' order.
        Returns the forwards' hidden states (all L + 1, [B, P - 1, H], zero past a row's end) or None."""
        if images is not None and any(row is not None for row in images):
            raise ValueError("images in the prompt are not built for hybrid targets")
        longest = max(p.numel() for p in prompts)
        self.slots = longest - 1
        self.rows = len(prompts)
        self._features = (tuple(feature_layers), need_last)
        want_hidden = bool(feature_layers) or need_last
        by_length: dict[int, list[int]] = {}
        for b, p in enumerate(prompts):
            by_length.setdefault(p.numel(), []).append(b)
        groups = list(by_length.values())
        caches: list[Cache] = []
        hidden: list[tuple[torch.Tensor, ...] | None] = []  # per group: its forward's L + 1 hidden states
        for rows in groups:
            cache = hybrid_cache(self.model.config)
            caches.append(cache)
            if prompts[rows[0]].numel() == 1:
                hidden.append(None)
                continue
            ids = torch.stack([prompts[b][:-1] for b in rows])  # [n, P - 1]
            out = self.model(input_ids=ids, **cache_kwargs(self.model, cache), use_cache=True, output_hidden_states=want_hidden, logits_to_keep=1)
            hidden.append(out.hidden_states)
        sizes = [len(rows) for rows in groups]
        self.cache = stack_rows(caches, self.slots, sizes)
        stacked = [b for rows in groups for b in rows]  # the prompt in each stacked row
        order = sorted(range(len(stacked)), key=stacked.__getitem__)  # stacked row of each prompt
        if order != list(range(len(order))):
            select_state_rows(self.cache, order)
            select_rows(self.cache, order, self.slots)
        if self.slots == 0 or not want_hidden:
            return None
        like = next(h for h in hidden if h is not None)
        return tuple(
            torch.cat(
                [
                    torch.nn.functional.pad(h[i], (0, 0, 0, self.slots - h[i].shape[1]))
                    if h is not None
                    else like[i].new_zeros(n, self.slots, like[i].shape[-1])
                    for h, n in zip(hidden, sizes)
                ]
            )[order]
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
        if not keep:
            return super().select_rows(keep, lengths)
        assert self.cache is not None  # made by start
        self.rows = len(keep)
        select_state_rows(self.cache, keep)
        self.slots = max(lengths)
        select_rows(self.cache, keep, self.slots)
