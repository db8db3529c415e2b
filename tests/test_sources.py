"""Conversation sources (ShareGPT salvage, both JSON forms, role mapping, drop counts, cache) and
self-distillation regeneration (multi-turn feeding, resume, torn-line repair) with a stub model."""

from __future__ import annotations

import json

import pytest
import torch

from drafthead.inference.drafters.settings import TreeSettings
from drafthead.train.data.chat_format import tokenize_conversations
from drafthead.train.regeneration.regenerate import RegenerateSettings, done_ids, regenerate
from drafthead.train.data.sources import EmptySourceError, load_conversations, normalize_record, read_conversations
from drafthead.train.data.tiny import tiny_tokenizer


def sharegpt_record(i, turns=(("human", "hi"), ("gpt", "hello"))):
    return {"id": f"r{i}", "conversations": [{"from": f, "value": f"{v} {i}"} for f, v in turns]}


def test_truncated_array_is_salvaged_record_by_record(tmp_path):
    records = [sharegpt_record(i) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"r4"') + 10  # inside the 5th record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    rows, report = read_conversations(path)
    assert [r["id"] for r in rows] == ["r0", "r1", "r2", "r3"]
    assert report.file_truncated and report.records_read == 4 and report.truncated_at_char is not None
    assert "truncated" in report.summary()
    # cut right after a comma between records: still a cut, nothing lost before it
    path.write_text(text[: text.index('"r3"') - 10].rstrip().rstrip("{").rstrip())
    rows, report = read_conversations(path)
    assert len(rows) == 3 and report.file_truncated
    # a complete file is not reported as cut
    path.write_text(text)
    rows, report = read_conversations(path)
    assert len(rows) == 5 and not report.file_truncated


def test_both_forms_and_jsonl_normalise_to_messages(tmp_path):
    openai = {
        "id": "o1",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    }
    share = {
        "id": "s1",
        "conversations": [
            {"from": "human", "value": "q2"},
            {"from": "chatgpt", "value": "a2"},
            {"from": "user", "value": "q3"},
            {"from": "bard", "value": "a3"},
        ],
    }
    (tmp_path / "a.json").write_text(json.dumps([openai, share]))
    (tmp_path / "a.jsonl").write_text(json.dumps(openai) + "\n" + json.dumps(share) + "\n")
    for name in ("a.json", "a.jsonl"):
        ds, report = load_conversations("json", str(tmp_path / name), use_cache=False)
        assert ds["id"] == ["o1", "s1"]
        assert ds[0]["messages"] == openai["messages"]
        assert [m["role"] for m in ds[1]["messages"]] == ["user", "assistant", "user", "assistant"]
        assert ds[1]["messages"][3]["content"] == "a3"
        assert report.conversations == 2 and report.dropped_conversations == {} and report.dropped_turns == {}


def test_unknown_roles_and_invalid_conversations_are_counted():
    ok, dropped, reason = normalize_record(
        {"conversations": [{"from": "human", "value": "q"}, {"from": "narrator", "value": "x"}, {"from": "gpt", "value": "a"}]}
    )
    assert reason is None and [m["role"] for m in ok] == ["user", "assistant"] and dropped == {"unknown_role:narrator": 1}
    # dropping the unknown turn leaves two assistant turns in a row: the conversation is invalid
    _, dropped, reason = normalize_record(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "t"},
                {"role": "assistant", "content": "b"},
            ]
        }
    )
    assert reason == "not_alternating" and dropped == {"unknown_role:tool": 1}
    # ShareGPT parts that start mid-answer lose the leading answer; a trailing question is cut
    ok, dropped, reason = normalize_record(
        {
            "conversations": [
                {"from": "gpt", "value": "tail"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
                {"from": "human", "value": "q2"},
            ]
        }
    )
    assert reason is None and [m["content"] for m in ok] == ["q", "a"]
    assert dropped == {"leading_assistant": 1, "trailing_user": 1}
    assert normalize_record({"conversations": [{"from": "human", "value": "q"}]})[2] == "no_user_assistant_exchange"
    assert normalize_record({"text": "no chat"})[2] == "no_conversation_field"


def test_report_counts_over_a_file(tmp_path):
    records = [
        sharegpt_record(0),
        sharegpt_record(1, (("human", "q"), ("alien", "?"), ("gpt", "a"))),
        sharegpt_record(2, (("gpt", "a"), ("gpt", "b"))),
        sharegpt_record(0),
    ]  # r0 twice
    (tmp_path / "c.json").write_text(json.dumps(records))
    ds, report = load_conversations("json", str(tmp_path / "c.json"), use_cache=False)
    assert len(ds) == 2 + 1  # r2 has no user turn
    assert report.dropped_turns["unknown_role:alien"] == 1
    assert report.dropped_conversations == {"no_user_assistant_exchange": 1}
    assert report.renamed_duplicate_ids == 1 and ds["id"][-1] == "r0#1"


def test_empty_result_is_a_clear_error(tmp_path):
    (tmp_path / "e.json").write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "only answers"}]}]))
    with pytest.raises(EmptySourceError, match="no usable conversation.*no_user_assistant_exchange"):
        load_conversations("json", str(tmp_path / "e.json"), use_cache=False)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(EmptySourceError):
        load_conversations("json", str(tmp_path / "empty.jsonl"), use_cache=False)
    with pytest.raises(ValueError, match="unknown source"):
        load_conversations("reddit")


