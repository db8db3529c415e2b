"""transformers' custom_generate entry point for drafthead's speculative decoding: `model.generate(
..., custom_generate=drafthead.hf_generate.CUSTOM_GENERATE, trust_remote_code=True)` runs this
file's `generate` (drafthead/hf_generate.py) in place of transformers' decoding loop."""

from drafthead.hf_generate import generate

__all__ = ["generate"]
