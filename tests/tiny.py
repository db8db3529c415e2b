"""Tiny random causal LMs of several families, built in-process (docs/style.md 10)."""
from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # a small window so that tests cross it: the tree mask must apply it
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
}


def tiny_causal_lm(family: str = "llama", vocab: int = 96, seed: int = 0, layers: int = 2, hidden: int = 32,
                   dtype=torch.float32, attn: str = "sdpa", **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    # sharper random logits make greedy paths less degenerate
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.requires_grad_(False)
    return model


def repetitive_prompt(vocab: int, length: int = 12, seed: int = 0) -> torch.Tensor:
    """[1, L + L/2] random tokens (avoiding specials 0-2) whose tail repeats: lookup has matches."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (1, length), generator=g)
    return torch.cat([head, head[:, : length // 2]], dim=1)


def plain_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """The reference: transformers' own greedy generate, no EOS stopping."""
    out = model.generate(prompt, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=2)
    return out[0, prompt.shape[1]:].tolist()
