"""Chat conversations -> token ids + a loss mask on the assistant's tokens.

The loss mask marks every token of each assistant reply *and* the end-of-turn token that closes
it (`<|im_end|>` for SmolLM2): a draft head must learn to predict where the answer stops.
Templates such as SmolLM2's have no `{% generation %}` markers, so the assistant spans are derived
by rendering prefixes of the conversation (docs/acceptance.md lists the mask off-by-one as a known
complaint about other trainers):

    prefix_i = render(messages[:i], add_generation_prompt=True)   # ends with "<|im_start|>assistant\n"
    upto_i   = render(messages[:i+1])                             # ends with "...content<|im_end|>\n"
    span_i   = [len(prefix_i), len(upto_i.rstrip()))              # content + "<|im_end|>", not the "\n"

Both renders must be prefixes of the full render (checked; a template that rewrites earlier turns
raises). The text is then tokenized piece by piece, cut at the span boundaries, so no token
straddles a boundary: SmolLM2's BPE would otherwise merge the header's "\n" with an answer's
leading spaces into one token, half prompt and half label. Piecewise is also what generation
sees: the prompt ends with the header's own tokens and the answer's tokens start fresh.

A tokenizer without a chat template gets inference/bench/prompts.py's plain format, the one generation
uses for it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import datasets

from ..inference.bench.prompts import render_chat


# Bump when the formatting or mask rules change. `.map` caches are keyed on the map function, and
# datasets hashes the functions it calls by module and name only, not by their code: without a
# bump, a changed rule would read samples tokenized under the old one.
FORMAT_VERSION = 1


class ChatTemplateError(ValueError):
    pass


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(full rendered text, [start, end) character span of each assistant turn incl. its end-of-turn text)."""
    text = render_chat(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render_chat(tokenizer, messages[: i + 1]).rstrip()
        if not text.startswith(prefix) or not text.startswith(upto) or len(upto) <= len(prefix):
            raise ChatTemplateError(
                f"the chat template does not render turn {i} as a prefix of the whole conversation; "
                "assistant spans cannot be derived by prefix rendering"
            )
        spans.append((len(prefix), len(upto)))
    return text, spans


def end_of_turn_text(tokenizer) -> str:
    """What the template writes right after an assistant reply, e.g. '<|im_end|>' (whitespace stripped)."""
    probe = "d5a1e7"
    text = render_chat(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": probe}])
    return text[text.rindex(probe) + len(probe) :].strip()


def stop_token_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: the end-of-turn token (when it is one token) and eos."""
    ids = []
    eot = end_of_turn_text(tokenizer)
    if eot:
        eot_ids = tokenizer.encode(eot, add_special_tokens=False)
        if len(eot_ids) == 1:
            ids.append(eot_ids[0])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@dataclass
class FormattedChat:
    input_ids: list[int]
    loss_mask: list[bool]  # True on assistant tokens (the labels the heads learn)
    truncated: bool


def format_conversation(tokenizer, messages: list[dict], max_length: int) -> FormattedChat:
    """Tokenize one conversation with the chat template; keep the first `max_length` tokens."""
    text, spans = assistant_char_spans(tokenizer, messages)
    pieces, pos = [], 0  # (text, is_label) alternating prompt / assistant span
    for start, end in spans:
        pieces += [(text[pos:start], False), (text[start:end], True)]
        pos = end
    pieces.append((text[pos:], False))
    ids: list[int] = []
    mask: list[bool] = []
    for piece, is_label in pieces:
        if piece:
            # add_special_tokens=False: the template already writes BOS/system tokens where the model wants them
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
            ids += piece_ids
            mask += [is_label] * len(piece_ids)
    truncated = len(ids) > max_length
    return FormattedChat(ids[:max_length], mask[:max_length], truncated)


@dataclass
class FormatReport:
    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    loss_tokens: int = 0

    def to_dict(self):
        return asdict(self)

    def summary(self) -> str:
        return (
            f"formatted {self.kept}/{self.conversations} conversations, {self.tokens} tokens "
            f"({self.loss_tokens} assistant), {self.truncated} truncated, dropped {self.dropped or 'none'}"
        )


def format_row(tokenizer, row: dict, max_length: int) -> dict:
    """One {id, messages} row -> {input_ids, loss_mask, truncated, n_loss, n_tokens}: the `.map`
    function of both the cached path (below) and the streaming one (train/streaming.py).
    A template that cannot format the row raises ChatTemplateError naming the row's id."""
    try:
        f = format_conversation(tokenizer, row["messages"], max_length)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"conversation {row.get('id')!r}: {e}") from e
    return {"input_ids": f.input_ids, "loss_mask": f.loss_mask, "truncated": f.truncated, "n_loss": sum(f.loss_mask),
            "n_tokens": len(f.input_ids)}


def has_loss(n_loss: int) -> bool:
    """A formatted sample keeps at least one labelled (assistant) token within max_length."""
    return n_loss > 0


def _column_sum(dataset: datasets.Dataset, column: str) -> int:
    """Sum of an integer column without turning it into Python objects (respects `.filter`)."""
    import pyarrow.compute as pc

    return int(pc.sum(dataset.with_format("arrow")[column]).as_py() or 0)


def tokenize_conversations(
    dataset: datasets.Dataset, tokenizer, max_length: int, num_proc: int | None = None
) -> tuple[datasets.Dataset, FormatReport]:
    """`messages` dataset -> dataset with `id`, `input_ids`, `loss_mask`; drops (and counts) samples
    with no assistant token inside `max_length`.

    `.map` and `.filter` run in `num_proc` processes and are cached by fingerprint (the input's
    fingerprint, the function with its tokenizer, `max_length` and FORMAT_VERSION): on a dataset from
    `load_conversations`, which is memory-mapped from $DRAFTHEAD_CACHE/data, the cache files sit
    beside it and a second call reads them instead of tokenizing again. An in-memory dataset
    (`use_cache=False`) is tokenized every time.
    """

    def fmt(row, version=FORMAT_VERSION):  # a default value is hashed with the function: the version keys the cache
        return format_row(tokenizer, row, max_length)

    mapped = dataset.map(fmt, remove_columns=[c for c in dataset.column_names if c != "id"], num_proc=num_proc,
                         desc="chat template")
    out = mapped.filter(has_loss, input_columns="n_loss", num_proc=num_proc, desc="drop samples without labels")
    report = FormatReport(conversations=len(mapped), kept=len(out), truncated=_column_sum(mapped, "truncated"))
    if len(out) < len(mapped):
        report.dropped = {"no_assistant_token_within_max_length": len(mapped) - len(out)}
    report.loss_tokens = _column_sum(out, "n_loss")
    report.tokens = _column_sum(out, "n_tokens")
    return out.remove_columns(["truncated", "n_loss", "n_tokens"]), report
