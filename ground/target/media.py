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

import contextlib
from dataclasses import dataclass
from typing import cast

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
    token = image_token_id(config)
    assert token is not None  # images reach only targets with an image token (check_images)
    return (ids == token).to(torch.int32)


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
        ids[None], mm_token_type_ids=token_types(model.config, ids[None]), image_grid_thw=row.image_grid_thw.to(ids.device)
    )
    return positions[:, 0], int(deltas.reshape(-1)[0])


def prefill_inputs(model, prompts: list[torch.Tensor], images: list[PromptImages | None] | None, width: int) -> tuple[dict, torch.Tensor]:
    """The prefill forward's image arguments for right-padded rows of `width` tokens (each prompt
    but its last token), and each row's position offset [B] for the rounds after it. The images
    are the ones `check_images` passed (generate_batch checks them before any forward)."""
    device = prompts[0].device
    offsets = torch.zeros(len(prompts), dtype=torch.long, device=device)
    if images is None or all(row is None for row in images):
        return {}, offsets
    kwargs = _pixel_inputs(model, images, device)
    if uses_mrope(model):
        positions = torch.zeros(3, len(prompts), width, dtype=torch.long, device=device)
        for b, (p, row) in enumerate(zip(prompts, images)):
            rows, delta = rope_positions(model, p, row)
            n = p.numel() - 1
            positions[:, b, :n] = rows[:, :n]
            positions[:, b, n:] = rows[:, n - 1 : n] + 1 + torch.arange(width - n, device=device) if n else 0
            offsets[b] = delta
        kwargs["position_ids"] = positions
    else:
        types = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            types[b, : p.numel() - 1] = token_types(model.config, p[:-1])
        kwargs["token_type_ids"] = types
    return kwargs, offsets


def forward_inputs(model, input_ids: torch.Tensor, images: list[PromptImages | None]) -> dict:
    """The image arguments of a whole-sequence forward over right-padded rows [B, T] (the feature
    capture of training): transformers numbers Qwen-VL's M-RoPE positions itself from the image
    token types, the grids and the padding mask, as its own generate does."""
    if all(row is None for row in images):
        return {}
    kwargs = _pixel_inputs(model, images, input_ids.device)
    types = token_types(model.config, input_ids)
    kwargs.update({"mm_token_type_ids": types} if uses_mrope(model) else {"token_type_ids": types.long()})
    return kwargs


def _pixel_inputs(model, images: list[PromptImages | None], device) -> dict:
    """The rows' images in one batch, in row order: pixel values, and Qwen-VL's grids."""
    given = [row for row in images if row is not None]
    kwargs: dict = {"pixel_values": torch.cat([row.pixel_values for row in given]).to(device)}
    if uses_mrope(model):
        # an M-RoPE target's images carry their grids (its processor gives them)
        kwargs["image_grid_thw"] = torch.cat(cast(list[torch.Tensor], [row.image_grid_thw for row in given])).to(device)
    return kwargs


def _deepstack_owner(model):
    """The language model that adds Qwen3-VL's deepstack vision features after its first layers, or None."""
    inner = getattr(model, "model", model)
    text = getattr(inner, "language_model", None)
    return text if hasattr(text, "_deepstack_process") else None


@contextlib.contextmanager
def deepstack_inputs(model):
    """Record, during one forward, what Qwen3-VL's first decoder layers really take in at image
    positions. transformers records layer k's output as hidden_states[k + 1] and only then adds
    the deepstack's vision features for layer k, so where the deepstack acts hidden_states[k + 1]
    is not the input of layer k + 1, which our feature convention (index i: the input of layer i)
    requires. Yields the list of those inputs, one per deepstack layer, for `with_deepstack`."""
    owner = _deepstack_owner(model)
    recorded: list[torch.Tensor] = []
    if owner is None:
        yield recorded
        return
    original = owner._deepstack_process

    def record(*args, **kwargs):
        out = original(*args, **kwargs)
        recorded.append(out)
        return out

    owner._deepstack_process = record  # an instance attribute over the class's method, for this forward
    try:
        yield recorded
    finally:
        del owner._deepstack_process


def with_deepstack(hidden_states, recorded: list[torch.Tensor]):
    """hidden_states (all L + 1) with entry k + 1 replaced by the input of layer k + 1 wherever
    the deepstack added to layer k's output (`deepstack_inputs`). The last entry, the final normed
    state, is never one of them."""
    if not recorded or hidden_states is None:
        return hidden_states
    states = list(hidden_states)
    for k, h in enumerate(recorded):
        if k + 1 < len(states) - 1:
            states[k + 1] = h
    return tuple(states)
