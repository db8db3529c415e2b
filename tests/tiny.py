"""Tiny random causal LMs of several families, built in-process (docs/style.md 10)."""

from __future__ import annotations

import functools

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from drafthead.train.data.tiny import build_tiny, tiny_sizes

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # a small window so that tests cross it: the tree mask must apply it
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
    # q/k norms; head_dim is its own field (default 128), so it is set to hidden / heads
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # attention sinks, alternating sliding/full layers, MoE; no sdpa in transformers: eager
    "gpt_oss": (
        GptOssConfig,
        GptOssForCausalLM,
        {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "layer_types": None, "attn": "eager"},
    ),
    # embedding scale, alternating local/global layers with two RoPE bases, final soft-capping
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"head_dim": 8, "sliding_window": 8, "layer_types": "alternate", "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 8},
    ),
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),  # fused qkv_proj and gate_up_proj
    # MLA attention (low-rank q and kv, split rope/nope dims) and a routed MoE after a dense layer.
    # MLA has one K/V per query head (DeepSeek-V3: 128 and 128): transformers expands the latent to
    # every head, then repeats it heads / kv_heads times more whenever a mask is given
    "deepseek_v3": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        {
            "num_key_value_heads": 4,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "head_dim": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # MoE on every layer, chunked attention, NoPE layers, q/k norm
    "llama4": (
        Llama4TextConfig,
        Llama4ForCausalLM,
        {
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 64,
            "attention_chunk_size": 8,
            "layer_types": None,
        },
    ),
}


# The Gated DeltaNet layers of the Qwen3-Next / Qwen3.5 families, and their MoE MLP
GATED_DELTANET = {
    "head_dim": 8,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "layer_types": "recurrent_first",
}
GATED_DELTANET_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}

# Hybrid targets (recurrent layers; inference/engine/hybrid_target.py): a recurrent layer, then an
# attention layer, and so on ("recurrent_first"), unless the family lays its layers out itself.
HYBRID = {
    # Gated DeltaNet and gated attention, MoE with a shared expert
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {**GATED_DELTANET, **GATED_DELTANET_MOE},
    ),
    # Gated DeltaNet, dense
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        GATED_DELTANET,
    ),
    # Mamba-2 and attention, MoE (Granite 4; RoPE on, which transformers' default leaves off)
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {
            "position_embedding_type": "rope",
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 8,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 16,
            "layer_types": "recurrent_first",
        },
    ),
    # Mamba-2 and attention side by side in every layer
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 16, "head_dim": 8, "mamba_d_ssm": 64},
    ),
    # gated short convolutions (no recurrent state, only the window) and attention
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {"layer_types": "conv_first"}),
    # Mamba-1 and attention (every second layer), MoE; no positional embedding at all (NoPE)
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "num_experts": 4,
            "mamba_d_state": 8,
            "mamba_expand": 2,
            "mamba_dt_rank": 4,
        },
    ),
    # Mamba-2 and attention (IBM Bamba)
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        {"attn_layer_indices": [1, 3], "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 16},
    ),
    # Mamba-2, attention and MLP-only layers (NVIDIA Nemotron-H)
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        {
            "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "ssm_state_size": 8,
            "n_groups": 1,
            "chunk_size": 16,
            "head_dim": 8,
        },
    ),
    # Gated DeltaNet and attention (OLMo hybrid)
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", {"layer_types": "recurrent_first"}),
    # Gated DeltaNet and gated attention, MoE (Qwen3.5 MoE)
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {**GATED_DELTANET, **GATED_DELTANET_MOE},
    ),
    # short convolutions and attention, MoE (LFM2 MoE)
    "lfm2_moe": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        {"layer_types": "conv_first", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "num_dense_layers": 1},
    ),
    # state-space models with no attention layer at all (eager: transformers gives them no sdpa path)
    "mamba": ("MambaConfig", "MambaForCausalLM", {"state_size": 8, "expand": 2, "attn": "eager"}),
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        {"num_heads": 4, "head_dim": 16, "state_size": 8, "n_groups": 1, "chunk_size": 16, "expand": 2, "attn": "eager"},
    ),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", {"state_size": 8, "expand": 2, "attn": "eager"}),
}


# families only the MTP tests build (tests/test_mtp.py): GLM-4.5's MoE, its first layer dense
OTHER = {
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            "head_dim": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
}


def _hybrid_family(name: str):
    import transformers

    config, model, extra = HYBRID[name] if name in HYBRID else OTHER[name]
    return getattr(transformers, config), getattr(transformers, model), extra


