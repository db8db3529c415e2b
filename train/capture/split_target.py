"""The frozen target's forward on one rank's columns of a row split across ranks (online features
under `context_parallel: N`; heads/context_split.py splits the draft layer's side).

Each rank runs the decoder on its own shard of columns, with the row's global position ids, so
every per-token part (embeddings, norms, MLPs, rotary) is the unsplit forward's. Attention is the
one place columns meet: `split_attention` all-gathers every layer's keys and values over the
group and attends from the local queries to the keys of every earlier column. That is the same
all-gather form as the draft layer's, without gradients (the target is frozen), so each rank keeps
1/N of the activations and one layer's whole keys and values at a time.

The mask is made here from the row's global columns: causal, padding, packed conversations kept
apart, and each layer's sliding window; softcapping and attention sinks (gpt-oss) as the model
passes them. Layers that do not attend over keys (linear attention, state-space mixers) or chunked
attention cannot be split this way: `split_refusal` names them, and the trainer then runs the
target whole on every rank and says so.

EAGLE-3's loss at column t reads the target's final state at t + 1 + i for unroll step i, so the
final layer comes back with a halo: this rank's columns plus the next `halo` columns of the next
rank (zeros past the row's end).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ...heads.batch import FeatureBatch
from ...heads.context_split import ContextSplit, pad_columns, pad_positions
from ...ground.target.identity import text_config
from ...heads.packing import segment_ids
from .features import target_mask_kwargs

ATTENTION_NAME = "drafthead_split_target"
CHUNK_BYTES = 64 << 20  # one chunk of query rows' fp32 scores against their keys
SPLITTABLE_LAYERS = {"full_attention", "sliding_attention"}


@dataclass
class _Row:
    """What `split_attention` needs of the whole padded row, for the forward in flight."""

    split: ContextSplit
    lo: int  # the global column of local query row 0
    keys_real: torch.Tensor  # [B, Tp] bool: not padding
    positions: torch.Tensor  # [B, Tp] long: each column's position in its conversation
    segments: torch.Tensor | None  # [B, Tp] conversation index for packed rows, else None


_ROW: _Row | None = None


def split_refusal(model) -> str | None:
    """Why this target's forward cannot be split by columns, or None."""
    config = text_config(model)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    other = sorted(kinds - SPLITTABLE_LAYERS)
    if other:
        return f"its layers of type {', '.join(other)} do not attend over every earlier key"
    if getattr(config, "attention_chunk_size", None):
        return "its chunked attention layers"
    return None


def split_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
):
    """transformers' attention-function signature: query [B, h, Tl, D] and key/value [B, hkv, Tl, D]
    of this rank's columns -> ([B, Tl, h, Dv], None), attending over the whole row's keys."""
    row = _ROW
    if row is None:
        raise RuntimeError("split_attention runs only inside split_target_features")
    B, heads, Tl, D = query.shape
    # [B, hkv, Tp, D] each; two collectives, since latent attention's keys and values differ in width
    keys, values = row.split.gather(key, dim=2), row.split.gather(value, dim=2)
    kv_heads = keys.shape[1]
    g = heads // kv_heads
    scaling = D**-0.5 if scaling is None else scaling
    q = query.reshape(B, kv_heads, g, Tl, D)
    c = max(1, min(Tl, CHUNK_BYTES // max(1, 4 * B * heads * keys.shape[2])))
    outs = []
    for q0 in range(0, Tl, c):
        q1 = min(Tl, q0 + c)
        end = row.lo + q1  # keys of columns past the chunk's last are never seen (causal)
        rows = torch.arange(row.lo + q0, end, device=query.device)
        cols = torch.arange(end, device=query.device)
        allowed = (cols[None, :] <= rows[:, None])[None] & row.keys_real[:, None, :end]  # [B, c, end]
        if row.segments is not None:
            allowed = allowed & (row.segments[:, rows, None] == row.segments[:, None, :end])
        if sliding_window is not None:
            allowed = allowed & (row.positions[:, rows, None] - row.positions[:, None, :end] < sliding_window)
        if softcap is None and s_aux is None:  # torch's fused kernel, at the target's dtype
            out = F.scaled_dot_product_attention(
                query[:, :, q0:q1], keys[:, :, :end], values[:, :, :end], attn_mask=allowed[:, None], scale=scaling, enable_gqa=True
            )
            outs.append(out.view(B, kv_heads, g, q1 - q0, -1))
            continue
        scores = (
            torch.matmul(q[:, :, :, q0:q1].reshape(B, kv_heads, g * (q1 - q0), D).float(), keys[:, :, :end].float().transpose(-1, -2)).view(
                B, kv_heads, g, q1 - q0, end
            )
            * scaling
        )
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed[:, None, None], torch.finfo(scores.dtype).min)
        if s_aux is not None:  # a learned sink logit per head, in the softmax and then dropped
            sink = s_aux.float().view(1, kv_heads, g, 1, 1).expand(B, -1, -1, q1 - q0, 1)
            p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(scores, dim=-1)
        out = torch.matmul(p.reshape(B, kv_heads, g * (q1 - q0), end), values[:, :, :end].float())
        outs.append(out.view(B, kv_heads, g, q1 - q0, -1).to(query.dtype))
    out = torch.cat(outs, dim=3).reshape(B, heads, Tl, -1)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, split_attention)


