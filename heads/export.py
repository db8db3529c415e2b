"""Export heads to the layouts serving engines load, and import them back (REFERENCE.md s.3).

Layouts written (checked against vLLM's llama_eagle3.py / llama_eagle.py / medusa.py loaders):

EAGLE-3, vLLM and SGLang (identical): config.json with `architectures: ["LlamaForCausalLMEagle3"]`,
  `model_type: "llama"`, `num_hidden_layers: 1`, `draft_vocab_size`, `target_hidden_size`,
  `eagle_config.eagle_aux_hidden_state_layer_ids`, plus the decoder layer's Llama fields;
  model.safetensors keys `midlayer.*`, `fc.weight [H, 3H]`, `norm.weight`,
  `lm_head.weight [draft_vocab, H]`, `d2t` int64, `t2d` bool. No embeddings: the engines share the
  target's. Layer ids: vLLM collects `hidden_states + residual` *before* decoder layer idx for
  every idx in eagle_aux_hidden_state_layer_ids, i.e. the input of layer idx, which is
  transformers' output_hidden_states[idx]: our `aux_layers` are written unchanged.
  The engines' EAGLE-3 layer is Llama's, whose `attention_bias` puts a bias on q/k/v *and* o_proj;
  for families with q/k/v bias but no o_proj bias (Qwen2) a zero `o_proj.bias` is written (exact).
EAGLE-1, vLLM (EagleLlamaForCausalLM) and SGLang (LlamaForCausalLMEagle): the original EAGLE
  checkpoint layout: config.json = the target family's config with num_hidden_layers 1 (engines add
  the Eagle prefix to the architecture themselves); keys `fc.weight [H, 2H]` (input
  cat(embed, feature), no bias) and `layers.0.*` without `input_layernorm` (both engines drop it).
Medusa, vLLM only (SGLang has no Medusa loader): config.json `architectures: ["MedusaModel"]`,
  `model_type: "medusa"`, `num_heads`, `num_hidden_layers` (residual blocks per head),
  `medusa_fc_bias: true`; keys `blocks.{h}.layers.{l}.weight|bias`, `lm_heads.{h}.weight`. A head
  that shares the target's LM head is written with `original_lm_head: true` and one
  `lm_heads.0.weight`, which needs the target (`target_model=`).

Every exported config.json also carries a `drafthead` block (kind, our config with the target
identity, version): HF-style config loaders keep unknown keys, and `import_head` uses it to check
the target. Without it (a foreign checkpoint) the import trusts the shapes.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from .config import config_from_dict
from .identity import HeadTargetMismatch, check_compatible, identify_target, identity_diff
from .io import (
    ADAPTER_DIR,
    CONFIG_NAME,
    FORMAT,
    WEIGHTS_NAME,
    HeadFormatError,
    check_state_dict,
    drafthead_version,
    read_head_dir,
    read_json,
    read_safetensors,
    write_json,
    write_safetensors,
)

FORMATS = ("ours", "vllm", "sglang")
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
MEDUSA_ARCH = "MedusaModel"

# Llama config fields the engines' EAGLE layers read, copied from the draft layer's HF config.
_LLAMA_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "mlp_bias",
)


def _dtype_name(state: dict[str, torch.Tensor]) -> str:
    floats = sorted({str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()})
    return floats[0] if len(floats) == 1 else "float32"


def _rope_fields(layer_cfg: dict) -> dict:
    """transformers v5 keeps RoPE settings in `rope_parameters`; engines read rope_theta/rope_scaling."""
    out = {}
    rp = layer_cfg.get("rope_parameters") or {}
    theta = layer_cfg.get("rope_theta", rp.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = theta
    scaling = layer_cfg.get("rope_scaling")
    if scaling is None and rp and rp.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def _drafthead_block(meta: dict) -> dict:
    return {"format": FORMAT, "drafthead_version": meta.get("drafthead_version", drafthead_version()),
            "config": meta["config"]}


# ----------------------------------------------------------------------------- export


def export_head(head_dir, out_dir, fmt: str, *, dtype: torch.dtype | None = None,
                target_model: nn.Module | None = None) -> Path:
    """Write `head_dir` (our format) to `out_dir` in layout `fmt` ("ours" | "vllm" | "sglang").

    dtype: cast floating tensors (e.g. torch.bfloat16). target_model: only for a Medusa head that
    shares the target's LM head (its weight must be written out for vLLM).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (known: {', '.join(FORMATS)})")
    head_dir, out_dir = Path(head_dir), Path(out_dir)
    if out_dir.resolve() == head_dir.resolve():
        raise ValueError("export output directory must differ from the head directory")
    config, meta, state = read_head_dir(head_dir)
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    out_dir.mkdir(parents=True, exist_ok=True)

    if fmt == "ours":
        if (head_dir / ADAPTER_DIR).exists():
            shutil.copytree(head_dir / ADAPTER_DIR, out_dir / ADAPTER_DIR, dirs_exist_ok=True)
        write_safetensors(out_dir / WEIGHTS_NAME, state, {"format": "pt"})
        write_json(out_dir / CONFIG_NAME, {**meta, "dtype": _dtype_name(state)})
        return out_dir

    if config.kind == "medusa2" and (head_dir / ADAPTER_DIR).exists():
        raise ValueError("a medusa2 head changes the target (LoRA adapter): export the merged target too; "
                         "exporting the heads alone would not match it")
    if config.kind == "eagle3":
        cfg_json, tensors = _eagle3_to_engine(config, meta, state)
    elif config.kind == "eagle1":
        cfg_json, tensors = _eagle1_to_engine(config, meta, state)
    else:
        if fmt == "sglang":
            raise ValueError("SGLang has no Medusa loader; export Medusa heads with --format vllm")
        cfg_json, tensors = _medusa_to_vllm(config, meta, state, target_model, dtype)
    cfg_json["torch_dtype"] = _dtype_name(tensors)
    cfg_json["drafthead"] = _drafthead_block(meta)
    write_safetensors(out_dir / WEIGHTS_NAME, tensors, {"format": "pt"})
    write_json(out_dir / CONFIG_NAME, cfg_json)
    return out_dir


