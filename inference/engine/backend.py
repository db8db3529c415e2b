"""The backend the decode loop drives for a target: the llama.cpp backend as it is, a hybrid
target's chain backend, or the torch backend (their common steps: torch_target.py)."""

from __future__ import annotations

from .compiled import StaticDecoding
from .hybrid_target import HybridTarget
from .invariant import on_by_default
from .recurrent import has_recurrent_layers
from .torch_target import TorchTarget


def row_invariant_by_default(target, static_cache: bool = False, compile: str | None = None) -> bool:
    """Whether decoding `target` is row-invariant when nobody chose: only on the torch engine's
    eager forward over a dynamic cache (no llama.cpp backend, no recurrent layers, no static cache
    or compile), and there by `invariant.on_by_default`."""
    if hasattr(target, "verify") and hasattr(target, "start"):
        return False
    if static_cache or compile or has_recurrent_layers(target.config):
        return False
    return on_by_default(target)


def target_backend(target, static_cache: bool = False, compile: str | None = None, row_invariant: bool | None = False):
    """The backend the decode loop drives: `target` itself when it is one (a LlamaCppTarget), a
    HybridTarget around a transformers model with recurrent layers, else a TorchTarget.
    row_invariant None: `row_invariant_by_default`."""
    if row_invariant is None:
        row_invariant = row_invariant_by_default(target, static_cache, compile)
    if hasattr(target, "verify") and hasattr(target, "start"):
        if row_invariant:
            raise ValueError(
                "row-invariant decoding is our torch engine's (inference/engine/invariant.py); the llama.cpp backend's kernels are ggml's"
            )
        return target
    if has_recurrent_layers(target.config):
        if static_cache or compile or row_invariant:
            raise ValueError(
                f"{target.config.model_type} has recurrent layers: its backend (inference/engine/hybrid_target.py) "
                "runs the eager forward on transformers' dynamic cache; drop --static-cache / --compile / --row-invariant"
            )
        return HybridTarget(target)
    if row_invariant and (static_cache or compile):
        raise ValueError("row-invariant decoding runs the eager forward on a dynamic cache: drop --static-cache / --compile")
    return TorchTarget(target, StaticDecoding.of(target, compile) if static_cache or compile else None, row_invariant)
