"""The recurrent part of a hybrid target's cache: the states of its linear-attention, state-space
and short-convolution layers (docs/trees.md "Hybrid targets").

Such a layer keeps, per row, a convolution window (the last K inputs, [B, C, K]) and, for the
linear-attention and state-space kinds, one recurrent state ([B, heads, ...]). A verify forward
appends a chain of N nodes; each row then keeps the state after its own accepted count a_b:

    record(cache, n)          before the forward: transformers keeps the N states it passes
                              through (the state after 0, 1, ..., N - 1 nodes, then the last)
                              and the whole convolution input [B, C, K + N]
    keep_states(cache, a)     row b's window becomes inputs [a_b, a_b + K), its state the one
                              after a_b nodes; recording stops
    rewind(cache)             every row back to its state before the forward (a = 0)

Only chains: a state follows one sequence, so branches of a tree would each need their own
(the trade-off is written in docs/trees.md). The attention layers' K/V are cache.py's concern.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
)

from .cache import has_kv

# layer types (config.layer_types, as transformers names them) whose state is recurrent
RECURRENT_TYPES = frozenset({"linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding"})


def has_recurrent_layers(config) -> bool:
    """Whether the target's decoder has layers with a recurrent state (a pure rule on the config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()
    return bool(RECURRENT_TYPES & set(types))


def recurrent_layers(cache: Cache) -> list[LinearAttentionCacheLayerMixin]:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def hybrid_cache(config) -> Cache:
    """transformers' own cache for the target (a recurrent layer per recurrent layer type), with
    every attention layer a plain full-length one: the engine applies windows through its masks and
    cuts the K/V itself (cache.py)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
            cache.layers[i] = LinearAttentionAndFullAttentionLayer()
        elif isinstance(layer, DynamicSlidingWindowLayer):
            cache.layers[i] = DynamicLayer()
    return cache


def _states(layer) -> range:
    return range(layer.number_of_states)


def stack_rows(caches: list[Cache], slots: int, sizes: list[int]) -> Cache:
    """One cache of sum(sizes) rows from caches of sizes[i] rows each, which prefilled different
    prompt lengths: K/V right-padded with zeros to `slots` (hidden by the mask), recurrent states
    stacked, in the caches' order. Rows that prefilled nothing get zero states, which is what
    transformers starts a sequence from. Returns the first prefilled cache, filled in place (it
    carries the layers' initialised flags)."""
    filled = [c for c in caches if c.get_seq_length() > 0 or any(layer.is_conv_states_initialized[0] for layer in recurrent_layers(c))]
    if not filled:
        return caches[0]
    base = filled[0]
    for i, layer in enumerate(base.layers):
        rows = [c.layers[i] if i < len(c.layers) else None for c in caches]  # None: a cache that prefilled nothing
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for s in _states(layer):
                for name, ready in (("conv_states", layer.is_conv_states_initialized), ("recurrent_states", layer.is_recurrent_states_initialized)):
                    if not ready[s]:
                        continue
                    like = getattr(layer, name)[s]  # [rows, ...]
                    getattr(layer, name)[s] = torch.cat(
                        [
                            getattr(row, name)[s] if row is not None and getattr(row, name)[s] is not None else like.new_zeros(n, *like.shape[1:])
                            for row, n in zip(rows, sizes)
                        ]
                    )
                layer.has_previous_state[s] = True
        if has_kv(layer):

            def padded(row, n, name):
                if not has_kv(row):  # rows that prefilled nothing
                    like = getattr(layer, name)
                    return like.new_zeros(n, like.shape[1], slots, like.shape[3])
                t = getattr(row, name)
                return torch.nn.functional.pad(t, (0, 0, 0, slots - t.shape[2]))

            kv = cast(CacheLayerMixin, layer)  # has_kv: an attention layer's K/V
            kv.keys, kv.values = (torch.cat([padded(row, n, name) for row, n in zip(rows, sizes)]) for name in ("keys", "values"))
    return base


def record(cache: Cache, n: int) -> None:
    """Make the next forward keep the states it passes through (its N input tokens)."""
    for layer in recurrent_layers(cache):
        layer.activate_past_recording(recurrent_states_to_keep=n)
        # one history per state (transformers' dict.fromkeys would share a single list)
        layer.recurrent_states_history = {s: [] for s in _states(layer)}
        # a layer with no state yet (every prompt one token long) records no window before the
        # nodes: keep_states puts the zeros transformers starts from in front
        # (drafthead's own mark on transformers' layer object)
        setattr(layer, "drafthead_from_empty", {s: not layer.has_previous_state[s] for s in _states(layer)})


def keep_states(cache: Cache, accepted: list[int]) -> None:
    """Row b keeps the state after its first accepted[b] chain nodes (1 <= accepted[b] <= N, or 0
    for none); recording stops. In place, on a cache that `record` prepared for the forward."""
    for layer in recurrent_layers(cache):
        if not layer.record_past:
            raise RuntimeError("keep_states: the forward was not recorded (call record first)")
        for s in _states(layer):
            if layer.is_conv_states_initialized[s]:
                full = layer.conv_states[s]  # [B, C, K + N]
                k = layer.conv_kernel_size[s]
                assert full is not None and k is not None  # initialised
                if getattr(layer, "drafthead_from_empty")[s]:  # set by record
                    full = torch.nn.functional.pad(full, (k, 0))
                start = torch.as_tensor(accepted, device=full.device)
                index = start[:, None] + torch.arange(k, device=full.device)  # [B, K]
                index = index.view(index.shape[0], *([1] * (full.dim() - 2)), k).expand(*full.shape[:-1], k)
                layer.conv_states[s] = full.gather(-1, index).contiguous()
            if layer.is_recurrent_states_initialized[s]:
                history = layer.recurrent_states_history[s]  # the states after 0..N-1 nodes
                last = layer.recurrent_states[s]
                assert last is not None  # initialised
                states = torch.stack([*history, last])  # [N + 1, B, ...]
                rows = torch.arange(states.shape[1], device=states.device)
                layer.recurrent_states[s] = states[torch.as_tensor(accepted, device=states.device), rows].contiguous()
        layer.record_past = False
        layer.recurrent_states_history = {s: [] for s in _states(layer)}


def rewind(cache: Cache) -> None:
    """Every row back to its state before the recorded forward."""
    states = [t for layer in recurrent_layers(cache) for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
    if states:
        keep_states(cache, [0] * states[0].shape[0])  # [B, ...]: every state has a row per batch row


def select_state_rows(cache: Cache, rows: list[int]) -> None:
    """Keep batch rows `rows` (in that order) of every recurrent state. In place."""
    for layer in recurrent_layers(cache):
        for s in _states(layer):
            for states, ready in (
                (layer.conv_states, layer.is_conv_states_initialized),
                (layer.recurrent_states, layer.is_recurrent_states_initialized),
            ):
                if ready[s]:
                    state = states[s]
                    assert state is not None  # initialised
                    states[s] = state[torch.as_tensor(rows, device=state.device)]
