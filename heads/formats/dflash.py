"""DFlash's layout: what vLLM (`method: dflash`), SGLang (`DFLASH`) and z-lab's `dflash` package
load as `DFlashDraftModel` (docs/formats.md "Parallel drafters in the engines").

    config.json        architectures ["DFlashDraftModel"], model_type qwen3, the draft layers' Qwen3
                       fields (num_hidden_layers = draft layers, rope_theta and rope_parameters
                       stated: the readers' defaults differ), block_size, num_target_layers, and
                       dflash_config {target_layer_ids, mask_token_id}
    model.safetensors  our tensor names exactly: fc.weight [H, n_feat * H], hidden_norm.weight,
                       layers.{i}.* (q/k/v/o_proj, q_norm, k_norm, the two norms, gate/up/down_proj),
                       norm.weight; no embed_tokens and no lm_head (the target's are used)

`target_layer_ids` name the decoder layer whose *output* is taken: our output_hidden_states index
minus one (vLLM adds the one back; SGLang captures "before layer id + 1", the same state).
"""

from __future__ import annotations

from ..io import HeadFormatError
from .common import Export, ForeignHead, Layout, layer_config, read_weights, rope_fields, rope_parameters_of

ARCH = "DFlashDraftModel"
QWEN3_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "attention_bias",
    "rope_parameters",
)


# layer fields a draft may choose apart from its target (hidden_size may not: the target's embedding
# feeds the block and the target's LM head reads its output)
OWN_FIELDS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")


def is_layout(cfg: dict) -> bool:
    return ARCH in (cfg.get("architectures") or [])


def to_engine(config, meta: dict, state: dict) -> tuple[dict, dict]:
    lc = layer_config(meta)
    cfg = {k: lc[k] for k in QWEN3_FIELDS if lc.get(k) is not None}
    cfg.update(rope_fields(lc))
    cfg.update(
        {
            "architectures": [ARCH],
            "model_type": "qwen3",
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * config.num_layers,  # non-causal inside the block
            "block_size": config.block_size,
            "num_target_layers": config.target.num_layers,
            "dflash_config": {"target_layer_ids": [i - 1 for i in config.feature_layers], "mask_token_id": config.mask_token_id},
        }
    )
    return cfg, dict(state)


def read(src, cfg: dict, state: dict) -> ForeignHead:
    dcfg = cfg.get("dflash_config") or {}
    ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    block = dcfg.get("block_size", cfg.get("block_size"))
    if ids is None or mask is None or block is None:  # each reader would fill these with a default of its own
        missing = [name for name, v in (("target_layer_ids", ids), ("mask_token_id", mask), ("block_size", block)) if v is None]
        raise HeadFormatError(
            f"{src}: config.json states no {', '.join(missing)}; the engines would each pick their own, so what this head was trained with is unknown"
        )
    types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in types) or cfg.get("is_causal") or dcfg.get("causal"):
        raise HeadFormatError(
            f"{src}: layer_types {types} / causal: drafthead's DFlash layers attend the whole block non-causally; refusing rather than approximating"
        )
    extras = sorted(
        k
        for k in ("projector_type", "input_embedding_scale", "output_multiplier", "final_logit_softcapping", "attention_value_scale", "use_swa")
        if dcfg.get(k, cfg.get(k))
    )
    if extras:
        raise HeadFormatError(f"{src}: {', '.join(extras)} set: a DFlash variant drafthead does not run")
    if "lm_head.weight" in state or "embed_tokens.weight" in state:
        raise HeadFormatError(f"{src}: the checkpoint carries its own embed_tokens / lm_head; drafthead's DFlash reads the target's")
    aux_layers = tuple(int(i) + 1 for i in ids)
    overrides = {
        "aux_layers": aux_layers,
        "mask_token_id": int(mask),
        "block_size": int(block),
        "num_layers": int(cfg.get("num_hidden_layers", 1)),
    }
    for name in OWN_FIELDS:  # the draft's own choices: our layer is built with them
        if cfg.get(name) is not None:
            overrides[name] = cfg[name]
    rope = rope_parameters_of(cfg)
    if rope is not None:
        overrides["rope_parameters"] = rope
    state = {k.removeprefix("model."): v for k, v in state.items()}
    notes = [f"target_layer_ids {list(ids)} (layer outputs) -> output_hidden_states {list(aux_layers)}"]
    return ForeignHead("dflash", "dflash", overrides, state, notes=notes, layer_fields=cfg)


LAYOUTS = (Layout("dflash", lambda src, cfg: is_layout(cfg), lambda cfg: "dflash", lambda src, cfg, convention: read(src, cfg, read_weights(src))),)
EXPORTS = (Export("dflash", ("dflash",), "vLLM's, SGLang's and z-lab's DFlash", lambda job: to_engine(job.config, job.meta, job.state)),)
