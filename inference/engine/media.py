"""Images in a vision-language target's prompt (docs/families.md "Images in the prompt").

Only a forward over the prompt sees the images: the prefill, and the feature capture of training.
It takes the processor's pixel inputs, and which tokens are image tokens:

    Gemma-3      token_type_ids [B, P]: 1 at image tokens, which attend to each other both ways
    Qwen-VL      M-RoPE positions [3, B, P] from the model's own `get_rope_index`; the text after
                 an image continues from the image's largest position + 1, not from its token
                 count, and that shift, the row's rope delta, stays with every later position

Tree verification adds each row's delta to its positions (prefix length + depth + delta), and
every other part of a round is unchanged: image tokens are committed prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images, as the target's image processor gives them, in the order their
    placeholder tokens appear.

    pixel_values:   Gemma-3 [images, 3, H, W]; Qwen-VL [patches, C * T * patch * patch]
    image_grid_thw: Qwen-VL [images, 3], each image's (time, height, width) patch grid
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None = None


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def image_token_id(config) -> int | None:
    """The placeholder id an image's tokens carry in the prompt, or None for a text-only target."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


def uses_mrope(model) -> bool:
    rope = getattr(_text_config(model.config), "rope_parameters", None) or {}
    return "mrope_section" in rope and hasattr(getattr(model, "model", None), "get_rope_index")


def token_types(config, ids: torch.Tensor) -> torch.Tensor:
    """[..., P] int: 1 at image placeholder tokens, 0 elsewhere."""
    return (ids == image_token_id(config)).to(torch.int32)


def check_images(model, prompts: list[torch.Tensor], images: list[PromptImages | None]) -> None:
    """One clear line, before any forward, for images a target or a prompt cannot take."""
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts: give one per prompt (None for none)")
    token = image_token_id(model.config)
    if token is None:
        raise ValueError(f"{type(model).__name__} takes no images (no image token in its config)")
    for b, (p, row) in enumerate(zip(prompts, images)):
        placeholders = int((p == token).sum())
        if row is None:
            if placeholders:
                raise ValueError(f"prompt {b} has {placeholders} image tokens and no images")
            continue
        if placeholders == 0:
            raise ValueError(f"prompt {b} has images and no image tokens ({token})")
        if int(p[-1]) == token:
            raise ValueError(f"prompt {b} ends with an image token: end it with text (the chat template's generation prompt)")


def rope_positions(model, ids: torch.Tensor, row: PromptImages | None) -> tuple[torch.Tensor, int]:
    """One prompt's M-RoPE positions [3, P] and its rope delta (the text after the prompt sits at
    token index + delta), from the model's own rule."""
    if row is None or row.image_grid_thw is None:
        return torch.arange(ids.numel(), device=ids.device).expand(3, -1), 0
    positions, deltas = model.model.get_rope_index(
        ids[None], mm_token_type_ids=token_types(model.config, ids[None]), image_grid_thw=row.image_grid_thw.to(ids.device))
    return positions[:, 0], int(deltas.reshape(-1)[0])


def prefill_inputs(model, prompts: list[torch.Tensor], images: list[PromptImages | None] | None,
                   width: int) -> tuple[dict, torch.Tensor]:
    """The prefill forward's image arguments for right-padded rows of `width` tokens (each prompt
    but its last token), and each row's position offset [B] for the rounds after it."""
    device = prompts[0].device
    offsets = torch.zeros(len(prompts), dtype=torch.long, device=device)
    if images is None or all(row is None for row in images):
        return {}, offsets
    check_images(model, prompts, images)
    given = [row for row in images if row is not None]
    kwargs: dict = {"pixel_values": torch.cat([row.pixel_values for row in given]).to(device)}
    if uses_mrope(model):
        kwargs["image_grid_thw"] = torch.cat([row.image_grid_thw for row in given]).to(device)
        positions = torch.zeros(3, len(prompts), width, dtype=torch.long, device=device)
        for b, (p, row) in enumerate(zip(prompts, images)):
            rows, delta = rope_positions(model, p, row)
            n = p.numel() - 1
            positions[:, b, :n] = rows[:, :n]
            positions[:, b, n:] = rows[:, n - 1: n] + 1 + torch.arange(width - n, device=device) if n else 0
            offsets[b] = delta
        kwargs["position_ids"] = positions
    else:
        types = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            types[b, : p.numel() - 1] = token_types(model.config, p[:-1])
        kwargs["token_type_ids"] = types
    return kwargs, offsets
