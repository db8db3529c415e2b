"""The speculative decode loop: draft a tree, verify it in one target forward, accept exactly.

Cache convention (docs/trees.md): the target cache holds every committed token but
the last, the *pending* token, which enters each round as the root (node 0) of the verified tree.

    prefill(prompt[:-1])                           pending = prompt[-1]
    loop: tree = drafter.propose()                 root = pending
          logits = forward_tree(tree)              [B, N, V], appends N nodes to the cache
          path, token = accept(tree, logits)       exact rule (greedy or rejection sampling)
          keep_path(cache, path)                   cache = prefix + accepted nodes
          emit tokens[path[1:]] + token;           pending = token

A batch runs the same loop with one drafter and one tree per row: the trees are padded to one
node count and verified in one forward, each row accepts by itself and keeps its own path, and a
row that finishes leaves the batch (docs/trees.md "Batches"). The loop itself is decoder.py's
Decoder, which also lets rows join between rounds (a server's continuous batching).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...ground.clock import PhaseClock
from ...ground.target.load import context_limit
from ...ground.target.media import PromptImages, check_images
from .acceptance import TypicalAcceptance
from .backend import target_backend
from .decoder import Decoder, DecoderSettings, Row, RowSettings, limit_drafter
from .drafter import fork_drafter
from .sizing import check_sizing, load_policy, size_drafter
from .rounds import tau_of
from .sampling import SamplingConfig
from .stopping import StopRules, check_stop_strings
from .torch_target import TorchTarget


class PromptTooLong(ValueError):
    """The prompt does not leave room for one new token within the target's context."""


def check_seed(seed) -> None:
    """A sampler's seed is a whole number (or None: unseeded); anything else is a ValueError
    naming it, not torch's "manual_seed expected a long"."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be a whole number, got {seed!r}")


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    max_length: int | None = None  # context limit; None: the target config's max_position_embeddings
    profile: bool = False  # synchronise the device around each phase so `timings` are exact
    # LOSSY, opt-in: Medusa's typical acceptance instead of the exact rule (sampling only)
    typical: TypicalAcceptance | None = None
    # how each round's tree is sized (sizing.py SIZINGS): fixed (the drafter's whole tree), policy
    # (the load policy cuts every row's tree to the node count that pays at this batch size, down to
    # plain decoding) or confidence (the drafter sizes its own against the verifier's cost); the
    # engine builds what the rule needs from the target it decodes with
    sizing: str = "fixed"
    # the target's linears on the faster CPU kernel per row count while we decode
    # (inference/kernels/target_linears.py); generate() and training never see the swap
    engine_linears: bool = True
    # a static KV cache (fixed slot count, K/V written in place), and with `compile` (a
    # torch.compile backend: "inductor") the target's round forward compiled (inference/engine/compiled.py);
    # the first generation pays the compile
    static_cache: bool = False
    compile: str | None = None
    # every forward row-invariant (inference/engine/invariant.py): bf16 output equal to our plain
    # decoding bit for bit. None: on in bf16 where the CPU has native bf16 row-invariant kernels
    # (inference/engine/backend.py row_invariant_by_default), else off
    row_invariant: bool | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_seed(self.seed)
        check_stop_strings(self.stop_strings)
        check_sizing(self.sizing)
        if self.typical is not None and self.sampling.greedy:
            raise ValueError("typical acceptance is a sampling rule (and lossy); greedy decoding is exact already")

    @property
    def lossy(self) -> bool:
        """True when the output is NOT the target's own distribution (typical acceptance)."""
        return self.typical is not None


