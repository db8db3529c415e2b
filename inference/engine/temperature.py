"""Llama 4's attention temperature on its NoPE layers, at the positions tree nodes really hold.

transformers scales a NoPE layer's queries by

    s(p) = 1 + attn_scale * log1p(floor((p + 1) / floor_scale))

with p the cache length plus the query's index in the forward (docs/families.md "Llama 4's
temperature tuning"). Plain decoding's p is the token's position. In a tree forward the index is
the node's order, not its depth, and in a ragged batch the cache length is the longest row's, so
once p or a position reaches floor_scale - 1 (8191 in the released configs) a node's factor is
not the one plain decoding gives its position. `true_position_temperature` multiplies each NoPE
layer's query projection by s(position) / s(p) for one forward, so the queries carry s(position);
below floor_scale - 1 both factors are exactly 1 and nothing is installed.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


_NOPE: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def _nope_attentions(target) -> list:
    """The attention modules whose queries transformers scales by s(p) (Llama 4's NoPE layers),
    found once per target: the forwards past floor_scale - 1 each need them."""
    if target not in _NOPE:
        # use_rope is the config's no_rope_layers entry, 0 or 1
        _NOPE[target] = [m for m in target.modules() if hasattr(m, "floor_scale") and hasattr(m, "q_proj") and not m.use_rope]
    return _NOPE[target]


def temperature(positions: torch.Tensor, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """s(p) of transformers' Llama 4 attention, for integer positions p (any shape), float32."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


@contextlib.contextmanager
def true_position_temperature(target, cache, position_ids: torch.Tensor):
    """Within it, the target's NoPE queries carry s(position_ids) [B, N] instead of transformers'
    s(cache length + index); a no-op for other targets and below floor_scale - 1."""
    config = target.config.get_text_config()
    if not getattr(config, "attn_temperature_tuning", False):  # every other family: nothing to do
        yield
        return
    n = position_ids.shape[-1]
    past = cache.get_seq_length() if cache is not None else 0
    if max(int(position_ids.max()), past + n - 1) + 1 < config.floor_scale:
        yield
        return
    layers = _nope_attentions(target)
    handles = []
    try:
        for attn in layers:

            def rescale(module, args, output, attn=attn):
                # p as the attention computes it, before this forward's K/V join the cache
                seen = cache.get_seq_length(attn.layer_idx)
                assumed = torch.arange(n, device=output.device) + seen
                ratio = temperature(position_ids, attn.floor_scale, attn.attn_scale) / temperature(assumed, attn.floor_scale, attn.attn_scale)
                return output * ratio.to(output.dtype)[..., None]

            handles.append(attn.q_proj.register_forward_hook(rescale))
        yield
    finally:
        for handle in handles:
            handle.remove()
