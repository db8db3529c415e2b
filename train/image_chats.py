"""Chats with images, for vision-language targets (docs/models-and-data.md "Chats with images").

A record names its images (`image`: one path, or `images`: a list; relative to the data file's
folder) and marks where each sits in the text with `<image>`, as LLaVA and ShareGPT4V data do. A
record with images and no marker gets them before its first user turn's text, LLaVA's rule.

Formatting runs the target's own processor (`AutoProcessor` of the target folder): the chat
template renders the conversation with the processor's placeholder for each image, the processor
expands each placeholder into the image's tokens and turns the image into pixel inputs. The labels
(assistant tokens) are those of the text-only rendering, carried over to the expanded ids.
"""
from __future__ import annotations

import difflib
from pathlib import Path

import torch

IMAGE_MARKER = "<image>"


def record_images(record: dict, folder: Path, messages: list[dict]) -> tuple[list[str], list[dict], str | None]:
    """(absolute image paths, messages with a marker per image, why the record is dropped or None)."""
    value = record.get("images", record.get("image"))
    if value is None or value == []:
        if any(IMAGE_MARKER in m["content"] for m in messages):
            return [], messages, "image_marker_without_image"
        return [], messages, None
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        return [], messages, "image_not_a_path"
    markers = sum(m["content"].count(IMAGE_MARKER) for m in messages)
    if markers == 0:
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        messages = [dict(m) for m in messages]
        messages[first]["content"] = IMAGE_MARKER * len(paths) + "\n" + messages[first]["content"]
    elif markers != len(paths):
        return [], messages, "image_count_mismatch"
    if any(IMAGE_MARKER in m["content"] for m in messages if m["role"] != "user"):
        return [], messages, "image_outside_user_turn"
    resolved = [Path(p) if Path(p).is_absolute() else (folder / p) for p in paths]
    if not all(p.is_file() for p in resolved):
        return [], messages, "image_missing"
    return [str(p.resolve()) for p in resolved], messages, None


def load_processor(target: str):
    """The target folder's processor (tokenizer, image processor, chat template), or a one-line error."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(target)
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"the data has images, and {target} has no processor that loads ({type(e).__name__}: {e})") from None
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"the data has images, and {target}'s processor ({type(processor).__name__}) has no image processor")
    return processor


def image_placeholder(processor) -> str:
    """The text a chat template puts for one image, which the processor expands into its tokens:
    Gemma 3's begin-of-image token; Qwen-VL's image pad between its vision start and end tokens."""
    boi = getattr(processor, "boi_token", None)
    if boi:
        return boi
    tokenizer = processor.tokenizer
    vocab = tokenizer.get_vocab()
    start = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
    end = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
    if start in vocab and end in vocab:
        return f"{start}{processor.image_token}{end}"
    return processor.image_token


def open_images(paths: list[str]):
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in paths]


def prompt_images(processor, paths: list[str]):
    """media.PromptImages of a row's images, from the processor's image processor."""
    from ..inference.engine.media import PromptImages

    out = processor.image_processor(images=open_images(paths), return_tensors="pt")
    grid = out.get("image_grid_thw")
    return PromptImages(out["pixel_values"], grid if isinstance(grid, torch.Tensor) else None)


def encode_image_prompt(processor, prompt: str, paths: list[str]):
    """([1, P] ids, media.PromptImages) of one user message with its images before its text,
    through the chat template with the generation prompt, then the processor."""
    from ..inference.engine.media import PromptImages

    content = image_placeholder(processor) * len(paths) + "\n" + prompt
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                   tokenize=False)
    out = processor(text=[text], images=[open_images(paths)], add_special_tokens=False, return_tensors="pt")
    grid = out.get("image_grid_thw")
    return out["input_ids"], PromptImages(out["pixel_values"], grid if isinstance(grid, torch.Tensor) else None)


def carry_labels(text_ids: list[int], text_mask: list[bool], ids: list[int]) -> list[bool]:
    """The loss mask of `ids` (the processor's expanded ids): True where a token matches a labelled
    token of the text-only ids. Expansion only inserts image tokens, in user turns."""
    mask = [False] * len(ids)
    matcher = difflib.SequenceMatcher(None, text_ids, ids, autojunk=False)
    for a, b, n in matcher.get_matching_blocks():
        for k in range(n):
            mask[b + k] = text_mask[a + k]
    return mask


def format_image_chat(processor, messages: list[dict], paths: list[str], max_length: int,
                      answer_ids: list[list[int]] | None = None) -> dict:
    """One conversation with images -> {input_ids, loss_mask, images, truncated, n_loss, n_tokens}.
    A cut at `max_length` inside an image's tokens moves before that image, and drops it and the
    images after it."""
    from .chat_format import assistant_char_spans, format_conversation

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
    return {"input_ids": ids[:cut], "loss_mask": mask[:cut], "images": paths[: len(kept)], "truncated": len(ids) > cut,
            "n_loss": sum(mask[:cut]), "n_tokens": cut}


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
