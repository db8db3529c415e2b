"""Prompt loading (MT-bench and JSONL forms), its errors, and chat encoding."""

from __future__ import annotations

import json

import pytest

from drafthead.inference.bench.prompts import Prompt, PromptError, encode_chat, load_prompts


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_mt_bench_has_80_first_turns_with_categories():
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80
    categories = {p.category for p in prompts}
    # MT-bench: 8 categories of 10 questions
    assert len(categories) == 8 and "uncategorized" not in categories
    assert all(sum(p.category == c for p in prompts) == 10 for c in categories)
    assert len({p.id for p in prompts}) == 80
    first = prompts[0]
    assert first.id == "81" and first.category == "writing"
    assert first.text.startswith("Compose an engaging travel blog post")
    assert "Rewrite your previous response" not in first.text  # first turn only


def test_limit_keeps_the_first_prompts():
    assert [p.id for p in load_prompts("mt-bench", limit=3)] == ["81", "82", "83"]


@pytest.mark.parametrize("limit", [0, -2])
def test_non_positive_limit_is_an_error(limit):
    with pytest.raises(PromptError, match="limit"):
        load_prompts("mt-bench", limit=limit)


def test_jsonl_forms(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "plain prompt", "category": "math", "id": "a"}),
            "",
            json.dumps({"turns": ["first turn", "second turn"]}),
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"},
                        {"role": "user", "content": "last question"},
                        {"role": "assistant", "content": "an answer to drop"},
                    ]
                }
            ),
        ],
    )
    a, b, c = load_prompts(path)
    assert (a.text, a.category, a.id, a.messages) == ("plain prompt", "math", "a", None)
    assert (b.text, b.category, b.id) == ("first turn", "uncategorized", "3")  # id = line number
    assert c.text == "last question"
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user"]
    assert c.chat_messages()[-1] == {"role": "user", "content": "last question"}


def test_empty_file_is_an_error(tmp_path):
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(PromptError, match="no prompts"):
        load_prompts(path)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "JSON object"),
        ('{"text": "wrong key"}', "'prompt', 'turns' or 'messages'"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"turns": []}', "non-empty list"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "no user message"),
        ('{"messages": [{"role": "user"}]}', "'role' and 'content'"),
    ],
)
def test_malformed_line_names_its_number(tmp_path, bad, message):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": "fine"}), bad])
    with pytest.raises(PromptError, match=message) as info:
        load_prompts(path)
    assert f"{path}:2:" in str(info.value)


def test_missing_file_and_unknown_dataset(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(PromptError, match="unknown dataset"):
        load_prompts("alpaca-eval")


def test_encode_chat_applies_the_template(tiny_tokenizer):
    ids = encode_chat(tiny_tokenizer, Prompt(text="hello world"))
    assert ids.dim() == 2 and ids.shape[0] == 1
    text = tiny_tokenizer.decode(ids[0])
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    # a plain string is the same as a Prompt holding it
    assert encode_chat(tiny_tokenizer, "hello world").equal(ids)


def test_encode_chat_keeps_the_conversation(tiny_tokenizer):
    prompt = Prompt(
        text="two",
        messages=({"role": "user", "content": "one"}, {"role": "assistant", "content": "1"}, {"role": "user", "content": "two"}),
    )
    text = tiny_tokenizer.decode(encode_chat(tiny_tokenizer, prompt)[0])
    assert text.count("<|im_start|>") == 4 and "assistant\n1<|im_end|>" in text
    assert text.endswith("<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n")


def test_encode_without_template_is_plain(tiny_tokenizer):
    import copy

    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    ids = encode_chat(plain, "hello world")
    assert plain.decode(ids[0]) == "hello world\n\n"  # the plain format's generation prompt: a blank line
    two = Prompt(text="two", messages=({"role": "user", "content": "one"}, {"role": "assistant", "content": "1"}, {"role": "user", "content": "two"}))
    assert plain.decode(encode_chat(plain, two)[0]) == f"one\n\n1{plain.eos_token}\n\ntwo\n\n"