def _layer_cfg(meta: dict) -> dict:
    lc = meta.get("layer_config")
    if not lc:
        raise HeadFormatError("head config.json has no layer_config (needed to describe the decoder layer)")
    return lc


def _eagle3_to_engine(config, meta, state):
    lc = _layer_cfg(meta)
    if len(config.feature_layers) != 3:
        raise ValueError(f"vLLM/SGLang EAGLE-3 fuse exactly 3 features (fc 3H->H); this head has {config.feature_layers}")
    qkv_bias = "midlayer.self_attn.q_proj.bias" in state
    tensors = dict(state)
    if qkv_bias and "midlayer.self_attn.o_proj.bias" not in tensors:
        o = tensors["midlayer.self_attn.o_proj.weight"]
        tensors["midlayer.self_attn.o_proj.bias"] = torch.zeros(o.shape[0], dtype=o.dtype)
    cfg = {k: lc[k] for k in _LLAMA_FIELDS if k in lc and lc[k] is not None}
    cfg.update(_rope_fields(lc))
    cfg.update({
        "architectures": [EAGLE3_ARCH],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "attention_bias": qkv_bias,
        "tie_word_embeddings": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
            "use_aux_hidden_state": True,
        },
    })
    return cfg, tensors


def _eagle1_to_engine(config, meta, state):
    if config.input_layernorm:
        raise ValueError("vLLM/SGLang EAGLE-1 drop layer 0's input_layernorm; this head keeps it "
                         "(Eagle1Config.input_layernorm=True) and would run differently there")
    lc = dict(_layer_cfg(meta))
    for k in ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "output_hidden_states", "use_cache"):
        lc.pop(k, None)
    lc.update(_rope_fields(lc))
    lc["num_hidden_layers"] = 1
    if "layer_types" in lc and lc["layer_types"]:
        lc["layer_types"] = lc["layer_types"][:1]
    lc["tie_word_embeddings"] = False
    return lc, dict(state)


