"""EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty")
and the decoder-layer plumbing it shares with EAGLE-3 (heads/eagle3.py).

EAGLE-1 drafts at the feature level. At position t it reads the target's final normed hidden
state f_t and the embedding of the *next* token x_{t+1}:

    h_t = DecoderLayer(fc(cat(embed(x_{t+1}), f_t)))        fc: 2H -> H, no bias (vLLM layout)
    loss = SmoothL1(h_t, f_{t+1}) + 0.1 * CE(lm_head(h_t), x_{t+2})     (EAGLE sec. 4)

lm_head and embed are the target's own (frozen references, not saved). h_t is a predicted
feature, so deeper draft steps feed it back as the next step's feature.

The decoder layer is a Llama decoder layer sized from the target, whatever its family: the layer
every engine serves (`llama_layer_config`; docs/formats.md "The draft layer per target family"),
or, for heads saved with `draft_layer="target"`, the target family's own class built from its
config with num_hidden_layers = 1. Its input_layernorm is replaced by Identity, as in
EAGLE's cnets.py (`if self.index != 0`) and vLLM's llama_eagle.py (`disable_input_layernorm`):
the fc output is not re-normalised. `Eagle1Config.input_layernorm=True` keeps it.

Inference contract (what the EAGLE drafter calls):
  * `fuse(features)` -> [B, T, H]: EAGLE-1 takes the single feature as is.
  * `step(fused, tokens, position_ids, cache, attention_mask)` -> (hidden [B,T,H], logits [B,T,V]).
    The pair (feature of position t, token t+1) sits at position id t; a node drafted at depth d
    below the last committed pair at position t uses position t + d, and its `fused` is the
    `hidden` that `step` returned for its parent. `cache` is a `DynamicCache` holding K/V of the
    pairs already run (layer_idx 0); crop it back to the committed length before committing.
  * `attention_mask`: additive [B, 1, T, past + T] (0 = attend, large negative = blocked), e.g.
    `inference.engine.tree.tree_attention_mask`; None = causal over the cache plus the new positions.
    The head was trained attending over the whole prefix: build its masks without the target's
    sliding window (Mistral), whatever the target's own verification mask uses.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from .batch import FeatureBatch
from .config import DRAFT_OWN_FIELDS, Eagle1Config, Eagle3Config
from ..ground.target.identity import text_config
from .io import DraftHeadBase, FrozenRefs, shift_left, shifted_labels
from .losses import distill_loss
from .packing import causal_within
from .ttt_attention import TTTMask
from ..ground.target.parts import decoder_of

# ----------------------------------------------------------------------------- shared plumbing


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder blocks (`model.model.layers` for Llama/Qwen2/Mistral/Gemma...)."""
    dec = decoder_of(model)
    layers = getattr(dec, "layers", None)
    if layers is None or len(layers) == 0:
        raise TypeError(
            f"cannot find decoder layers in {type(model).__name__}; EAGLE heads need a transformers decoder-only model with `.model.layers`"
        )
    return layers


def _rope_decoder(model: nn.Module) -> nn.Module | None:
    """The target's RoPE decoder (a rotary embedding beside its `layers`), looked for through
    `get_decoder()` and `.model` (some families' get_decoder() returns the model itself); None
    for a target without one (GPT-2's learned positions, NoPE targets such as Jamba)."""
    candidates = [decoder_of(model), getattr(model, "model", None)]
    return next((dec for dec in candidates if _rotary_of(dec) is not None and bool(getattr(dec, "layers", None))), None)


def _rotary_of(decoder) -> nn.Module | None:
    """The decoder's rotary embedding: `rotary_emb`, or `pos_emb` where it is one (LFM2 MoE)."""
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        rotary = getattr(decoder, "pos_emb", None)
        if rotary is not None and not type(rotary).__name__.endswith("RotaryEmbedding"):
            return None
    return rotary


def has_rope_decoder(model: nn.Module) -> bool:
    """Whether the target has what EAGLE and DFlash draft layers are built from (_rope_decoder)."""
    return _rope_decoder(model) is not None


def target_rotary(model: nn.Module) -> nn.Module:
    dec = _rope_decoder(model)
    if dec is None:
        raise TypeError(f"{type(model).__name__} has no `rotary_emb`; EAGLE heads need a RoPE decoder")
    rotary = _rotary_of(dec)
    assert rotary is not None  # _rope_decoder picks a decoder that has one
    return rotary


# RoPE fields a Llama draft layer cannot run: it rotates the whole head with one table
_ROPE_DROP = ("partial_rotary_factor", "mrope_section", "mrope_interleaved", "type")


