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

A tokenizer without a chat template gets ground/target/chat.py's plain format, the one generation
uses for it.

An answer that comes with the ids the target produced (`data regenerate` keeps them) is labelled
with those ids, not with its text re-tokenized: decoding then encoding need not give the same ids
(a different split of the same text, or an answer cut mid-character whose text holds U+FFFD), and
the head must learn the tokens the target emitted. The ids are used when they decode to exactly the
text the template renders for the answer (before its end-of-turn text); a template that rewrites
answers (trims them, drops reasoning) gets the text re-tokenized, and the report counts those.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field

import datasets

from ...ground.target.chat import render_chat
from .image_chats import IMAGE_MARKER, image_placeholder, open_images


# Bump when the formatting or mask rules change. `.map` caches are keyed on the map function, and
# datasets hashes the functions it calls by module and name only, not by their code: without a
# bump, a changed rule would read samples tokenized under the old one.
# 2: an answer's own token ids label it (answer_token_ids).
# 3: rows with images formatted by the target's processor (train/data/image_chats.py).
FORMAT_VERSION = 3


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


def decode_answer(tokenizer, ids: list[int]) -> str:
    """An answer's text from the ids the target produced: every token as it is (no special tokens
    skipped, no spaces cleaned up), so that the template renders text these ids decode to."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _encode(tokenizer, piece: str) -> list[int]:
    # add_special_tokens=False: the template already writes BOS/system tokens where the model wants them
    return tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []


def _answer_label_ids(tokenizer, span: str, ids: list[int]) -> list[int] | None:
    """The label ids of one rendered assistant span (answer + end-of-turn text) from the target's
    own ids, or None when the template rendered other text than those ids decode to."""
    answer = decode_answer(tokenizer, ids)
    if not span.startswith(answer):
        return None
    return list(ids) + _encode(tokenizer, span[len(answer) :])


@dataclass
class FormattedChat:
    input_ids: list[int]
    loss_mask: list[bool]  # True on assistant tokens (the labels the heads learn)
    truncated: bool
    ids_kept: int = 0  # answers labelled with their own token ids
    ids_unmatched: int = 0  # answers with ids whose rendered text differs: re-tokenized


def format_conversation(tokenizer, messages: list[dict], max_length: int, answer_ids: list[list[int]] | None = None) -> FormattedChat:
    """Tokenize one conversation with the chat template; keep the first `max_length` tokens.
    answer_ids: per assistant message, the ids the target produced ([]: none; module docstring)."""
    text, spans = assistant_char_spans(tokenizer, messages)
    answer_ids = answer_ids or [[]] * len(spans)
    ids: list[int] = []
    mask: list[bool] = []
    kept = unmatched = 0
    pos = 0
    for (start, end), own in zip(spans, answer_ids):
        prompt_ids = _encode(tokenizer, text[pos:start])
        label_ids = _answer_label_ids(tokenizer, text[start:end], own) if own else None
        kept += label_ids is not None
        unmatched += bool(own) and label_ids is None
        if label_ids is None:
            label_ids = _encode(tokenizer, text[start:end])
        ids += prompt_ids + label_ids
        mask += [False] * len(prompt_ids) + [True] * len(label_ids)
        pos = end
    tail = _encode(tokenizer, text[pos:])
    ids += tail
    mask += [False] * len(tail)
    truncated = len(ids) > max_length
    return FormattedChat(ids[:max_length], mask[:max_length], truncated, kept, unmatched)


@dataclass
class FormatReport:
    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    loss_tokens: int = 0
    answer_ids_kept: int = 0  # answers labelled with the target's own token ids
    answer_ids_unmatched: int = 0  # answers whose ids the template renders otherwise: re-tokenized

    def to_dict(self):
        return asdict(self)

    def summary(self) -> str:
        ids = (
            (
                f", {self.answer_ids_kept} answers on the target's own token ids"
                + (f" ({self.answer_ids_unmatched} re-tokenized: the template renders other text)" if self.answer_ids_unmatched else "")
            )
            if self.answer_ids_kept or self.answer_ids_unmatched
            else ""
        )
        return (
            f"formatted {self.kept}/{self.conversations} conversations, {self.tokens} tokens "
            f"({self.loss_tokens} assistant), {self.truncated} truncated, dropped {self.dropped or 'none'}{ids}"
        )


def format_row(tokenizer, row: dict, max_length: int, processor=None) -> dict:
    """One {id, messages, images?} row -> {input_ids, loss_mask, images, truncated, n_loss, n_tokens}:
    the `.map` function of both the cached path (below) and the streaming one (train/data/streaming.py).
    A row with images is formatted by the target's `processor` (train/data/image_chats.py).
    A template that cannot format the row raises ChatTemplateError naming the row's id."""
    images = row.get("images") or []
    if images:
        if processor is None:
            raise ValueError(
                f"conversation {row.get('id')!r} has images: they need the target's processor "
                "(the cached data path loads it; streaming takes text rows only)"
            )
        chat = format_image_chat(processor, row["messages"], images, max_length, row.get("answer_token_ids"))
        return {**chat, "n_ids_kept": 0, "n_ids_unmatched": 0}
    try:
        f = format_conversation(tokenizer, row["messages"], max_length, row.get("answer_token_ids"))
    except ChatTemplateError as e:
        raise ChatTemplateError(f"conversation {row.get('id')!r}: {e}") from e
    return {
        "input_ids": f.input_ids,
        "loss_mask": f.loss_mask,
        "images": [],
        "truncated": f.truncated,
        "n_loss": sum(f.loss_mask),
        "n_tokens": len(f.input_ids),
        "n_ids_kept": f.ids_kept,
        "n_ids_unmatched": f.ids_unmatched,
    }


