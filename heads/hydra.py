"""Hydra heads (Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa
Decoding").

A Medusa head k guesses token t + k + 2 from the target's state h_t alone, blind to what the
heads before it drafted. A Hydra head k also reads the embeddings of every token in between: the
pending token x_{t+1} (the target's own, from h_t) and the k drafted before it:

    z_t^(k) = W_in^(k) [h_t ; E(x_{t+1}) ; ... ; E(x_{t+k+1})]      (k + 2) H -> H
    p_t^(k) = softmax(W2^(k) . ResBlock^(k)(z_t^(k)))                 Medusa's blocks and LM heads

E is the target's frozen input embedding. W_in starts as [I, 0, ..., 0], so a fresh Hydra head is
a fresh Medusa head; training is teacher-forced (the real tokens stand in for the drafts) under
Medusa's loss, sum_k loss_decay**k * CE_k. Drafting (inference/drafters/head_drafters.py HydraDrafter)
grows a static tree depth by depth, each node's children read from its own path.
"""

from __future__ import annotations

import torch
from torch import nn

from .batch import FeatureBatch
from .config import HydraConfig
from .io import shift_left
from .medusa import MedusaHead


class HydraHead(MedusaHead):
    config: HydraConfig

    def __init__(self, config: HydraConfig, target_model: nn.Module | None = None) -> None:
        super().__init__(config)
        H = config.hidden_size
        inputs = [nn.Linear((k + 2) * H, H, bias=False) for k in range(config.num_heads)]
        self.inputs = nn.ModuleList(inputs)
        with torch.no_grad():
            for layer in inputs:  # [I, 0, ..., 0]: only h_t passes at first
                layer.weight.zero_()
                layer.weight[:, :H].copy_(torch.eye(H))

    def path_logits(self, h: torch.Tensor, path_embeds: torch.Tensor, k: int) -> torch.Tensor:
        """Head k on h [N, H] and the embeddings of the k + 1 tokens after it, path_embeds
        [N, k + 1, H] (pending token first) -> logits [N, V] for the next token."""
        x = torch.cat([h.to(self.dtype), path_embeds.to(self.dtype).flatten(1)], dim=-1)
        return self.head_logits(self.inputs[k](x), k)

    def labelled_logits(self, batch: FeatureBatch, h: torch.Tensor):
        """Teacher-forced: head k at t reads x_{t+1} .. x_{t+k+1} (the real tokens stand in for the
        drafts) and predicts x_{t+k+2}; Medusa's loss over it (MedusaHead.compute_loss)."""
        embeds = self.refs.embed_tokens(batch.input_ids, self.dtype)  # [B, T, H]
        following = torch.stack([shift_left(embeds, j) for j in range(1, self.num_heads + 1)], dim=2)  # [B, T, K, H]
        return lambda k, valid: self.path_logits(h[valid], following[valid][:, : k + 1], k)
