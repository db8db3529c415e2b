"""Export-direction harness for upstream Medusa (medusa-llm 0.1).

Loads a head folder in upstream Medusa's layout (config.json + medusa_lm_head.pt) with medusa-llm's
own loading code and runs its heads on an inputs.safetensors file.

    .venv-interop/medusa/bin/python scripts/interop/check_medusa.py --head DIR --target DIR \
        --inputs tests/fixtures/interop/inputs.safetensors --out PREFIX [--full] [--reference FILE]

Both modes follow `medusa.model.medusa_model.MedusaModel.from_pretrained`: `MedusaConfig.from_pretrained
(head)`, `MedusaModel(base, medusa_num_heads, medusa_num_layers, base_model_name_or_path)`,
`torch.load(head/medusa_lm_head.pt)`, `medusa_head.load_state_dict(state, strict=False)`.
The base model is always --target (config.json's base_model_name_or_path is reported, not used):
  default: a stand-in base holding only the target's lm_head (MedusaModel.__init__ reads nothing else
           of it but config/dtype/device); --full: the package's own KV Llama loaded from --target.
MedusaModel.__init__'s AutoTokenizer call falls back to None when the target tokenizer cannot be loaded.
strict=False hides missing/unexpected keys, so the harness reports them, and also checks that every
tensor of the file is what the loaded module holds (upstream ties a head's ResBlocks: with
medusa_num_layers > 1 distinct block tensors cannot all survive loading).
Writes PREFIX.safetensors {logits [K, 1, T, V] = medusa_head[k](inputs["hidden"])} and PREFIX.json;
prints the JSON on one line.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from harness_common import harness_args, stub_tokenizer  # beside this file (scripts/interop/)


def target_lm_head(target: Path) -> torch.Tensor:
    cfg = json.loads((target / "config.json").read_text())
    names = ("lm_head.weight",) if not cfg.get("tie_word_embeddings", False) else ()
    names += ("model.embed_tokens.weight",)
    for name in names:
        for f in sorted(target.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                if name in fh.keys():
                    return fh.get_tensor(name)
    raise FileNotFoundError(f"no lm_head / embed_tokens in {target}")


class StandInBase(nn.Module):
    """What MedusaModel.__init__ reads of its base model: config, lm_head.weight, dtype, device."""

    def __init__(self, target: Path, dtype: torch.dtype):
        super().__init__()
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(str(target))
        w = target_lm_head(target).to(dtype)
        self.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(w)

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    @property
    def device(self):
        return self.lm_head.weight.device


def main() -> int:
    args = harness_args("base = the package's KV Llama loaded from --target", "logits")
    dtype = getattr(torch, args.dtype)
    res: dict = {
        "consumer": "medusa-llm",
        "version": md.version("medusa-llm"),
        "torch": torch.__version__,
        "transformers": md.version("transformers"),
        "head": str(args.head),
        "base": "KVLlamaForCausalLM.from_pretrained(target)" if args.full else "stand-in (target lm_head only)",
        "ok": False,
    }
    try:
        import medusa.model.medusa_model as mm

        files = sorted(os.listdir(args.head))
        res["files"] = files
        if "medusa_lm_head.pt" not in files:
            raise FileNotFoundError("medusa-llm 0.1 loads only medusa_lm_head.pt (MedusaModel.from_pretrained); folder has " + ", ".join(files))
        notes = []
        stub_tokenizer(mm, notes)
        mcfg = mm.MedusaConfig.from_pretrained(str(args.head))
        raw = json.loads((args.head / "config.json").read_text())
        res["config"] = {k: raw.get(k) for k in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path")}
        res["config_defaults_used"] = [k for k in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path") if k not in raw]
        if args.full:
            base = mm.KVLlamaForCausalLM.from_pretrained(str(args.target), torch_dtype=dtype)
        else:
            base = StandInBase(args.target, dtype)
        model = mm.MedusaModel(base, mcfg.medusa_num_heads, mcfg.medusa_num_layers, str(args.target))
        state = torch.load(str(args.head / "medusa_lm_head.pt"), map_location=base.device)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise TypeError("medusa_lm_head.pt is not a flat tensor state dict")
        inc = model.medusa_head.load_state_dict(state, strict=False)
        loaded = model.medusa_head.state_dict()
        mismatched = [k for k, v in state.items() if k in loaded and (loaded[k].shape != v.shape or not torch.equal(loaded[k].to(v.dtype), v))]
        res.update(
            {
                "keys": {k: list(v.shape) for k, v in state.items()},
                "dtypes": sorted({str(v.dtype) for v in state.values()}),
                "missing_keys": list(inc.missing_keys),
                "unexpected_keys": list(inc.unexpected_keys),
                "tensors_not_as_loaded": mismatched,
                "resblocks_shared": bool(mcfg.medusa_num_layers > 1 and model.medusa_head[0][0] is model.medusa_head[0][1]),
                "notes": notes,
            }
        )
        model.medusa_head.eval()
        inp = load_file(str(args.inputs))
        with torch.no_grad():
            h = inp["hidden"].to(dtype)
            logits = torch.stack([model.medusa_head[i](h) for i in range(model.medusa)], dim=0).float()
        save_file({"logits": logits.contiguous()}, args.out + ".safetensors")
        res["outputs"] = {"logits": list(logits.shape)}
        res["logits_abs_mean"] = float(logits.abs().mean())
        if args.reference is not None:
            ref = load_file(str(args.reference))["logits"].float()
            res["max_abs_diff_vs_reference"] = float((logits - ref).abs().max())
        res["loaded_exactly"] = not (inc.missing_keys or inc.unexpected_keys or mismatched)
        res["ok"] = res["loaded_exactly"]
        if not res["ok"]:
            res["error"] = "checkpoint did not load exactly (strict=False would hide this upstream)"
    except Exception as e:  # report, don't crash: the driver reads the JSON
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc(limit=3)
    Path(args.out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
