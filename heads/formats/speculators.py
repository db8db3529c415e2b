"""The speculators format: vLLM's preferred EAGLE-3 layout, written by the speculators library
(docs/formats.md, "speculators").

    config.json   speculators_model_type "eagle3", speculators_version, architectures,
                  speculators_config {algorithm, proposal_methods, default_proposal_method, verifier},
                  transformer_layer_config (the decoder layer's Llama config, where vocab_size lives),
                  draft_vocab_size, eagle_aux_hidden_state_layer_ids (top level, vLLM's numbering),
                  norm_before_residual, and the EAGLE-3.1 flags
    model.safetensors  layers.0.* (our midlayer.*), fc.weight, norm.weight, lm_head.weight, d2t, t2d,
                  embed_tokens.weight (a copy of the target's)

Every flag is written explicitly: vLLM defaults `norm_before_residual` to True for this format,
speculators' own config class to False, so a config that omits it is refused on import.

P-EAGLE (`speculators_model_type` "peagle", docs/formats.md "Parallel drafters") adds
`mask_token_id` and the parallel depth as `speculative_tokens`; its `mask_hidden` is stored as
[1, 1, n x H], and the learned mask embedding travels as `embed_tokens`' row `mask_token_id`
(that row alone differs from the target's).
"""

from __future__ import annotations

import torch

from ..io import HeadFormatError
from . import dspark
from .eagle3 import check_engine_layers
from ...ground.target.parts import input_embeddings
from .common import (
    FAMILY_LAYER_FORMATS,
    SPECULATORS_VERSION,
    Export,
    ForeignHead,
    Layout,
    layer_config,
    llama_layer_fields,
    read_weights,
    refuse_unknown,
    rope_parameters_of,
)

MODEL_TYPES = {"eagle3": "eagle3", "eagle31": "eagle3", "peagle": "peagle"}  # our kind -> theirs
# theirs -> its architecture; each of their types is read into our kind of the same name
ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator"}
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
# Boolean layer flags, their default when absent (speculators' own config class) and our field
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
_PREFIX_OURS, _PREFIX_THEIRS = "midlayer.", "layers.0."
LAYER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # transformer_layer_config's


def is_layout(cfg: dict) -> bool:
    return "speculators_model_type" in cfg


def kind_of(cfg: dict) -> str:
    """Our head kind for a speculators config (read() refuses the types it does not know)."""
    model_type = cfg.get("speculators_model_type")
    if model_type == "dspark":  # heads/formats/dspark.py reads it
        return "dspark"
    return model_type if model_type in ARCHITECTURES else "eagle3"


def tensor_name(ours: str) -> str:
    """A head tensor's name in the speculators layout: our `midlayer.*` is its `layers.0.*`."""
    return _PREFIX_THEIRS + ours[len(_PREFIX_OURS) :] if ours.startswith(_PREFIX_OURS) else ours


def to_speculators(config, meta: dict, state: dict, target_embed: torch.Tensor | None, verifier: str | None = None) -> tuple[dict, dict]:
    """verifier: where speculators' loader finds the target (it reads the verifier's config and
    weights when it loads the draft); default the target's recorded name."""
    check_engine_layers(config)
    if "midlayer.self_attn.q_proj.bias" in state:
        raise ValueError("speculators' EAGLE-3 layer is Llama's without attention biases; this head's family has them")
    if target_embed is None:
        raise ValueError("the speculators format stores the target's embed_tokens: pass the target")
    tensors = {tensor_name(k): v for k, v in state.items()}
    # the target's own values and dtype: engines use this copy instead of the target's embedding
    # unless the two are equal, so a rounded copy would change what the head sees
    tensors["embed_tokens.weight"] = target_embed.detach().to("cpu")
    model_type = MODEL_TYPES[config.kind]
    speculative_tokens = 3
    if model_type == "peagle":
        embed = tensors["embed_tokens.weight"].clone()
        embed[config.mask_token_id] = tensors.pop("mask_embedding").to(embed.dtype)
        tensors["embed_tokens.weight"] = embed
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)
        speculative_tokens = config.parallel_depth
    lc = layer_config(meta)
    layer = llama_layer_fields(lc)
    # the layer type speculators builds: Llama's, or a family's own it serves (FAMILY_LAYER_FORMATS)
    family = config.target.model_type if config.draft_layer == "target" else "llama"
    family = family if family in FAMILY_LAYER_FORMATS["speculators"] else "llama"
    layer.update(
        {
            "architectures": [LAYER_ARCHITECTURES[family]],
            "model_type": family,
            "num_hidden_layers": 1,
            "vocab_size": config.vocab_size,
            "attention_bias": False,
            "tie_word_embeddings": False,
        }
    )
    if family != "llama":  # Qwen3's layer reads its attention type from layer_types
        layer["layer_types"] = ["full_attention"]
    if config.sliding_window is not None:
        layer.update({"layer_types": ["sliding_attention"], "sliding_window": config.sliding_window, "use_sliding_window": True})
    target = config.target
    cfg = {
        "architectures": [ARCHITECTURES[model_type]],
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": speculative_tokens, "accept_tolerance": 0.0, "verifier_accept_k": 1}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or target.name, "architectures": list(lc.get("architectures") or [])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        IDS_KEY: list(config.feature_layers),
        **{flag: bool(getattr(config, flag)) for flag in FLAGS},
        "target_hidden_size": config.hidden_size,
    }
    if model_type == "peagle":
        cfg["mask_token_id"] = config.mask_token_id
    return cfg, tensors


