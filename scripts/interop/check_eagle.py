"""Export-direction harness for upstream EAGLE-1 (eagle-llm 1.2.1).

Loads a head folder in upstream EAGLE's layout (config.json + pytorch_model.bin) with eagle-llm's
own loading code and runs its draft forward on an inputs.safetensors file.

    .venv-interop/eagle/bin/python scripts/interop/check_eagle.py --head DIR --target DIR \
        --inputs tests/fixtures/interop/inputs.safetensors --out PREFIX [--full] [--reference FILE]

Default (draft only): the draft half of `eagle.model.ea_model.EaModel` step by step -
`EConfig.from_pretrained(config.json)`, `bias = json["bias"]` (default True), `Model(config, bias=bias)`,
`torch.load(pytorch_model.bin)`, `load_state_dict(strict=True)`, cast to the target's dtype.
--full: the real `EaModel.from_pretrained(base_model_path=target, ea_model_path=head)` (the package's
own KV Llama as the base; its AutoTokenizer call falls back to None when the tokenizer cannot be loaded),
then its `ea_layer`.

Forward: `ea_layer(hidden_states=inputs["feature"], input_ids=inputs["input_ids"])` with the default
position ids 0..T-1 and causal mask (column t = feature f_t beside token x_{t+1}, as after
topK_genrate's `input_ids[:, 1:]`). Writes PREFIX.safetensors {hidden [1,T,H], logits [1,T,V] =
the target's lm_head on hidden, as EaModel drafts} and PREFIX.json; prints the JSON on one line.
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

from harness_common import harness_args, stub_tokenizer  # beside this file (scripts/interop/)


def target_tensor(target: Path, names: tuple[str, ...]) -> torch.Tensor | None:
    files = sorted(target.glob("*.safetensors"))
    for name in names:
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                if name in fh.keys():
                    return fh.get_tensor(name)
    return None


def load_draft(head: Path, dtype: torch.dtype):
    """The draft half of EaModel.__init__ + EaModel.from_pretrained, without a base model."""
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    configpath = head / "config.json"
    config = EConfig.from_pretrained(str(configpath))
    con = json.loads(configpath.read_text())
    bias = con["bias"] if "bias" in con else True  # ea_model.py: try con["bias"] except -> True
    ea_layer = Model(config, bias=bias)
    state = torch.load(str(head / "pytorch_model.bin"), map_location="cpu")
    ea_layer.load_state_dict(state, strict=True)
    ea_layer.to(dtype)
    return ea_layer, config, bias, state


def load_full(head: Path, target: Path, dtype: torch.dtype):
    import eagle.model.ea_model as em

    notes = []
    stub_tokenizer(em, notes)
    model = em.EaModel.from_pretrained(base_model_path=str(target), ea_model_path=str(head), torch_dtype=dtype)
    con = json.loads((head / "config.json").read_text())
    bias = con["bias"] if "bias" in con else True
    state = torch.load(str(head / "pytorch_model.bin"), map_location="cpu")
    lm = model.base_model.lm_head.weight.detach().float().cpu()
    return model.ea_layer, model.ea_layer.layers[0].self_attn.config, bias, state, lm, notes


def main() -> int:
    args = harness_args("load through EaModel.from_pretrained (with the base)", "hidden")
    dtype = getattr(torch, args.dtype)
    res: dict = {
        "consumer": "eagle-llm",
        "version": md.version("eagle-llm"),
        "torch": torch.__version__,
        "transformers": md.version("transformers"),
        "head": str(args.head),
        "loader": "EaModel.from_pretrained" if args.full else "EConfig + cnets.Model + load_state_dict(strict=True)",
        "ok": False,
    }
    try:
        files = sorted(os.listdir(args.head))
        res["files"] = files
        if "pytorch_model.bin" not in files:
            raise FileNotFoundError("upstream EAGLE loads only pytorch_model.bin (ea_model.py); folder has " + ", ".join(files))
        if args.full:
            ea_layer, config, bias, state, lm, notes = load_full(args.head, args.target, dtype)
            res["notes"] = notes
        else:
            ea_layer, config, bias, state = load_draft(args.head, dtype)
            lm = target_tensor(args.target, ("lm_head.weight", "model.embed_tokens.weight"))
            lm = None if lm is None else lm.float()
        ea_layer.eval()
        rot = ea_layer.layers[0].self_attn.rotary_emb
        res.update(
            {
                "bias": bool(bias),
                "keys": sorted(state),
                "dtypes": sorted({str(v.dtype) for v in state.values()}),
                "rope_base_used": float(rot.base),
                "rope_class": type(rot).__name__,
                "config_rope_theta": getattr(config, "rope_theta", None),
                "num_hidden_layers": config.num_hidden_layers,
                "head_dim": ea_layer.layers[0].self_attn.head_dim,
            }
        )
        temb = target_tensor(args.target, ("model.embed_tokens.weight",))
        if temb is not None:
            res["embed_tokens_max_abs_diff_vs_target"] = float((state["embed_tokens.weight"].float() - temb.float()).abs().max())
        inp = load_file(str(args.inputs))
        with torch.no_grad():
            hidden = ea_layer(hidden_states=inp["feature"].to(dtype), input_ids=inp["input_ids"]).float()
        out = {"hidden": hidden.contiguous()}
        if lm is not None:
            out["logits"] = (hidden @ lm.t()).contiguous()
        save_file(out, args.out + ".safetensors")
        res["outputs"] = {k: list(v.shape) for k, v in out.items()}
        res["hidden_abs_mean"] = float(hidden.abs().mean())
        if args.reference is not None:
            ref = load_file(str(args.reference))["hidden"].float()
            res["max_abs_diff_vs_reference"] = float((hidden - ref).abs().max())
        res["ok"] = True
    except Exception as e:  # report, don't crash: the driver reads the JSON
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc(limit=3)
    Path(args.out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
