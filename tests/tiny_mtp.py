"""A tiny DeepSeek-V3 target folder whose checkpoint carries an MTP layer, as DeepSeek-V3's does
(`num_nextn_predict_layers: 1`, the layer at index L after the decoder layers, experts stored one
by one), written with transformers' own code, not with ours: a DeepSeek-V3 of L + 1 layers is
saved and its layer L becomes the MTP block (tests/test_mtp.py, scripts/studies/mtp_finetune.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_tiny_mtp_target(work: Path, layers: int = 4, seed: int = 5, **sizes):
    """(target folder, the L + 1 layer model whose layer L is the MTP block, the MTP layer's
    checkpoint tensors) under `work`."""
    from drafthead.inference.engine.targets import load_target
    from tests.conftest import build_tiny_tokenizer, save_tiny_target
    from tests.tiny import tiny_causal_lm

    folder = save_tiny_target(work / "target", "deepseek_v3", layers=layers, **sizes)
    tokenizer = build_tiny_tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    longer = tiny_causal_lm("deepseek_v3", vocab=len(tokenizer), seed=seed, layers=layers + 1, **ids, **sizes)
    longer.save_pretrained(work / "longer")
    prefix = f"model.layers.{layers}."
    block = {k: v for k, v in load_file(str(work / "longer" / "model.safetensors")).items() if k.startswith(prefix)}
    target = load_target(folder).model
    g = torch.Generator().manual_seed(3)
    H = target.config.hidden_size
    own = {prefix + "enorm.weight": 1 + 0.3 * torch.randn(H, generator=g),
           prefix + "hnorm.weight": 1 + 0.3 * torch.randn(H, generator=g),
           prefix + "eh_proj.weight": 0.2 * torch.randn(H, 2 * H, generator=g),
           prefix + "shared_head.norm.weight": 1 + 0.3 * torch.randn(H, generator=g),
           prefix + "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
           prefix + "shared_head.head.weight": target.get_output_embeddings().weight.detach().clone()}
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, **block, **own}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return folder, longer, {**block, **own}
