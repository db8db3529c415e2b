"""Which target a head was trained on, and the check that a head only runs on that target.

A draft head is only meaningful on the exact target it was trained against: its features, its
vocabulary and (for Medusa-2) its fine-tuned weights come from that model. The identity is recorded
in every saved head's config and checked on load (`heads.registry.load_head`).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any

from torch import nn

from ..field_types import type_problems
from .parts import output_embeddings

# Fields that must agree for a head to be loadable; `name` only warns (a local path vs a hub id).
_MUST_MATCH = ("model_type", "vocab_size", "hidden_size", "num_layers", "tokenizer_sha")


class HeadTargetMismatch(ValueError):
    """A head was loaded onto a target other than the one it was trained on."""


@dataclass(frozen=True)
class TargetIdentity:
    name: str  # what the user calls the target (path or hub id); informational only
    model_type: str  # transformers `config.model_type`, e.g. "llama", "qwen2"
    vocab_size: int  # rows of the target's LM head (the logits' last dimension)
    hidden_size: int
    num_layers: int  # decoder blocks L; output_hidden_states has L + 1 entries
    tokenizer_sha: str | None  # `tokenizer_fingerprint`; None: recorded without a tokenizer

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TargetIdentity":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TargetIdentity key(s): {', '.join(unknown)}")
        missing = sorted(known - set(d))
        if missing:
            raise ValueError(f"TargetIdentity is missing key(s): {', '.join(missing)}")
        problems = type_problems(cls, d)
        if problems:
            raise ValueError("TargetIdentity: " + "; ".join(problems))
        return cls(**d)


def text_config(model: Any):  # a transformers model
    """The decoder's config (multimodal wrappers nest it; plain causal LMs return themselves)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over a canonical dump of the vocabulary (token -> id, sorted) and the special tokens.

    Only content goes in (no file paths, no class names), so the same tokenizer saved and reloaded,
    or loaded as slow/fast, gives the same digest as long as its vocab and specials agree.
    """
    vocab = sorted(tokenizer.get_vocab().items())
    specials = {}
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        tok = getattr(tokenizer, attr, None)
        specials[attr] = None if tok is None else str(tok)
    dump = {
        "vocab": vocab,
        "special": specials,
        "all_special": sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", [])),
    }
    blob = json.dumps(dump, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def identify_target(model: Any, tokenizer=None, name: str | None = None) -> TargetIdentity:
    """The identity of a loaded target. tokenizer None leaves `tokenizer_sha` unrecorded."""
    cfg = text_config(model)
    lm_head = output_embeddings(model)
    vocab = int(lm_head.weight.shape[0]) if lm_head is not None else int(cfg.vocab_size)
    if name is None:
        name = str(getattr(model.config, "_name_or_path", "") or cfg.model_type)
    return TargetIdentity(
        name=name,
        model_type=str(cfg.model_type),
        vocab_size=vocab,
        hidden_size=int(cfg.hidden_size),
        num_layers=int(cfg.num_hidden_layers),
        tokenizer_sha=None if tokenizer is None else tokenizer_fingerprint(tokenizer),
    )


WEIGHT_SAMPLES = 64  # values read from each tensor for weights_fingerprint


def weights_fingerprint(model: nn.Module) -> str:
    """sha256 over every parameter's name, shape and WEIGHT_SAMPLES values spread over it, rounded
    to bf16: two targets of the same shapes and tokenizer (a base model and its fine-tune) differ,
    while the same weights loaded in fp32 or bf16 agree. Reads a few values per tensor, so it
    costs nothing next to loading the model."""
    import torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // WEIGHT_SAMPLES)
            values = flat[::step][:WEIGHT_SAMPLES].to("cpu", torch.bfloat16).view(torch.int16)
            digest.update(f"{name}:{tuple(p.shape)}:".encode())
            digest.update(values.numpy().tobytes())
    return digest.hexdigest()


def identity_diff(expected: TargetIdentity, actual: TargetIdentity, expects: str = "head expects") -> list[str]:
    """Fields (of `_MUST_MATCH`) that differ, as 'field: {expects} X, target has Y'. A tokenizer_sha of
    None on either side is "not recorded" and is not compared."""
    diffs = []
    for f in _MUST_MATCH:
        a, b = getattr(expected, f), getattr(actual, f)
        if f == "tokenizer_sha" and (a is None or b is None):
            continue
        if a != b:
            diffs.append(f"{f}: {expects} {a!r}, target has {b!r}")
    return diffs


def check_compatible(expected: TargetIdentity, actual: TargetIdentity) -> None:
    """Raise `HeadTargetMismatch` listing every differing field; only warn when the names differ."""
    diffs = identity_diff(expected, actual)
    if diffs:
        raise HeadTargetMismatch(f"this head was trained on target {expected.name!r} and cannot run on {actual.name!r}:\n  " + "\n  ".join(diffs))
    if expected.tokenizer_sha is not None and actual.tokenizer_sha is None:
        warnings.warn("the head records its tokenizer but none was given: tokenizer identity not checked", stacklevel=2)
    if expected.name != actual.name:
        warnings.warn(
            f"head was trained on target {expected.name!r}, loading onto {actual.name!r} (every structural field and the tokenizer match)",
            stacklevel=2,
        )


def eos_token_ids(model, tokenizer=None) -> tuple[int, ...]:
    """Every id that ends generation: the generation config's, the model config's and the
    tokenizer's EOS, in that order, without repeats."""
    found: list[int] = []

    def add(value) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in found:
                found.append(int(v))

    gen = getattr(model, "generation_config", None)
    add(getattr(gen, "eos_token_id", None))
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(found)
