"""Writes tests/fixtures/interop/eagle1/: an EAGLE-1 draft built and saved by upstream EAGLE's own
code (eagle-llm 1.2.1), plus its own forward on tests/fixtures/interop/inputs.safetensors.

Run with the eagle venv (scripts/interop/setup_eagle.sh):
    .venv-interop/eagle/bin/python scripts/interop/fixtures_eagle.py

What upstream code is used:
  * config: `eagle.model.configs.EConfig` built from the fixture target's config.json with
    num_hidden_layers 1 (what EAGLE's training config files are), written with its save_pretrained.
  * draft: `eagle.model.cnets.Model(config, bias=True)` (bias at its default; no "bias" key is
    written, so EaModel's loader takes its default True).
  * weights: `accelerate.Accelerator().save_state` (accelerate 0.21.0, eagle-llm's pin), as
    eagle/train/main.py saves a checkpoint; it writes pytorch_model.bin (kept) and
    random_states_0.pkl (dropped: not part of a released checkpoint).
  * reference: `Model.forward(hidden_states=feature, input_ids=input_ids)` in float32, eval mode,
    default position ids (0..7) and default mask (causal), as topK_genrate's first call does
    after its `input_ids = input_ids[:, 1:]` shift.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "interop"
OUT = FIX / "eagle1"
SEED = 1234

# keys of a transformers-5 config.json that a 4.x-era EAGLE config file does not carry
_DROP = ("rope_parameters", "dtype", "transformers_version", "architectures", "_name_or_path")


def build_config():
    from eagle.model.configs import EConfig

    cfg = json.loads((FIX / "target" / "config.json").read_text())
    for k in _DROP:
        cfg.pop(k, None)
    cfg["num_hidden_layers"] = 1
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "float32"
    return EConfig(**cfg)


def main() -> int:
    from accelerate import Accelerator
    from eagle.model.cnets import Model

    torch.manual_seed(SEED)
    config = build_config()
    model = Model(config, bias=True)
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        # embed_tokens: the target's (upstream copies it with load_emb=True; that path only reads
        # sharded bases, so copy by hand from the single-file fixture target)
        tw = load_file(str(FIX / "target" / "model.safetensors"))
        model.embed_tokens.weight.copy_(tw["model.embed_tokens.weight"])
        layer = model.layers[0]
        layer.post_attention_layernorm.weight.copy_(1 + 0.1 * torch.randn(config.hidden_size, generator=g))
        model.fc.bias.copy_(0.1 * torch.randn(config.hidden_size, generator=g))
        # scale up the default (kaiming-uniform) projections a little so attention is not ~uniform
        for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight):
            p.mul_(8.0)
    model.eval()

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        acc = Accelerator(cpu=True)
        prepared = acc.prepare(model)
        acc.save_state(output_dir=tmp)
        written = sorted(os.listdir(tmp))
        shutil.copy(Path(tmp) / "pytorch_model.bin", OUT / "pytorch_model.bin")
    config.save_pretrained(str(OUT))  # config.json

    inp = load_file(str(FIX / "inputs.safetensors"))
    with torch.no_grad():
        hidden = prepared(hidden_states=inp["feature"].float(), input_ids=inp["input_ids"])
        # the same forward with the target's own RoPE base, to show the fixture tells them apart
        rot = prepared.layers[0].self_attn.rotary_emb
        base_used = float(rot.base)
        from eagle.model.cnets import LlamaRotaryEmbedding

        prepared.layers[0].self_attn.rotary_emb = LlamaRotaryEmbedding(rot.dim, max_position_embeddings=config.max_position_embeddings, base=100000.0)
        hidden_1e5 = prepared(hidden_states=inp["feature"].float(), input_ids=inp["input_ids"])
        prepared.layers[0].self_attn.rotary_emb = rot
    save_file({"hidden": hidden.contiguous()}, str(OUT / "reference.safetensors"))

    sd = torch.load(OUT / "pytorch_model.bin", map_location="cpu")
    meta = {
        "package": "eagle-llm",
        "version": md.version("eagle-llm"),
        "writer": "eagle.model.cnets.Model(EConfig, bias=True) saved by accelerate.Accelerator.save_state "
        "(accelerate 0.21.0, as eagle/train/main.py) -> pytorch_model.bin; config.json by "
        "EConfig.save_pretrained",
        "aux_id_convention": None,
        "notes": (
            "EAGLE-1 draft for the fixture target (hidden 64, 4 heads, 2 kv heads). Keys: "
            + ", ".join(sorted(sd))
            + ". fc.weight [64,128] takes cat(embed(x_{t+1}), f_t) (embed first); fc.bias present (bias default "
            "True; config.json has no 'bias' key); layer 0 has no input_layernorm; embed_tokens.weight is a copy "
            "of the target's. config.json keeps the target's rope_theta 1e5 (as copied base configs do) but "
            f"upstream's rotary ignores it: reference computed with base {base_used:g} (cnets.LlamaAttention."
            "_init_rope passes no base). Forward: Model.forward(hidden_states=feature, input_ids=input_ids) with "
            "default position ids 0..7 and causal mask; column t = (feature f_t, token x_{t+1}) at position t. "
            f"max|hidden(base 1e5) - hidden(base 1e4)| = {float((hidden_1e5 - hidden).abs().max()):.4g}. "
            f"torch {torch.__version__}, transformers {md.version('transformers')}. Seed {SEED}."
        ),
    }
    (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(
        json.dumps(
            {
                "out": str(OUT),
                "accelerate_wrote": written,
                "keys": len(sd),
                "rope_base": base_used,
                "hidden_abs_mean": float(hidden.abs().mean()),
                "max_diff_vs_base_1e5": float((hidden_1e5 - hidden).abs().max()),
                "bytes": sum(f.stat().st_size for f in OUT.iterdir()),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