@dataclass
class GenerationResult:
    new_tokens: torch.Tensor  # [B, n_new] long, what the target emitted after the prompt
    accepted_lengths: list[int]  # tokens emitted per verification round, the target's own included
    finish_reason: str  # "eos" | "stop_string" | "length" | "context"
    lossy: bool = False  # made with a lossy acceptance rule (typical acceptance): not the target's distribution
    timings: dict[str, float] = field(default_factory=dict)  # seconds: draft, verify, accept, cache, other
    drafted: list[int] = field(default_factory=list)  # draft nodes per round (root excluded)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def num_rounds(self) -> int:
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward in decoding (the target's own token included)."""
        return tau_of(self.accepted_lengths)


@dataclass
class BatchGenerationResult:
    """A batch's output: one GenerationResult per prompt, in the caller's order (their `timings`
    are empty: the rounds were shared), and the batch's own clock."""

    rows: list[GenerationResult]
    num_forwards: int  # verification forwards the batch ran
    timings: dict[str, float] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    lossy: bool = False

    @property
    def num_new_tokens(self) -> int:
        return sum(row.new_tokens.shape[1] for row in self.rows)


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's own prompt [P_b]: the tokens where attention_mask is 1 (left or right padding)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, P], got {tuple(input_ids.shape)}")
    if attention_mask is None:
        return list(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    return [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]


def speculative_generate(
    target,
    drafter,
    input_ids: torch.Tensor,
    config: GenerationConfig,
    *,
    attention_mask: torch.Tensor | None = None,
    images=None,
    tokenizer=None,
    streamer=None,
    on_tokens=None,
):
    """Generate from `target` with trees from `drafter`; the output is the target's own
    (token for token under greedy, in distribution under sampling).

    input_ids: [B, P] prompts, padded on either side where `attention_mask` [B, P] says so.
    Batch 1 returns a GenerationResult; B > 1 a BatchGenerationResult with one per row (each row
    drafts with its own fork of `drafter`). `on_tokens(list[int])` and a transformers `streamer`
    (batch 1 only) receive each round's emitted tokens as they are accepted.
    images: for a vision-language target, one media.PromptImages (or None) per row, or one
    PromptImages for a single prompt; the prompt holds the image placeholder tokens.
    """
    prompts = unpad(input_ids, attention_mask)
    if isinstance(images, PromptImages):
        images = [images]
    if len(prompts) > 1 and (streamer is not None or on_tokens is not None):
        raise ValueError("streaming (streamer, on_tokens) takes one prompt at a time")
    result = generate_batch(target, drafter, prompts, config, images=images, tokenizer=tokenizer, streamer=streamer, on_tokens=on_tokens)
    if len(prompts) > 1:
        return result
    row = result.rows[0]
    row.timings, row.prefill_seconds, row.decode_seconds = result.timings, result.prefill_seconds, result.decode_seconds
    return row


def generate_batch(
    target, drafter, prompts: list[torch.Tensor], config: GenerationConfig, *, images=None, tokenizer=None, streamer=None, on_tokens=None
) -> BatchGenerationResult:
    """The decode loop over prompts [P_b] of any lengths; row 0 drafts with `drafter`, row b > 0
    with `fork_drafter(drafter)` (shared weights, its own state)."""
    max_len = context_limit(target.config, config.max_length)
    _check_prompts(prompts, max_len)
    backend = target_backend(target, config.static_cache, config.compile, config.row_invariant)
    if images is not None:
        if not isinstance(backend, TorchTarget):
            raise ValueError("images in the prompt run on the torch backend only")
        check_images(target, prompts, images)
    row_invariant = bool(getattr(backend, "row_invariant", False))
    size_drafter(target, drafter, config.sizing, row_invariant)  # before the forks: they share its cost
    drafters = [drafter] + [fork_drafter(drafter) for _ in prompts[1:]]
    device = prompts[0].device
    policy = load_policy(target, drafter, row_invariant) if config.sizing == "policy" else None
    settings = DecoderSettings(
        max_len=max_len,
        device=device,
        typical=config.typical,
        policy=policy,
        decode=None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)),
        profile=config.profile,
    )
    decoder = Decoder(backend, settings, drafter.feature_layers, drafter.needs_last_hidden)
    rows = _row_settings(target, config, len(prompts), streamer, on_tokens)

    with torch.inference_mode(), backend.engine_context(config.engine_linears):
        start = time.perf_counter()
        joined = decoder.join(prompts, drafters, rows, config.max_new_tokens, images)
        if streamer is not None:
            streamer.put(prompts[0][None].cpu())
        prefill_seconds = time.perf_counter() - start
        decoder.clock = PhaseClock(device, sync=config.profile)  # its clock starts now, when the rounds do
        try:
            while decoder.active:
                decoder.step()
        finally:
            if policy is not None:  # the policy's num_draft is for its own rounds only
                for d in drafters:
                    limit_drafter(d, None)
        if streamer is not None:
            streamer.end()
    return _batch_result(joined, decoder, config.lossy, prefill_seconds)


def _row_settings(target, config: GenerationConfig, n: int, streamer, on_tokens) -> list[RowSettings]:
    """Every row's settings from the one config: one generator shared by the rows (their draws
    interleave in round order), the stream callback on row 0."""
    generator = None if config.seed is None else torch.Generator().manual_seed(config.seed)
    rules = StopRules(tuple(config.eos_token_ids), tuple(config.stop_strings), config.max_new_tokens)
    seen_vocab = _seen_vocab(target, config)
    callback = on_tokens
    if streamer is not None:

        def callback(kept: list[int]) -> None:
            if on_tokens is not None:
                on_tokens(kept)
            streamer.put(torch.tensor(kept))

    return [RowSettings(config.sampling, rules, generator, callback if b == 0 else None, seen_vocab) for b in range(n)]


def _check_prompts(prompts: list[torch.Tensor], max_len: int | None) -> None:
    if not prompts:
        raise ValueError("no prompts")
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("empty prompt: nothing to condition on")
    longest = max(p.numel() for p in prompts)
    if max_len is not None and longest >= max_len:
        raise PromptTooLong(f"prompt of {longest} tokens leaves no room in a context of {max_len}")


def _seen_vocab(target, config: GenerationConfig) -> int | None:
    """The vocabulary over which rows track the tokens they have seen, for a repetition penalty (None: none)."""
    if config.sampling.repetition_penalty == 1.0:
        return None
    return target.config.get_text_config().vocab_size if hasattr(target.config, "get_text_config") else target.config.vocab_size


def _batch_result(rows: list[Row], decoder: Decoder, lossy: bool, prefill_seconds: float) -> BatchGenerationResult:
    device = decoder.settings.device
    return BatchGenerationResult(
        rows=[
            GenerationResult(
                new_tokens=torch.tensor([row.emitted], dtype=torch.long, device=device),
                accepted_lengths=row.accepted_lengths,
                finish_reason=row.finish or "length",
                lossy=lossy,
                drafted=row.drafted,
            )
            for row in rows
        ],
        num_forwards=decoder.num_forwards,
        timings=dict(decoder.clock.seconds),
        prefill_seconds=prefill_seconds,
        decode_seconds=sum(decoder.clock.seconds.values()),
        lossy=lossy,
    )
