"""Long prompts from chats (inference/bench/long_prompts.py, `drafthead data long-prompts`): whole exchanges
joined in order, each prompt within its token budget and past three quarters of it, ending on a
question, no exchange used twice; bench reads the file."""

import json

import pytest

from drafthead.inference.bench.prompts import load_prompts
from drafthead.inference.bench.long_prompts import exchanges, long_chats, prompt_tokens
from drafthead.train.data.tiny import tiny_tokenizer


def chats(n: int, words: int = 4):
    return [
        {
            "id": str(i),
            "messages": [
                {"role": "user", "content": f"question {i} " + "about numbers " * words},
                {"role": "assistant", "content": f"answer {i} " + "one two three " * words},
                {"role": "user", "content": f"and {i} again?"},  # no answer: never used
            ],
        }
        for i in range(n)
    ]


def test_prompts_fill_their_budget_with_whole_exchanges_and_end_on_a_question():
    tok = tiny_tokenizer()
    prompts = long_chats(chats(60), tok, 600, 3)
    assert [p["id"] for p in prompts] == ["long600-0", "long600-1", "long600-2"]
    seen = []
    for p in prompts:
        messages = p["messages"]
        assert 450 < prompt_tokens(tok, messages) <= 600
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2) + ["user"]
        seen += [m["content"] for m in messages if m["role"] == "user"]
    assert len(seen) == len(set(seen))  # no exchange twice
    assert not any(s.startswith("and ") for s in seen)  # unanswered turns are not exchanges
    assert len(list(exchanges(chats(4)))) == 4


def test_running_out_and_an_exchange_longer_than_the_budget():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"ran out after [1-4] of 5 prompts of 600 tokens"):
        long_chats(chats(12), tok, 600, 5)
    huge = chats(1, words=400) + chats(30)
    first = long_chats(huge, tok, 600, 1)[0]["messages"]
    assert all(len(m["content"]) < 1000 for m in first)  # the exchange over budget was skipped


def test_the_cli_writes_a_file_bench_reads_and_never_replaces_one(tmp_path, capsys):
    from drafthead.cli import main
    from drafthead.train.data.tiny import save_tiny_target

    target = save_tiny_target(tmp_path / "tiny", chats=5)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats(40)))
    out = tmp_path / "long.jsonl"
    args = [
        "data",
        "long-prompts",
        "--source",
        "json",
        "--path",
        str(data),
        "--target",
        str(target),
        "--tokens",
        "600",
        "--count",
        "2",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    prompts = load_prompts(out)
    assert len(prompts) == 2 and prompts[0].messages[-1]["role"] == "user" and len(prompts[0].messages) > 3
    assert main(args) == 2
    assert "exists, and long-prompts never replaces a file" in capsys.readouterr().err
    # a second copy writing the same file while the first holds it is refused, and writes nothing
    from drafthead.ground.outdir import output_lock

    other = tmp_path / "other.jsonl"
    with output_lock(other):
        assert main(args[:-1] + [str(other)]) == 2
    assert "is being written by another drafthead process" in capsys.readouterr().err and not other.exists()
