"""Long prompts from real chats: whole turns of consecutive conversations joined into one
multi-turn chat of about `tokens` tokens, ending on a user turn (docs/models-and-data.md "Long
prompts"). `bench --dataset FILE` and the tau-by-length study read them: a head trained on 2K-token
rows is measured where its drafts sit 8K or 16K tokens deep.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from ...ground.target.chat import render_chat


def exchanges(conversations: Iterable[dict]) -> Iterator[tuple[dict, dict]]:
    """(user, assistant) message pairs of the conversations, in order; unpaired turns skipped."""
    for conversation in conversations:
        messages = conversation["messages"]
        for first, second in zip(messages, messages[1:]):
            if first["role"] == "user" and second["role"] == "assistant":
                yield {"role": "user", "content": first["content"]}, {"role": "assistant", "content": second["content"]}


def prompt_tokens(tokenizer, messages: list[dict]) -> int:
    """Tokens of the chat rendered with the generation prompt, as the engine encodes it."""
    return len(tokenizer(render_chat(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False).input_ids)


def long_chats(conversations: Iterable[dict], tokenizer, tokens: int, count: int) -> list[dict]:
    """`count` prompts {id, messages}, each of at most `tokens` tokens rendered and more than
    three quarters of that: consecutive (user, assistant) exchanges, then the next exchange's user
    turn as the question. Where the question does not fit after them, the oldest exchanges are
    dropped. No exchange is used twice; a question longer than `tokens` alone is skipped. Raises
    ValueError when the conversations run out first."""
    out: list[dict] = []
    history: list[dict] = []  # whole exchanges, user and assistant turns alternating
    for user, answer in exchanges(conversations):
        candidate = history + [user]
        size = prompt_tokens(tokenizer, candidate)  # rendered once per candidate: 8K-token renders add up
        while size > tokens and history:
            history = history[2:]  # the oldest exchange goes
            candidate = history + [user]
            size = prompt_tokens(tokenizer, candidate)
        if size > tokens:  # the question alone is over budget
            history = []
            continue
        if size > 3 * tokens // 4:
            out.append({"id": f"long{tokens}-{len(out)}", "messages": candidate})
            if len(out) == count:
                return out
            history = []
            continue
        history = candidate + [answer]
    raise ValueError(f"the conversations ran out after {len(out)} of {count} prompts of {tokens} tokens")
