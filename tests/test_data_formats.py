"""Local data formats through `datasets` (json, jsonl, parquet, csv, arrow, save_to_disk folders),
one clear error per kind of bad data, the tokenization cache, and the streaming path (order,
rank sharding, exact resume, held-out eval). docs/models-and-data.md, "Data formats and streaming"."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import datasets
import pyarrow as pa
import pytest

from drafthead.train.data import chat_format, json_records, sources
from drafthead.train.data.chat_format import ChatTemplateError, tokenize_conversations
from drafthead.train.data.samples import TokenDataset
from drafthead.train.data.sources import EmptySourceError, load_conversations, read_conversations
from drafthead.train.data.streaming import TokenStream, rank_batches

OPENAI = [
    {"id": "o1", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]},
    {
        "id": "o2",
        "messages": [
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"},
            {"role": "user", "content": "q3"},
            {"role": "assistant", "content": "a3"},
        ],
    },
]
SHAREGPT = [{"id": "s1", "conversations": [{"from": "human", "value": "q4"}, {"from": "narrator", "value": "x"}, {"from": "gpt", "value": "a4"}]}]


def chat(i: int) -> dict:
    """A conversation whose tokens are unique to `i` (the id is in both turns)."""
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"continue: {i}"}, {"role": "assistant", "content": f"{i} one two three"}]}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def as_table(records) -> datasets.Dataset:
    """Records as one table; a record without some column gets None there (from_list would keep
    only the first record's columns)."""
    columns = dict.fromkeys(k for r in records for k in r)
    return datasets.Dataset.from_dict({c: [r.get(c) for r in records] for c in columns})


def write_arrow(path, records):
    table = as_table(records).data.table
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def rows_of(ds) -> list[tuple[str, list]]:
    return [(r["id"], r["messages"]) for r in ds]


def key(sample) -> tuple[int, ...]:
    return tuple(sample["input_ids"].tolist())


# ---------------------------------------------------------------------------------------------- formats


def test_every_local_format_gives_the_same_conversations(tmp_path):
    records = OPENAI + SHAREGPT
    expected, report = read_conversations(write_jsonl(tmp_path / "a.jsonl", records))
    expected = [(r["id"], r["messages"]) for r in expected]
    assert [i for i, _ in expected] == ["o1", "o2", "s1"] and report.dropped_turns == {"unknown_role:narrator": 1}

    (tmp_path / "a.json").write_text(json.dumps(records))
    table = as_table(records)
    table.to_parquet(str(tmp_path / "a.parquet"))
    write_arrow(tmp_path / "a.arrow", records)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "saved_dict"))
    write_csv(
        tmp_path / "a.csv",
        ["id", "messages", "conversations"],
        [[r["id"], json.dumps(r.get("messages", "")), json.dumps(r["conversations"]) if "conversations" in r else ""] for r in records],
    )
    for name, fmt in [
        ("a.json", "json"),
        ("a.jsonl", "json"),
        ("a.parquet", "parquet"),
        ("a.arrow", "arrow"),
        ("saved", "saved"),
        ("saved_dict", "saved"),
        ("a.csv", "csv"),
    ]:
        ds, report = load_conversations("file", str(tmp_path / name), use_cache=False)
        assert rows_of(ds) == expected, name
        assert report.format == fmt and report.records_read == 3 and report.dropped_turns == {"unknown_role:narrator": 1}
    # the `json` source reads the same file as `file` does
    assert rows_of(load_conversations("json", str(tmp_path / "a.json"), use_cache=False)[0]) == expected


def test_csv_prompt_response_columns(tmp_path):
    path = write_csv(
        tmp_path / "pr.csv", ["id", "system", "prompt", "response"], [["1", "", "q1", "a1"], ["2", "be brief", "q2", "a2"], ["3", "", "q3", ""]]
    )
    ds, report = load_conversations("file", str(path), use_cache=False)
    assert rows_of(ds) == [
        ("1", [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]),
        ("2", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]),
    ]
    assert report.dropped_conversations == {"empty_assistant_turn": 1}
    assert report.first_dropped == {"empty_assistant_turn": "record 2 (id '3', keys: id, system, prompt, response)"}


def test_source_names_and_format_errors(tmp_path):
    (tmp_path / "a.txt").write_text("{}")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_conversations("file", str(tmp_path / "a.txt"), use_cache=False)
    datasets.Dataset.from_list(OPENAI).to_parquet(str(tmp_path / "a.parquet"))
    with pytest.raises(ValueError, match="looks like parquet.*use source 'file'"):
        load_conversations("json", str(tmp_path / "a.parquet"), use_cache=False)
    table = datasets.Dataset.from_list(OPENAI)
    datasets.DatasetDict({"a": table, "b": table}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ValueError, match="none is 'train'"):
        load_conversations("file", str(tmp_path / "two"), use_cache=False)


