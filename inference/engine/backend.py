"""The backend the decode loop drives for a target: the llama.cpp backend as it is, a hybrid
target's chain backend, or the torch backend (their common steps: torch_target.py)."""

from __future__ import annotations

from .compiled import StaticDecoding
from .hybrid_target import HybridTarget
from .recurrent import has_recurrent_layers
from .torch_target import TorchTarget


def target_backend(target, static_cache: bool = False, compile: str | None = None, row_invariant: bool = False):
    """The backend the decode loop drives: `target` itself when it is one (a LlamaCppTarget), a
    HybridTarget around a transformers model with recurrent layers, else a TorchTarget."""
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
