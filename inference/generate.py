"""The speculative decode loop: draft a tree, verify it in one target forward, accept exactly.

Cache convention (docs/trees.md): the target cache holds every committed token but
the last, the *pending* token, which enters each round as the root (node 0) of the verified tree.

    prefill(prompt[:-1])                           pending = prompt[-1]
    loop: tree = drafter.propose()                 root = pending
          logits = forward_tree(tree)              [B, N, V], appends N nodes to the cache
          path, token = accept(tree, logits)       exact rule (greedy or rejection sampling)
          keep_path(cache, path)                   cache = prefix + accepted nodes
          emit tokens[path[1:]] + token;           pending = token
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .acceptance import Acceptance, TypicalAcceptance, greedy_accept, tree_rejection_sample, typical_accept
from .cache import cache_kwargs, keep_path, new_cache
from .drafter import RoundStats
from .sampling import SamplingConfig, apply_repetition_penalty, logits_to_probs, seen_mask
from .stopping import StopRules, first_stop
from .tree import DraftTree, ancestor_mask, node_depths
from .verify import check_tree_mask_support, forward_tree, select_features


class PromptTooLong(ValueError):
    """The prompt does not leave room for one new token within the target's context."""


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

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
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
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))


def context_limit(config, override: int | None = None) -> int | None:
    return override or getattr(config, "max_position_embeddings", None)


def limit_depth(tree: DraftTree, max_depth: int) -> tuple[DraftTree, list[int] | None]:
    """Drop nodes deeper than max_depth (a depth-d path emits d + 1 tokens). Returns the tree and,
    when nodes were dropped, the original index of each kept node (None: the tree is unchanged)."""
    depth = node_depths(tree.parents)
    if int(depth.max()) <= max_depth:
        return tree, None
    keep = (depth <= max_depth).nonzero().flatten()
    return tree.subtree(keep), keep.tolist()


