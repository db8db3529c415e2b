"""EAGLE-3's training-time-test attention in memory that grows linearly with the sequence.

At unroll step i the draft layer's keys are i + 1 blocks of T (the cache fills block by block):
column t sees block 0 up to t (in its own conversation, within the sliding window) and, in each
block j >= 1, its own column t only (heads/eagle3.py `ttt_attention_mask` is the same rule as a
dense [T, (i + 1) T] mask, which at 32K tokens and 7 steps is 29 GB for the last step's mask alone).

Here the rule stays a description (`TTTMask`), and `ttt_attention` computes it for a chunk of
query rows at a time: scores against block 0 up to the chunk's last column ([c, end]) plus the i
diagonal scores ([c, i]), one softmax over both, then the weighted sums. Each chunk runs under
activation checkpointing, so what the backward keeps is the chunk's inputs (views of q, k, v), not
its [c, T] scores: memory O(c T) at a time, O(T) kept. A sequence that fits one chunk runs without
checkpointing (no recompute). Results equal the dense mask's within fp32 rounding (the tests).

Split across ranks (`TTTMask.split`, heads/context_split.py), each rank holds a shard of the query
columns and of every step's keys: the block-0 keys are all-gathered, the diagonal ones are each
column's own and stay local, and the mask keeps its global column numbers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from .context_split import ContextSplit
from .packing import segment_ids

ATTENTION_NAME = "drafthead_ttt"
CHUNK_BYTES = 64 << 20  # the scores of one chunk of query rows (fp32, every head and batch row)


@dataclass
class TTTMask:
    """What step `step` of the unroll may attend to (module docstring), in place of a dense mask.

    positions: [B, T] the step-0 tokens' positions (0..T-1, or per conversation for packed rows),
    of the whole row when it is split;
    packed: rows hold several conversations (keys of another one are never seen);
    window: the draft layer's sliding window, or None;
    split: the row's columns are split across ranks (heads/context_split.py), or None."""

    step: int
    positions: torch.Tensor
    packed: bool = False
    window: int | None = None
    split: ContextSplit | None = None

    def block0(self, q0: int, q1: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, q1 - q0, q1] of query rows q0..q1-1 over block-0 keys 0..q1-1."""
        device = self.positions.device
        rows = torch.arange(q0, q1, device=device)
        cols = torch.arange(q1, device=device)
        allowed = (cols[None, :] <= rows[:, None])[None]  # [1, c, q1]
        if self.packed:
            seg = segment_ids(self.positions)
            allowed = allowed & (seg[:, q0:q1, None] == seg[:, None, :q1])
        if self.window is not None:
            behind = self.positions[:, q0:q1, None] + self.step - self.positions[:, None, :q1]
            allowed = allowed & (behind < self.window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def chunk_rows(batch: int, heads: int, length: int, budget: int | None = None) -> int:
    """Query rows per chunk: as many as keep one chunk's fp32 scores [B, h, c, T] within `budget`
    (default CHUNK_BYTES)."""
    budget = CHUNK_BYTES if budget is None else budget
    return max(1, min(length, budget // max(1, 4 * batch * heads * length)))


def _chunk(q, k0, v0, kd, vd, spec: TTTMask, q0: int, scaling: float, softcap: float | None):
    """q [B, hkv, g, c, D] (query rows q0..q0+c-1, the g query heads of each key/value head);
    k0/v0 [B, hkv, end, D] (block 0 up to the chunk's end); kd/vd [B, hkv, i, c, D] (each query's
    own diagonal keys) -> [B, hkv, g, c, Dv]. The heads of a group share one matmul with their
    key/value head, which is never copied g times; the mask is made here, inside the checkpoint,
    so that no chunk's [c, end] mask is kept for the backward."""
    B, hkv, g, c, D = q.shape
    end = k0.shape[2]
    mask = spec.block0(q0, end, q.dtype)[:, :, None]  # [B, 1, 1, c, end]
    scores = torch.matmul(q.reshape(B, hkv, g * c, D), k0.transpose(-1, -2)).view(B, hkv, g, c, end) * scaling
    diagonal = (q[:, :, :, None] * kd[:, :, None]).sum(-1).transpose(-1, -2) * scaling  # [B, hkv, g, c, i]
    if softcap is not None:
        scores, diagonal = (torch.tanh(s / softcap) * softcap for s in (scores, diagonal))
    both = torch.cat([scores + mask, diagonal], dim=-1)
    p = torch.softmax(both, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(p[..., :end].reshape(B, hkv, g * c, end), v0).view(B, hkv, g, c, -1)
    if kd.shape[2]:
        out = out + (p[..., end:].transpose(-1, -2)[..., None] * vd[:, :, None]).sum(3)
    return out


def ttt_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: TTTMask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, h, T, D], key/value [B, hkv, (i + 1) T, D]
    (block j = unroll step j's keys) -> ([B, T, h, Dv], None). With a split mask T is this rank's
    shard of columns, and block 0 is gathered from every rank."""
    if not isinstance(attention_mask, TTTMask):
        raise TypeError("ttt_attention takes a TTTMask (heads/eagle3.py ttt_unroll passes one)")
    B, heads, T, D = query.shape
    kv_heads = key.shape[1]
    steps = key.shape[2] // T  # i + 1
    scaling = D**-0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    q = query.view(B, kv_heads, heads // kv_heads, T, D)  # query head h reads key/value head h // g
    k0, v0 = key[:, :, :T], value[:, :, :T]
    split, offset = attention_mask.split, 0  # offset: the global column of local row 0
    if split is not None:
        # one collective for both: the backward then has one all-to-all per step, in the same
        # order on every rank (two could run in either order and swap their gradients)
        k0, v0 = split.gather(torch.stack([k0, v0]), dim=3).unbind(0)  # [B, hkv, size * T, D] each
        offset = split.rank * T
    kd = key[:, :, T:].unflatten(2, (steps - 1, T))  # [B, hkv, i, T, D]
    vd = value[:, :, T:].unflatten(2, (steps - 1, T))
    c = chunk_rows(B, heads, k0.shape[2])
    outs = []
    for q0 in range(0, T, c):
        q1 = min(T, q0 + c)
        args = (
            q[:, :, :, q0:q1],
            k0[:, :, : offset + q1],
            v0[:, :, : offset + q1],
            kd[:, :, :, q0:q1],
            vd[:, :, :, q0:q1],
            attention_mask,
            offset + q0,
            scaling,
            softcap,
        )
        if c < T and torch.is_grad_enabled():
            outs.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            outs.append(_chunk(*args))
    out = torch.cat(outs, dim=3).flatten(1, 2)  # [B, h, T, Dv]
    return out.transpose(1, 2), None


def _register() -> None:
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, ttt_attention)


@contextlib.contextmanager
def ttt_attention_for(layer_config):
    """Within the block the draft layer built from `layer_config` attends with `ttt_attention`."""
    _register()
    before = layer_config._attn_implementation
    layer_config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        layer_config._attn_implementation = before
