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
# generation settings that leave the tokens alone: outputs a sequences-only return drops, cache
# and compile choices, an assistant's schedule (no assistant runs), transformers' bookkeeping
_INERT = frozenset(
    {
        "_from_model_config",
        "transformers_version",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "prefill_chunk_size",
        "low_memory",
        "is_assistant",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "prompt_lookup_num_tokens",
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
    from .inference.engine.generate import GenerationConfig, check_seed, speculative_generate
    from .inference.engine.sampling import SamplingConfig

    check_seed(seed)

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
        max_length, prompt = config.max_length or 20, input_ids.shape[1]
        if max_length <= prompt:  # transformers' generate() refuses it too
            raise ValueError(
                f"max_length={max_length} leaves no room for a new token after the {prompt}-token prompt: set max_new_tokens, or a larger max_length"
            )
        max_new = max_length - prompt
    sampling = _sampling(config, SamplingConfig)
    eos = config.eos_token_id  # the model's own unless the caller set it; None: no stopping token
    eos = tuple(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else ()
    name = Path(str(getattr(model.config, "_name_or_path", "") or "target")).name
    drafting = spec.build(SimpleNamespace(name=name, model=model, tokenizer=tokenizer), sampling=sampling, seed=seed, note=lambda line: None)
    result = speculative_generate(
        drafting.verifier,
        drafting.factory(),
        input_ids,
        GenerationConfig(max_new_tokens=max_new, sampling=sampling, eos_token_ids=eos, seed=seed, sizing=drafting.sizing),
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


def _sampling(config, SamplingConfig):
    """The SamplingConfig of a generation config as transformers' generate() reads it: greedy
    unless do_sample; unset settings at transformers' defaults (a 0 is kept, not taken for unset)."""

    def given(value, default):
        return default if value is None else value

    penalty = float(given(config.repetition_penalty, 1.0))
    if not config.do_sample:
        return SamplingConfig(repetition_penalty=penalty)
    temperature = float(given(config.temperature, 1.0))
    if not temperature > 0:  # transformers' generate() refuses it: it is not greedy decoding
        raise ValueError(f"do_sample=True samples at a temperature > 0, got temperature={temperature}: for greedy decoding set do_sample=False")
    top_k, top_p = int(given(config.top_k, 0)), float(given(config.top_p, 1.0))
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty)


def _generation_config(model, generation_config, kwargs: dict):
    """The generation config generate() would use: the one given (or the model's) with the
    generation keywords of `kwargs` applied; those keywords are taken out of `kwargs`. A setting
    this loop does not honour, given as a keyword or in the config, is refused."""
    import copy

    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = config.update(**kwargs)
    keywords = {key for key in kwargs if key not in unused}
    for key in keywords:
        del kwargs[key]
    for key, value in config.to_diff_dict().items():  # every setting away from transformers' default
        if key not in _HONOURED and key not in _INERT:
            where = "" if key in keywords else " (in the generation config)"
            raise ValueError(f"drafthead's generate() does not honour {key}={value!r}{where}: drop it, or call generate() without custom_generate")
    if (config.num_beams or 1) > 1:
        raise ValueError("drafthead's generate() decodes one hypothesis per prompt: num_beams must be 1")
    if config.return_dict_in_generate:
        raise ValueError("drafthead's generate() returns the sequences only: drop return_dict_in_generate")
    return config