def salvage_slow(text: str) -> tuple[list, bool]:
    """The whole-text decoder the chunked one replaced: raw_decode record by record over the full
    string. (records, whether the file is cut)."""
    decoder, records, i = json.JSONDecoder(), [], text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\t\r,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return records, i >= len(text)
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return records, True
        records.append(record)


def test_chunked_json_array_decoder_slow_twin(tmp_path, monkeypatch):
    """Read 5 characters at a time, the decoder sees records, strings and separators split at every
    possible place; cut at every position, it salvages what the whole-text decoder salvages."""
    monkeypatch.setattr(json_records, "_CHUNK", 5)
    records = [chat(0), {"id": "tricky", "messages": [{"role": "user", "content": '],[{"\\ ünï ✓'}]}, 12345, chat(1)]
    text = json.dumps(records, indent=1, ensure_ascii=False)
    path = tmp_path / "a.json"
    for cut in range(text.index("[") + 1, len(text) + 1):
        path.write_text(text[:cut], encoding="utf-8")
        report = sources.SourceReport(source="t")
        got = list(sources.iter_records(path, report))
        assert (got, report.file_truncated) == salvage_slow(text[:cut]), cut
        assert report.records_read == len(got)


def test_num_proc_tokenizes_alike_and_names_bad_conversations(tmp_path, tiny_tokenizer):
    ds, _ = load_conversations("json", str(write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(8)])), use_cache=False)
    one, report = tokenize_conversations(ds, tiny_tokenizer, max_length=64)
    two, report2 = tokenize_conversations(ds, tiny_tokenizer, max_length=64, num_proc=2)
    assert two["input_ids"] == one["input_ids"] and two["loss_mask"] == one["loss_mask"] and report2 == report
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{{ messages[-1]['content'] }}"
    with pytest.raises(ChatTemplateError, match="conversation 'c"):  # raised in a worker, re-raised here
        tokenize_conversations(ds, tok, max_length=64, num_proc=2)


# ---------------------------------------------------------------------------------------------- errors


def test_records_without_a_chat_field_name_the_file_and_first_record(tmp_path):
    path = write_jsonl(tmp_path / "text.jsonl", [{"id": "t1", "text": "hi"}, {"id": "t2", "text": "ho"}])
    with pytest.raises(EmptySourceError, match=r"text\.jsonl: none of its 2 records has 'messages'.*record 0 \(id 't1', keys: id, text\)"):
        load_conversations("json", str(path), use_cache=False)
    datasets.Dataset.from_list([{"text": "hi"}]).to_parquet(str(tmp_path / "text.parquet"))
    with pytest.raises(EmptySourceError, match=r"text\.parquet: none of its 1 records.*record 0 \(keys: text\)"):
        load_conversations("file", str(tmp_path / "text.parquet"), use_cache=False)
    # some usable: the others are counted, with the first one named, and loading goes on
    ds, report = load_conversations("json", str(write_jsonl(tmp_path / "mixed.jsonl", [{"x": 1}, chat(0), [1, 2]])), use_cache=False)
    assert len(ds) == 1 and report.dropped_conversations == {"no_conversation_field": 2}
    assert report.first_dropped == {"no_conversation_field": "record 0 (keys: x)"}
    # every record dropped for a rule: the error names the commonest reason's first record
    path = write_jsonl(tmp_path / "answers.jsonl", [{"id": "g", "conversations": [{"from": "gpt", "value": "a"}]}])
    with pytest.raises(EmptySourceError, match=r"answers\.jsonl.*first no_user_assistant_exchange: record 0 \(id 'g'"):
        load_conversations("json", str(path), use_cache=False)


