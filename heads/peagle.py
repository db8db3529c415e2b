"""P-EAGLE: the EAGLE-3 head drafting several tokens in one forward (parallel drafting).

An EAGLE-3 step at column t reads the pair (embed(x_{t+1}), fused target features at t) and
predicts x_{t+2}. Deeper tokens need the features of tokens not verified yet; EAGLE-3 feeds its
own hidden state back, one forward per depth. P-EAGLE instead puts `parallel_depth - 1` *mask
positions* after the last pair, each reading (mask_embedding, placeholder), where

    placeholder = fuse(mask_hidden)       mask_hidden: a learned [n_feat * H] vector in the
                                          fused-feature space (what vLLM loads as `mask_hidden`)

so the element at depth d of the chain anchored at column t sits at position t + d, sees the
real pairs at columns <= t and its own chain's earlier mask positions, and predicts x_{t+2+d}.
At inference that is an ordinary causal forward over [catch-up pairs, mask x (K - 1)].

Training (`compute_loss`): depth 0 is EAGLE-3's step 0 over every column. Depth d >= 1 keeps a
random subset of the columns kept at depth d - 1, `max(cod_ratio**d, cod_min_ratio)` of all
columns (`cod_columns`), so deep depths cost a fraction of a full unroll. Loss: soft CE (or an LK
loss, `loss`: heads/losses.py) against the target's distribution (restricted to the draft vocab)
summed over every kept element and divided by their number, as the reference trainers do (docs/formats.md "Parallel drafters").
"""

from __future__ import annotations


import torch
from torch import nn

from .batch import FeatureBatch
from .config import PEagleConfig
from .eagle3 import Eagle3Head
from .io import shift_left, shifted_labels
from .eagle import prepare_mask, window_mask
from .losses import distill_loss, dpace_chain_loss, label_confidence
from .packing import causal_within, segment_ids
from ..ground.target.parts import input_embeddings


def cod_columns(T: int, depths: int, ratio: float, min_ratio: float, generator: torch.Generator | None = None, device=None) -> list[torch.Tensor]:
    """Nested column subsets per depth: [0] all T columns, [d] a random subset of [d - 1] holding
    max(1, round(max(ratio**d, min_ratio) * T)) columns (never more than [d - 1] has), sorted."""
    kept = [torch.arange(T, device=device)]
    for d in range(1, depths):
        previous = kept[-1]
        size = min(previous.numel(), max(1, round(max(ratio**d, min_ratio) * T)))
        pick = torch.randperm(previous.numel(), generator=generator)[:size].to(previous.device)
        kept.append(previous[pick].sort().values)
    return kept