def test_limit_and_disk_cache(tmp_path, isolated_cache):
    (tmp_path / "d.json").write_text(json.dumps([sharegpt_record(i) for i in range(10)]))
    ds, report = load_conversations("json", str(tmp_path / "d.json"), limit=3)
    assert len(ds) == 3 and report.stopped_at_limit
    cached = list((isolated_cache / "data").iterdir())
    assert len(cached) == 1 and (cached[0] / "report.json").exists()
    again, report2 = load_conversations("json", str(tmp_path / "d.json"), limit=3)
    assert again["id"] == ds["id"] and report2 == report
    assert len(list((isolated_cache / "data").iterdir())) == 1  # served from the cache


def test_sharegpt_package_file_is_salvaged():
    rows, report = read_conversations(__import__("drafthead.train.data.sources", fromlist=["x"]).sharegpt_path(), source_name="sharegpt")
    assert report.file_truncated and report.records_read == 17671  # docs/models-and-data.md
    assert report.conversations == len(rows) > 17000
    assert report.dropped_turns.get("leading_assistant", 0) > 0
    assert all(m["role"] in ("system", "user", "assistant") for r in rows[:500] for m in r["messages"])


# ---------------------------------------------------------------------------------------------- regenerate


class StubTarget(torch.nn.Module):
    """generate() appends 'ans<k>' + <|im_end|> and records the (unpadded) prompts it saw."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tok, self.w = tokenizer, torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"max_position_embeddings": 4096})()
        self.prompts, self.calls = [], 0

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        assert (attention_mask[:, -1] == 1).all()  # left padding
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            self.prompts.append(self.tok.decode(ids[mask.bool()]))
            self.calls += 1
            new = self.tok.encode(f"ans{self.calls}", add_special_tokens=False) + [eos_token_id[0]]
            rows.append(torch.tensor(ids.tolist() + new))
        width = max(len(r) for r in rows)
        return torch.stack([torch.cat([r, torch.full((width - len(r),), pad_token_id)]) for r in rows])


def test_regenerate_feeds_own_answers_and_resumes(tmp_path):
    tok = tiny_tokenizer()
    convs = [
        {
            "id": "a",
            "messages": [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": "two"},
                {"role": "assistant", "content": "old"},
            ],
        },
        {"id": "b", "messages": [{"role": "user", "content": "three"}, {"role": "assistant", "content": "old"}]},
        {"id": "c", "messages": [{"role": "user", "content": "four"}, {"role": "assistant", "content": "old"}]},
    ]
    out = tmp_path / "regen.jsonl"
    stub = StubTarget(tok)
    report = regenerate(stub, tok, convs[:2], out, RegenerateSettings(max_new_tokens=8, batch_size=2), progress=False)
    assert report.written == 2 and report.turns_answered == 3 and report.answers_cut == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    a = records[0]["messages"]
    assert [m["content"] for m in a] == ["one", "ans1", "two", "ans3"]  # turn 2 answered after a's own ans1
    second_turn_prompt = stub.prompts[2]
    assert "ans1" in second_turn_prompt and "old" not in second_turn_prompt
    assert second_turn_prompt.endswith("<|im_start|>assistant\n")

    # an interrupted write leaves a torn line: it is cut, finished ids are skipped
    with open(out, "a") as f:
        f.write('{"id": "c", "messa')
    assert done_ids(out) == {"a", "b"} and out.read_text().endswith("\n")
    stub2 = StubTarget(tok)
    report = regenerate(stub2, tok, convs, out, RegenerateSettings(max_new_tokens=8, batch_size=2), progress=False)
    assert report.already_done == 2 and report.written == 1 and stub2.calls == 1
    ds, _ = load_conversations("regenerated", str(out), use_cache=False)
    assert ds["id"] == ["a", "b", "c"]


class FixedAnswers(StubTarget):
    """generate() appends the given ids for each prompt in turn (no stop token: cut by max_new_tokens;
    one prompt per call, as unfinished rows of a batch would all be as long)."""

    def __init__(self, tokenizer, answers: list[list[int]]):
        super().__init__(tokenizer)
        self.answers = answers

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        rows = [torch.tensor(ids.tolist() + self.answers[self.calls + i]) for i, ids in enumerate(input_ids)]
        self.calls += len(rows)
        width = max(len(r) for r in rows)
        return torch.stack([torch.cat([r, torch.full((width - len(r),), pad_token_id)]) for r in rows])


def test_regenerate_keeps_the_targets_token_ids(tmp_path):
    """Issue 38 item 7: each answer keeps the ids the target produced, so an answer cut inside a
    character (its text ends in U+FFFD) or split unlike the tokenizer would split its text still
    trains on the target's tokens; the report counts the answers whose re-tokenized text differs."""
    tok = tiny_tokenizer()
    split = [i for ch in "the answer" for i in tok.encode(ch, add_special_tokens=False)]  # one token per letter
    assert tok.encode(tok.decode(split), add_special_tokens=False) != split
    cut = tok.encode("café", add_special_tokens=False)[:-1]
    plain = tok.encode("hello there", add_special_tokens=False)
    convs = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "x"}]} for i in range(3)]
    out = tmp_path / "regen.jsonl"
    report = regenerate(FixedAnswers(tok, [split, cut, plain]), tok, convs, out, RegenerateSettings(max_new_tokens=16, batch_size=1), progress=False)
    assert report.answers_with_ids == 3 and report.ids_retokenize_differ == 2 and report.answers_cut == 3
    answers = [json.loads(x)["messages"][1] for x in out.read_text().splitlines()]
    assert [a["token_ids"] for a in answers] == [split, cut, plain]
    assert answers[1]["content"].endswith("\ufffd")
    ds, _ = load_conversations("regenerated", str(out), use_cache=False)
    assert ds["answer_token_ids"] == [[split], [cut], [plain]]
    samples, formatted = tokenize_conversations(ds, tok, max_length=256)
    assert formatted.answer_ids_kept == 3 and formatted.answer_ids_unmatched == 0
    for row, ids in zip(samples, [split, cut, plain]):
        labels = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert labels[: len(ids)] == ids and len(labels) == len(ids) + 1  # and the end-of-turn token


