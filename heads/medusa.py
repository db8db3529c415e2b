"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads").

Head k (0-based) reads the target's final normed hidden state h_t and predicts token t + k + 2
(the target's own LM head predicts t + 1):

    p_t^(k) = softmax(W2^(k) . ResBlock^(k)(h_t)),   ResBlock(x) = x + SiLU(W1 x + b1)  (num_layers times)

W1 and b1 start at zero, so a fresh head is the target's LM head on h_t. W2 is either an own
trainable copy of the target LM head (Medusa's init) or the target's frozen LM head itself
(`share_lm_head`). Module names match vLLM's Medusa layout (`blocks.{k}.layers.{l}`,
`lm_heads.{k}`), so export is a rename-free copy.
"""

from __future__ import annotations

from typing import Iterable, cast

import torch
import torch.nn.functional as F
from torch import nn

from .batch import FeatureBatch
from .config import MedusaConfig
from .io import DraftHeadBase, FrozenRefs, shifted_labels
from .losses import dpace_chain_loss
from ..ground.target.parts import lm_head_of


class ResidualBlock(nn.Module):
    """x + SiLU(W x + b), `num_layers` times. Zero init: a fresh block is the identity."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        layers = [nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers)]
        self.layers = nn.ModuleList(layers)
        for layer in layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHead(DraftHeadBase):
    config: MedusaConfig

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(H, config.num_layers) for _ in range(config.num_heads))
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(config.num_heads))
        self.refs = FrozenRefs()

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def init_from_target(self, model: nn.Module, **kwargs) -> None:
        """Each own LM head starts as a copy of the target's (Medusa's init)."""
        if self.lm_heads is None:
            return
        w = lm_head_of(model).weight
        with torch.no_grad():
            for lm in cast(Iterable[nn.Linear], self.lm_heads):
                lm.weight.copy_(w.to(lm.weight.dtype))

    def head_logits(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """Head k on hidden states h [..., H] -> logits [..., V]."""
        x = self.blocks[k](h)
        return self.refs.lm_logits(x) if self.lm_heads is None else self.lm_heads[k](x)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> [K, ..., V]."""
        h = h.to(self.dtype)
        return torch.stack([self.head_logits(h, k) for k in range(self.num_heads)])

    @torch.no_grad()
    def draft_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """last_hidden [B, H] (final normed target state at the last committed position, i.e. the
        state whose LM-head output gave the pending token) -> [K, B, V]: head k's logits for the
        token k + 1 steps after the pending one."""
        return self.forward(last_hidden)

    def compute_loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """sum_k loss_decay**k * CE_k over loss-masked positions (see `shifted_labels`).

        metrics: loss_k, acc_k (top-1 vs the label token) per head, num_labels (head 0's count).
        Hidden states may carry grad (Medusa-2 trains the target jointly; the trainer adds the
        target's own LM loss).
        """
        L = self.config.final_layer
        if L not in batch.hidden_states:
            raise KeyError(f"{self.kind} needs hidden_states[{L}] (final normed state); batch has {sorted(batch.hidden_states)}")
        h = batch.hidden_states[L].to(self.dtype)  # [B, T, H]
        logits_at = self.labelled_logits(batch, h)
        total = h.new_zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        chains = []  # with loss dpace, per head: (cells, CE [N], None); position t's chain is heads 0..K-1
        for k in range(self.num_heads):
            labels, valid = shifted_labels(batch.input_ids, batch.loss_mask, batch.attention_mask, k + 2, batch.position_ids)
            logits = logits_at(k, valid).float()  # [N, V]
            target = labels[valid]
            n = target.numel()
            if n:
                each = F.cross_entropy(logits, target, reduction="none")
                ce = each.mean()
                acc = (logits.argmax(-1) == target).float().mean().item()
            else:  # keep the graph so backward() still works on an all-masked batch
                each, ce, acc = logits.sum(-1) * 0.0, logits.sum() * 0.0, 0.0
            if self.config.loss == "dpace":
                chains.append((valid.flatten().nonzero().flatten(), each, None))
            else:
                total = total + self.config.loss_decay**k * ce
            metrics[f"loss_{k}"] = ce.item()
            metrics[f"acc_{k}"] = acc
            if k == 0:
                metrics["num_labels"] = float(n)
        if chains:
            total = dpace_chain_loss(chains, h.shape[0] * h.shape[1], self.config.dpace_alpha)
        metrics["loss"] = total.item()
        return total, metrics

    def labelled_logits(self, batch: FeatureBatch, h: torch.Tensor):
        """(k, valid [B, T] bool) -> head k's logits [N, V] at the valid positions (label t + k + 2).
        Only labelled positions go through the [N, V] projection: memory ~ N*V, not B*T*V."""
        return lambda k, valid: self.head_logits(h[valid], k)
