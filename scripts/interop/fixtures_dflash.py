"""Build a tiny DFlash fixture with z-lab's own `dflash` package (run with the dflash venv).

    .venv-interop/dflash/bin/python scripts/interop/fixtures_dflash.py

Writes tests/fixtures/interop/dflash/:
  config.json + model.safetensors   dflash's DFlashDraftModel.save_pretrained output, a seeded
                                    random draft for the fixture target (target_layer_ids [0, 1, 2],
                                    one layer, block_size 4, mask_token_id 200)
  reference.safetensors             context [1, 8]: input_ids of inputs.safetensors, the committed text
                                    block [1, 4]: [token, mask x 3] at positions 8..11
                                    logits [1, 3, 256]: the target LM head on the draft's outputs at
                                      block positions 1..3 (what dflash_generate drafts from)
                                    prompt [1, 8], output_ids [1, 8 + 20], acceptance_lengths [n]:
                                      dflash_generate's greedy run on the target
  meta.json                         versions and how the reference was made

The forward is called as dflash_generate calls it (target_hidden = the target's layer outputs
[k + 1] for each target_layer_id, concatenated; noise_embedding = the target's embedding of the
block; position ids spanning context then block).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config

import dflash.model as dm
from dflash.model import DFlashDraftModel, dflash_generate, extract_context_feature

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "interop"
TARGET = FIX / "target"
OUT = FIX / "dflash"
SEED = 4321
BLOCK, MASK, LAYER_IDS = 4, 200, [0, 1, 2]


@torch.no_grad()
def randomize(model: DFlashDraftModel, gen: torch.Generator) -> None:
    for _, p in model.named_parameters():
        if p.ndim == 1:  # RMSNorm weights
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


@torch.no_grad()
def main() -> None:
    gen = torch.Generator().manual_seed(SEED)
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32, attn_implementation="sdpa").eval()
    tc = target.config
    config = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=False,
        layer_types=["full_attention"],
    )
    config.architectures = ["DFlashDraftModel"]
    config.block_size = BLOCK
    config.num_target_layers = tc.num_hidden_layers
    config.dflash_config = {"target_layer_ids": LAYER_IDS, "mask_token_id": MASK}
    model = DFlashDraftModel(config).eval()
    randomize(model, gen)
    if OUT.exists():
        shutil.rmtree(OUT)
    model.save_pretrained(str(OUT))
    model = DFlashDraftModel.from_pretrained(str(OUT), dtype=torch.float32).eval()  # what a user loads

    context = load_file(str(FIX / "inputs.safetensors"))["input_ids"]  # [1, 8]
    n = context.shape[1]
    hs = target(context, output_hidden_states=True).hidden_states
    target_hidden = extract_context_feature(hs, LAYER_IDS)  # [1, 8, 3H]
    block = torch.tensor([[17] + [MASK] * (BLOCK - 1)])
    noise = target.get_input_embeddings()(block)
    hidden = model(target_hidden=target_hidden, noise_embedding=noise, position_ids=torch.arange(n + BLOCK)[None], use_cache=False)
    logits = target.lm_head(hidden[:, 1:])  # [1, 3, V]

    dm._cuda_time = __import__("time").perf_counter  # its timing sync is CUDA-only (stats only)
    prompt = context.clone()
    stats = dflash_generate(model, target, prompt, 20, None, temperature=0.0, return_stats=True)
    save_file(
        {
            "context": context,
            "block": block,
            "logits": logits.contiguous(),
            "prompt": prompt,
            "output_ids": stats.output_ids.contiguous(),
            "acceptance_lengths": torch.tensor(stats.acceptance_lengths),
        },
        str(OUT / "reference.safetensors"),
    )
    (OUT / "meta.json").write_text(
        json.dumps(
            {
                "package": "dflash",
                "version": md.version("dflash"),
                "writer": "dflash.model.DFlashDraftModel.save_pretrained",
                "versions": {p: md.version(p) for p in ("torch", "transformers")},
                "target": "../target",
                "seed": SEED,
                "reference": "DFlashDraftModel.forward as dflash_generate calls it; dflash_generate greedy, 20 tokens",
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {OUT}: acceptance_lengths {stats.acceptance_lengths}")


if __name__ == "__main__":
    main()