def full_attention_rope(cfg) -> dict:
    """The target's RoPE as one transformers-v5 `rope_parameters` dict: that of its full-attention
    layers when the target keeps one per layer type (Gemma 3's local and global bases), since the
    draft attends over the whole committed prefix like a global layer."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if "rope_theta" not in rope:
        rope = dict(rope.get("full_attention") or next(iter(rope.values()), None) or {})
    rope.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
    rope.setdefault("rope_type", "default")
    return {k: v for k, v in rope.items() if k not in _ROPE_DROP}


def llama_layer_config(cfg, rope_parameters: dict | None = None, sizes: dict | None = None) -> LlamaConfig:
    """The Llama decoder layer the engines serve as an EAGLE draft layer, sized from the target's
    (text) config `cfg`, whatever its family (docs/formats.md "The draft layer per target family"):
    its hidden size, heads, KV heads, head_dim (hidden / heads when it states none), dense MLP width
    (`intermediate_size`; 3 * hidden for a target stating none), RMSNorm epsilon and full-attention
    RoPE; SiLU and no attention bias, no q/k norm, no MoE, no sliding window. sizes: the draft's
    own values of DRAFT_OWN_FIELDS (sizes, activation) where not None."""
    own = {k: v for k, v in (sizes or {}).items() if v is not None}
    heads = own.get("num_attention_heads", cfg.num_attention_heads)
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=own.get("intermediate_size", getattr(cfg, "intermediate_size", None) or 3 * cfg.hidden_size),
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=own.get("num_key_value_heads", getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=own.get("head_dim", getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        hidden_act=own.get("hidden_act", "silu"),
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
        initializer_range=getattr(cfg, "initializer_range", 0.02),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_parameters or full_attention_rope(cfg)),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_id=getattr(cfg, "eos_token_id", None),
        pad_token_id=getattr(cfg, "pad_token_id", None),
    )


def family_layer_config(cfg, rope_parameters: dict | None = None, sizes: dict | None = None):
    """The target's own (text) config with one layer: the draft layer of heads saved with
    `draft_layer="target"` (before the engines' Llama layer became the default); `sizes` must be
    unset (those heads always took the target's)."""
    if any(v is not None for v in (sizes or {}).values()):
        raise ValueError(f"a head with its target family's layer takes the target's sizes, not {sizes}")
    cfg = copy.deepcopy(cfg)
    cfg.num_hidden_layers = 1
    if rope_parameters is not None:
        cfg.rope_parameters = dict(rope_parameters)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        # the draft attends over the whole committed prefix: prefer a full-attention layer type
        cfg.layer_types = ["full_attention" if "full_attention" in layer_types else layer_types[0]]
    return cfg


def draft_layer_config(model: nn.Module, rope_parameters: dict | None = None, draft_layer: str = "llama", sizes: dict | None = None):
    """The HF config the draft decoder layer is built from: `llama_layer_config` (draft_layer
    "llama") or `family_layer_config` ("target"). rope_parameters: the draft's own RoPE
    (transformers v5 `rope_parameters`), else the target's; sizes: as llama_layer_config's."""
    if rope_parameters is not None:
        if "rope_theta" not in rope_parameters:
            raise ValueError(f"rope_parameters needs rope_theta, got {rope_parameters}")
        rope_parameters = {"rope_type": "default", **rope_parameters}
    build = DRAFT_LAYERS[draft_layer]
    cfg = build(text_config(model), rope_parameters, sizes)
    cfg.architectures = [type(model).__name__]  # the target's family, for export (the verifier's name)
    if getattr(cfg, "_attn_implementation", None) not in ("eager", "sdpa"):
        # flash/flex kernels take no arbitrary additive 4-D mask, and tree drafting needs one
        cfg._attn_implementation = "sdpa"
    return cfg


# draft_layer -> the config builder; Eagle1Config.draft_layer documents the choice
DRAFT_LAYERS = {"llama": llama_layer_config, "target": family_layer_config}


@dataclass(frozen=True)
class DraftLayerParts:
    """The module classes a draft decoder layer is made of."""

    layer: type
    attention: type
    mlp: type
    norm: type
    rotary: type


def draft_layer_parts(model: nn.Module, draft_layer: str) -> DraftLayerParts:
    """Llama's classes, or (draft_layer "target") those of the target's first decoder layer."""
    if draft_layer == "llama":
        return DraftLayerParts(LlamaDecoderLayer, LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding)
    # the first attention layer: a hybrid target's first layers may be recurrent ones
    family = next((layer for layer in decoder_layers(model) if hasattr(layer, "self_attn")), decoder_layers(model)[0])
    return DraftLayerParts(type(family), type(family.self_attn), type(family.mlp), type(family.input_layernorm), type(target_rotary(model)))


def cache_kwarg(fn) -> str:
    """transformers renamed `past_key_values` -> `cache` in v5 (old name deprecated until 5.40)."""
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"


def causal_mask(batch: int, q_len: int, past_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [B, 1, q, past + q]: query j (absolute past + j) sees keys 0..past + j."""
    q = torch.arange(q_len, device=device)[:, None] + past_len
    k = torch.arange(past_len + q_len, device=device)[None, :]
    mask = torch.zeros(q_len, past_len + q_len, dtype=dtype, device=device)
    mask.masked_fill_(k > q, torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, q_len, past_len + q_len)


def prepare_mask(mask: torch.Tensor | None, batch: int, q_len: int, past_len: int, dtype, device) -> torch.Tensor:
    """None -> causal; bool (True = attend) -> additive; additive -> cast to the head's dtype."""
    if mask is None:
        return causal_mask(batch, q_len, past_len, dtype, device)
    if mask.dtype == torch.bool:
        out = torch.zeros(mask.shape, dtype=dtype, device=device)
        return out.masked_fill_(~mask.to(device), torch.finfo(dtype).min)
    # clamp in float32 so the bound is representable whatever the mask's own dtype (a bf16 mask
    # clamped at float32's min overflows), then cast: large negatives stay finite
    return mask.to(device).float().clamp(min=torch.finfo(dtype).min).to(dtype)


def window_mask(mask: torch.Tensor, position_ids: torch.Tensor, window: int, key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Block keys `window` or more positions behind the query: additive mask [B, 1, T, K], query
    positions [B, T]. Without `key_positions` [B, K], a key's position is taken as its cache index:
    exact for the committed prefix (index == position), and for keys of the current tree or unroll,
    whose index is >= their position, the distance is only underestimated, which matters only if it
    could reach the window, and a tree or unroll never spans it. Packed rows (heads/packing.py),
    whose positions restart, pass the keys' own positions."""
    K = mask.shape[-1]
    keys = torch.arange(K, device=mask.device)[None] if key_positions is None else key_positions.to(mask.device)
    behind = position_ids[:, None, :, None] - keys[:, None, None, :]  # [B, 1, T, K]
    return mask.masked_fill(behind >= window, torch.finfo(mask.dtype).min)


class DecoderHeadBase(DraftHeadBase):
    """Shared by EAGLE-1/3: target references, RoPE, cache handling."""

    config: Eagle1Config | Eagle3Config
    _rotary: nn.Module  # set with object.__setattr__, outside nn.Module's registry (_init_decoder_common)
    needs_rope_decoder = True  # its draft layer is a copy of the target's kind (has_rope_decoder)

    if TYPE_CHECKING:  # each head's own: None, or its [Vd] draft-to-target offsets

        @property
        def draft_to_target(self) -> torch.Tensor | None: ...

    def _init_decoder_common(self, target_model: nn.Module) -> None:
        self.refs = FrozenRefs()
        layer = self.config.layer
        sizes = {name: getattr(layer, name) for name in DRAFT_OWN_FIELDS}
        self._layer_cfg = draft_layer_config(target_model, layer.rope_parameters, self.config.draft_layer, sizes)
        self._parts = draft_layer_parts(target_model, self.config.draft_layer)
        # RoPE tables stay float32 and unregistered: `head.to(bfloat16)` would otherwise round
        # inv_freq. Moved to the input's device on first use.
        # object.__setattr__: keep it out of nn.Module's registry (no state_dict entry, no cast).
        object.__setattr__(self, "_rotary", self._parts.rotary(config=self._layer_cfg))

    def layer_config(self) -> dict:
        return self._layer_cfg.to_dict()

    @staticmethod
    def new_cache() -> DynamicCache:
        """An empty cache for the head's one decoder layer (layer_idx 0)."""
        return DynamicCache()

    def _position_embeddings(self, x: torch.Tensor, position_ids: torch.Tensor):
        if next(self._rotary.buffers()).device != x.device:
            self._rotary.to(x.device)
        return self._rotary(x, position_ids)

    def _inputs(self, x, tokens, position_ids, cache, attention_mask):
        B, T = tokens.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(T, device=tokens.device) + past)[None].expand(B, T)
        if isinstance(attention_mask, TTTMask):  # EAGLE-3's unroll: the rule goes to ttt_attention as is
            return position_ids, attention_mask, self._position_embeddings(x, position_ids)
        mask = prepare_mask(attention_mask, B, T, past, x.dtype, x.device)
        window = getattr(self.config, "sliding_window", None)
        if window is not None:
            mask = window_mask(mask, position_ids, window)
        return position_ids, mask, self._position_embeddings(x, position_ids)

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., V_draft] -> target-vocab logits [..., V] (-inf off the draft
        vocab). Identity when the head already scores the full vocabulary."""
        d2t = self.draft_to_target
        if d2t is None:
            return logits
        ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., ids] = logits
        return out


# ----------------------------------------------------------------------------- EAGLE-1


class Eagle1Head(DecoderHeadBase):
    config: Eagle1Config

    def __init__(self, config: Eagle1Config, target_model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self._init_decoder_common(target_model)
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)  # input: cat(embed(x_{t+1}), f_t), embed first (EAGLE, vLLM)
        layer = self._parts.layer(self._layer_cfg, layer_idx=0)
        if not config.input_layernorm:
            layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])  # key prefix `layers.0.` as in EAGLE/vLLM checkpoints
        self._cache_kw = cache_kwarg(type(layer).forward)

    draft_to_target = None  # EAGLE-1 scores the full target vocabulary

    def fuse(self, features) -> torch.Tensor:
        """features: [B, T, H] or a one-element list of it (output_hidden_states index L)."""
        if isinstance(features, (list, tuple)):
            if len(features) != 1:
                raise ValueError(f"EAGLE-1 takes one feature (index L), got {len(features)}")
            features = features[0]
        return features.to(self.dtype)

    def _hidden(self, fused, tokens, position_ids, cache, attention_mask) -> torch.Tensor:
        x = self.fc(torch.cat([self.refs.embed_tokens(tokens, self.dtype), fused.to(self.dtype)], dim=-1))
        position_ids, mask, pos_emb = self._inputs(x, tokens, position_ids, cache, attention_mask)
        out = self.layers[0](
            x,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=pos_emb,
            use_cache=cache is not None,
            **{self._cache_kw: cache},
        )
        return out[0] if isinstance(out, tuple) else out

    def step(self, fused, tokens, position_ids=None, cache=None, attention_mask=None, last_only=False):
        """fused [B,T,H], tokens [B,T] -> (hidden [B,T,H] = predicted next features, logits [B,T,V];
        last_only: [B,1,V], the last position's)."""
        h = self._hidden(fused, tokens, position_ids, cache, attention_mask)
        return h, self.refs.lm_logits(h[:, -1:] if last_only else h)

    def compute_loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """feature_weight * SmoothL1(h_t, f_{t+1}) + ce_weight * CE(lm_head(h_t), x_{t+2}) on
        positions t whose label t+2 is loss-masked (see `shifted_labels`); with
        `ce_to_target_dist` the CE target is softmax(lm_head(f_{t+1})), the target's own
        distribution for x_{t+2}, and `config.loss` may replace that soft CE by an LK loss
        (heads/losses.py). metrics: loss_feature, loss_ce (the token term), acc_0 (top-1 vs the
        data token, or vs the target's argmax in soft mode), alpha_0 (soft mode: the acceptance
        rate), num_labels."""
        L = self.config.final_layer
        if L not in batch.hidden_states:
            raise KeyError(f"EAGLE-1 needs hidden_states[{L}]; batch has {sorted(batch.hidden_states)}")
        f = batch.hidden_states[L].to(self.dtype)  # [B, T, H]
        next_tokens = shift_left(batch.input_ids, 1)  # x_{t+1} at t
        # packed rows: positions restart and attention stays inside each conversation
        mask = None if batch.position_ids is None else causal_within(batch.position_ids)[:, None]  # [B, 1, T, T]
        h = self._hidden(f, next_tokens, batch.positions, None, mask)  # [B, T, H]
        labels, valid = shifted_labels(batch.input_ids, batch.loss_mask, batch.attention_mask, 2, batch.position_ids)
        h_v = h[valid]  # [N, H]
        f_next = shift_left(f, 1)[valid].detach()  # f_{t+1}, [N, H]
        n = h_v.shape[0]
        logits = self.refs.lm_logits(h_v).float()  # [N, V]
        if n == 0:
            zero = h_v.sum() * 0.0
            return zero, {"loss": 0.0, "loss_feature": 0.0, "loss_ce": 0.0, "acc_0": 0.0, "num_labels": 0.0}
        feat = F.smooth_l1_loss(h_v.float(), f_next.float())
        if self.config.ce_to_target_dist:
            with torch.no_grad():
                p = torch.softmax(self.refs.lm_logits(f_next).float(), dim=-1)
            each, alpha = distill_loss(logits, p, self.config.loss, self.config.lk_eta)  # [N], [N]
            ce = each.mean()
            ref = p.argmax(-1)
            extra = {"alpha_0": alpha.mean().item()}
        else:
            ref = labels[valid]
            ce = F.cross_entropy(logits, ref)
            extra = {}
        loss = self.config.feature_weight * feat + self.config.ce_weight * ce
        acc = (logits.argmax(-1) == ref).float().mean().item()
        return loss, {
            "loss": loss.item(),
            "loss_feature": feat.item(),
            "loss_ce": ce.item(),
            "acc_0": acc,
            "num_labels": float(n),
            **extra,
        }