def test_empty_sources_and_bad_lines_name_the_file(tmp_path):
    for name, text in [("empty.jsonl", ""), ("blank.json", "  \n"), ("empty_array.json", "[]")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(EmptySourceError, match=f"{name}: it holds no records"):
            load_conversations("json", str(tmp_path / name), use_cache=False)
    write_csv(tmp_path / "header.csv", ["id", "messages"], [])
    with pytest.raises(EmptySourceError, match="header.csv: it holds no records"):
        load_conversations("file", str(tmp_path / "header.csv"), use_cache=False)
    (tmp_path / "bad.jsonl").write_text(json.dumps(chat(0)) + "\n{oops\n" + json.dumps(chat(1)) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 is not valid JSON"):
        load_conversations("json", str(tmp_path / "bad.jsonl"), use_cache=False)
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 is not valid JSON"):  # the cached path says the same
        load_conversations("json", str(tmp_path / "bad.jsonl"))


def test_chat_template_errors_name_the_conversation(tmp_path, tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)  # the shared fixture stays intact
    tok.chat_template = "{{ messages[-1]['content'] }}"  # renders only the last message: no prefix rendering
    path = write_jsonl(tmp_path / "c.jsonl", [chat(0), chat(1)])
    ds, _ = load_conversations("json", str(path), use_cache=False)
    with pytest.raises(ChatTemplateError, match="conversation 'c0': the chat template does not render"):
        tokenize_conversations(ds, tok, max_length=64)
    with pytest.raises(ChatTemplateError, match="conversation 'c0': the chat template does not render"):
        TokenStream("json", str(path), tok, 64).count_batches(1)


# ---------------------------------------------------------------------------------------------- cache


def test_tokenization_is_cached_by_fingerprint(tmp_path, isolated_cache, tiny_tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(12)])
    # The fingerprint hashes the map function with every function it calls, this spy included, so
    # the spy keeps its count outside Python objects (one byte per call in a log file): its hash
    # stays the same from one call to the next.
    log, real = str(tmp_path / "calls.log"), chat_format.format_conversation

    def counting(tokenizer, messages, max_length, answer_ids=None):
        with open(log, "a") as f:
            f.write("x")
        return real(tokenizer, messages, max_length, answer_ids)

    def calls() -> int:
        return len(Path(log).read_text()) if Path(log).exists() else 0

    monkeypatch.setattr(chat_format, "format_conversation", counting)
    ds, _ = load_conversations("json", str(path))
    assert ds.cache_files and str(isolated_cache) in ds.cache_files[0]["filename"]  # memory-mapped from our cache
    first, report = tokenize_conversations(ds, tiny_tokenizer, max_length=64)
    assert calls() == 12 and report.kept == 12
    assert all(str(isolated_cache) in f["filename"] for f in first.cache_files)  # the map cache sits beside it
    again, report2 = tokenize_conversations(load_conversations("json", str(path))[0], tiny_tokenizer, max_length=64)
    assert calls() == 12, "the second call re-ran the chat template instead of reading the map cache"
    assert report2 == report and again.cache_files == first.cache_files and again["input_ids"] == first["input_ids"]
    tokenize_conversations(ds, tiny_tokenizer, max_length=32)  # another max_length: another fingerprint
    assert calls() == 24
    monkeypatch.setattr(chat_format, "FORMAT_VERSION", chat_format.FORMAT_VERSION + 1)  # changed rules
    tokenize_conversations(ds, tiny_tokenizer, max_length=64)
    assert calls() == 36


# ---------------------------------------------------------------------------------------------- streaming


def rank_batches_slow(samples, batch_size, rank, world_size, skip):
    """Obviously right: every full chunk, rank's slice, minus the first `skip`."""
    samples = list(samples)
    n_chunks = len(samples) // (world_size * batch_size)
    chunks = [samples[k * world_size * batch_size : (k + 1) * world_size * batch_size] for k in range(n_chunks)]
    return [c[rank * batch_size : (rank + 1) * batch_size] for c in chunks][skip:]


def test_rank_batches_slow_twin():
    for n in (0, 1, 7, 12, 13, 24):
        for batch_size, world_size in ((1, 1), (2, 1), (2, 3), (4, 2)):
            for rank in range(world_size):
                for skip in (0, 1, 3):
                    assert list(rank_batches(range(n), batch_size, rank, world_size, skip)) == rank_batches_slow(
                        range(n), batch_size, rank, world_size, skip
                    )
    with pytest.raises(ValueError):
        next(rank_batches(range(4), 2, rank=2, world_size=2))


@pytest.fixture(scope="module")
def stream_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("stream") / "s.jsonl", [chat(i) for i in range(40)])


def test_stream_gives_the_cached_path_samples(stream_file, tiny_tokenizer):
    ds, _ = load_conversations("json", str(stream_file), use_cache=False)
    cached = TokenDataset(tokenize_conversations(ds, tiny_tokenizer, max_length=64)[0])
    stream = TokenStream("json", str(stream_file), tiny_tokenizer, 64)
    streamed = [s for batch in stream.batches(1) for s in batch]
    assert len(streamed) == len(cached) == 40
    for s, c in zip(streamed, cached):
        assert set(s) == {"input_ids", "loss_mask"} and s["input_ids"].dtype == c["input_ids"].dtype
        assert s["input_ids"].equal(c["input_ids"]) and s["loss_mask"].equal(c["loss_mask"])


