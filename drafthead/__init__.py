"""drafthead: train Medusa/EAGLE draft heads on a frozen target LLM and run lossless
tree-speculative generation.

    from drafthead import load_target, build_drafter, speculative_generate, GenerationConfig
    target = load_target("smollm2-135m")
    drafter = build_drafter("prompt-lookup", target.model, target.tokenizer)
    result = speculative_generate(target.model, drafter, input_ids, GenerationConfig(max_new_tokens=128))

The names below are imported lazily (PEP 562), so importing a subpackage such as
drafthead.heads does not pull in transformers and the whole inference stack.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_target": "drafthead.inference.targets",
    "LoadedTarget": "drafthead.inference.targets",
    "eos_token_ids": "drafthead.inference.targets",
    "build_drafter": "drafthead.drafters",
    "speculative_generate": "drafthead.inference.generate",
    "GenerationConfig": "drafthead.inference.generate",
    "GenerationResult": "drafthead.inference.generate",
    "BatchGenerationResult": "drafthead.inference.generate",
    "SpeculationPolicy": "drafthead.inference.policy",
    "measure_verify_cost": "drafthead.inference.cost",
    "SamplingConfig": "drafthead.inference.sampling",
    "TypicalAcceptance": "drafthead.inference.acceptance",
    "load_prompts": "drafthead.inference.prompts",
    "encode_chat": "drafthead.inference.prompts",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # cache: the next access skips __getattr__
        return value
    raise AttributeError(f"module 'drafthead' has no attribute {name!r}")


def __dir__():
    return __all__
