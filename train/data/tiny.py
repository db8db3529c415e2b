"""A tiny random target (2-layer Llama, byte-level BPE with a ChatML template) and synthetic chats.

For tests and smoke runs of the whole pipeline without a real model (docs/style.md 10): everything is
built offline and deterministically from a seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ...ground.outdir import fresh_folder

# ChatML like SmolLM2's, without its default system prompt.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = "zero one two three four five six seven eight nine ten red green blue cat dog bird sun moon tree".split()


def tiny_conversations(n: int, seed: int = 0, max_turns: int = 2) -> list[list[dict]]:
    """Synthetic chats with a learnable pattern: the assistant continues a word sequence."""
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, max_turns)):
            start, length = rng.randrange(len(_WORDS)), rng.randint(3, 8)
            seq = [_WORDS[(start + k) % len(_WORDS)] for k in range(length)]
            messages.append({"role": "user", "content": "continue: " + " ".join(seq[:2])})
            messages.append({"role": "assistant", "content": " ".join(seq)})
        convs.append(messages)
    return convs


def write_tiny_jsonl(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write `n` synthetic chats as OpenAI-form JSONL (one `{id, messages}` per line)."""
    path = Path(path)
    with path.open("w") as f:
        for i, messages in enumerate(tiny_conversations(n, seed)):
            f.write(json.dumps({"id": f"tiny-{i}", "messages": messages}) + "\n")
    return path


def tiny_tokenizer(vocab_size: int = 320):
    """Byte-level BPE trained on the synthetic chats; fast (has offsets) and has a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [m["content"] for conv in tiny_conversations(200, seed=1234) for m in conv]
    corpus += ["user", "assistant", "system", "Hello! How can I help?"]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_sizes(vocab_size: int, hidden_size: int, num_layers: int, max_positions: int) -> dict:
    """The config sizes every tiny target shares, whatever its family: 4 attention heads over 2 KV
    heads and an MLP twice the hidden width."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )


def build_tiny(config_cls, model_cls, *, seed: int = 0, attn: str | None = None, **config_kwargs):
    """A random `model_cls` of `config_cls(**config_kwargs)`, initialised from `seed` (eval mode):
    the one place a tiny model is built, for `data tiny-target` and for the tests' families."""
    import torch

    config = config_cls(**config_kwargs)
    if attn is not None:
        config._attn_implementation = attn
    torch.manual_seed(seed)
    return model_cls(config).eval()


def tiny_target(tokenizer, hidden_size: int = 64, num_layers: int = 2, seed: int = 0):
    """A random LlamaForCausalLM sized to `tokenizer` (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    sizes = tiny_sizes(len(tokenizer), hidden_size, num_layers, max_positions=1024)
    return build_tiny(LlamaConfig, LlamaForCausalLM, seed=seed, tie_word_embeddings=True, **sizes, **ids)


CHATS_FILE = "chats.jsonl"
TINY_FILE = "tiny-target.json"  # the settings that made the folder
# The saved tiny target's depth: the fewest layers with 3 distinct decoder-layer outputs for
# EAGLE-3's default features (heads/config.py default_eagle3_layers), so every engine export takes
# a head trained on it. In-process test targets stay at 2 layers, the cheapest.
TINY_LAYERS = 4


def save_tiny_target(
    out_dir: str | Path,
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = TINY_LAYERS,
    seed: int = 0,
    chats: int = 0,
    overwrite: bool = False,
) -> Path:
    """Save a tiny random target + tokenizer as a Hugging Face folder that `from_pretrained` loads,
    with `chats` synthetic chats in CHATS_FILE (none: 0). The folder appears whole or not at all,
    and a non-empty one is replaced only with `overwrite` (ground/outdir.py)."""
    out_dir = Path(out_dir)
    tokenizer = tiny_tokenizer(vocab_size)
    model = tiny_target(tokenizer, hidden_size, num_layers, seed)
    with fresh_folder(out_dir, overwrite=overwrite, what="tiny target folder") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if chats:
            write_tiny_jsonl(tmp / CHATS_FILE, chats, seed=seed)
        settings = {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers, "seed": seed, "chats": chats}
        (tmp / TINY_FILE).write_text(json.dumps(settings, indent=1) + "\n")
    return out_dir