def tiny_causal_lm(
    family: str = "llama", vocab: int = 96, seed: int = 0, layers: int = 2, hidden: int = 32, dtype=torch.float32, attn: str = "sdpa", **overrides
):
    if family in MULTIMODAL:
        return MULTIMODAL[family](vocab=vocab, seed=seed, layers=layers, hidden=hidden, **overrides)
    config_cls, model_cls, extra = FAMILIES[family] if family in FAMILIES else _hybrid_family(family)
    kwargs = dict(tiny_sizes(vocab, hidden, layers, max_positions=256), bos_token_id=0, eos_token_id=1, pad_token_id=2)
    kwargs.update(extra)
    kwargs.update(overrides)
    attn = kwargs.pop("attn", attn)
    if kwargs.get("layer_types", ...) is None:  # the family's own pattern, recomputed for `layers`
        del kwargs["layer_types"]
    elif kwargs.get("layer_types") in ("recurrent_first", "conv_first"):
        recurrent = "linear_attention" if kwargs["layer_types"] == "recurrent_first" else "conv"
        kwargs["layer_types"] = [recurrent if i % 2 == 0 else "full_attention" for i in range(layers)]
    elif kwargs.get("layer_types") == "alternate":  # sliding, full, sliding, ...: tests cross both kinds
        kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return frozen_and_sharpened(build_tiny(config_cls, model_cls, seed=seed, attn=attn, **kwargs).to(dtype))


def frozen_and_sharpened(model):
    """Eval mode, no gradients, and sharper random logits (LM head x 4), which make greedy paths
    less degenerate: how every tiny target of this module is finished."""
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.eval().requires_grad_(False)


def repetitive_prompt(vocab: int, length: int = 12, seed: int = 0) -> torch.Tensor:
    """[1, L + L/2] random tokens (avoiding specials 0-2) whose tail repeats: lookup has matches."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (1, length), generator=g)
    return torch.cat([head, head[:, : length // 2]], dim=1)


def left_padded(prompts: list[torch.Tensor], pad: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and attention mask, shorter prompts padded on the left (as tokenizers do for generation)."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel() :] = p
        mask[b, width - p.numel() :] = 1
    return ids, mask


def prompts_of(lengths, seed=0) -> list[torch.Tensor]:
    return [repetitive_prompt(96, length=max(2, n), seed=seed + n)[0, :n] for n in lengths]


def plain_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """The reference: transformers' own greedy generate, no EOS stopping."""
    out = model.generate(prompt, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, prompt.shape[1] :].tolist()


