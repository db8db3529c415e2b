"""The `edits` prompt set (`drafthead bench --dataset edits`): requests whose answer copies much of
the prompt (rewrite this paragraph, fix this code, proofread this email), where drafting from the
prompt is nearly free and long, so speculation pays on a small CPU (docs/results.md).

Built from the installed ShareGPT package (train/data/sources.py `sharegpt_chats` reads it for
the callers), not from a model's behaviour: a conversation qualifies
when its first user turn asks for an edit near its start (`EDIT_VERBS`), holds the text to edit
(EDIT_CHARS), and ShareGPT's own first answer copies it: at least COPIED of the answer's word
4-grams occur in the prompt. The set is the qualifying first turns in file order, each text once;
it changes only with the ShareGPT package.
"""

from __future__ import annotations

import itertools
import re
from typing import Iterable

from .prompts import Prompt

EDITS = "edits"
EDIT_VERBS = re.compile(r"\b(rewrite|re-write|fix|correct|edit|proofread|rephrase|refactor|improve|revise|paraphrase)\b", re.I)
VERB_WITHIN = 200  # characters from the start of the request
EDIT_CHARS = (300, 3000)  # the request's length: room for a text to edit, short enough for a 2-core CPU
COPIED = 0.3  # the share of the reference answer's word 4-grams found in the prompt
SCAN = 20000  # ShareGPT conversations read at most (the package's file holds about 17,000)


def fourgrams(text: str) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + 4]) for i in range(len(words) - 3)}


def copied_share(prompt: str, answer: str) -> float:
    """The share of the answer's word 4-grams that occur in the prompt (0 for answers under 4 words)."""
    said = fourgrams(answer)
    return len(said & fourgrams(prompt)) / len(said) if said else 0.0


def is_edit(prompt: str, answer: str) -> bool:
    return (
        EDIT_CHARS[0] <= len(prompt) <= EDIT_CHARS[1]
        and EDIT_VERBS.search(prompt[:VERB_WITHIN]) is not None
        and copied_share(prompt, answer) >= COPIED
    )


def edit_prompts(chats: Iterable[dict], limit: int | None = None) -> list[Prompt]:
    """The edits set (module docstring) among `chats`, ShareGPT's conversations in file order
    (the first SCAN are read), its first `limit` prompts (None: all)."""
    out, seen = [], set()
    for chat in itertools.islice(chats, SCAN):
        messages = chat["messages"]
        if (
            len(messages) >= 2
            and messages[0]["role"] == "user"
            and messages[1]["role"] == "assistant"
            and messages[0]["content"] not in seen
            and is_edit(messages[0]["content"], messages[1]["content"])
        ):
            seen.add(messages[0]["content"])
            out.append(Prompt(text=messages[0]["content"], category=EDITS, id=chat["id"]))
            if limit is not None and len(out) >= limit:
                break
    return out