def node_seen(history_seen: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[B, N, V] bool: tokens a repetition penalty sees at each node = history + the node's path."""
    anc = ancestor_mask(parents).to(torch.float32)  # [N, N]
    onehot = torch.nn.functional.one_hot(tokens, history_seen.shape[-1]).to(torch.float32)  # [B, N, V]
    on_path = torch.einsum("ij,bjv->biv", anc, onehot) > 0
    return on_path | history_seen[:, None, :]


def accept_tree(tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, history_seen, generator,
                typical: TypicalAcceptance | None = None) -> Acceptance:
    """Apply the exact rule (or, when asked, the LOSSY typical rule) to batch row 0. logits: [B, N, V]
    target logits at the tree nodes."""
    tokens, parents = tree.tokens[0], tree.parents
    seen = None
    if sampling.repetition_penalty != 1.0:
        seen = node_seen(history_seen, tree.tokens, parents)[0]
    if sampling.greedy:
        # float32 first, as generate() does: argmax over bf16 is ~3x slower on CPU, and the cast
        # is exact, so ties still resolve to the first index
        lg = logits[0].float()
        if seen is not None:
            lg = apply_repetition_penalty(lg, seen, sampling.repetition_penalty)
        return greedy_accept(tokens, parents.to(tokens.device), lg.argmax(dim=-1))
    p = logits_to_probs(logits[0], sampling, seen)  # [N, V]
    if typical is not None:
        return typical_accept(tokens.cpu(), parents.cpu(), p.cpu(), typical, generator)
    q = None if tree.draft_probs is None else tree.draft_probs[0]
    return tree_rejection_sample(tokens.cpu(), parents.cpu(), p.cpu(), None if q is None else q.cpu(), generator)


class _Clock:
    """Accumulates wall time per phase; synchronises the device first when profiling."""

    def __init__(self, device: torch.device, exact: bool):
        self.totals: dict[str, float] = defaultdict(float)
        self.sync = exact and device.type == "cuda"
        self.device = device
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.totals[phase] += now - self.last
        self.last = now


def speculative_generate(
    target,
    drafter,
    input_ids: torch.Tensor,
    config: GenerationConfig,
    *,
    tokenizer=None,
    streamer=None,
    on_tokens=None,
) -> GenerationResult:
    """Generate from `target` with trees from `drafter`; the output is the target's own
    (token for token under greedy, in distribution under sampling).

    input_ids: [B, P] prompt (batch 1 for now). `on_tokens(list[int])` and a transformers
    `streamer` receive each round's emitted tokens as they are accepted.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, P], got {tuple(input_ids.shape)}")
    batch, prompt_len = input_ids.shape
    if batch != 1:
        raise NotImplementedError(f"batch size {batch}: speculative generation runs batch 1 for now")
    if prompt_len == 0:
        raise ValueError("empty prompt: nothing to condition on")
    check_tree_mask_support(target.config)
    max_len = context_limit(target.config, config.max_length)
    if max_len is not None and prompt_len >= max_len:
        raise PromptTooLong(f"prompt of {prompt_len} tokens leaves no room in a context of {max_len}")
    device = input_ids.device
    generator = None
    if config.seed is not None:
        generator = torch.Generator().manual_seed(config.seed)
    rules = StopRules(tuple(config.eos_token_ids), tuple(config.stop_strings), config.max_new_tokens)
    decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    want_hidden = bool(drafter.feature_layers) or drafter.needs_last_hidden
    vocab = target.config.get_text_config().vocab_size if hasattr(target.config, "get_text_config") else target.config.vocab_size
    track_seen = config.sampling.repetition_penalty != 1.0

    with torch.inference_mode():
        start = time.perf_counter()
        cache = new_cache()
        prefix, pending = input_ids[:, :-1], input_ids[:, -1]
        features = None
        if prefix.shape[1] > 0:
            out = target(
                input_ids=prefix, **cache_kwargs(target, cache), use_cache=True, output_hidden_states=want_hidden, logits_to_keep=1
            )
            features = select_features(out.hidden_states, drafter.feature_layers, drafter.needs_last_hidden)
        drafter.begin(prefix, features, pending)
        history_seen = seen_mask(input_ids, vocab) if track_seen else None
        if streamer is not None:
            streamer.put(input_ids.cpu())
        prefill_seconds = time.perf_counter() - start

        clock = _Clock(device, config.profile)
        emitted: list[int] = []
        accepted_lengths: list[int] = []
        drafted: list[int] = []
        finish = "length"
        committed = prompt_len  # tokens in the sequence, pending included
        while True:
            # A path of depth d emits d + 1 tokens: stay within max_new_tokens and the context.
            max_depth = config.max_new_tokens - len(emitted) - 1
            if max_len is not None:
                if committed >= max_len:
                    finish = "context"
                    break
                max_depth = min(max_depth, max_len - committed - 1)
            tree, kept_nodes = limit_depth(drafter.propose(), max_depth)
            clock.lap("draft")

            past_len = committed - 1
            verification = forward_tree(target, cache, tree.tokens, tree.parents, past_len, want_hidden)
            clock.lap("verify")

            result = accept_tree(tree, verification.logits, config.sampling, history_seen, generator, config.typical)
            clock.lap("accept")

            keep_path(cache, past_len, result.path)
            clock.lap("cache")

            path_tokens = tree.tokens[0, result.path].tolist()
            round_tokens = path_tokens[1:] + [result.next_token]
            before = len(emitted)
            emitted.extend(round_tokens)
            stop = first_stop(emitted, before, rules, decode)
            if stop is not None:
                del emitted[stop[0]:]
                finish = stop[1]
            kept = emitted[before:]
            accepted_lengths.append(len(kept))
            drafted.append(tree.num_draft)
            committed += len(round_tokens)
            if track_seen:
                history_seen[0, torch.tensor(round_tokens, device=device)] = True
            if on_tokens is not None and kept:
                on_tokens(kept)
            if streamer is not None and kept:
                streamer.put(torch.tensor(kept))
            if stop is not None:
                clock.lap("other")
                break
            path_index = torch.tensor(result.path, device=device)
            round_features = select_features(
                verification.hidden_states, drafter.feature_layers, drafter.needs_last_hidden, path_index
            )
            depth_of = node_depths(tree.parents)
            depths = depth_of[result.path].tolist()
            drafter.commit(
                tree.tokens[:, path_index],
                round_features,
                torch.tensor([result.next_token], device=device),
                RoundStats(num_drafted=tree.num_draft, num_accepted=len(result.path) - 1,
                           depth=int(depth_of.max()), accepted_depths=depths[1:],
                           # in the drafter's own numbering, before limit_depth
                           path=list(result.path) if kept_nodes is None else [kept_nodes[i] for i in result.path]),
            )
            clock.lap("other")
        if streamer is not None:
            streamer.end()

    return GenerationResult(
        new_tokens=torch.tensor([emitted], dtype=torch.long, device=device),
        accepted_lengths=accepted_lengths,
        finish_reason=finish,
        lossy=config.lossy,
        timings=dict(clock.totals),
        drafted=drafted,
        prefill_seconds=prefill_seconds,
        decode_seconds=sum(clock.totals.values()),
    )
