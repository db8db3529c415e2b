"""EAGLE-3's research layout: what vLLM and SGLang load, SpecForge `to_sglang` writes, and
llama.cpp's converter reads (docs/formats.md, "EAGLE-3 research layout").

    config.json        architectures ["LlamaForCausalLMEagle3"], model_type llama, num_hidden_layers 1,
                       draft_vocab_size, target_hidden_size, the decoder layer's Llama fields, and the
                       aux-layer ids: nested `eagle_config.eagle_aux_hidden_state_layer_ids` (vLLM,
                       SGLang) or top-level `eagle_aux_hidden_state_layer_ids` (llama.cpp)
    model.safetensors  midlayer.*, fc.weight [H, 3H], norm.weight, lm_head.weight [Vd, H], d2t, t2d;
                       embed_tokens.weight optional (a copy of the target's)

The three engine formats differ only in how they write the ids: vLLM and llama.cpp number them as
we do, SGLang one lower (`ID_OFFSETS`). The engines' layer is Llama's, whose `attention_bias` puts a
bias on q/k/v *and* o_proj: for families with q/k/v bias but no o_proj bias (Qwen2) a zero
`o_proj.bias` is written, which is exact; llama.cpp's converter takes no attention bias at all.
"""

from __future__ import annotations

import torch

from ..config import engine_layer_problem
from ..io import HeadFormatError
from .common import (
    ID_OFFSETS,
    Export,
    ForeignHead,
    Layout,
    ids_from_ours,
    ids_to_ours,
    layer_config,
    llama_layer_fields,
    need_convention,
    read_weights,
    rope_parameters_of,
)

ARCH = "LlamaForCausalLMEagle3"
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
O_BIAS = "midlayer.self_attn.o_proj.bias"

# export format -> (id convention, ids written top-level rather than under eagle_config, layer flags
# the consumer reads from this layout: docs/formats.md)
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
VARIANTS = {
    "vllm": ("vllm", False, FLAGS),
    "sglang": ("sglang", False, ()),
    "llama.cpp": ("vllm", True, ("norm_before_residual", "norm_before_fc")),
}


def is_layout(cfg: dict) -> bool:
    return any("Eagle3" in a for a in cfg.get("architectures") or []) or "draft_vocab_size" in cfg


def to_engine(fmt: str, config, meta: dict, state: dict) -> tuple[dict, dict]:
    convention, top_level, readable = VARIANTS[fmt]
    check_engine_layers(config)
    if config.sliding_window is not None:
        raise ValueError(
            f"this head's draft layer attends a sliding window of {config.sliding_window}, which the "
            "research layout cannot say: export it with --format speculators"
        )
    unread = [f for f in FLAGS if getattr(config, f) and f not in readable]
    if unread:
        raise ValueError(
            f"this head sets {', '.join(unread)}, which {fmt} does not read from this layout: export it with --format speculators or vllm"
        )
    qkv_bias = "midlayer.self_attn.q_proj.bias" in state
    if qkv_bias and fmt == "llama.cpp":
        raise ValueError("llama.cpp's EAGLE-3 converter takes no attention biases; this head's family has q/k/v biases")
    tensors = dict(state)
    if qkv_bias and O_BIAS not in tensors:
        o = tensors["midlayer.self_attn.o_proj.weight"]
        tensors[O_BIAS] = torch.zeros(o.shape[0], dtype=o.dtype)
    ids = ids_from_ours(config.feature_layers, convention)
    cfg = llama_layer_fields(layer_config(meta))
    cfg.update(
        {
            "architectures": [ARCH],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "vocab_size": config.vocab_size,
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.hidden_size,
            "attention_bias": qkv_bias,
            "tie_word_embeddings": False,
        }
    )
    if top_level:
        cfg[IDS_KEY] = ids
    else:
        cfg["eagle_config"] = {IDS_KEY: ids, "use_aux_hidden_state": True}
    cfg.update({f: bool(getattr(config, f)) for f in readable})  # explicit, never the reader's default
    return cfg, tensors


def check_engine_layers(config) -> None:
    """Refuse feature indices the engines cannot fuse (heads/config.py engine_layer_problem),
    with the way out."""
    problem = engine_layer_problem(config.feature_layers, config.final_layer)
    if problem is not None:
        raise ValueError(
            f"{problem}: retrain with aux_layers set to 3 distinct indices in 1..{config.final_layer - 1} "
            "(a target of 4 layers or more has them; the default picks them)"
        )