def test_stream_order_is_fixed_by_seed_and_epoch(stream_file, tiny_tokenizer):
    stream = TokenStream("json", str(stream_file), tiny_tokenizer, 64, eval_size=4, shuffle_buffer=16)
    order = lambda seed, epoch: [key(s) for b in stream.batches(2, seed=seed, epoch=epoch) for s in b]  # noqa: E731
    first = order(0, 0)
    assert order(0, 0) == first
    assert order(0, 1) != first and order(1, 0) != first
    assert len(first) == 36 and sorted(order(0, 1)) == sorted(first)  # the same samples in another order
    plain = TokenStream("json", str(stream_file), tiny_tokenizer, 64, eval_size=4)  # no buffer: file order
    file_order = [key(s) for b in plain.batches(2, seed=5, epoch=3) for s in b]
    assert file_order == [key(s) for b in plain.batches(2) for s in b] and sorted(file_order) == sorted(first)


def test_ranks_partition_each_chunk_and_end_together(stream_file, tiny_tokenizer):
    stream = TokenStream("json", str(stream_file), tiny_tokenizer, 64, eval_size=3, shuffle_buffer=8)
    world = [list(stream.batches(2, rank=r, world_size=3, seed=7, epoch=2)) for r in range(3)]
    whole = list(stream.batches(6, seed=7, epoch=2))  # one rank, batch = a whole chunk
    assert [len(w) for w in world] == [len(whole)] * 3 == [37 // 6] * 3  # the last 1 sample is dropped everywhere
    for k, chunk in enumerate(whole):
        assert [key(s) for r in range(3) for s in world[r][k]] == [key(s) for s in chunk]
    assert stream.count_batches(2, world_size=3) == len(whole)


def test_skip_resumes_exactly(stream_file, tiny_tokenizer):
    stream = TokenStream("json", str(stream_file), tiny_tokenizer, 64, eval_size=2, shuffle_buffer=8)
    full = [[key(s) for s in b] for b in stream.batches(3, rank=1, world_size=2, seed=3, epoch=1)]
    resumed = [[key(s) for s in b] for b in stream.batches(3, rank=1, world_size=2, seed=3, epoch=1, skip=4)]
    assert len(full) == 38 // 6 and resumed == full[4:]


def test_eval_samples_are_the_head_and_never_trained_on(stream_file, tiny_tokenizer):
    stream = TokenStream("json", str(stream_file), tiny_tokenizer, 64, eval_size=5, shuffle_buffer=40)
    held_out = {key(s) for s in stream.eval_samples()}
    head = [key(s) for b in TokenStream("json", str(stream_file), tiny_tokenizer, 64).batches(5) for s in b][:5]
    assert len(held_out) == 5 and held_out == set(head)
    for epoch in range(3):
        trained = [key(s) for b in stream.batches(5, epoch=epoch) for s in b]
        assert len(trained) == 35 and not held_out & set(trained)


def test_streaming_reads_every_format_and_salvages_a_cut_array(tmp_path, tiny_tokenizer):
    records = [chat(i) for i in range(6)]
    expected = [key(s) for b in TokenStream("json", str(write_jsonl(tmp_path / "a.jsonl", records)), tiny_tokenizer, 64).batches(1) for s in b]
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "a.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    write_arrow(tmp_path / "a.arrow", records)
    write_csv(tmp_path / "a.csv", ["id", "messages"], [[r["id"], json.dumps(r["messages"])] for r in records])
    for name in ("a.parquet", "saved", "a.arrow", "a.csv"):
        stream = TokenStream("file", str(tmp_path / name), tiny_tokenizer, 64)
        assert [key(s) for b in stream.batches(1) for s in b] == expected, name
    text = json.dumps(records)
    (tmp_path / "cut.json").write_text(text[: text.index('"c5"') + 8])  # inside the last record
    stream = TokenStream("json", str(tmp_path / "cut.json"), tiny_tokenizer, 64)
    assert [key(s) for b in stream.batches(1) for s in b] == expected[:5]
    assert stream.report.file_truncated and stream.report.records_read == 5


def test_streaming_too_little_data_is_one_error(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "few.jsonl", [chat(i) for i in range(5)])
    with pytest.raises(EmptySourceError, match="few.jsonl: too few usable samples.*4 go to the eval set.*= 2 more"):
        list(TokenStream("json", str(path), tiny_tokenizer, 64, eval_size=4).batches(1, world_size=2))
    path = write_jsonl(tmp_path / "none.jsonl", [{"id": "t", "text": "hi"}])
    with pytest.raises(EmptySourceError, match=r"none.jsonl: none of its 1 records.*record 0 \(id 't'"):
        TokenStream("json", str(path), tiny_tokenizer, 64).count_batches(1)
