"""A target's own multi-token-prediction (MTP) layer as a head (docs/formats.md "MTP layers").

DeepSeek-V3 ships `num_nextn_predict_layers` = 1 such layer after its decoder layers, at checkpoint
index L = num_hidden_layers, and vLLM and SGLang serve it as the target's own drafter. For the
feature f_t (the target's final normed state) and the next token x_{t+1}:

    h     = block(eh_proj(cat(enorm(embed(x_{t+1})), hnorm(f_t))))     block: a decoder layer of the target's kind
    f'    = norm(h)                                                   the MTP layer's own final norm (shared_head.norm)
    logits = lm_head(f')                                              the target's LM head (shared_head.head holds a copy)

f' is the predicted next feature, which the next draft step takes as its f (what vLLM recycles).
As vLLM does, the embedding at position 0 is zeroed. So it is EAGLE-1 (heads/eagle.py) with three
norms, the target's own layer kind and these names; it drafts and trains as EAGLE-1 does.

transformers builds DeepSeek-V3 without its MTP layer and skips those tensors when loading: the
checkpoint's `model.layers.{L}.*` tensors are read from its safetensors here (`read_mtp_layer`),
and written back in that layout (`checkpoint_tensors`; heads/formats/mtp.py).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .config import MTPConfig
from .eagle import Eagle1Head, decoder_layers
from .identity import text_config

# the MTP layer's own tensors (checkpoint names after `model.layers.{L}.`) -> our module names;
# everything else under that prefix is its decoder block (ours under `layers.0.`)
OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "fc.weight",
       "shared_head.norm.weight": "final_norm.weight"}
# checkpoint copies of target tensors: read only to check they are the target's, written back from it
SHARED = {"embed_tokens.weight", "shared_head.head.weight"}


class MTPHead(Eagle1Head):
    def __init__(self, config: MTPConfig, target_model: nn.Module) -> None:
        super().__init__(config, target_model)
        # the block: a decoder layer of the target's last layer's kind (DeepSeek-V3: MLA with a
        # routed MoE, which layer_idx 0 of a one-layer config would not give), cached as layer 0
        block = copy.deepcopy(decoder_layers(target_model)[-1])
        for module in block.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = 0
        self.layers = nn.ModuleList([block])
        H, eps = config.hidden_size, getattr(text_config(target_model), "rms_norm_eps", 1e-6)
        self.enorm, self.hnorm, self.final_norm = (self._parts.norm(H, eps=eps) for _ in range(3))

    def init_from_target(self, model: nn.Module, **kwargs) -> None:
        """The target checkpoint's own MTP layer, where its folder holds one; else the block
        starts as a copy of the target's last decoder layer (norms at one, eh_proj random)."""
        folder = getattr(model.config, "_name_or_path", "")
        tensors = read_mtp_layer(folder, self.config.checkpoint_layer) if folder and Path(folder).is_dir() else {}
        if tensors:
            self.load_state_dict(head_state_from_checkpoint(tensors, model), strict=True)
    def _hidden(self, fused, tokens, position_ids, cache, attention_mask) -> torch.Tensor:
        e = self.refs.embed_tokens(tokens, self.dtype)
        if position_ids is not None:  # vLLM and SGLang zero the embedding at position 0
            e = e.masked_fill((position_ids == 0)[..., None], 0.0)
        x = self.fc(torch.cat([self.enorm(e), self.hnorm(fused.to(self.dtype))], dim=-1))
        position_ids, mask, pos_emb = self._inputs(x, tokens, position_ids, cache, attention_mask)
        out = self.layers[0](x, attention_mask=mask, position_ids=position_ids, position_embeddings=pos_emb,
                             use_cache=cache is not None, **{self._cache_kw: cache})
        return self.final_norm(out[0] if isinstance(out, tuple) else out)


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


def read_mtp_layer(folder, layer: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of MTP layer `layer`, by their names after `model.layers.{layer}.`;
    {} when the checkpoint has none."""
    prefix = f"model.layers.{layer}."
    where = {k: p for k, p in _weights(Path(folder)).items() if k.startswith(prefix)}
    out = {}
    for path in sorted(set(where.values())):
        with safe_open(str(path), "pt") as f:
            for k in (k for k, p in where.items() if p == path):
                out[k[len(prefix):]] = f.get_tensor(k)
    return out


def _fuse_experts(block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (mlp.experts.{e}.{gate,up,down}_proj.weight) -> transformers'
    fused ones: gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]."""
    experts = sorted({int(k.split(".")[2]) for k in block if k.startswith("mlp.experts.") and k.split(".")[2].isdigit()})
    if not experts:
        return block
    out = {k: v for k, v in block.items() if not (k.startswith("mlp.experts.") and k.split(".")[2].isdigit())}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([block[f"mlp.experts.{e}.gate_proj.weight"],
                                                              block[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
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


def head_state_from_checkpoint(tensors: dict[str, torch.Tensor], target_model: nn.Module) -> dict[str, torch.Tensor]:
    """An MTP layer's checkpoint tensors -> our head's state dict. Its copies of the target's
    embedding and LM head must equal the target's (the head uses the target's own)."""
    for name, theirs in (("embed_tokens.weight", target_model.get_input_embeddings().weight),
                         ("shared_head.head.weight", target_model.get_output_embeddings().weight)):
        if name in tensors and not torch.equal(tensors[name].to(theirs.dtype), theirs.detach().cpu()):
            raise ValueError(f"the MTP layer's {name} is not the target's: this checkpoint's MTP layer was trained "
                             "for another target")
    state = {OWN[k]: v for k, v in tensors.items() if k in OWN}
    block = _fuse_experts({k: v for k, v in tensors.items() if k not in OWN and k not in SHARED})
    state.update({f"layers.0.{k}": v for k, v in block.items()})
    return state


def checkpoint_tensors(state: dict[str, torch.Tensor], layer: int, target_model: nn.Module) -> dict[str, torch.Tensor]:
    """An MTP head's state dict as the checkpoint holds its MTP layer `layer`: `model.layers.{layer}.*`,
    experts per expert, with the target's embedding and LM head copied in (vLLM's and SGLang's MTP
    loaders read them there)."""
    prefix = f"model.layers.{layer}."
    out = {prefix + theirs: state[ours] for theirs, ours in OWN.items()}
    block = _split_experts({k[len("layers.0."):]: v for k, v in state.items() if k.startswith("layers.0.")})
    out.update({prefix + k: v for k, v in block.items()})
    out[prefix + "embed_tokens.weight"] = target_model.get_input_embeddings().weight.detach().cpu()
    out[prefix + "shared_head.head.weight"] = target_model.get_output_embeddings().weight.detach().cpu()
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}
