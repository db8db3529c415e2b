"""The parts of a Hugging Face target that heads, formats and the engine read: its input
embedding, its LM head and its decoder stack, each typed once here (a method looked up on an
`nn.Module` reads as `Tensor | Module` to a type checker)."""

from __future__ import annotations

from typing import Callable, cast

from torch import nn


def input_embeddings(model: nn.Module) -> nn.Embedding:
    return cast(Callable[[], nn.Embedding], model.get_input_embeddings)()


def output_embeddings(model: nn.Module) -> nn.Linear | None:
    """The LM head, or None for a model without one."""
    return cast(Callable[[], "nn.Linear | None"], model.get_output_embeddings)()


def lm_head_of(model: nn.Module) -> nn.Linear:
    """The LM head of a model that must have one."""
    head = output_embeddings(model)
    if head is None:
        raise TypeError(f"{type(model).__name__} has no LM head (get_output_embeddings() is None)")
    return head


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack: `get_decoder()`, else `.model`, else the model itself."""
    get = getattr(model, "get_decoder", None)
    return cast(nn.Module, get()) if get is not None else getattr(model, "model", model)
