"""Write the tiny Llama target and the random head inputs that every interop fixture is built on.

    .venv/bin/python scripts/interop/make_fixture_target.py   # -> tests/fixtures/interop/{target/,inputs.safetensors}

The target's rope_theta is 1e5 (not Llama's 1e4) on purpose: a producer that ignores the target's
RoPE base (upstream EAGLE-1) then writes a head that must be imported with its own base.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "interop"


def main() -> None:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms, so a missing or misplaced norm shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(ROOT / "target", safe_serialization=True)
    # transformers 5 writes only `rope_parameters`; consumers pinned to transformers 4 read `rope_theta`
    cfg_path = ROOT / "target" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = config.rope_parameters["rope_theta"]
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    g = torch.Generator().manual_seed(1)
    T, H = 8, config.hidden_size
    save_file(
        {
            "input_ids": torch.randint(3, config.vocab_size, (1, T), generator=g),
            "features3": torch.randn(1, T, 3 * H, generator=g),
            "feature": torch.randn(1, T, H, generator=g),
            "hidden": torch.randn(1, T, H, generator=g),
        },
        str(ROOT / "inputs.safetensors"),
    )


if __name__ == "__main__":
    main()
