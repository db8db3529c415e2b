"""DFlash (block diffusion drafting, arXiv 2602.06036): one forward drafts a whole block.

The committed text's target features are fused once per position,

    c_t = hidden_norm(fc(cat(F_a1[t], F_a2[t], ...)))          fc: n_feat * H -> H, no bias

and every draft layer turns them into keys and values of its own (k_proj / v_proj, k_norm, RoPE
at t), which the drafter caches: they never change once t is committed. A round's queries are
one block of `block_size` positions after the committed text at position n:

    tokens    = [x_n (the pending token), MASK, ..., MASK]       positions n .. n + S - 1
    h^0       = embed(tokens)                                    the target's frozen embedding
    h^(l+1)   = layer_l(h^l)  with keys/values cat(context K/V, block K/V), no causal mask
    q_k       = softmax(lm_head(norm(h[k])))                     the target's LM head, k = 1..S-1

so block position k drafts x_{n+k} from the committed text alone: the drafts form per-position
marginals (a chain of argmaxes, or a static tree of per-position top-r). The layers are Qwen3's
(q_norm / k_norm per head, SiLU MLP) whatever the target family, because that is the layout the
engines load (vLLM's and SGLang's `DFlashDraftModel`; docs/formats.md "Parallel drafters").

Training (`compute_loss`): `num_anchors` random anchors a per sequence, each a block at a..a+S-1
that sees the context keys at positions < a and its own block (`block_attention_mask`), all in
one forward. Position k of the block is scored against the target's distribution for token a + k
(softmax of the LM head on the final normed state at a + k - 1), weighted exp(-(k - 1) / gamma),
under soft CE or an LK loss (`loss`, heads/losses.py), or soft CE under D-PACE's weights (`loss: dpace`).
"""

from __future__ import annotations

import copy
import math
from typing import Iterable, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .batch import FeatureBatch
from .config import DFlashConfig
from .eagle import full_attention_rope
from ..ground.target.identity import text_config
from .io import DraftHeadBase, FrozenRefs
from .losses import distill_loss, dpace_weights, label_confidence
from .packing import row_positions, same_segment_shift, segment_ids
from ..ground.target.parts import input_embeddings

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, each [B, kv_heads, n, head_dim]


