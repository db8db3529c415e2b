"""Logit processing shared by target and drafter (docs/acceptance.md: both sides, the same rules).

Order and semantics follow transformers' `generate()`: repetition penalty, then temperature,
top-k, top-p. Temperature 0 means greedy: the distribution is a point mass on the argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off

    def __post_init__(self) -> None:
        # written so that nan fails each test (every comparison with nan is False)
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL penalty as transformers applies it: divide positive logits of seen tokens by
    `penalty`, multiply negative ones. logits [..., V], seen [..., V] bool (broadcastable)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def warp_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, top-p on [..., V] float logits; filtered entries become -inf."""
    logits = logits.float() / cfg.temperature
    vocab = logits.shape[-1]
    if cfg.top_k and cfg.top_k < vocab:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        # transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep >= 1
        sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - cfg.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The processed next-token distribution [..., V] (float32). Greedy: one-hot on the argmax."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, cfg.repetition_penalty)
    if cfg.greedy:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return warp_logits(logits, cfg).softmax(dim=-1)


def seen_mask(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] bool: which tokens occur in tokens [B, L]."""
    mask = torch.zeros(tokens.shape[0], vocab_size, dtype=torch.bool, device=tokens.device)
    return mask.scatter_(1, tokens, True)
