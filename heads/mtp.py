"""A target's own multi-token-prediction (MTP) layer as a head (docs/formats.md "MTP layers").

DeepSeek-V3 ships `num_nextn_predict_layers` = 1 such layer after its decoder layers, at checkpoint
index L = num_hidden_layers; Qwen3-Next one under `mtp.`. vLLM and SGLang serve it as the target's
own drafter. For the feature f_t (the target's final normed state) and the next token x_{t+1}:

    h     = block(eh_proj(cat(enorm(embed(x_{t+1})), hnorm(f_t))))     block: a decoder layer of the target's kind
    f'    = norm(h)                                                   the MTP layer's own final norm (shared_head.norm)
    logits = lm_head(f')                                              the target's LM head (shared_head.head holds a copy)

f' is the predicted next feature, which the next draft step takes as its f (what vLLM recycles).
DeepSeek's embedding at position 0 is zeroed, as vLLM does. So it is EAGLE-1 (heads/eagle.py) with
three norms, the target's own layer kind and the family's names (LAYOUTS); it drafts and trains
as EAGLE-1 does.

transformers builds these targets without their MTP layer and skips those tensors when loading:
they are read from the checkpoint's safetensors here (`read_mtp_layer`), and written back in
its layout (`checkpoint_tensors`; heads/formats/mtp.py).
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .config import MTPConfig
from .eagle import Eagle1Head, decoder_layers
from ..ground.target.identity import text_config
from ..ground.target.parts import input_embeddings, lm_head_of


@dataclass(frozen=True)
class MTPLayout:
    """How a family's checkpoint names its MTP layer.

    prefix:  the layer's tensors' prefix, with {layer} for the checkpoint layer index L
    own:     the layer's own tensors (names after the prefix) -> our module names
    block:   the prefix of its decoder block's tensors after `prefix` (ours: `layers.0.`); ""
             for DeepSeek: every tensor that is neither `own` nor `shared`
    shared:  the layer's copies of target tensors: read only to check they are the target's,
             written back from it (name after the prefix -> "embed" | "lm_head")
    zero_first_position: the embedding at position 0 is zeroed (DeepSeek, GLM, in vLLM and SGLang)
    recycle_normed: the next draft step takes the layer's normed output as its feature (vLLM's
        DeepSeek and Qwen3-Next MTP); False: its output before that norm (vLLM's GLM MTP)
    """

    prefix: str
    own: dict
    block: str = ""
    shared: dict | None = None
    zero_first_position: bool = False
    recycle_normed: bool = True

    def layer_prefix(self, layer: int) -> str:
        return self.prefix.format(layer=layer)


_NEXTN: dict[str, Any] = dict(  # DeepSeek's names, which GLM-4.5 keeps
    prefix="model.layers.{layer}.",
    own={
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "fc.weight",
        "shared_head.norm.weight": "final_norm.weight",
    },
    shared={"embed_tokens.weight": "embed", "shared_head.head.weight": "lm_head"},
    zero_first_position=True,
)
LAYOUTS = {
    "deepseek_v3": MTPLayout(**_NEXTN),
    "glm4_moe": MTPLayout(**_NEXTN, recycle_normed=False),
    "qwen3_next": MTPLayout(
        prefix="mtp.",
        own={
            "pre_fc_norm_embedding.weight": "enorm.weight",
            "pre_fc_norm_hidden.weight": "hnorm.weight",
            "fc.weight": "fc.weight",
            "norm.weight": "final_norm.weight",
        },
        block="layers.0.",
    ),
}


def mtp_layout(model_or_config) -> MTPLayout:
    config: Any = model_or_config.config if isinstance(model_or_config, nn.Module) else model_or_config
    family = (config.get_text_config() if hasattr(config, "get_text_config") else config).model_type
    if family not in LAYOUTS:
        raise ValueError(f"MTP layers are read for {', '.join(LAYOUTS)} targets, not {family}")
    return LAYOUTS[family]


def _target_tensor(target_model: nn.Module, which: str) -> torch.Tensor:
    module = input_embeddings(target_model) if which == "embed" else lm_head_of(target_model)
    return module.weight.detach().cpu()


class MTPHead(Eagle1Head):
    config: MTPConfig

    def __init__(self, config: MTPConfig, target_model: nn.Module) -> None:
        layout = mtp_layout(target_model)  # refuses a family whose MTP layer we do not read, before building
        super().__init__(config, target_model)
        self.layout = layout
        # the block: a decoder layer of the target's last attention layer's kind (DeepSeek-V3: MLA
        # with a routed MoE, which layer_idx 0 of a one-layer config would not give; Qwen3-Next:
        # its gated attention with MoE), cached as layer 0
        block = copy.deepcopy(_last_attention_layer(target_model))
        for module in block.modules():
            if hasattr(module, "layer_idx"):
                setattr(module, "layer_idx", 0)  # an attribute of the target's layer classes, not of nn.Module
        self.layers = nn.ModuleList([block])
        H, eps = config.hidden_size, getattr(text_config(target_model), "rms_norm_eps", 1e-6)
        self.enorm, self.hnorm, self.final_norm = (self._parts.norm(H, eps=eps) for _ in range(3))

    def init_from_target(self, model: nn.Module, **kwargs) -> None:
        """The target checkpoint's own MTP layer, where its folder holds one; else the block
        starts as a copy of the target's last decoder layer (norms at one, eh_proj random)."""
        folder = getattr(model.config, "_name_or_path", "")
        if not (folder and Path(folder).is_dir()):
            return
        prefix = self.layout.layer_prefix(self.config.checkpoint_layer)
        tensors = read_mtp_layer(folder, prefix)
        if tensors:
            self.load_state_dict(head_state_from_checkpoint(tensors, model, self.layout), strict=True)
        else:  # a new layer, not the target's: what the user asked for only if they meant to train one
            warnings.warn(
                f"{folder} holds no MTP layer ({prefix}*): this mtp head starts from a copy of the target's "
                "last decoder layer, not from a layer the target was trained with",
                stacklevel=2,
            )

    def step(self, fused, tokens, position_ids=None, cache=None, attention_mask=None, last_only=False):
        """(the next step's feature [B,T,H], logits [B,T,V] or, last_only, [B,1,V]): the layer's
        normed output scores the tokens; the feature is that or the output before the norm
        (MTPLayout.recycle_normed)."""
        h = self._block_output(fused, tokens, position_ids, cache, attention_mask)
        normed = self.final_norm(h)
        return (normed if self.layout.recycle_normed else h), self.refs.lm_logits(normed[:, -1:] if last_only else normed)

    def _hidden(self, fused, tokens, position_ids, cache, attention_mask) -> torch.Tensor:
        """The normed output, which the token CE scores and the feature loss compares with f_{t+1}."""
        return self.final_norm(self._block_output(fused, tokens, position_ids, cache, attention_mask))

    def _block_output(self, fused, tokens, position_ids, cache, attention_mask) -> torch.Tensor:
        e = self.refs.embed_tokens(tokens, self.dtype)
        if self.layout.zero_first_position and position_ids is not None:
            e = e.masked_fill((position_ids == 0)[..., None], 0.0)
        x = self.fc(torch.cat([self.enorm(e), self.hnorm(fused.to(self.dtype))], dim=-1))
        position_ids, mask, pos_emb = self._inputs(x, tokens, position_ids, cache, attention_mask)
        out = self.layers[0](
            x, attention_mask=mask, position_ids=position_ids, position_embeddings=pos_emb, use_cache=cache is not None, **{self._cache_kw: cache}
        )
        return out[0] if isinstance(out, tuple) else out


def _last_attention_layer(model: nn.Module) -> nn.Module:
    layers = decoder_layers(model)
    types = getattr(text_config(model), "layer_types", None) or []
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    return layers[full[-1] if full else -1]


def _weights(folder: Path) -> dict[str, Path]:
    """checkpoint tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder} has no safetensors weights")
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def read_mtp_layer(folder, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors under `prefix` (an MTP layer's), by their names after it; {} when
    the checkpoint has none."""
    where = {k: p for k, p in _weights(Path(folder)).items() if k.startswith(prefix)}
    out = {}
    for path in sorted(set(where.values())):
        with safe_open(str(path), "pt") as f:
            for k in (k for k, p in where.items() if p == path):
                out[k[len(prefix) :]] = f.get_tensor(k)
    return out


def _fuse_experts(block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (mlp.experts.{e}.{gate,up,down}_proj.weight) -> transformers'
    fused ones: gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]."""
    experts = sorted({int(k.split(".")[2]) for k in block if k.startswith("mlp.experts.") and k.split(".")[2].isdigit()})
    if not experts:
        return block
    out = {k: v for k, v in block.items() if not (k.startswith("mlp.experts.") and k.split(".")[2].isdigit())}
    out["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([block[f"mlp.experts.{e}.gate_proj.weight"], block[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts]
    )
    out["mlp.experts.down_proj"] = torch.stack([block[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    return out


def _split_experts(block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`_fuse_experts` undone: the checkpoint's per-expert names."""
    if "mlp.experts.gate_up_proj" not in block:
        return block
    out = {k: v for k, v in block.items() if k not in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
    gate_up, down = block["mlp.experts.gate_up_proj"], block["mlp.experts.down_proj"]
    inner = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        out[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inner]
        out[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, inner:]
        out[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    return out


def head_state_from_checkpoint(tensors: dict[str, torch.Tensor], target_model: nn.Module, layout: MTPLayout) -> dict[str, torch.Tensor]:
    """An MTP layer's checkpoint tensors (names after its prefix) -> our head's state dict. Its
    copies of the target's embedding and LM head must equal the target's (the head uses the
    target's own)."""
    shared = layout.shared or {}
    for name, which in shared.items():
        theirs = _target_tensor(target_model, which)
        if name in tensors and not torch.equal(tensors[name].to(theirs.dtype), theirs):
            raise ValueError(f"the MTP layer's {name} is not the target's: this checkpoint's MTP layer was trained for another target")
    state = {layout.own[k]: v for k, v in tensors.items() if k in layout.own}
    block = {k[len(layout.block) :]: v for k, v in tensors.items() if k not in layout.own and k not in shared and k.startswith(layout.block)}
    state.update({f"layers.0.{k}": v for k, v in _fuse_experts(block).items()})
    return state


def checkpoint_tensors(state: dict[str, torch.Tensor], layer: int, target_model: nn.Module) -> dict[str, torch.Tensor]:
    """An MTP head's state dict as the target's checkpoint holds its MTP layer (`layer`: its
    index L), in the family's names (LAYOUTS), experts per expert, with the layer's copies of the
    target's embedding and LM head where the family keeps them (vLLM's and SGLang's MTP loaders
    read them there)."""
    layout = mtp_layout(target_model)
    prefix = layout.layer_prefix(layer)
    ours = {v: k for k, v in layout.own.items()}
    out = {prefix + ours[k]: v for k, v in state.items() if k in ours}
    block = _split_experts({k[len("layers.0.") :]: v for k, v in state.items() if k.startswith("layers.0.")})
    out.update({prefix + layout.block + k: v for k, v in block.items()})
    out.update({prefix + name: _target_tensor(target_model, which) for name, which in (layout.shared or {}).items()})
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}
