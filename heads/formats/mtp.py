"""The `mtp` export: an MTP head (heads/mtp.py) written back as the target checkpoint's own MTP
layer, which vLLM (`deepseek_mtp`) and SGLang (DeepSeek NextN) load as the target's drafter.

The folder holds `model.safetensors` with the layer's tensors under `model.layers.{L}.`, and the
target's `config.json` with `num_nextn_predict_layers: 1`. Serve it as the speculative model beside
the target, or copy its tensors into the target's checkpoint in place of the old MTP layer.
"""
from __future__ import annotations

from torch import nn

from ..mtp import checkpoint_tensors


def to_engine(config, state: dict, target_model: nn.Module | None) -> tuple[dict, dict]:
    """(config.json, tensors) of the layout."""
    if target_model is None:
        raise ValueError("--format mtp writes the target's config and its embedding and LM head copies: "
                         "it needs the target (--target)")
    cfg = target_model.config.to_dict()
    cfg["num_nextn_predict_layers"] = 1
    if any(k.endswith("mlp.gate.e_score_correction_bias") for k in state):
        # DeepSeek's routing without auxiliary loss, which that bias belongs to: vLLM builds the
        # bias only for this `topk_method` (DeepSeek-V3's own configs say it; transformers' drop it)
        cfg.setdefault("topk_method", "noaux_tc")
    return cfg, checkpoint_tensors(state, config.checkpoint_layer, target_model)
