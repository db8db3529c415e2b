"""The tensors a head trains on: target features for a batch of formatted chat sequences.

The trainer only sees these (docs/style.md 9): they come from the target inside the training step
(online) or from shards captured ahead (`drafthead data capture`); trainer tests use random ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .packing import row_positions


@dataclass
class FeatureBatch:
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token, 0 = right padding
    loss_mask: torch.Tensor  # [B, T] bool, True where input_ids[t] is an assistant token (a label)
    # Target hidden states by `output_hidden_states` index (0 = embeddings, L = final normed): [B, T, H]
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # [B, T] long: each token's position in its own conversation when rows are packed (several
    # conversations per row, heads/packing.py); None: one conversation per row, positions 0..T-1
    position_ids: torch.Tensor | None = None
    # the hidden states hold one rank's columns of a row split across ranks (train/capture/split_target.py),
    # the final layer with the halo of later columns EAGLE-3's loss reads; ids and masks stay whole
    split_columns: bool = False
    # per row, the images of a vision-language target's prompt (ground/target/media.py
    # PromptImages) or None; only the target's forward reads them (train/capture/features.py)
    images: list | None = None

    @property
    def positions(self) -> torch.Tensor:
        """[B, T] long: `position_ids`, or 0..T-1 in every row."""
        batch, length = self.input_ids.shape
        return row_positions(self.position_ids, batch, length, device=self.input_ids.device)

    @property
    def labels_ok(self) -> torch.Tensor:
        """[B, T] bool: the positions whose token is a label (an assistant token, not padding)."""
        return self.loss_mask.bool() & self.attention_mask.bool()

    def require(self, layers, kind: str) -> None:
        """Raise KeyError unless every `output_hidden_states` index in `layers` is in the batch
        (a head's features plus L, the final state its soft targets come from)."""
        missing = sorted(set(layers) - set(self.hidden_states))
        if missing:
            raise KeyError(
                f"{kind} needs hidden_states {sorted(set(layers))} (its features plus L for the soft "
                f"targets; config.train_hidden_layers); batch lacks {missing}"
            )

    def to(self, device) -> "FeatureBatch":
        return FeatureBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.loss_mask.to(device),
            {k: v.to(device) for k, v in self.hidden_states.items()},
            self.position_ids.to(device) if self.position_ids is not None else None,
            self.split_columns,
            self.images,
        )
