"""Build and load heads by kind: each kind's module class is the one its heads/config.py KINDS row
names."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import cast

import torch
from torch import nn

from .config import CONFIG_CLASSES, KINDS, HeadConfig, MedusaConfig, head_kind, resolve
from .eagle import has_rope_decoder
from .eagle3 import Eagle3Head
from ..ground.target.identity import HeadTargetMismatch, check_compatible, eos_token_ids, identify_target, identity_diff
from .io import ADAPTER_DIR, DraftHeadBase, check_state_dict, read_head_dir
from .io import HeadFormatError
from .medusa import MedusaHead
from ..ground.target.parts import lm_head_of

# each kind's module class, as its KINDS row names it
HEAD_CLASSES: dict[str, type[DraftHeadBase]] = {name: resolve(kind.module) for name, kind in KINDS.items()}


def make_config(kind: str, target_model: nn.Module, tokenizer=None, name: str | None = None, **overrides) -> HeadConfig:
    """The config of a `kind` head for this target (identity recorded), with `overrides` on top;
    unknown override keys are errors."""
    if kind not in CONFIG_CLASSES:
        raise ValueError(f"unknown head kind {kind!r} (known: {', '.join(CONFIG_CLASSES)})")
    check_target_fits(kind, target_model)  # first: a kind this target cannot take is the one thing to say
    d = {"kind": kind, **overrides, "target": identify_target(target_model, tokenizer, name)}
    return CONFIG_CLASSES[kind].from_dict(d)


def bind_target(config: HeadConfig, target_model: nn.Module, tokenizer=None, name: str | None = None) -> HeadConfig:
    """`config` (a head config made without a target: a run's head section) for this target: its
    identity recorded, and the fields that follow from the target's sizes filled in."""
    check_target_fits(config.kind, target_model)
    return dataclasses.replace(config, target=identify_target(target_model, tokenizer, name))


def check_target_fits(kind: str, target_model: nn.Module) -> None:
    """Refuse a kind whose draft layer copies the target's RoPE decoder layer for a target that
    has none, naming the kinds that can train for it."""
    if HEAD_CLASSES[kind].needs_rope_decoder and not has_rope_decoder(target_model):
        fits = [k for k, cls in HEAD_CLASSES.items() if not cls.needs_rope_decoder]
        raise ValueError(
            f"a {kind} head builds its draft layers from the target's RoPE decoder layer, and "
            f"{type(target_model).__name__} has none; for this target train one of: {', '.join(fits)}"
        )


def target_dtype(model: nn.Module) -> torch.dtype:
    return lm_head_of(model).weight.dtype


def target_device(model: nn.Module) -> torch.device:
    return lm_head_of(model).weight.device


def _new_module(config: HeadConfig, target_model: nn.Module) -> DraftHeadBase:
    cls = HEAD_CLASSES[config.kind]
    # KINDS: MedusaHead is the module of the kinds whose config is a MedusaConfig
    return cls(cast(MedusaConfig, config)) if cls is MedusaHead else cls(config, target_model)


def build_head(
    config: HeadConfig,
    target_model: nn.Module,
    *,
    token_counts: torch.Tensor | None = None,
    always_include=None,
    dtype: torch.dtype | None = None,
) -> DraftHeadBase:
    """A fresh head for `target_model`, initialised from it where the design says so.

    token_counts [V]: training-data token frequencies, required by EAGLE-3 when its draft vocab is
    smaller than the target's. always_include: ids forced into that draft vocab (default: the
    target's EOS ids). dtype: parameters' dtype (default the target's; trainers often want
    float32 masters). The head lives on the target's device.
    """
    if config.target is None:
        raise ValueError("config has no target identity; make it with make_config(kind, target_model, tokenizer)")
    diffs = identity_diff(config.target, identify_target(target_model))
    if diffs:
        raise HeadTargetMismatch("config was made for another target:\n  " + "\n  ".join(diffs))
    head = _new_module(config, target_model)
    if always_include is None:
        always_include = [i for i in eos_token_ids(target_model) if 0 <= i < config.vocab_size]
    head.init_from_target(target_model, token_counts=token_counts, always_include=always_include)
    head.to(device=target_device(target_model), dtype=dtype or target_dtype(target_model))
    return head.bind_target(target_model)


def apply_adapter(target_model: nn.Module, adapter_dir: Path) -> nn.Module:
    """Load a peft LoRA adapter onto the target and merge it (the merged model is "the target"
    for exactness from then on)."""
    from peft import PeftModel  # optional at import time: only medusa2 needs it

    peft_model = PeftModel.from_pretrained(target_model, str(adapter_dir))
    return peft_model.merge_and_unload()


def check_draft_vocab(head: DraftHeadBase, where) -> None:
    """An EAGLE-3 head's loaded d2t/t2d must describe one valid draft vocabulary (HeadFormatError)."""
    if not isinstance(head, Eagle3Head):
        return
    from .draft_vocab import validate_draft_vocab

    try:
        validate_draft_vocab(head.d2t, head.t2d)
    except ValueError as e:
        raise HeadFormatError(f"{where}: invalid draft vocab: {e}") from e


def load_head(path, target_model: nn.Module, tokenizer, target_name: str | None = None, *, dtype: torch.dtype | None = None):
    """Load a saved head onto `target_model` -> (head, target_model).

    Checks, in order: the directory's format (config, kind, keys, weights file readable), the
    target identity (`HeadTargetMismatch` lists every differing field; a different name only
    warns), every tensor's presence and shape. A medusa2 head's `adapter/` is applied to the target
    and merged; the returned target is then the adapted one. The head is cast to the target's
    dtype and device and bound to it.
    """
    path = Path(path)
    config, meta, state = read_head_dir(path)
    assert config.target is not None  # read_head_dir refuses a config without one
    actual = identify_target(target_model, tokenizer, target_name or config.target.name)
    check_compatible(config.target, actual)

    adapter, adapts = path / ADAPTER_DIR, head_kind(config.kind).adapts_target
    if adapter.exists():
        if not adapts:
            raise HeadFormatError(f"{path} has an adapter/ but is a {config.kind} head (only medusa2 adapts the target)")
        target_model = apply_adapter(target_model, adapter)
    elif adapts:
        warnings.warn(f"medusa2 head {path} has no adapter/: the target is used unmodified", stacklevel=2)

    head = _new_module(config, target_model)
    check_state_dict(head.state_dict(), state, where=f"in {path}")
    own = head.state_dict()
    head.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)
    check_draft_vocab(head, path)
    head.to(device=target_device(target_model), dtype=dtype or target_dtype(target_model))
    head.eval()
    return head.bind_target(target_model), target_model
