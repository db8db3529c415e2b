"""Tiny random targets of vocabulary 128 and their feature batches (right padding, a hole in
the labels): what the heads' loss tests run on (tests/test_heads.py, tests/test_losses.py)."""

from __future__ import annotations

import torch

from drafthead.heads.batch import FeatureBatch
from tests.tiny import tiny_causal_lm

V, LAYERS, T = 128, 4, 20


def make_target(family="llama", seed=0, **kw):
    m = tiny_causal_lm(family, vocab=V, layers=LAYERS, hidden=32, seed=seed, **kw)
    with torch.no_grad():
        m.lm_head.weight.mul_(3.0)  # peakier target distributions: soft targets worth learning
    return m


def make_batch(target, seed=0, B=2, T=T) -> FeatureBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -5:] = 0  # right padding on the second row
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask[:, 6:] = True  # "assistant" tokens from position 6
    loss_mask[0, 12] = False  # a hole: a user turn in the middle
    loss_mask &= attn.bool()
    with torch.no_grad():
        out = target(ids, attention_mask=attn, output_hidden_states=True)
    return FeatureBatch(ids, attn, loss_mask, dict(enumerate(out.hidden_states)))


def counts_of(batch):
    return torch.bincount(batch.input_ids.flatten(), minlength=V)
