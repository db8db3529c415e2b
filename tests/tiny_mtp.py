"""Tiny targets whose checkpoints carry an MTP layer, as the released ones do, written with
transformers' own code, not with ours (tests/test_mtp.py, scripts/studies/mtp_finetune.py):

- DeepSeek-V3 and GLM-4.5: `num_nextn_predict_layers: 1`, the layer at index L after the decoder
  layers, its experts stored one by one; a target of L + 1 layers is saved and its layer L becomes
  the MTP block.
- Qwen3-Next: the layer under `mtp.`, its block a full-attention MoE layer at `mtp.layers.0.`; a
  one-layer Qwen3-Next of that layer type is saved and its layer 0 becomes the block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@dataclass
class MTPCheckpoint:
    folder: Path  # the target, its checkpoint carrying the MTP layer
    block: torch.nn.Module  # the MTP block as transformers built it (its weights are the checkpoint's)
    rotary: torch.nn.Module  # the rotary embedding of the model the block came from
    tensors: dict  # the MTP layer's checkpoint tensors
    names: dict  # enorm, hnorm, proj, norm, head (None where the layer keeps no copy): checkpoint names
    norm: Callable  # (x, weight, eps) -> the family's RMS norm
    zero_first: bool  # the embedding at position 0 is zeroed
    recycle_normed: bool  # the next draft step's feature is the normed output (vLLM's GLM MTP takes it before the norm)


def save_tiny_mtp_target(work: Path, family: str = "deepseek_v3", layers: int = 4, seed: int = 5) -> MTPCheckpoint:
    from drafthead.ground.target.load import load_target
    from tests.conftest import build_tiny_tokenizer, save_tiny_target
    from tests.tiny import tiny_causal_lm

    folder = save_tiny_target(work / "target", family, layers=layers)
    tokenizer = build_tiny_tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if family in ("deepseek_v3", "glm4_moe"):
        source = tiny_causal_lm(family, vocab=len(tokenizer), seed=seed, layers=layers + 1, **ids)
        index, prefix, block_prefix = layers, f"model.layers.{layers}.", f"model.layers.{layers}."
        names = {
            "enorm": "enorm.weight",
            "hnorm": "hnorm.weight",
            "proj": "eh_proj.weight",
            "norm": "shared_head.norm.weight",
            "head": "shared_head.head.weight",
            "embed": "embed_tokens.weight",
        }
        norm, zero_first = _rms, True
    else:
        source = tiny_causal_lm(family, vocab=len(tokenizer), seed=seed, layers=1, layer_types=["full_attention"], **ids)
        index, prefix, block_prefix = 0, "mtp.", "mtp.layers.0."
        names = {
            "enorm": "pre_fc_norm_embedding.weight",
            "hnorm": "pre_fc_norm_hidden.weight",
            "proj": "fc.weight",
            "norm": "norm.weight",
            "head": None,
            "embed": None,
        }
        norm, zero_first = (lambda x, w, eps: _rms(x, 1 + w, eps)), False
    source.save_pretrained(work / "source")
    taken = f"model.layers.{index}."
    block = {block_prefix + k[len(taken) :]: v for k, v in load_file(str(work / "source" / "model.safetensors")).items() if k.startswith(taken)}
    target = load_target(folder).model
    g = torch.Generator().manual_seed(3)
    H = target.config.hidden_size
    own = {
        prefix + names["enorm"]: 1 + 0.3 * torch.randn(H, generator=g),
        prefix + names["hnorm"]: 1 + 0.3 * torch.randn(H, generator=g),
        prefix + names["proj"]: 0.2 * torch.randn(H, 2 * H, generator=g),
        prefix + names["norm"]: 1 + 0.3 * torch.randn(H, generator=g),
    }
    if names["embed"]:
        own[prefix + names["embed"]] = target.get_input_embeddings().weight.detach().clone()
        own[prefix + names["head"]] = target.get_output_embeddings().weight.detach().clone()
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, **block, **own}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return MTPCheckpoint(
        folder,
        source.model.layers[index],
        source.model.rotary_emb,
        {**block, **own},
        {k: (prefix + v if v else None) for k, v in names.items()},
        norm,
        zero_first,
        recycle_normed=family != "glm4_moe",
    )
