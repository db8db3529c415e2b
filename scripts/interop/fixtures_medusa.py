"""Writes tests/fixtures/interop/medusa/: Medusa heads built and saved by upstream Medusa's own code
(medusa-llm 0.1), plus their own forward on tests/fixtures/interop/inputs.safetensors.

Run with the medusa venv (scripts/interop/setup_medusa.sh):
    .venv-interop/medusa/bin/python scripts/interop/fixtures_medusa.py

What upstream code is used:
  * heads: `medusa.model.medusa_model.MedusaModel(base_model, medusa_num_heads=3, medusa_num_layers=1,
    base_model_name_or_path=...)` on the fixture target loaded with the package's own
    `medusa.model.modeling_llama_kv.LlamaForCausalLM` (its base class). MedusaModel.__init__ also calls
    AutoTokenizer.from_pretrained(base path); the fixture target has no tokenizer, so that one call is
    stubbed (the tokenizer plays no part in the heads).
  * weights: MedusaModel's init (ResBlock weight zero, lm_head copies of the target's) replaced by seeded
    random values (non-zero ResBlock weights/biases, a distinct LM head per head), then saved as
    medusa/train/train.py does: `torch.save(medusa_head.state_dict(), "medusa_lm_head.pt")` and
    `MedusaConfig(...).save_pretrained(dir)` (config.json).
  * reference: `torch.stack([medusa_head[i](hidden) for i ...])`, the loop in MedusaModel.forward, float32.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "interop"
OUT = FIX / "medusa"
SEED = 4321
K, L = 3, 1
# base_model_name_or_path written into config.json: repo-root-relative path of the fixture target
BASE_NAME = "tests/fixtures/interop/target"


def main() -> int:
    import medusa.model.medusa_model as mm

    mm.AutoTokenizer.from_pretrained = staticmethod(lambda *a, **k: None)  # no tokenizer in the fixture target
    base = mm.KVLlamaForCausalLM.from_pretrained(str(FIX / "target"), torch_dtype=torch.float32)
    torch.manual_seed(SEED)
    model = mm.MedusaModel(base, medusa_num_heads=K, medusa_num_layers=L, base_model_name_or_path=BASE_NAME)
    g = torch.Generator().manual_seed(SEED + 1)
    H, V = model.hidden_size, model.vocab_size
    with torch.no_grad():
        for h in range(K):
            seq = model.medusa_head[h]
            for j in range(L):
                seq[j].linear.weight.copy_(torch.randn(H, H, generator=g) / H**0.5)
                seq[j].linear.bias.copy_(0.1 * torch.randn(H, generator=g))
            seq[L].weight.copy_(torch.randn(V, H, generator=g) / H**0.5)
    model.eval()

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    medusa_config = mm.MedusaConfig(medusa_num_heads=K, medusa_num_layers=L, base_model_name_or_path=BASE_NAME)
    medusa_config.save_pretrained(str(OUT))
    torch.save(model.medusa_head.state_dict(), OUT / "medusa_lm_head.pt")

    inp = load_file(str(FIX / "inputs.safetensors"))
    with torch.no_grad():
        hidden = inp["hidden"].float()
        logits = torch.stack([model.medusa_head[i](hidden) for i in range(model.medusa)], dim=0)
    save_file({"logits": logits.contiguous()}, str(OUT / "reference.safetensors"))

    sd = torch.load(OUT / "medusa_lm_head.pt", map_location="cpu")
    meta = {
        "package": "medusa-llm",
        "version": md.version("medusa-llm"),
        "writer": "medusa.model.medusa_model.MedusaModel(...).medusa_head.state_dict() via torch.save -> "
        "medusa_lm_head.pt; MedusaConfig.save_pretrained -> config.json (as medusa/train/train.py)",
        "aux_id_convention": None,
        "notes": (
            f"K={K} heads, medusa_num_layers={L}, hidden {H}, vocab {V}, float32. Keys: "
            + ", ".join(sorted(sd))
            + ". Head h = Sequential(ResBlock x L, Linear(H, V, bias=False)); ResBlock(x) = x + SiLU(linear(x)) with "
            "linear bias. Random seeded weights replace MedusaModel's init (zero ResBlock weight, target lm_head "
            "copies). reference logits [K,1,8,V] = medusa_head[k](inputs['hidden']). config.json "
            f"base_model_name_or_path is repo-root relative ({BASE_NAME}). torch {torch.__version__}, transformers "
            f"{md.version('transformers')}. Seed {SEED}."
        ),
    }
    (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(
        json.dumps(
            {
                "out": str(OUT),
                "keys": {k: list(v.shape) for k, v in sd.items()},
                "logits_shape": list(logits.shape),
                "logits_abs_mean": float(logits.abs().mean()),
                "bytes": sum(f.stat().st_size for f in OUT.iterdir()),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