def has_loss(n_loss: int) -> bool:
    """A formatted sample keeps at least one labelled (assistant) token within max_length."""
    return n_loss > 0


def _column_sum(dataset: datasets.Dataset, column: str) -> int:
    """Sum of an integer column without turning it into Python objects (respects `.filter`)."""
    import pyarrow.compute as pc

    return int(pc.sum(dataset.with_format("arrow")[column]).as_py() or 0)


def tokenize_conversations(
    dataset: datasets.Dataset, tokenizer, max_length: int, num_proc: int | None = None, processor=None
) -> tuple[datasets.Dataset, FormatReport]:
    """`messages` dataset -> dataset with `id`, `input_ids`, `loss_mask`, `images`; drops (and
    counts) samples with no assistant token inside `max_length`. processor: the target's, for rows
    with images (train/data/image_chats.py).

    `.map` and `.filter` run in `num_proc` processes and are cached by fingerprint (the input's
    fingerprint, the function with its tokenizer, `max_length` and FORMAT_VERSION): on a dataset from
    `load_conversations`, which is memory-mapped from $DRAFTHEAD_CACHE/data, the cache files sit
    beside it and a second call reads them instead of tokenizing again. An in-memory dataset
    (`use_cache=False`) is tokenized every time.
    """

    def fmt(row, version=FORMAT_VERSION):  # a default value is hashed with the function: the version keys the cache
        return format_row(tokenizer, row, max_length, processor)

    mapped = dataset.map(fmt, remove_columns=[c for c in dataset.column_names if c != "id"], num_proc=num_proc, desc="chat template")
    out = mapped.filter(has_loss, input_columns="n_loss", num_proc=num_proc, desc="drop samples without labels")
    report = FormatReport(conversations=len(mapped), kept=len(out), truncated=_column_sum(mapped, "truncated"))
    if len(out) < len(mapped):
        report.dropped = {"no_assistant_token_within_max_length": len(mapped) - len(out)}
    report.loss_tokens = _column_sum(out, "n_loss")
    report.tokens = _column_sum(out, "n_tokens")
    report.answer_ids_kept = _column_sum(out, "n_ids_kept")
    report.answer_ids_unmatched = _column_sum(out, "n_ids_unmatched")
    return out.remove_columns(["truncated", "n_loss", "n_tokens", "n_ids_kept", "n_ids_unmatched"]), report


# ----------------------------------------------------------------------------------------------
# Chats with images (train/data/image_chats.py has the records and the processor)
# ----------------------------------------------------------------------------------------------


def carry_labels(text_ids: list[int], text_mask: list[bool], ids: list[int]) -> list[bool]:
    """The loss mask of `ids` (the processor's expanded ids): True where a token matches a labelled
    token of the text-only ids. Expansion only inserts image tokens, in user turns."""
    mask = [False] * len(ids)
    matcher = difflib.SequenceMatcher(None, text_ids, ids, autojunk=False)
    for a, b, n in matcher.get_matching_blocks():
        for k in range(n):
            mask[b + k] = text_mask[a + k]
    return mask


def format_image_chat(processor, messages: list[dict], paths: list[str], max_length: int, answer_ids: list[list[int]] | None = None) -> dict:
    """One conversation with images -> {input_ids, loss_mask, images, truncated, n_loss, n_tokens}.
    A cut at `max_length` inside an image's tokens moves before that image, and drops it and the
    images after it."""
    tokenizer = processor.tokenizer
    placeholder = image_placeholder(processor)
    rendered = [{**m, "content": m["content"].replace(IMAGE_MARKER, placeholder)} for m in messages]
    plain = format_conversation(tokenizer, rendered, 10**9, answer_ids)
    text, _ = assistant_char_spans(tokenizer, rendered)
    out = processor(text=[text], images=[open_images(paths)], add_special_tokens=False, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    mask = carry_labels(plain.input_ids, plain.loss_mask, ids)
    image_id = getattr(processor, "image_token_id", None)
    if image_id is None or getattr(processor, "boi_token", None):  # Gemma 3's image soft token, not its boi
        image_id = tokenizer.convert_tokens_to_ids(getattr(tokenizer, "image_token", None) or processor.image_token)
    runs = _runs(ids, image_id)
    cut = min(len(ids), max_length)
    kept = [r for r in runs if r[1] <= cut]
    if len(kept) < len(runs) and runs[len(kept)][0] < cut:
        cut = runs[len(kept)][0]
    return {
        "input_ids": ids[:cut],
        "loss_mask": mask[:cut],
        "images": paths[: len(kept)],
        "truncated": len(ids) > cut,
        "n_loss": sum(mask[:cut]),
        "n_tokens": cut,
    }


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """[start, end) of each run of `token` in `ids`: one per image."""
    runs, start = [], None
    for i, t in enumerate(ids + [None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    return runs
