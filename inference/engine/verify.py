"""One target forward over a whole draft tree (docs/trees.md).

The target is an unmodified transformers causal LM; the tree goes in through `position_ids`
(prefix length + depth) and a 4-D additive attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import cache_capacity, cache_kwargs
from .drafter import TargetFeatures
from .temperature import true_position_temperature
from .recurrent import RECURRENT_TYPES
from .tree import TreeBatch, ancestor_mask, batch_tree_mask, node_depths


class TreeMaskUnsupported(NotImplementedError):
    """The target's architecture cannot take a custom 4-D tree mask."""


_MASK_ATTN = ("sdpa", "eager")


def check_tree_mask_support(config, recurrent: bool = False) -> None:
    """Raise TreeMaskUnsupported for attention kernels that ignore custom 4-D masks, and for layer
    kinds whose state a tree cannot branch (sparse-indexed layers; recurrent ones unless
    `recurrent`: the hybrid backend verifies chains, inference/engine/hybrid_target.py)."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in _MASK_ATTN:
        raise TreeMaskUnsupported(
            f"attention implementation {impl!r} cannot take a tree mask; load the target with attn_implementation='sdpa' or 'eager'"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise TreeMaskUnsupported(f"{config.model_type}: encoder-decoder targets are not supported")
    known = set(_LOCAL_RULES) | _POSITIONWISE | (RECURRENT_TYPES if recurrent else set())
    unknown = sorted(set(_layer_types(config) or ()) - known)
    if unknown:
        raise TreeMaskUnsupported(
            f"{config.model_type}: layer types {', '.join(unknown)} cannot verify a tree (the engine masks "
            f"{', '.join(_LOCAL_RULES)} layers and verifies chains through recurrent ones; docs/families.md)"
        )


def _text_config(config):
    """The decoder's config: a multimodal target (Gemma-3, Qwen2.5-VL) nests its language model's
    layer types and windows in `text_config`; a plain causal LM's is itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_types(config) -> list[str] | None:
    types = getattr(_text_config(config), "layer_types", None)
    return list(types) if types else None


def _sliding_window(config) -> int | None:
    config = _text_config(config)
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None) or None


# layer type -> the local-attention keywords of `batch_tree_mask` that layer type needs, read off
# the config (None where the config sets no window or chunk: the layer then attends in full)
_LOCAL_RULES = {
    "full_attention": lambda config: {},
    "sliding_attention": lambda config: {"sliding_window": _sliding_window(config)},
    "chunked_attention": lambda config: {"chunk_size": getattr(_text_config(config), "attention_chunk_size", None)},
}


# layer types without attention or state (Nemotron-H's MLP and MoE layers): they take no mask
_POSITIONWISE = frozenset({"mlp", "moe"})


def mask_rules(config) -> dict[str, dict | None]:
    """{layer type: batch_tree_mask keywords} for each layer type the target has; one entry,
    keyed "all", for a target without per-layer types (a configured window then holds in every
    layer, Mistral-style). A recurrent layer type maps to None: it takes no mask, its state
    follows the chain (recurrent.py); transformers' hybrids look their recurrent layers' masks up
    as "linear_attention" or "conv" and a layer of both kinds ("hybrid") its attention's as
    "full_attention". A pure rule on the config (docs/families.md)."""
    types = _layer_types(config)
    if types is None:
        return {"all": {"sliding_window": _sliding_window(config)}}
    rules: dict[str, dict | None] = {}
    for kind in dict.fromkeys(types):
        if kind in _POSITIONWISE:
            rules[kind] = None
        elif kind in RECURRENT_TYPES:
            rules.update({kind: None, "linear_attention": None, "conv": None})
            attention = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}.get(kind)
            if attention:
                rules[attention] = _LOCAL_RULES[attention](config)
        else:
            rules[kind] = _LOCAL_RULES[kind](config)
    return rules


def attention_masks(config, parents: torch.Tensor, past_len: int, dtype: torch.dtype, batch: int):
    """The mask for one tree shared by the batch, every row holding all `past_len` cached positions."""
    n = parents.shape[0]
    lengths = torch.full((batch,), past_len, dtype=torch.long, device=parents.device)
    return batch_attention_masks(
        config, ancestor_mask(parents)[None].expand(batch, n, n), node_depths(parents)[None].expand(batch, n), lengths, past_len, dtype
    )


