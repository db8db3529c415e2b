"""Our speculative decoding inside transformers' own `model.generate(...)`, for users who live in
HF's API. transformers' `custom_generate` hook runs `custom_generate/generate.py` from a folder in
place of its decoding loop; drafthead ships that folder (CUSTOM_GENERATE), whose file calls
`generate` below:

    from drafthead.hf_generate import CUSTOM_GENERATE
    out = model.generate(input_ids, custom_generate=CUSTOM_GENERATE, trust_remote_code=True,
                         draft_head="runs/eagle3/final", max_new_tokens=128)

`out` is what `generate()` returns by default, the prompts followed by the new tokens ([B, P + n],
rows that stop early padded with the pad id), and it equals our `speculative_generate`'s output
(and so, under greedy decoding in fp32, the target's plain `generate()`). The drafting settings are
DraftSpec's (drafthead/draft_spec.py) under their Python names: `draft_head`, `proposer`,
`draft_model`, `num_draft`, `sizing`, `lookup_nodes`, `lookup_streak`, `depth`, `branch`.
Sampling settings come from the generation config as `generate()` reads them (`do_sample`,
`temperature`, `top_k`, `top_p`, `repetition_penalty`); `seed` seeds our sampler.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

# the folder transformers' custom_generate hook takes: it holds custom_generate/generate.py
CUSTOM_GENERATE = str(Path(__file__).resolve().parent)

# generate() arguments our loop has no counterpart for: refused in one line rather than ignored
_UNSUPPORTED = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)
# the generation settings this loop honours; any other one a caller sets is refused, not ignored
_HONOURED = frozenset(
    {
        "max_new_tokens",
        "max_length",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        "num_beams",
        "return_dict_in_generate",
        "use_cache",
    }
)
# DraftSpec's fields a caller may not pass here: the head comes as `draft_head`, and the model
# given is the verifier (no llama.cpp backend)
_NOT_DRAFTING = frozenset({"head", "backend", "gguf_type"})


def generate(
    model,
    inputs=None,
    generation_config=None,
    streamer=None,
    attention_mask=None,
    tokenizer=None,
    draft_head: str | None = None,
    seed: int | None = None,
    **kwargs,
):
    """transformers' custom_generate entry point (module docstring): `model` is the target."""
    from dataclasses import fields

    import torch

    from .draft_spec import DraftSpec
    from .inference.engine.generate import GenerationConfig, speculative_generate
    from .inference.engine.sampling import SamplingConfig

    for name in _UNSUPPORTED:
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"drafthead's generate() takes no {name}: drop it, or call generate() without custom_generate")
    kwargs.pop("synced_gpus", None)  # one process decodes its own batch
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("drafthead's generate() needs the prompt ids (inputs or input_ids)")
    drafting_names = [f.name for f in fields(DraftSpec) if f.name not in _NOT_DRAFTING]
    spec = DraftSpec(head=draft_head, **{name: kwargs.pop(name) for name in drafting_names if name in kwargs})
    config = _generation_config(model, generation_config, kwargs)
    if kwargs:
        raise ValueError(f"drafthead's generate() does not take {', '.join(sorted(kwargs))}")
    max_new = config.max_new_tokens
    if max_new is None:
        max_new = max(0, (config.max_length or 20) - input_ids.shape[1])
    sampling = (
        SamplingConfig(
            temperature=float(config.temperature or 1.0),
            top_k=int(config.top_k or 0),
            top_p=float(config.top_p or 1.0),
            repetition_penalty=float(config.repetition_penalty or 1.0),
        )
        if config.do_sample
        else SamplingConfig(repetition_penalty=float(config.repetition_penalty or 1.0))
    )
    eos = config.eos_token_id  # the model's own unless the caller set it; None: no stopping token
    eos = tuple(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else ()
    name = Path(str(getattr(model.config, "_name_or_path", "") or "target")).name
    drafting = spec.build(SimpleNamespace(name=name, model=model, tokenizer=tokenizer), sampling=sampling, seed=seed, note=lambda line: None)
    result = speculative_generate(
        drafting.verifier,
        drafting.factory(),
        input_ids,
        GenerationConfig(max_new_tokens=max_new, sampling=sampling, eos_token_ids=eos, seed=seed, policy=drafting.policy),
        attention_mask=attention_mask,
        tokenizer=tokenizer,
        streamer=streamer,
    )
    rows = getattr(result, "rows", [result])
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    width = max(row.new_tokens.shape[1] for row in rows)
    new = torch.full((len(rows), width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    for b, row in enumerate(rows):
        new[b, : row.new_tokens.shape[1]] = row.new_tokens[0].to(input_ids.device)
    return torch.cat([input_ids, new], dim=1)


def _generation_config(model, generation_config, kwargs: dict):
    """The generation config generate() would use: the one given (or the model's) with the
    generation keywords of `kwargs` applied; those keywords are taken out of `kwargs`."""
    import copy

    from transformers import GenerationConfig as HFGenerationConfig

    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = config.update(**kwargs)
    defaults = HFGenerationConfig()
    for key in list(kwargs):
        if key in unused:
            continue
        if key not in _HONOURED and kwargs[key] != getattr(defaults, key, None):
            raise ValueError(f"drafthead's generate() does not honour {key}={kwargs[key]!r}: drop it, or call generate() without custom_generate")
        del kwargs[key]
    if (config.num_beams or 1) > 1:
        raise ValueError("drafthead's generate() decodes one hypothesis per prompt: num_beams must be 1")
    if config.return_dict_in_generate:
        raise ValueError("drafthead's generate() returns the sequences only: drop return_dict_in_generate")
    return config
