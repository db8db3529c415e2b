"""A conversation as the text a target reads: the tokenizer's chat template, or the plain format
for a tokenizer without one (a base model such as Gemma-3-270M): the tokenizer's own BOS, the
turns' texts separated by a blank line, EOS after each answer, and a blank line as the generation
prompt. Generation (inference/bench/prompts.py `encode_chat`) and training (train/data/chat_format.py)
both render with `render_chat`, so a head learns the format it is served with
(docs/models-and-data.md "Targets without a chat template")."""

from __future__ import annotations

import logging

# The plain format of a tokenizer without a chat template (this module's docstring). `bos` is the text
# of the BOS the tokenizer adds by itself, "" when it adds none (GPT-2).
# The blank lines are string literals: transformers renders templates with trim_blocks, which
# drops the first newline after a block tag.
PLAIN_CHAT_TEMPLATE = (
    "{{ bos }}{% for m in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n\\n' }}{% endif %}"
)
_log = logging.getLogger(__name__)
_told_plain: set[str] = set()  # tokenizers already told about the plain format, by name


def _bos_text(tokenizer) -> str:
    """The BOS token's text when the tokenizer adds one by itself, else ""."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token if bos is not None and ids and ids[0] == bos else ""


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text: the tokenizer's chat template, or PLAIN_CHAT_TEMPLATE when it has none."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    name = str(getattr(tokenizer, "name_or_path", ""))
    if name not in _told_plain:
        _told_plain.add(name)
        _log.warning(
            "tokenizer %r has no chat template: conversations use the plain format (turns separated by a blank line, EOS after each answer)", name
        )
    return tokenizer.apply_chat_template(
        messages, chat_template=PLAIN_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=add_generation_prompt, bos=_bos_text(tokenizer)
    )