def read(src, cfg: dict, state: dict) -> ForeignHead:
    model_type = cfg.get("speculators_model_type")
    if model_type not in ARCHITECTURES:
        raise HeadFormatError(
            f"{src}: speculators_model_type {model_type!r} is not supported (drafthead reads {', '.join(map(repr, ARCHITECTURES))})"
        )
    for flag in FLAGS:
        refuse_unknown(cfg, flag, (True, False), str(src))
    if "norm_before_residual" not in cfg:
        raise HeadFormatError(
            f"{src}: the config does not say norm_before_residual, and the consumers disagree on "
            "its default (speculators' config class: False, vLLM's reader: True); write it explicitly"
        )
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise HeadFormatError(f"{src}: speculators config has no transformer_layer_config")
    ids = cfg.get(IDS_KEY)
    if ids is None:
        raise HeadFormatError(f"{src}: speculators config names no {IDS_KEY}")
    family = layer.get("model_type", "llama")
    if family not in ("llama", *FAMILY_LAYER_FORMATS["speculators"]):
        raise HeadFormatError(
            f"{src}: transformer_layer_config model_type {family!r}: speculators builds llama or "
            f"{', '.join(FAMILY_LAYER_FORMATS['speculators'])} draft layers"
        )
    vocab = cfg.get("draft_vocab_size", layer.get("vocab_size"))
    if vocab is None:
        raise HeadFormatError(f"{src}: the config states no draft_vocab_size, nor transformer_layer_config.vocab_size")
    overrides: dict[str, object] = {
        "aux_layers": tuple(int(i) for i in ids),
        "draft_vocab_size": int(vocab),
        **{flag: bool(cfg.get(flag, False)) for flag in FLAGS},
    }
    if family != "llama":
        overrides["draft_layer"] = "target"  # the target family's own layer (checked against the target on import)
    rope = rope_parameters_of(layer)
    if rope is not None:
        overrides["rope_parameters"] = rope
    types = layer.get("layer_types") or ["full_attention"]
    if types == ["sliding_attention"]:  # speculators' trainer default; one draft layer
        if not layer.get("sliding_window"):
            raise HeadFormatError(f"{src}: transformer_layer_config says sliding_attention but gives no sliding_window")
        overrides["sliding_window"] = int(layer["sliding_window"])
        layer = {k: v for k, v in layer.items() if k not in ("layer_types", "use_sliding_window")}
    theirs = dict(state)
    copies = {k: theirs.pop(k) for k in ("embed_tokens.weight",) if k in theirs}
    ours = {(_PREFIX_OURS + k[len(_PREFIX_THEIRS) :] if k.startswith(_PREFIX_THEIRS) else k): v for k, v in theirs.items()}
    notes = [f"aux-layer ids {list(ids)} (speculators numbers them as vLLM does); " + ", ".join(f"{flag}={overrides[flag]}" for flag in FLAGS)]
    skipped_rows: dict[str, tuple[int, ...]] = {}
    if model_type == "peagle":
        mask_id = cfg.get("mask_token_id")
        if not isinstance(mask_id, int) or "embed_tokens.weight" not in copies:
            raise HeadFormatError(f"{src}: a P-EAGLE checkpoint needs mask_token_id and embed_tokens.weight (the mask token's trained row)")
        if "mask_hidden" not in ours:
            raise HeadFormatError(f"{src}: a P-EAGLE checkpoint needs mask_hidden (the learned feature placeholder)")
        ours["mask_hidden"] = ours["mask_hidden"].reshape(-1)
        ours["mask_embedding"] = copies["embed_tokens.weight"][mask_id].clone()
        skipped_rows["embed_tokens.weight"] = (mask_id,)  # the one row that is the head's, not the target's
        proposals = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        overrides.update(mask_token_id=mask_id, parallel_depth=int(proposals[0].get("speculative_tokens", 1)))
        notes.append(f"P-EAGLE: mask token {mask_id}, {overrides['parallel_depth']} tokens per forward")
    return ForeignHead("speculators", model_type, overrides, ours, copies, notes=notes, layer_fields=layer, copy_rows_own=skipped_rows)


def _read(src, cfg: dict, convention: str | None) -> ForeignHead:
    reader = dspark.read_speculators if cfg.get("speculators_model_type") == "dspark" else read
    return reader(src, cfg, read_weights(src))


def _write(job) -> tuple[dict, dict]:
    return to_speculators(job.config, job.meta, job.state, job.target_tensor(input_embeddings), job.verifier)


LAYOUTS = (Layout("speculators", lambda src, cfg: is_layout(cfg), kind_of, _read),)
EXPORTS = (Export("speculators", ("eagle3", "eagle31", "peagle"), "speculators", _write),)  # DSpark's: dspark.py