def dflash_layer_config(target_model: nn.Module, config: DFlashConfig) -> Qwen3Config:
    """The Qwen3 config of the draft layers: the target's hidden size, and its MLP width, heads, norm
    epsilon and RoPE unless `config` states the draft's own."""
    cfg = text_config(target_model)

    def own(name, default):
        return getattr(config.layer, name) or default

    heads = own("num_attention_heads", cfg.num_attention_heads)
    rope = {"rope_type": "default", **config.layer.rope_parameters} if config.layer.rope_parameters else full_attention_rope(cfg)
    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=own("intermediate_size", cfg.intermediate_size),
        num_hidden_layers=config.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=own("num_key_value_heads", getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=own("head_dim", getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        rms_norm_eps=own("rms_norm_eps", getattr(cfg, "rms_norm_eps", 1e-6)),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
        rope_parameters=rope,
        attention_bias=False,
        hidden_act="silu",
        tie_word_embeddings=False,
    )


def decay_weights(num_drafted: int, gamma: float | None) -> list[float]:
    """The loss weight of the k-th drafted token of a block, k = 0..num_drafted-1: exp(-k / gamma),
    or 1 (None)."""
    return [1.0 if gamma is None else math.exp(-i / gamma) for i in range(num_drafted)]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d] rotated by cos / sin [B, T, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def sample_anchors(label_ok: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None, position_ids: torch.Tensor | None = None):
    """Block anchors for training: (anchors [B, A] long, sorted; ok [B, A] bool).

    Position p can anchor a block when it has context before it (p >= 1) and the token after it is
    a label (label_ok[p + 1]). Each conversation draws min(num_anchors, its count) of them without
    replacement; A is the largest draw of a row in the batch and shorter rows are padded with
    ok = False. label_ok: [B, T] bool, loss mask & attention mask. position_ids [B, T]: packed rows
    (heads/packing.py), where p counts from its conversation's start and p + 1 must lie in it.
    """
    B, T = label_ok.shape
    positions = row_positions(position_ids, B, T, label_ok.device)
    valid = torch.zeros_like(label_ok, dtype=torch.bool)
    if T > 2:
        valid[:, : T - 1] = label_ok[:, 1:].bool() & (positions[:, : T - 1] >= 1)
    inside = same_segment_shift(position_ids, 1)
    if inside is not None:
        valid &= inside
    segments = segment_ids(positions)
    picks = []
    for row, seg in zip(valid, segments):
        drawn = []
        for s in seg[row].unique():  # each conversation draws its own anchors
            where = (row & (seg == s)).nonzero().flatten()
            order = torch.randperm(where.numel(), generator=generator)[:num_anchors].to(where.device)
            drawn.append(where[order])
        picks.append(torch.cat(drawn).sort().values if drawn else row.new_zeros(0, dtype=torch.long))
    A = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(B, A, dtype=torch.long, device=label_ok.device)
    ok = torch.zeros(B, A, dtype=torch.bool, device=label_ok.device)
    for b, p in enumerate(picks):
        anchors[b, : p.numel()], ok[b, : p.numel()] = p, True
    return anchors, ok


def block_attention_mask(
    T: int, anchors: torch.Tensor, block_size: int, dtype: torch.dtype, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Additive [B, 1, A * S, T + A * S] training mask: the keys are the T context positions, then
    the A blocks in order. A query of block j sees context positions < anchors[:, j] (the text
    committed before its pending token; in the anchor's own conversation when rows are packed,
    position_ids [B, T]) and every position of block j, none of other blocks."""
    B, A = anchors.shape
    S = block_size
    device = anchors.device
    block_of = torch.arange(A, device=device).repeat_interleave(S)  # [A * S]
    query_anchor = anchors.repeat_interleave(S, dim=1)  # [B, A * S]
    sees_context = torch.arange(T, device=device)[None, None] < query_anchor[:, :, None]
    if position_ids is not None:
        seg = segment_ids(position_ids.to(device))  # [B, T]
        sees_context = sees_context & (seg[:, None, :] == seg.gather(1, query_anchor)[:, :, None])
    sees_block = (block_of[:, None] == block_of[None, :])[None].expand(B, -1, -1)
    allowed = torch.cat([sees_context, sees_block], dim=-1)  # [B, A * S, T + A * S]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys and values are the cached context's plus the block's own."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        assert cfg.num_key_value_heads is not None  # Qwen3Config fills a None in from num_attention_heads
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)  # per head, before RoPE
        self.k_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, heads, self.head_dim)

    def keys_values(self, x: torch.Tensor, cos, sin) -> KV:
        """x [B, T, H] at the positions cos / sin were made for -> keys, values [B, kv_heads, T, d]."""
        k = rope(self.k_norm(self._split(self.k_proj(x), self.kv_heads)).transpose(1, 2), cos, sin)
        return k, self._split(self.v_proj(x), self.kv_heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, context: KV, cos, sin, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, S, H] (the block, normed), context K/V [B, kv_heads, C, d] -> [B, S, H].
        mask: additive [B, 1, S, C + S], or None: every query sees every key."""
        B, S, _ = x.shape
        q = rope(self.q_norm(self._split(self.q_proj(x), self.heads)).transpose(1, 2), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # scale 1 / sqrt(d), Qwen3's
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer over the block; the context enters only as keys/values (the
    fused features are not passed through input_layernorm, as in the reference models)."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, context: KV, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(DraftHeadBase):
    config: DFlashConfig
    _rotary: Qwen3RotaryEmbedding  # set with object.__setattr__, outside nn.Module's registry (__init__)
    draft_to_target = None  # drafts score the target's whole vocabulary through its LM head
    needs_rope_decoder = True  # its layers are sized from a Llama-style RoPE decoder's config (intermediate_size...)

    def __init__(self, config: DFlashConfig, target_model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.refs = FrozenRefs()
        self._layer_cfg = dflash_layer_config(target_model, config)
        H, n_feat = config.hidden_size, len(config.feature_layers)
        self.fc = nn.Linear(n_feat * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=self._layer_cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(self._layer_cfg) for _ in range(config.num_layers))
        self.norm = Qwen3RMSNorm(H, eps=self._layer_cfg.rms_norm_eps)
        # RoPE tables stay float32 and out of the state dict, as the EAGLE heads' (heads/eagle.py)
        object.__setattr__(self, "_rotary", Qwen3RotaryEmbedding(config=copy.deepcopy(self._layer_cfg)))

    def layer_config(self) -> dict:
        return self._layer_cfg.to_dict()

    def init_from_target(self, model: nn.Module, **kwargs) -> None:
        """Nothing to copy (the embedding and LM head stay the target's); refuse a mask token
        whose embedding row is zero, such as a padding row: the mask positions would read nothing."""
        mask_id = self.config.mask_token_id
        if not input_embeddings(model).weight[mask_id].detach().abs().sum() > 0:
            raise ValueError(
                f"the target's embedding row of mask_token_id {mask_id} is zero (a padding row?): pick another token for the mask positions"
            )

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _cos_sin(self, x: torch.Tensor, position_ids: torch.Tensor):
        if self._rotary.inv_freq.device != x.device:
            self._rotary.to(x.device)
        return self._rotary(x, position_ids)  # each [B, T, d] in x's dtype

    def fuse(self, features) -> torch.Tensor:
        """features: list of [B, T, H] at `feature_layers`, in that order -> c [B, T, H]."""
        if len(features) != len(self.config.feature_layers):
            raise ValueError(f"DFlash fuses {len(self.config.feature_layers)} features {self.config.feature_layers}, got {len(features)}")
        return self.hidden_norm(self.fc(torch.cat([f.to(self.dtype) for f in features], dim=-1)))

    def context(self, fused: torch.Tensor, position_ids: torch.Tensor) -> list[KV]:
        """Each layer's keys/values of committed positions: fused [B, n, H] at position_ids [B, n]."""
        cos, sin = self._cos_sin(fused, position_ids)
        return [layer.self_attn.keys_values(fused, cos, sin) for layer in cast(Iterable[DFlashLayer], self.layers)]

    def block_tokens(self, first: torch.Tensor) -> torch.Tensor:
        """first [...] (each block's pending token) -> [..., S]: it, then S - 1 mask tokens."""
        mask_id = self.config.mask_token_id
        assert mask_id is not None  # DFlashConfig refuses None
        masks = first.new_full((*first.shape, self.block_size - 1), mask_id)
        return torch.cat([first[..., None], masks], dim=-1)

    def block_hidden(self, tokens, position_ids, context: list[KV], mask=None) -> torch.Tensor:
        """The final normed hidden states [B, Q, H] of block tokens [B, Q] at position_ids [B, Q]."""
        h = self.refs.embed_tokens(tokens, self.dtype)
        cos, sin = self._cos_sin(h, position_ids)
        for layer, kv in zip(self.layers, context):
            h = layer(h, kv, cos, sin, mask)
        return self.norm(h)

    def draft_logits(self, pending: torch.Tensor, position: int, context: list[KV]) -> torch.Tensor:
        """One block after a committed text of `position` tokens (context: their K/V), its first
        token `pending` [B] -> target-vocab logits [B, S - 1, V] for tokens position + 1 ..
        position + S - 1."""
        tokens = self.block_tokens(pending)  # [B, S]
        positions = (torch.arange(self.block_size, device=tokens.device) + position)[None].expand_as(tokens)
        return self.refs.lm_logits(self.block_hidden(tokens, positions, context)[:, 1:])

    def compute_loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict[str, float]]:
        anchors, ok = sample_anchors(batch.labels_ok, self.config.num_anchors, position_ids=batch.position_ids)
        return self.block_loss(batch, anchors, ok)

    def run_blocks(self, batch: FeatureBatch, anchors: torch.Tensor, ok: torch.Tensor):
        """All blocks at `anchors` [B, A] in one forward (module docstring) ->
        (h [B, A, S, H] final normed states, label [B, A, K], valid [B, A, K]): drafted token k
        (block slot S - K + k, K = config.num_drafted) is the text's token `label`, scored where
        `valid` (ok, inside the row and its conversation, a label position)."""
        cfg, S, K = self.config, self.block_size, self.config.num_drafted
        ids = batch.input_ids
        B, T = ids.shape
        batch.require(set(cfg.feature_layers) | {cfg.final_layer}, self.kind)
        fused = self.fuse([batch.hidden_states[i] for i in cfg.feature_layers])  # [B, T, H]
        positions = batch.positions  # [B, T]: restarting in each conversation of a packed row
        context = self.context(fused, positions)
        A = anchors.shape[1]
        offsets = torch.arange(S, device=ids.device)
        tokens = self.block_tokens(ids.gather(1, anchors)).reshape(B, A * S)
        block_positions = (positions.gather(1, anchors)[:, :, None] + offsets).reshape(B, A * S)
        mask = block_attention_mask(T, anchors, S, self.dtype, batch.position_ids)
        h = self.block_hidden(tokens, block_positions, context, mask).view(B, A, S, -1)
        ahead = torch.arange(1, K + 1, device=ids.device)  # drafted token k is the text's token anchor + k + 1
        label = anchors[:, :, None] + ahead  # [B, A, K]
        at = label.clamp(max=T - 1).view(B, -1)
        valid = ok[:, :, None] & (label < T) & batch.labels_ok.gather(1, at).view_as(label)
        if batch.position_ids is not None:  # the label must be in the anchor's conversation
            rise = positions.gather(1, at).view_as(label) - positions.gather(1, anchors)[:, :, None]
            valid &= rise == ahead
        return h, label, valid

    def position_weights(self, index, shape: tuple[int, int, int], confidence: torch.Tensor):
        """The loss weight of each scored element (b, a, k) = `index` in blocks of `shape` [B, A, K],
        and the sum that normalises them: exp(-k / gamma) over their sum, or with `loss: dpace`
        D-PACE's weights of each block's chain from `confidence` [N] (heads/losses.py) over the
        number of blocks scored (the reference's per-block reduction)."""
        b, a, k = index
        if self.config.loss != "dpace":
            w = torch.tensor(decay_weights(shape[2], self.config.loss_decay_gamma), device=confidence.device)[k]
            return w, w.sum()
        B, A, K = shape
        chain = b * A + a
        grid = torch.zeros(B * A, K, device=confidence.device)
        valid = torch.zeros(B * A, K, dtype=torch.bool, device=confidence.device)
        grid[chain, k], valid[chain, k] = confidence.float(), True
        w = dpace_weights(grid, valid, self.config.dpace_alpha)[chain, k]
        return w, valid.any(-1).sum().clamp_min(1).float()

    def block_loss(self, batch: FeatureBatch, anchors: torch.Tensor, ok: torch.Tensor):
        """The loss over blocks at `anchors` [B, A] (those with ok [B, A]) (module docstring).

        Returns (sum_e w_e CE_e / sum_e w_e, metrics): loss_i and acc_i for the i-th drafted token
        (block position i + 1; top-1 == the target's argmax), num_labels (the first's count).
        """
        cfg, S = self.config, self.block_size
        h, label, valid = self.run_blocks(batch, anchors, ok)
        b, a, k = valid.nonzero(as_tuple=True)
        logits = self.refs.lm_logits(h[b, a, k + 1]).float()  # [N, V]
        with torch.no_grad():  # the target's distribution for token label, from the state before it
            hL = batch.hidden_states[cfg.final_layer]
            p = torch.softmax(self.refs.lm_logits(hL[b, label[b, a, k] - 1].float()), dim=-1)
        ce, alpha = distill_loss(logits, p, cfg.loss, cfg.lk_eta)  # [N], [N]: the objective per element
        w, total = self.position_weights((b, a, k), tuple(label.shape), label_confidence(logits, p))
        loss = (w * ce).sum() / total if ce.numel() else logits.sum() * 0.0
        hits = logits.argmax(-1) == p.argmax(-1)
        metrics: dict[str, float] = {"loss": loss.item()}
        for i in range(S - 1):
            metrics.update(position_metrics(i, k == i, ce=ce, acc=hits.float(), alpha=alpha))
        return loss, metrics


def position_metrics(i: int, at: torch.Tensor, **per_element: torch.Tensor) -> dict[str, float]:
    """{name_i: mean over the elements `at` [N] bool} for each per_element [N] tensor (0 where
    none), named loss_i for `ce`; num_labels (their count) for the first position."""
    n = int(at.sum())
    out = {f"{'loss' if name == 'ce' else name}_{i}": (v[at].float().mean().item() if n else 0.0) for name, v in per_element.items()}
    if i == 0:
        out["num_labels"] = float(n)
    return out