def read(src, cfg: dict, state: dict, convention: str | None) -> ForeignHead:
    nested = (cfg.get("eagle_config") or {}).get(IDS_KEY)
    top = cfg.get(IDS_KEY)
    if nested is not None and top is not None and list(nested) != list(top):
        raise HeadFormatError(f"{src}: eagle_config.{IDS_KEY}={nested} and top-level {IDS_KEY}={top} disagree")
    ids = nested if nested is not None else top
    vocab = cfg.get("draft_vocab_size", cfg.get("vocab_size"))
    if vocab is None:
        raise HeadFormatError(f"{src}: config.json states no draft_vocab_size or vocab_size")
    overrides: dict[str, object] = {
        "draft_vocab_size": int(vocab),
        # absent flags: the readers' default (False in vLLM's, SGLang's and llama.cpp's research readers)
        **{f: bool(cfg.get(f, False)) for f in FLAGS},
    }
    nested_fc = (cfg.get("eagle_config") or {}).get("norm_before_fc")
    if nested_fc is not None:
        overrides["norm_before_fc"] = bool(nested_fc)
    notes = []
    if ids is None:
        return _default_capture_points(src, cfg, state, overrides, convention)
    convention = need_convention(
        convention,
        ("vllm", "sglang"),
        f"{src} is an EAGLE-3 research checkpoint, whose "
        "aux-layer ids vLLM-side producers (vLLM, speculators, llama.cpp) and SGLang-side "
        "producers (SGLang, SpecForge) number differently",
    )
    if convention == "sglang" and "norm_output" in cfg:
        raise HeadFormatError(
            f"{src}: norm_output={cfg['norm_output']!r} means two things on the SGLang side: SpecForge "
            "reads it as 'norm before lm_head' (default true), SGLang as EAGLE-3.1's normed feedback "
            "(default false); drop the key if the head was trained by SpecForge"
        )
    aux_layers = ids_to_ours(ids, convention)
    overrides["aux_layers"] = aux_layers
    notes.append(f"aux-layer ids {list(ids)} read in {convention}'s convention -> output_hidden_states {list(aux_layers)}")
    return _foreign(src, cfg, state, overrides, notes)


def _default_capture_points(src, cfg: dict, state: dict, overrides: dict, convention: str | None) -> ForeignHead:
    """A checkpoint naming no aux-layer ids (SpecForge's `to_hf` writes none unless its draft config
    had them): vLLM, SGLang and SpecForge all capture the same points then, the inputs of target
    layers [2, L//2, L-3], which are our default aux_layers (heads/config.py default_eagle3_layers),
    whatever the producer's numbering. (On a target of fewer than 7 layers the formula repeats a
    layer, which no engine fuses, so no such checkpoint runs anywhere; ours differ there.)"""
    if "norm_output" in cfg and convention != "vllm":
        raise HeadFormatError(
            f"{src}: names no aux-layer ids and sets norm_output={cfg['norm_output']!r}, which "
            "SpecForge and SGLang read differently: say the producer with convention= / --convention"
        )
    overrides["aux_layers"] = None  # filled in from the target: default_eagle3_layers(L)
    notes = [f"config.json names no {IDS_KEY}: read with the engines' default capture points, the inputs of target layers [2, L//2, L-3]"]
    return _foreign(src, cfg, state, overrides, notes)


def _foreign(src, cfg: dict, state: dict, overrides: dict, notes: list[str]) -> ForeignHead:
    target_hidden = cfg.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != int(cfg.get("hidden_size", target_hidden)):
        raise HeadFormatError(
            f"{src}: target_hidden_size {target_hidden} != hidden_size {cfg.get('hidden_size')}: "
            "a draft narrower than its target cannot be represented"
        )
    rope = rope_parameters_of(cfg)
    if rope is not None:
        overrides["rope_parameters"] = rope
    state = dict(state)
    copies = {}
    if "embed_tokens.weight" in state:
        copies["embed_tokens.weight"] = state.pop("embed_tokens.weight")
    return ForeignHead("eagle3-research", "eagle3", overrides, state, copies, notes=notes, layer_fields=cfg)


def _read_research(src, cfg: dict, convention: str | None) -> ForeignHead:
    ours = cfg.get("drafthead")
    if ours is not None:  # our own export: the config says how its ids are counted
        convention = convention or _our_export_convention(cfg, ours)
    return read(src, cfg, read_weights(src), convention)


def _our_export_convention(cfg: dict, ours: dict) -> str:
    ids = (cfg.get("eagle_config") or {}).get(IDS_KEY, cfg.get(IDS_KEY))
    layers = list(ours["config"].get("aux_layers") or [])
    for name, offset in ID_OFFSETS.items():
        if ids is not None and [i + offset for i in ids] == layers:
            return name
    raise HeadFormatError(f"aux ids {ids} match neither convention for the recorded layers {layers}")


def _write(job) -> tuple[dict, dict]:
    return to_engine(job.fmt, job.config, job.meta, job.state)


LAYOUTS = (Layout("eagle3-research", lambda src, cfg: is_layout(cfg), lambda cfg: "eagle3", _read_research),)
EXPORTS = (
    Export("vllm", ("eagle3", "eagle31"), "vLLM", _write),  # vLLM takes P-EAGLE through speculators only
    Export("sglang", ("eagle3",), "SGLang", _write),
    Export("llama.cpp", ("eagle3",), "llama.cpp", _write),
)
