"""EAGLE-3's reduced draft vocabulary (docs/trees.md, docs/cpu-measurements.md).

The draft LM head scores only `size` target tokens, the most frequent in the training data. Two
tensors describe the subset, in the layout vLLM and SGLang load:

    d2t: int64 [size]  offsets: target_id = draft_id + d2t[draft_id]
    t2d: bool  [V]     t2d[target_id] is True iff the target token is in the draft vocab

Draft ids are assigned in increasing target id order, so `arange(size) + d2t` is strictly
increasing. An all-zero d2t (a known bug in released heads) is only valid when the draft vocab is
exactly target ids 0..size-1; `validate_draft_vocab` checks the real property instead.
"""

from __future__ import annotations

from typing import Iterable

import torch


def count_tokens(input_ids: torch.Tensor, vocab_size: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token frequencies [V] long over `input_ids` (any shape), only where `mask` is True."""
    ids = input_ids if mask is None else input_ids[mask.bool()]
    return torch.bincount(ids.reshape(-1).long().cpu(), minlength=vocab_size)[:vocab_size]


def build_draft_vocab(token_counts: torch.Tensor, size: int, always_include: Iterable[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent target tokens (ties: lower id first), plus `always_include` ids
    (EOS and other special tokens a draft must be able to propose) which take precedence.

    token_counts: [V] counts (int or float, >= 0). Returns (d2t int64 [size], t2d bool [V]).
    """
    if token_counts.dim() != 1:
        raise ValueError(f"token_counts must be [V], got {tuple(token_counts.shape)}")
    V = token_counts.shape[0]
    if size <= 0:
        raise ValueError(f"draft vocab size must be > 0, got {size}")
    if size > V:
        raise ValueError(f"draft vocab size {size} exceeds the target vocab {V}")
    if bool((token_counts < 0).any()):
        raise ValueError("token_counts must be >= 0")
    forced = sorted({int(i) for i in always_include})
    bad = [i for i in forced if not 0 <= i < V]
    if bad:
        raise ValueError(f"always_include ids {bad} outside the target vocab 0..{V - 1}")
    if len(forced) > size:
        raise ValueError(f"{len(forced)} always_include ids do not fit a draft vocab of {size}")
    # Rank: forced first, then by count descending, then by id ascending. Sorting by id first and
    # then stably by score keeps ties in id order.
    score = token_counts.double().cpu().clone()
    if forced:
        score[torch.tensor(forced)] = float("inf")
    order = torch.sort(-score, stable=True).indices  # ids ascending within equal scores
    chosen = torch.sort(order[:size]).values  # [size] target ids, increasing
    return draft_vocab_from_ids(chosen, V)


def draft_vocab_from_ids(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a strictly increasing list of target ids."""
    target_ids = target_ids.long().cpu()
    d2t = target_ids - torch.arange(target_ids.shape[0])
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    validate_draft_vocab(d2t, t2d)
    return d2t, t2d


def identity_draft_vocab(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full vocabulary as the draft vocab: d2t all zero, t2d all True (valid by the rule above)."""
    return torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool)


def draft_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[size] long: the target id of each draft id."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def validate_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Check (d2t, t2d) describe one strictly increasing injection draft -> target and agree.

    Returns the target ids [size]. Raises ValueError naming the first problem found.
    """
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise ValueError(f"d2t and t2d must be 1-D, got {tuple(d2t.shape)} and {tuple(t2d.shape)}")
    if d2t.dtype != torch.long:
        raise ValueError(f"d2t must be int64, got {d2t.dtype}")
    if t2d.dtype != torch.bool:
        raise ValueError(f"t2d must be bool, got {t2d.dtype}")
    size, V = d2t.shape[0], t2d.shape[0]
    if size == 0 or size > V:
        raise ValueError(f"draft vocab size {size} must be in 1..{V}")
    ids = draft_target_ids(d2t.cpu())
    if bool((ids < 0).any()) or bool((ids >= V).any()):
        raise ValueError(f"d2t maps draft ids outside the target vocab 0..{V - 1}")
    if size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        i = int(torch.nonzero(ids[1:] <= ids[:-1])[0])
        raise ValueError(f"d2t is not strictly increasing: draft ids {i}, {i + 1} map to {int(ids[i])}, {int(ids[i + 1])}")
    t2d = t2d.cpu()
    if int(t2d.sum()) != size:
        raise ValueError(f"t2d marks {int(t2d.sum())} tokens but d2t has {size}")
    if not bool(t2d[ids].all()):
        raise ValueError("t2d and d2t disagree: a draft token's target id is not marked in t2d")
    return ids