def batch_attention_masks(
    config,
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    prefix_lengths: torch.Tensor,
    past_len: int,
    dtype: torch.dtype,
    kv_length: int | None = None,
):
    """The tree mask in the form the target's family takes: one [B, 1, N, past+N] tensor (or
    [B, 1, N, kv_length] for a static cache) where every layer attends alike, or a {layer type:
    mask} dict where layer types differ (Gemma-3 and gpt-oss: sliding and full; Llama 4: chunked
    and full; a hybrid's recurrent layer types: None). Masks are our own, so windows and chunks are applied here, not by transformers."""
    built: dict[tuple, torch.Tensor] = {}

    def mask(rule: dict) -> torch.Tensor:
        key = tuple(sorted((k, v) for k, v in rule.items() if v is not None))
        if key not in built:  # layer types with the same rule share one tensor
            built[key] = batch_tree_mask(ancestors, depths, prefix_lengths, past_len, dtype, kv_length=kv_length, **dict(key))
        return built[key]

    masks = {kind: None if rule is None else mask(rule) for kind, rule in mask_rules(config).items()}
    if not built:  # no attention layer at all (Mamba): no mask
        return None
    if len(built) == 1 and None not in masks.values():
        return next(iter(masks.values()))
    return masks


@dataclass
class Verification:
    logits: torch.Tensor  # [B, N, V] target logits at every node
    # per output_hidden_states index, [B, N, H] (the llama.cpp backend: {index: [B, N, H]} of the asked ones)
    hidden_states: tuple[torch.Tensor, ...] | dict[int, torch.Tensor] | None


def forward_tree(target, cache, tokens: torch.Tensor, parents: torch.Tensor, past_len: int, want_hidden: bool) -> Verification:
    """Run the target over one tree's nodes `tokens` [B, N] (every row the same shape) after
    `past_len` cached positions. Appends the N nodes' K/V to `cache` (the caller keeps only the
    accepted path)."""
    batch, n = tokens.shape
    parents = parents.to(tokens.device)
    trees = TreeBatch(tokens, ancestor_mask(parents)[None].expand(batch, n, n), node_depths(parents)[None].expand(batch, n), [n] * batch)
    lengths = torch.full((batch,), past_len, dtype=torch.long, device=tokens.device)
    return forward_trees(target, cache, trees, lengths, past_len, want_hidden)


def forward_trees(
    target,
    cache,
    trees: TreeBatch,
    prefix_lengths: torch.Tensor,
    past_len: int,
    want_hidden: bool,
    forward=None,
    position_offsets: torch.Tensor | None = None,
) -> Verification:
    """Run the target over each row's tree after its own `prefix_lengths[b]` committed tokens, all
    rows in one forward; the cache holds `past_len` slots per row (docs/trees.md "Batches").
    A node sits at position prefix_lengths[b] + depth. `forward`: the callable that runs the
    target (its compiled form, inference/engine/compiled.py); None: the target itself.
    position_offsets [B]: added to each row's positions (a Qwen-VL row's rope delta after an image
    in its prompt, ground/target/media.py); the masks stay in slots."""
    dtype = next(target.parameters()).dtype
    mask = batch_attention_masks(target.config, trees.ancestors, trees.depths, prefix_lengths, past_len, dtype, kv_length=cache_capacity(cache))
    position_ids = prefix_lengths[:, None] + trees.depths
    if position_offsets is not None:
        position_ids = position_ids + position_offsets[:, None]
    with true_position_temperature(target, cache, position_ids):
        out = (target if forward is None else forward)(
            input_ids=trees.tokens,
            attention_mask=mask,
            position_ids=position_ids,
            **cache_kwargs(target, cache),
            use_cache=True,
            output_hidden_states=want_hidden,
        )
    return Verification(out.logits, out.hidden_states if want_hidden else None)


def select_features(hidden_states, layers: tuple[int, ...], need_last: bool, index=None, row: int | None = None) -> TargetFeatures | None:
    """Pick the drafter's feature layers (and the final normed state) at positions `index` (a tensor or slice),
    of batch row `row` only (kept as a batch of one) when given. Only the picked layers are
    sliced: a forward returns all L + 1 hidden states, and a round visits every row."""
    if hidden_states is None:
        return None

    def pick(h):
        if row is not None:
            h = h[row : row + 1]
        return h if index is None else h[:, index]

    return TargetFeatures(
        layers=layers,
        hidden_states=tuple(pick(hidden_states[i]) for i in layers),
        last=pick(hidden_states[-1]) if need_last else None,
    )
