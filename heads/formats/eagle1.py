"""EAGLE-1 layouts (docs/formats.md, "EAGLE-1"): the original EAGLE checkpoint, which upstream
EAGLE (eagle-llm) writes and vLLM / SGLang load.

    config.json   the target family's config with num_hidden_layers 1 (engines add the Eagle prefix to
                  the architecture themselves); upstream adds `"bias": true|false` for fc's bias
    weights       fc.weight [H, 2H] (input cat(embed(x_{t+1}), f_t)), fc.bias (upstream default),
                  layers.0.* without input_layernorm; upstream also stores embed_tokens.weight (a copy
                  of the target's) and uses pytorch_model.bin

Upstream EAGLE runs its RoPE with base 10000 whatever its config says, so a checkpoint it trained
for a target with another base is read with base 10000 (convention "eagle"), and we refuse to
export a head to it unless the head's own base is 10000.
"""

from __future__ import annotations

import torch

from ..io import HeadFormatError
from .common import Export, ForeignHead, Layout, drop_zero_extra, layer_config, need_convention, read_weights, rope_fields, rope_parameters_of
from ...ground.target.parts import input_embeddings

# draft-layer family -> the architecture the config names, per format (docs/formats.md "The draft
# layer per target family"): vLLM prefixes "Eagle" itself (EagleLlamaForCausalLM), SGLang loads the
# named class as is (LlamaForCausalLMEagle, Qwen2ForCausalLMEagle), upstream EAGLE is Llama's
SERVED = {
    "vllm": {"llama": "LlamaForCausalLM"},
    "sglang": {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"},
    "eagle": {"llama": "LlamaForCausalLM"},
}
UPSTREAM_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_DROP = (
    "transformers_version",
    "_name_or_path",
    "_model_name_or_path",
    "dtype",
    "torch_dtype",
    "output_hidden_states",
    "use_cache",
    "rope_parameters",
)


def _base_config(meta: dict) -> dict:
    lc = dict(layer_config(meta))
    rope = rope_fields(lc)
    for k in _DROP:
        lc.pop(k, None)
    lc.update(rope)
    lc["num_hidden_layers"] = 1
    if lc.get("layer_types"):
        lc["layer_types"] = lc["layer_types"][:1]
    lc["tie_word_embeddings"] = False
    return lc


def to_engine(fmt: str, config, meta: dict, state: dict, target_embed: torch.Tensor | None) -> tuple[dict, dict]:
    """fmt "vllm" | "sglang": the engines' layout (safetensors, no embeddings); "eagle": upstream's."""
    if config.input_layernorm:
        raise ValueError(
            "EAGLE-1 checkpoints have no input_layernorm on layer 0; this head keeps one "
            "(Eagle1Config.input_layernorm=True) and would run differently there"
        )
    cfg, tensors = _base_config(meta), dict(state)
    family = cfg.get("model_type", "llama")
    if family not in SERVED[fmt]:
        raise ValueError(
            f"{fmt}'s EAGLE-1 drafters are {', '.join(SERVED[fmt])} layers; this head keeps its "
            f"{family} target's own layer (draft_layer=target): retrain it with draft_layer=llama"
        )
    cfg["architectures"] = [SERVED[fmt][family]]
    if fmt == "sglang":
        # SGLang's fc always has a bias, random unless the file holds one: write a zero one
        tensors.setdefault("fc.bias", torch.zeros(config.hidden_size, dtype=tensors["fc.weight"].dtype))
        return cfg, tensors
    if fmt != "eagle":
        if "fc.bias" in tensors and bool(tensors["fc.bias"].abs().max() > 0):
            raise ValueError(f"{fmt}'s EAGLE-1 fc has no bias and drops one silently; this head's fc.bias is non-zero: export it with --format eagle")
        tensors.pop("fc.bias", None)  # zero: dropping it is exact
        return cfg, tensors
    rope = rope_parameters_of(cfg) or {}
    if rope.get("rope_type", "default") != "default" or float(rope.get("rope_theta", 10000.0)) != 10000.0:
        raise ValueError(
            f"upstream EAGLE runs RoPE with base 10000 whatever its config says; this head uses {rope} and would draft differently there (rope_theta)"
        )
    if target_embed is None:
        raise ValueError("upstream EAGLE stores the target's embed_tokens in the checkpoint: pass the target")
    tensors["embed_tokens.weight"] = target_embed.detach().to("cpu")  # exact; upstream casts the draft to the base's dtype
    if "fc.bias" not in tensors:
        tensors["fc.bias"] = torch.zeros(config.hidden_size, dtype=tensors["fc.weight"].dtype)  # exact: adds 0
    cfg["bias"] = True
    return cfg, tensors


def is_layout(cfg: dict) -> bool:
    return cfg.get("num_hidden_layers") == 1 and cfg.get("model_type") not in (None, "medusa")


def read(src, cfg: dict, state: dict, convention: str | None) -> ForeignHead:
    state = dict(state)
    copies = {}
    if "embed_tokens.weight" in state:
        copies["embed_tokens.weight"] = state.pop("embed_tokens.weight")
    overrides: dict[str, object] = {"fc_bias": "fc.bias" in state}
    if cfg.get("bias") is not None and bool(cfg["bias"]) != overrides["fc_bias"]:
        raise HeadFormatError(f"{src}: config says bias={cfg['bias']} but fc.bias is {'present' if overrides['fc_bias'] else 'absent'}")
    if "layers.0.input_layernorm.weight" in state:
        overrides["input_layernorm"] = True
    stated = rope_parameters_of(cfg)
    notes = []
    if stated is not None and stated != UPSTREAM_ROPE:
        convention = need_convention(
            convention,
            ("eagle", "vllm"),
            f"{src} is an EAGLE-1 checkpoint whose config "
            f"states RoPE {stated}; upstream EAGLE ran it with base 10000 regardless "
            "(eagle), vLLM and SGLang with the stated one (vllm)",
        )
        rope = UPSTREAM_ROPE if convention == "eagle" else stated
        notes.append(f"RoPE {rope} ({convention}'s convention)")
    else:
        rope = UPSTREAM_ROPE if stated is None else stated
    overrides["rope_parameters"] = rope
    return ForeignHead("eagle1", "eagle1", overrides, state, copies, notes=notes, layer_fields=cfg)


def _read(src, cfg: dict, convention: str | None) -> ForeignHead:
    ours = cfg.get("drafthead")
    if ours is not None:  # our own export counts aux ids as vLLM does
        convention = convention or "vllm"
    foreign = read(src, cfg, read_weights(src), convention)
    if ours is not None and not ours["config"].get("fc_bias", False):  # SGLang's EAGLE-1 fc always has a bias
        drop_zero_extra({}, foreign.state, "fc.bias", src, "this head's fc has none")
    return foreign


def _write(job) -> tuple[dict, dict]:
    return to_engine(job.fmt, job.config, job.meta, job.state, job.target_tensor(input_embeddings))


LAYOUTS = (Layout("eagle1", lambda src, cfg: is_layout(cfg), lambda cfg: "eagle1", _read),)
EXPORTS = (
    Export("vllm", ("eagle1",), "vLLM", _write),
    Export("sglang", ("eagle1",), "SGLang", _write),
    Export("eagle", ("eagle1",), "upstream EAGLE", _write, weights="pytorch_model.bin"),
)
