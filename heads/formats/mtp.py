"""The `mtp` export: an MTP head (heads/mtp.py) written back as the target checkpoint's own MTP
layer, which vLLM (`deepseek_mtp`) and SGLang (DeepSeek NextN) load as the target's drafter.

The folder holds `model.safetensors` with the layer's tensors in the checkpoint's names, and the
target folder's own `config.json` as it is on disk (the engines read keys transformers drops when it
loads it: DeepSeek's `scoring_func`, `topk_method` and YaRN `rope_scaling`, Qwen3-Next's
`full_attention_interval`), with `num_nextn_predict_layers: 1`. Serve it as the speculative model beside
the target, or copy its tensors into the target's checkpoint in place of the old MTP layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

from torch import nn

from ..mtp import checkpoint_tensors
from .common import Export

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def to_engine(config, state: dict, target_model: nn.Module | None) -> tuple[dict, dict]:
    """(config.json, tensors) of the layout."""
    if target_model is None:
        raise ValueError("--format mtp writes the target's config and its embedding and LM head copies: it needs the target (--target)")
    on_disk = Path(str(getattr(target_model.config, "_name_or_path", "") or "")) / "config.json"
    cfg = json.loads(on_disk.read_text()) if on_disk.is_file() else cast("PretrainedConfig", target_model.config).to_dict()
    cfg["num_nextn_predict_layers"] = 1  # the one layer written here
    if any(k.endswith("mlp.gate.e_score_correction_bias") for k in state):
        # DeepSeek's routing without auxiliary loss, which that bias belongs to: vLLM builds the
        # bias only for this `topk_method` (DeepSeek-V3's own configs say it; transformers' drop it)
        cfg.setdefault("topk_method", "noaux_tc")
    return cfg, checkpoint_tensors(state, config.checkpoint_layer, target_model)


EXPORTS = (Export("mtp", ("mtp",), "vLLM's and SGLang's MTP", lambda job: to_engine(job.config, job.state, job.target_model), served_layer=False),)
