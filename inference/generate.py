"""The speculative decode loop: draft a tree, verify it in one target forward, accept exactly."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingConfig


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class GenerationResult:
    new_tokens: torch.Tensor  # [B, n_new] long, what the target emitted after the prompt
    accepted_lengths: list[int]  # tokens emitted per verification round, the target's own included
    finish_reason: str  # "eos" | "stop_string" | "length" | "context"
    timings: dict[str, float] = field(default_factory=dict)  # seconds: draft, verify, accept, cache, other
    drafted: list[int] = field(default_factory=list)  # draft nodes per round
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def num_rounds(self) -> int:
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward in decoding (the target's own token included)."""
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))


def speculative_generate(target, drafter, input_ids, config, *, tokenizer=None, streamer=None, on_tokens=None):
    raise NotImplementedError("being written")
