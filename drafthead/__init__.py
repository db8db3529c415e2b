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
    "load_target": "drafthead.ground.target.load",
    "LoadedTarget": "drafthead.ground.target.load",
    "eos_token_ids": "drafthead.ground.target.identity",
    "build_drafter": "drafthead.draft_spec",
    "speculative_generate": "drafthead.inference.engine.generate",
    "GenerationConfig": "drafthead.inference.engine.generate",
    "GenerationResult": "drafthead.inference.engine.generate",
    "BatchGenerationResult": "drafthead.inference.engine.generate",
    "SpeculationPolicy": "drafthead.inference.engine.policy",
    "measure_verify_cost": "drafthead.inference.engine.cost",
    "SamplingConfig": "drafthead.inference.engine.sampling",
    "TypicalAcceptance": "drafthead.inference.engine.acceptance",
    "load_prompts": "drafthead.inference.bench.prompts",
    "encode_chat": "drafthead.inference.bench.prompts",
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
