"""Packed rows: several conversations one after another in one row of a batch.

A packed row holds conversations back to back, each with position ids 0, 1, ..., n - 1, then
right padding (positions 0, 1, ... again: a segment of its own that no label reads). The batch
carries only `position_ids` [B, T]; which conversation a token belongs to and which tokens may
see it are derived here, so every head keeps each conversation to itself from one rule:

    segment_ids    [B, T]     the index of a token's conversation in its row
    same_segment   [B, T, T]  query and key in one conversation
    causal_within  [B, T, T]  key at or before the query, in its conversation (block-diagonal causal)

`position_ids=None` stands for one conversation per row (positions 0..T-1), the padded layout.
"""

from __future__ import annotations

import torch


def row_positions(position_ids: torch.Tensor | None, batch: int, length: int, device=None) -> torch.Tensor:
    """[B, T] long: the positions of a batch, `position_ids` or 0..T-1 in every row."""
    if position_ids is not None:
        return position_ids.to(device) if device is not None else position_ids
    return torch.arange(length, device=device)[None].expand(batch, length)


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] long: 0 for the row's first conversation, 1 for the next, ...: a conversation
    starts wherever its position id is 0."""
    return (position_ids == 0).long().cumsum(-1) - 1


def same_segment(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: query t and key s are tokens of one conversation."""
    seg = segment_ids(position_ids)
    return seg[:, :, None] == seg[:, None, :]


def causal_within(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool (True = attend): key s at or before query t and in its conversation."""
    T = position_ids.shape[-1]
    cols = torch.arange(T, device=position_ids.device)
    return same_segment(position_ids) & (cols[None, :] <= cols[:, None])[None]


def same_segment_shift(position_ids: torch.Tensor | None, shift: int) -> torch.Tensor | None:
    """[B, T] bool: token t + shift lies in token t's conversation (positions rise by one inside a
    conversation, so it does iff its position is t's plus `shift`); False past the row's end.
    None for unpacked rows, where every in-row pair qualifies."""
    if position_ids is None:
        return None
    B, T = position_ids.shape
    out = torch.zeros((B, T), dtype=torch.bool, device=position_ids.device)
    if shift < T:
        out[:, : T - shift] = position_ids[:, shift:] == position_ids[:, : T - shift] + shift
    return out