def _medusa_to_vllm(config, meta, state, target_model, dtype):
    K, nl = config.num_heads, config.num_layers
    tensors = {k: v for k, v in state.items() if k.startswith("blocks.")}
    cfg = {
        "architectures": [MEDUSA_ARCH],
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": K,
        "num_hidden_layers": nl,
        "medusa_fc_bias": True,
        "truncated_vocab_size": config.vocab_size,
        "max_paths": 64,
        "topk": 10,
    }
    if config.share_lm_head:
        if target_model is None:
            raise ValueError("this Medusa head shares the target's LM head; vLLM needs its weight in the file: "
                             "pass target_model= to export_head")
        diffs = identity_diff(config.target, identify_target(target_model))
        if diffs:
            raise HeadTargetMismatch("target_model is not this head's target:\n  " + "\n  ".join(diffs))
        w = target_model.get_output_embeddings().weight.detach()
        tensors["lm_heads.0.weight"] = w.to(dtype or next(iter(tensors.values())).dtype)
        cfg["original_lm_head"] = True
    else:
        tensors.update({f"lm_heads.{k}.weight": state[f"lm_heads.{k}.weight"] for k in range(K)})
    return cfg, tensors


# ----------------------------------------------------------------------------- import


def detect_layout(src_dir) -> str:
    """"ours" | "eagle3" | "eagle1" | "medusa" from a directory's config.json."""
    meta = read_json(Path(src_dir) / CONFIG_NAME)
    if meta.get("format") == FORMAT:
        return "ours"
    archs = meta.get("architectures") or []
    if any("Eagle3" in a for a in archs) or "draft_vocab_size" in meta:
        return "eagle3"
    if meta.get("model_type") == "medusa" or MEDUSA_ARCH in archs:
        return "medusa"
    if meta.get("num_hidden_layers") == 1:
        return "eagle1"
    raise HeadFormatError(f"cannot tell which head layout {src_dir} holds (architectures={archs})")


def import_head(src_dir, target_model: nn.Module, tokenizer=None, target_name: str | None = None):
    """Read a head in our layout or an engine layout (written by `export_head` or by another
    trainer) onto `target_model` -> the head (bound, in the target's dtype/device).

    Engine layouts carry no target identity unless they were written by `export_head` (the
    `drafthead` block); then the identity is checked, else only the shapes are.
    """
    from .registry import _new_module, load_head, make_config, target_device, target_dtype

    src_dir = Path(src_dir)
    layout = detect_layout(src_dir)
    if layout == "ours":
        return load_head(src_dir, target_model, tokenizer, target_name)[0]
    meta = read_json(src_dir / CONFIG_NAME)
    state = read_safetensors(src_dir / WEIGHTS_NAME)
    ours = meta.get("drafthead")
    if ours is not None:
        config = config_from_dict(ours["config"])
        check_compatible(config.target, identify_target(target_model, tokenizer, target_name or config.target.name))
    elif layout == "eagle3":
        aux = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        over = {"draft_vocab_size": int(meta.get("draft_vocab_size", meta["vocab_size"]))}
        if aux is not None:
            over["aux_layers"] = tuple(aux)
        config = make_config("eagle3", target_model, tokenizer, target_name, **over)
    elif layout == "eagle1":
        config = make_config("eagle1", target_model, tokenizer, target_name)
    else:
        config = make_config("medusa1", target_model, tokenizer, target_name, num_heads=int(meta["num_heads"]),
                             num_layers=int(meta["num_hidden_layers"]),
                             share_lm_head=bool(meta.get("original_lm_head", False)))

    head = _new_module(config, target_model)
    expected = head.state_dict()
    state = dict(state)
    if layout == "eagle3":
        ob = "midlayer.self_attn.o_proj.bias"
        if ob in state and ob not in expected:
            if bool(state[ob].abs().max() > 0):
                raise HeadFormatError(f"{src_dir}: non-zero {ob}, but the target family's attention has no o_proj bias")
            del state[ob]
    elif layout == "medusa" and config.share_lm_head:
        state.pop("lm_heads.0.weight", None)  # the target's own LM head, which the head reads directly
    check_state_dict(expected, state, where=f"in {src_dir}")
    head.load_state_dict(state, strict=True)
    if layout == "eagle3":
        from .draft_vocab import validate_draft_vocab

        validate_draft_vocab(head.d2t, head.t2d)
    head.to(device=target_device(target_model), dtype=target_dtype(target_model))
    head.eval()
    return head.bind_target(target_model)
