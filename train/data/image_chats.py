"""Chats with images, for vision-language targets (docs/models-and-data.md "Chats with images").

A record names its images (`image`: one path, or `images`: a list; relative to the data file's
folder) and marks where each sits in the text with `<image>`, as LLaVA and ShareGPT4V data do. A
record with images and no marker gets them before its first user turn's text, LLaVA's rule.

This module reads such records and holds the target's processor (`AutoProcessor` of the target
folder), its placeholder for an image and the pixel inputs of a row's images. The formatting
itself is train/data/chat_format.py's `format_image_chat`: the chat template renders the conversation
with the processor's placeholder for each image, the processor expands each placeholder into the
image's tokens, and the labels (assistant tokens) are those of the text-only rendering, carried
over to the expanded ids.
"""

from __future__ import annotations

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
    """The images at `paths`, decoded whole (RGB); one that does not decode (cut short, not an
    image) is a ValueError naming its file, which PIL's own message does not always do."""
    from PIL import Image

    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, SyntaxError, ValueError) as e:  # PIL's decoders raise all three
            raise ValueError(f"{path} is not a readable image ({' '.join(str(e).split())}): replace the file") from None
    return images


def prompt_images(processor, paths: list[str]):
    """media.PromptImages of a row's images, from the processor's image processor."""
    from ...ground.target.media import PromptImages

    out = processor.image_processor(images=open_images(paths), return_tensors="pt")
    grid = out.get("image_grid_thw")
    return PromptImages(out["pixel_values"], grid if isinstance(grid, torch.Tensor) else None)


def encode_image_prompt(processor, prompt: str, paths: list[str]):
    """([1, P] ids, media.PromptImages) of one user message with its images before its text,
    through the chat template with the generation prompt, then the processor."""
    from ...ground.target.media import PromptImages

    content = image_placeholder(processor) * len(paths) + "\n" + prompt
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[open_images(paths)], add_special_tokens=False, return_tensors="pt")
    grid = out.get("image_grid_thw")
    return out["input_ids"], PromptImages(out["pixel_values"], grid if isinstance(grid, torch.Tensor) else None)