def parallel_attention_mask(T: int, columns: list[torch.Tensor], dtype: torch.dtype, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Additive [1, 1, n_d, T + n_1 + ... + n_d] mask for depth d = len(columns) - 1 >= 1;
    [B, 1, n_d, ...] for packed rows (position_ids [B, T], heads/packing.py).

    Keys are laid out as the cache fills: the T depth-0 pairs, then each depth's kept columns.
    A depth-d query at column c sees depth-0 keys at columns <= c (the real context up to its
    anchor; in c's own conversation when rows are packed) and the keys of its own column at
    depths 1..d (its chain's earlier mask positions).
    """
    device = columns[0].device
    query = columns[-1]  # [n_d]
    key_col = torch.cat([torch.arange(T, device=device), *columns[1:]])
    key_depth = torch.cat(
        [torch.zeros(T, dtype=torch.long, device=device)]
        + [torch.full((c.numel(),), j + 1, dtype=torch.long, device=device) for j, c in enumerate(columns[1:])]
    )
    context = ((key_depth[None] == 0) & (key_col[None] <= query[:, None]))[None]  # [1, n_d, K]
    if position_ids is not None:
        seg = segment_ids(position_ids.to(device))  # [B, T]
        context = context & (seg[:, key_col][:, None, :] == seg[:, query][:, :, None])  # [B, n_d, K]
    allowed = context | ((key_depth[None] > 0) & (key_col[None] == query[:, None]))[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


class PEagleHead(Eagle3Head):
    config: PEagleConfig

    def __init__(self, config: PEagleConfig, target_model: nn.Module) -> None:
        super().__init__(config, target_model)
        H, n_feat = config.hidden_size, len(config.feature_layers)
        self.mask_embedding = nn.Parameter(torch.zeros(H))  # target's row of mask_token_id at init
        self.mask_hidden = nn.Parameter(torch.randn(n_feat * H))  # the reference trainers' N(0, 1) init

    def init_from_target(self, model: nn.Module, token_counts: torch.Tensor | None = None, always_include=(), **kwargs) -> None:
        super().init_from_target(model, token_counts=token_counts, always_include=always_include, **kwargs)
        with torch.no_grad():
            row = input_embeddings(model).weight[self.config.mask_token_id]
            self.mask_embedding.copy_(row.to(self.mask_embedding.device, self.mask_embedding.dtype))

    @property
    def parallel_depth(self) -> int:
        return self.config.parallel_depth

    def placeholder(self) -> torch.Tensor:
        """[H]: the fused feature every mask position reads, fuse() of mask_hidden's chunks."""
        chunks = self.mask_hidden.to(self.dtype).chunk(len(self.config.feature_layers))
        return self.fuse([c[None, None] for c in chunks])[0, 0]

    def _mask_inputs(self, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What n mask positions read: (embedding, fused feature), each [batch, n, H]."""
        return (self.mask_embedding.to(self.dtype)[None, None].expand(batch, n, -1), self.placeholder()[None, None].expand(batch, n, -1))

    def _masked_hidden(self, batch: int, n: int, position_ids, cache, attention_mask) -> torch.Tensor:
        """The layer output [batch, n, H] of n mask positions at `position_ids` [batch, n]."""
        e, fused = self._mask_inputs(batch, n)
        position_ids, mask, pos_emb = self._inputs(e, position_ids, position_ids, cache, attention_mask)
        return self.midlayer(e, fused, mask, position_ids, pos_emb, cache)

    def parallel_draft(self, fused, tokens, position_ids, cache) -> torch.Tensor:
        """One forward over the catch-up pairs (fused [B, T, H], tokens [B, T] at position_ids
        [B, T]) and `parallel_depth - 1` mask positions after the last. Appends all of their K/V to
        `cache` (crop the mask positions after drafting). Returns draft-vocab logits
        [B, parallel_depth, Vd]: the last pair's (depth 1) and each mask position's (depths 2..K)."""
        B, T = tokens.shape
        k = self.parallel_depth - 1
        mask_e, mask_fused = self._mask_inputs(B, k)
        e = torch.cat([self.refs.embed_tokens(tokens, self.dtype), mask_e], dim=1)
        hidden = torch.cat([fused.to(self.dtype), mask_fused], dim=1)
        last = position_ids[:, -1:]
        positions = torch.cat([position_ids, last + torch.arange(1, k + 1, device=last.device)[None]], dim=1)
        position_ids, mask, pos_emb = self._inputs(e, positions, positions, cache, None)  # causal
        h = self.midlayer(e, hidden, mask, position_ids, pos_emb, cache)
        return self.logits(h[:, T - 1 :])

    def compute_loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Soft CE over every kept (column, depth) element / their number (module docstring).

        metrics: loss_d and acc_d per depth (top-1 draft token == argmax of the target
        distribution restricted to the draft vocab), elements_d, num_labels (depth 0's).
        """
        cfg = self.config
        ids = batch.input_ids
        B, T = ids.shape
        target_p = self._target_distribution(batch)  # [B, T, Vd]
        fused = self.fuse([batch.hidden_states[i] for i in cfg.feature_layers])  # [B, T, H]
        cache = self.new_cache()
        positions = batch.positions  # [B, T]: restarting in each conversation of a packed row
        columns = cod_columns(T, cfg.parallel_depth, cfg.cod_ratio, cfg.cod_min_ratio, device=ids.device)
        window = cfg.sliding_window if batch.position_ids is not None else None
        total_ce = fused.new_zeros((), dtype=torch.float32)
        total_n = 0
        chains = []  # with loss dpace, per depth: (cells, loss [N], confidence [N])
        metrics: dict[str, float] = {}
        for d in range(cfg.parallel_depth):
            if d == 0:  # EAGLE-3's first step: the real pair at every column
                mask = None if batch.position_ids is None else causal_within(batch.position_ids)[:, None]
                if window is not None:
                    mask = window_mask(prepare_mask(mask, B, T, 0, self.dtype, ids.device), positions, window, positions)
                hidden = self._hidden(fused, shift_left(ids, 1), positions, cache, mask)
            else:
                mask = parallel_attention_mask(T, columns[: d + 1], self.dtype, batch.position_ids).expand(B, -1, -1, -1)
                pos = positions[:, columns[d]] + d  # [B, n_d]
                if window is not None:  # as EAGLE-3's unroll: depth-0 keys by their own positions, the
                    # chain's own keys at the query's (the cache-index rule never windows them out)
                    keys = torch.cat([positions] + [positions[:, columns[j]] + d for j in range(1, d + 1)], dim=1)
                    mask = window_mask(mask, pos, window, keys)
                hidden = self._masked_hidden(B, columns[d].numel(), pos, cache, mask)
            # [B, T]: t + 2 + d labelled
            _, valid = shifted_labels(ids, batch.loss_mask, batch.attention_mask, 2 + d, batch.position_ids)
            b_idx, j_idx = valid[:, columns[d]].nonzero(as_tuple=True)  # j: index into this depth's columns
            t_idx = columns[d][j_idx]
            logits = self.logits(hidden[b_idx, j_idx]).float()  # [N, Vd]
            p = target_p[b_idx, t_idx + 1 + d]  # the target's distribution for token t + 2 + d
            n = p.shape[0]
            each, alpha = distill_loss(logits, p, cfg.loss, cfg.lk_eta)  # [N], [N]
            if cfg.loss == "dpace":  # position t's chain is its depths 0..D-1
                chains.append((b_idx * T + t_idx, each, label_confidence(logits, p)))
            ce_sum = each.sum()
            total_ce, total_n = total_ce + ce_sum, total_n + n
            metrics[f"loss_{d}"] = ce_sum.item() / n if n else 0.0
            metrics[f"acc_{d}"] = (logits.argmax(-1) == p.argmax(-1)).float().mean().item() if n else 0.0
            metrics[f"alpha_{d}"] = alpha.mean().item() if n else 0.0
            metrics[f"elements_{d}"] = float(n)
            if d == 0:
                metrics["num_labels"] = float(n)
        loss = dpace_chain_loss(chains, B * T, cfg.dpace_alpha) if chains else total_ce / max(total_n, 1)
        metrics["loss"] = loss.item()
        return loss, metrics