def tiny_gemma3_vlm(vocab: int = 96, seed: int = 0, layers: int = 4, hidden: int = 32, **ids):
    """A Gemma-3-style multimodal target (Gemma3ForConditionalGeneration): a one-layer SigLIP
    vision tower and projector around the gemma3 text model of FAMILIES (alternating sliding and
    full layers, soft-capping), whose config nests in `text_config`. The image tokens take the
    top three ids of the vocabulary; text prompts never use them."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, **ids}
    text = Gemma3TextConfig(
        **tiny_sizes(vocab, hidden, layers, max_positions=256),
        head_dim=8,
        sliding_window=8,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=8,
        **ids,
    )
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    model = build_tiny(
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        seed=seed,
        attn="sdpa",
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=vocab - 1,
        boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2,
        **ids,
    )
    return frozen_and_sharpened(model)


# mrope_section splits head_dim / 2 = 4 rotary frequencies into (time, height, width): every
# section gets at least one (a low base keeps the slow height and width frequencies turning), so
# a position wrong in any of the three moves the logits
MROPE = {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 1, 1]}


def tiny_qwen_vl(generation: str = "qwen2_5_vl", vocab: int = 96, seed: int = 0, layers: int = 4, hidden: int = 32, **ids):
    """A Qwen-VL-style multimodal target with multimodal RoPE (M-RoPE: position ids [3, B, T], one
    row per section): `qwen2_5_vl` (Qwen2_5_VLForConditionalGeneration, sections in contiguous
    blocks) or `qwen3_vl` (Qwen3VLForConditionalGeneration, sections interleaved, q/k norms, a
    deepstack that adds vision features to early decoder layers at image positions). A one-layer
    vision tower projects to the text hidden size; the image, video and vision start/end tokens
    take the top four ids of the vocabulary, which text prompts never use."""
    import transformers

    classes = {
        "qwen2_5_vl": ("Qwen2_5_VL", {"fullatt_block_indexes": [0]}, {}),
        "qwen3_vl": ("Qwen3VL", {"deepstack_visual_indexes": [0], "num_position_embeddings": 16}, {"head_dim": hidden // 4}),
    }
    prefix, vision_extra, text_extra = classes[generation]
    ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, **ids}
    text = getattr(transformers, f"{prefix}TextConfig")(
        **tiny_sizes(vocab, hidden, layers, max_positions=256),
        rope_parameters=dict(MROPE),
        **text_extra,
        **ids,
    )
    vision = getattr(transformers, f"{prefix}VisionConfig")(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        patch_size=14,
        out_hidden_size=hidden,
        **vision_extra,
    )
    model = build_tiny(
        getattr(transformers, f"{prefix}Config"),
        getattr(transformers, f"{prefix}ForConditionalGeneration"),
        seed=seed,
        attn="sdpa",
        text_config=text,
        vision_config=vision,
        image_token_id=vocab - 1,
        video_token_id=vocab - 2,
        vision_start_token_id=vocab - 4,
        vision_end_token_id=vocab - 3,
        **ids,
    )
    return frozen_and_sharpened(model)


# multimodal targets, built by their own functions; tiny_causal_lm and the saved-folder fixtures
# (tests/conftest.py) take their names like a family's
MULTIMODAL = {
    "gemma3_vlm": tiny_gemma3_vlm,
    "qwen2_5_vl": functools.partial(tiny_qwen_vl, "qwen2_5_vl"),
    "qwen3_vl": functools.partial(tiny_qwen_vl, "qwen3_vl"),
}

# every target the family tests run: the causal-LM families, then the multimodal targets on text
TARGETS = sorted(FAMILIES) + sorted(MULTIMODAL)
HYBRID_TARGETS = sorted(HYBRID)
# hybrids without RoPE: no EAGLE or DFlash draft layer to copy from them (heads/eagle.py)
NOPE_HYBRIDS = frozenset({"falcon_mamba", "jamba", "mamba", "mamba2", "nemotron_h"})


def tiny_image(family: str, seed: int = 0, grid: tuple[int, int, int] = (1, 4, 4)):
    """(placeholder tokens [K], PromptImages) of one random image for a MULTIMODAL target of
    vocabulary 96 (tiny_gemma3_vlm, tiny_qwen_vl): Gemma-3 takes a 28x28 image as 4 tokens between
    its begin and end tokens; Qwen-VL a (time, height, width) grid of 14-pixel patches, 2x2 patches
    merged per token, between its vision start and end tokens."""
    from drafthead.ground.target.media import PromptImages

    g = torch.Generator().manual_seed(seed)
    vocab = 96
    if family == "gemma3_vlm":
        return torch.tensor([vocab - 3] + [vocab - 1] * 4 + [vocab - 2]), PromptImages(torch.randn(1, 3, 28, 28, generator=g))
    t, h, w = grid
    tokens = torch.tensor([vocab - 4] + [vocab - 1] * (t * h * w // 4) + [vocab - 3])
    return tokens, PromptImages(torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=g), torch.tensor([list(grid)]))


def image_prompt(family: str, text: int = 6, seed: int = 0, grid: tuple[int, int, int] = (1, 4, 4)):
    """([P] ids, PromptImages): `text` random text tokens with one image in their middle, then
    three more text tokens (the prompt ends in text, as a chat template's generation prompt does)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(3, 88, (text + 3,), generator=g)
    tokens, images = tiny_image(family, seed, grid)
    return torch.cat([words[: text // 2], tokens, words[text // 2 :]]), images


def plain_greedy_with_images(model, prompt: torch.Tensor, images, max_new_tokens: int) -> list[int]:
    """The reference with images: transformers' own greedy generate, given the image inputs the
    family's processor would give (pixel values, grids, which tokens are image tokens)."""
    from drafthead.ground.target.media import token_types

    if images is None:
        return plain_greedy(model, prompt[None], max_new_tokens)
    kwargs = {"pixel_values": images.pixel_values}
    types = token_types(model.config, prompt[None])
    if images.image_grid_thw is not None:
        kwargs.update(image_grid_thw=images.image_grid_thw, mm_token_type_ids=types)
    else:
        kwargs["token_type_ids"] = types.long()
    # an explicit mask: generate would otherwise take a prompt token equal to the pad id for padding
    out = model.generate(
        prompt[None],
        attention_mask=torch.ones_like(prompt[None]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=2,
        **kwargs,
    )
    return out[0, prompt.numel() :].tolist()
