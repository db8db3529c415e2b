"""Load a speculators-format EAGLE-3 folder with speculators' own loader and run its forward.

Run with the speculators venv (scripts/interop/setup_speculators.sh):

    .venv-interop/speculators/bin/python scripts/interop/check_speculators.py \
        --head DIR --inputs tests/fixtures/interop/inputs.safetensors --out PREFIX \
        [--target DIR] [--reference FILE] [--dtype float32|keep] [--convert-research]

Stages (each recorded in PREFIX.json; one JSON summary line is printed last):
  1. plain load: `SpeculatorModel.from_pretrained(DIR)` exactly as a user would call it
     (HF_HUB_OFFLINE=1 unless --allow-hub, so a hub-only verifier fails at once instead of
     retrying for ~30-50 s). Refusals (e.g. a vLLM-research layout without
     `speculators_model_type`) are recorded with their message.
  2. harness load: `Eagle3SpeculatorConfig.from_pretrained(DIR)`, then, if --target is given,
     speculators_config.verifier.name_or_path := TARGET (speculators reads the verifier's
     config.json and weights at load time and cannot run without it), attention set to 'eager'
     (dense masks, CPU-exact), then `SpeculatorModel.from_pretrained(DIR, config=cfg)`.
     With --convert-research and a folder lacking `speculators_model_type`, speculators' own
     Eagle3Converter (the `speculators convert --algorithm eagle3` path) first converts it.
  3. forward: model(hidden_states=features3, input_ids=input_ids, document_ids=zeros,
     position_ids=arange(T), ttt_steps=1); `hidden` = layers[-1] output (before the final
     norm), `logits` = lm_head output (draft vocab), caught with forward hooks. Saved to
     PREFIX.safetensors. Column t pairs token x_{t+1} with feature f_t (our convention, and
     speculators' shift_batch's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="folder in speculators format (config.json + model.safetensors)")
    ap.add_argument("--inputs", required=True, help="inputs.safetensors (input_ids, features3)")
    ap.add_argument("--out", required=True, help="output prefix: PREFIX.safetensors + PREFIX.json")
    ap.add_argument(
        "--target",
        default=None,
        help="local verifier folder; replaces speculators_config.verifier.name_or_path for the harness load (default: keep the folder's value)",
    )
    ap.add_argument("--reference", default=None, help="optional safetensors with hidden/logits to compare against")
    ap.add_argument("--dtype", default="float32", choices=["float32", "keep"], help="cast the loaded model before the forward (default float32)")
    ap.add_argument("--convert-research", action="store_true", help="convert a vLLM-research layout with speculators' Eagle3Converter first")
    ap.add_argument("--norm-before-residual", action="store_true", help="with --convert-research: pass norm_before_residual=True to the converter")
    ap.add_argument(
        "--aux-ids",
        type=int,
        nargs="*",
        default=None,
        help="with --convert-research: eagle_aux_hidden_state_layer_ids for the converter (it ignores the research config's nested eagle_config)",
    )
    ap.add_argument("--allow-hub", action="store_true", help="do not set HF_HUB_OFFLINE=1")
    return ap.parse_args()


def short_exc(e: BaseException) -> dict:
    tb = traceback.extract_tb(e.__traceback__)
    where = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in tb if "speculators" in f.filename][-3:]
    return {"type": type(e).__name__, "message": str(e)[:800], "where": where}


def main() -> int:
    args = parse()
    if not args.allow_hub:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # imports after HF_HUB_OFFLINE is set (huggingface_hub reads it at import)
    import importlib.metadata as md

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    head = Path(args.head)
    result: dict = {
        "consumer": "speculators",
        "versions": {n: md.version(n) for n in ("speculators", "torch", "transformers")},
        "head": str(head),
        "ok": False,
    }
    raw = json.loads((head / "config.json").read_text())
    result["raw_config"] = {
        k: raw.get(k)
        for k in (
            "speculators_model_type",
            "speculators_version",
            "architectures",
            "draft_vocab_size",
            "eagle_aux_hidden_state_layer_ids",
            "norm_before_residual",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
            "target_hidden_size",
        )
    }
    result["raw_config"]["verifier"] = (raw.get("speculators_config") or {}).get("verifier")
    with safe_open(str(head / "model.safetensors"), framework="pt") as f:
        file_keys = {k: [list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()] for k in f.keys()}
    result["file_tensors"] = file_keys

    # 1. plain load, as a user calls it
    try:
        m = SpeculatorModel.from_pretrained(str(head))
        result["plain_load"] = {"ok": True, "class": type(m).__name__}
        del m
    except Exception as e:  # noqa: BLE001
        result["plain_load"] = {"ok": False, **short_exc(e)}

    # 2. harness load
    load_dir = head
    try:
        if "speculators_model_type" not in raw:
            if not args.convert_research:
                raise RuntimeError(
                    "no speculators_model_type: not a speculators checkpoint (pass --convert-research to try speculators' Eagle3Converter)"
                )
            if not args.target:
                raise RuntimeError("--convert-research needs --target (the converter reads the verifier)")
            from speculators.convert.eagle.eagle3_converter import Eagle3Converter

            load_dir = Path(tempfile.mkdtemp(prefix="spec_conv_"))
            Eagle3Converter().convert(
                str(head),
                str(load_dir),
                args.target,
                validate=False,
                norm_before_residual=args.norm_before_residual,
                eagle_aux_hidden_state_layer_ids=args.aux_ids,
            )
            result["converted_to"] = str(load_dir)
            result["converted_config"] = json.loads((load_dir / "config.json").read_text())
        cfg = Eagle3SpeculatorConfig.from_pretrained(str(load_dir))
        if not isinstance(cfg, Eagle3SpeculatorConfig):
            raise TypeError(f"config resolved to {type(cfg).__name__}, not Eagle3SpeculatorConfig")
        if args.target:
            result["verifier_name_or_path_in_file"] = cfg.speculators_config.verifier.name_or_path
            cfg.speculators_config.verifier.name_or_path = str(args.target)
        cfg.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
        model = SpeculatorModel.from_pretrained(str(load_dir), config=cfg)
        model.eval()
        if args.dtype == "float32":
            model = model.float()
        result["harness_load"] = {"ok": True, "class": type(model).__name__}
    except Exception as e:  # noqa: BLE001
        result["harness_load"] = {"ok": False, **short_exc(e)}
        return finish(args, result)

    c = model.config
    tl = c.transformer_layer_config
    result["loaded_config"] = {
        "draft_vocab_size": c.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids (after resolve)": c.eagle_aux_hidden_state_layer_ids,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "layer_model_type": tl.model_type,
        "layer_config_class": type(tl).__name__,
        "hidden_size": tl.hidden_size,
        "intermediate_size": tl.intermediate_size,
        "num_hidden_layers": tl.num_hidden_layers,
        "num_attention_heads": tl.num_attention_heads,
        "num_key_value_heads": tl.num_key_value_heads,
        "head_dim": getattr(tl, "head_dim", None),
        "vocab_size": tl.vocab_size,
        "rms_norm_eps": tl.rms_norm_eps,
        "rope_parameters": getattr(tl, "rope_parameters", None),
        "layer_types": getattr(tl, "layer_types", None),
        "sliding_window": getattr(tl, "sliding_window", None),
        "max_position_embeddings": tl.max_position_embeddings,
        "hidden_act": tl.hidden_act,
        "verifier": c.speculators_config.verifier.model_dump(),
        "speculative_tokens": [p.speculative_tokens for p in c.speculators_config.proposal_methods],
    }
    # key bookkeeping: what the loaded file provides vs what the model holds (saved keys only)
    if load_dir != head:
        with safe_open(str(load_dir / "model.safetensors"), framework="pt") as f:
            file_keys = {k: [list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()] for k in f.keys()}
        result["converted_file_tensors"] = file_keys
    skip = set(getattr(model, "_keys_to_ignore_on_save", []) or [])
    model_keys = {k for k in model.state_dict() if k not in skip}
    result["keys"] = {
        "missing_in_file": sorted(model_keys - set(file_keys)),
        "unexpected_in_file": sorted(set(file_keys) - model_keys),
        "nan_params": sorted(n for n, p in model.named_parameters() if p.is_floating_point() and torch.isnan(p).any() and n in model_keys),
        # speculators 0.9.0 + transformers 5.19: a key absent from the file (e.g. embed_tokens,
        # which its own Eagle3Converter omits) comes up all-zero, not NaN, so the
        # copy-from-verifier fallback never fires.
        "all_zero_params": sorted(n for n, p in model.named_parameters() if n in model_keys and p.is_floating_point() and not p.any()),
    }
    if getattr(model, "d2t", None) is not None:
        ids = torch.arange(model.d2t.numel()) + model.d2t.cpu()
        t2d = model.t2d.cpu()
        result["vocab_map"] = {
            "d2t_dtype": str(model.d2t.dtype),
            "t2d_dtype": str(t2d.dtype),
            "t2d_sum": int(t2d.sum()),
            "draft_ids_in_range": bool(ids.min() >= 0 and ids.max() < t2d.numel()),
            "t2d_matches_d2t": bool(torch.equal(torch.zeros_like(t2d).index_fill(0, ids, True), t2d)),
            "first_target_ids": ids[:8].tolist(),
        }

    # 3. forward
    inp = load_file(args.inputs)
    ids_in = inp["input_ids"].long()
    T = ids_in.shape[1]
    feats = inp["features3"].to(model.fc.weight.dtype)
    got: dict = {}
    hooks = [
        model.layers[-1].register_forward_hook(lambda m, a, o: got.__setitem__("hidden", o.detach())),
        model.lm_head.register_forward_hook(lambda m, a, o: got.__setitem__("logits", o.detach())),
    ]
    try:
        with torch.no_grad():
            model(
                hidden_states=feats,
                input_ids=ids_in,
                document_ids=torch.zeros(1, T, dtype=torch.long),
                position_ids=torch.arange(T)[None],
                ttt_steps=1,
            )
    except Exception as e:  # noqa: BLE001
        result["forward"] = {"ok": False, **short_exc(e)}
        return finish(args, result)
    finally:
        for h in hooks:
            h.remove()
    out = {k: got[k].float().contiguous() for k in ("hidden", "logits")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, f"{args.out}.safetensors")
    result["forward"] = {
        "ok": True,
        "hidden_shape": list(out["hidden"].shape),
        "logits_shape": list(out["logits"].shape),
        "hidden_absmax": float(out["hidden"].abs().max()),
        "argmax_draft_ids": out["logits"].argmax(-1)[0].tolist(),
        "fed": "hidden_states=features3, input_ids=input_ids, document_ids=zeros, position_ids=arange(T), ttt_steps=1, attn=eager",
    }
    if args.reference:
        ref = load_file(args.reference)
        result["vs_reference"] = {
            k: float((out[k] - ref[k].float()).abs().max()) for k in ("hidden", "logits") if k in ref and ref[k].shape == out[k].shape
        }
    result["ok"] = True
    return finish(args, result)


def finish(args, result: dict) -> int:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    summary = {k: result.get(k) for k in ("consumer", "ok", "head")}
    summary["plain_load_ok"] = result.get("plain_load", {}).get("ok")
    summary["harness_load_ok"] = result.get("harness_load", {}).get("ok")
    if not summary["harness_load_ok"]:
        summary["error"] = result.get("harness_load", {}).get("message")
    elif not result.get("forward", {}).get("ok"):
        summary["error"] = result.get("forward", {}).get("message")
    if not summary["plain_load_ok"]:
        summary["plain_load_error"] = (result.get("plain_load", {}).get("message") or "")[:200]
    summary["missing_in_file"] = result.get("keys", {}).get("missing_in_file")
    summary["unexpected_in_file"] = result.get("keys", {}).get("unexpected_in_file")
    summary["all_zero_params"] = result.get("keys", {}).get("all_zero_params")
    summary["vs_reference"] = result.get("vs_reference")
    summary["out"] = f"{args.out}.json"
    print(json.dumps(summary, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