@pytest.mark.parametrize("proposer", ["prompt-lookup", "eagle3", "eagle3-policy"])
def test_regenerate_through_speculative_decoding_gives_the_plain_answers(tmp_path, proposer):
    """fp32 greedy: answering through our batched speculative decoding writes the same records as
    answering with transformers' generate() (multi-turn, prompts of different lengths per batch);
    with the load policy too (`data regenerate --speculative`'s default), on a made-up cost curve
    under which some rounds draft and some decode plainly."""
    from drafthead.inference.engine.policy import SpeculationPolicy
    from drafthead.inference.engine.sizing import set_policy
    from drafthead.heads.registry import build_head, make_config
    from drafthead.inference.drafters.head_drafters import EagleDrafter
    from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
    from tests.tiny import tiny_causal_lm

    tok = tiny_tokenizer()
    target = tiny_causal_lm(
        "llama", vocab=len(tok), layers=4, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id
    )
    if proposer.startswith("eagle3"):
        head = build_head(make_config("eagle3", target, tok, name="tiny"), target).eval()
        drafter = EagleDrafter(head, TreeSettings(num_draft=8, depth=3, branch=3))
    else:
        drafter = PromptLookupDrafter(length=4)
    convs = [
        {
            "id": str(i),
            "messages": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "and then " * (i + 1)},
            ],
        }
        for i, text in enumerate(["hi", "tell me a story about a cat", "the the the the"])
    ]
    plain, spec = tmp_path / "plain.jsonl", tmp_path / "spec.jsonl"
    regenerate(target, tok, convs, plain, RegenerateSettings(max_new_tokens=12, batch_size=1), progress=False)
    policy = SpeculationPolicy(lambda tokens: 1.0 + 0.05 * tokens, probe_every=2) if proposer.endswith("policy") else None
    if policy is not None:
        set_policy(target, drafter, policy)
    settings = RegenerateSettings(max_new_tokens=12, batch_size=3)
    report = regenerate(target, tok, convs, spec, settings, progress=False, drafter=drafter, sizing="fixed" if policy is None else "policy")
    assert report.written == 3 and report.turns_answered == 6
    assert spec.read_text() == plain.read_text()
    if policy is not None:
        assert 1 in policy.decisions and max(policy.decisions) > 1  # both plain and drafted rounds ran