@contextlib.contextmanager
def _attending_split(config, row: _Row):
    global _ROW
    _register()
    before, _ROW = config._attn_implementation, row
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation, _ROW = before, None


@torch.no_grad()
def split_target_features(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    layers: Sequence[int],
    split: ContextSplit,
    position_ids: torch.Tensor | None = None,
    final: int | None = None,
    halo: int = 0,
) -> dict[int, torch.Tensor]:
    """{layer: [B, S, H]}: train/capture/features.py `target_features` of this rank's S = split.shard(T)
    columns of the rows (padded to S * size columns), layer `final` with `halo` more columns
    ([B, S + halo, H]: the next rank's first ones). Padding columns are zero, as there."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    device = next(model.parameters()).device
    T = input_ids.shape[1]
    padded = split.shard(T) * split.size
    ids, real = (pad_columns(x.to(device), padded) for x in (input_ids, attention_mask))
    if position_ids is None:
        positions = torch.arange(padded, device=device).expand(ids.shape[0], -1)
    else:
        positions = pad_positions(position_ids.to(device), padded)
    lo, hi = split.bounds(padded)
    row = _Row(split, lo, real.bool(), positions, segment_ids(positions) if position_ids is not None else None)
    config = text_config(model)
    with _attending_split(config, row):
        out = decoder(
            input_ids=ids[:, lo:hi],
            **target_mask_kwargs(model, real[:, lo:hi], positions[:, lo:hi]),
            output_hidden_states=list(layers),
            use_cache=False,
        )
    local_real = real[:, lo:hi, None].bool()
    hidden = {layer: out.hidden_states[layer].masked_fill(~local_real, 0.0) for layer in layers}
    if final is not None and halo:
        state = hidden[final]
        k = min(halo, state.shape[1])  # k = S when the halo reaches past the next rank
        firsts = split.gather(state[:, :k], dim=1).split(k, dim=1)  # every rank's first k columns
        past_end = state.new_zeros(state.shape[0], halo, state.shape[2])
        hidden[final] = torch.cat([state, torch.cat([*firsts[split.rank + 1 :], past_end], dim=1)[:, :halo]], dim=1)
    return hidden


class SplitFeaturizer:
    """FeatureBatch without hidden states -> with this rank's columns of them (split_columns set),
    by running the frozen target split (`split_target_features`); train/capture/features.py
    OnlineFeaturizer's counterpart under context_parallel."""

    def __init__(self, model, layers: Sequence[int], split: ContextSplit, final: int, halo: int):
        self.model, self.layers, self.split, self.final, self.halo = model, tuple(layers), split, final, halo

    def __call__(self, batch: FeatureBatch) -> FeatureBatch:
        if batch.images is not None:
            raise ValueError("context_parallel splits text rows; rows with images are not built for it")
        hidden = split_target_features(
            self.model, batch.input_ids, batch.attention_mask, self.layers, self.split, batch.position_ids, final=self.final, halo=self.halo
        )
        return FeatureBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, hidden, batch.position_ids, split_columns=True)
