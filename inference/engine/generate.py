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
row that finishes leaves the batch (docs/trees.md "Batches").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .clock import PhaseClock
from .rounds import tau_of
from .acceptance import Acceptance, TypicalAcceptance, greedy_accept, tree_rejection_sample, typical_accept
from .drafter import Drafter, RootOnlyDrafter, RoundStats, TargetFeatures, fork_drafter
from .policy import SpeculationPolicy, cut_tree
from .sampling import SamplingConfig, apply_repetition_penalty, logits_to_probs, seen_mask
from .stopping import StopRules, check_stop_strings, first_stop
from .backend import target_backend
from .media import PromptImages, check_images
from .torch_target import TorchTarget
from .tree import DraftTree, ancestor_mask, node_depths
from .verify import select_features


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
    # speculation by load (`--sizing policy`): cuts every row's tree to the node count that pays
    # at this batch size, down to plain decoding (inference/engine/policy.py); None: verify whole trees
    policy: SpeculationPolicy | None = None
    # the target's linears on the faster CPU kernel per row count while we decode
    # (inference/kernels/target_linears.py); generate() and training never see the swap
    engine_linears: bool = True
    # a static KV cache (fixed slot count, K/V written in place), and with `compile` (a
    # torch.compile backend: "inductor") the target's round forward compiled (inference/engine/compiled.py);
    # the first generation pays the compile
    static_cache: bool = False
    compile: str | None = None
    # every verify forward row-invariant (inference/engine/invariant.py): bf16 output equal to our
    # plain decoding bit for bit; slower per forward
    row_invariant: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_seed(self.seed)
        check_stop_strings(self.stop_strings)
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


def accept_tree(
    tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, history_seen, generator, typical: TypicalAcceptance | None = None
) -> Acceptance:
    """Apply the exact rule (or, when asked, the LOSSY typical rule) to one row's tree (batch 1).
    logits: [1, N, V] target logits at the tree nodes."""
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


@dataclass
class _Row:
    """One sequence of a batch while it decodes."""

    drafter: Drafter
    prompt_len: int
    length: int  # committed tokens whose K/V the cache holds, in slots [0, length); the pending one is not
    seen: torch.Tensor | None  # [1, V] what a repetition penalty sees (prompt + emitted)
    pending: int  # the last committed token, whose K/V the next round computes as the tree root
    emitted: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    finish: str | None = None
    # plain rounds' (tokens [1, 1], features, pending [1]) not yet given to the drafter: it takes
    # them in one commit when it next drafts (_catch_up), so plain rounds cost no drafter work
    deferred: list = field(default_factory=list)


@dataclass
class _Decoding:
    """What every round of one generation reads: the target and settings, the output hooks and
    the engine's pieces (one home instead of a dozen parameters on each step)."""

    backend: Any  # the target's forward and cache (torch_target.py, llamacpp/target.py)
    config: GenerationConfig
    want_hidden: bool  # the verifier returns hidden states for the drafters' features
    generator: torch.Generator | None
    rules: StopRules
    decode: object  # token ids -> text for stop strings, or None
    on_tokens: Callable[[list[int]], None] | None
    streamer: Any  # a transformers-style streamer: put(tokens), end()
    clock: PhaseClock
    max_len: int | None  # the context limit
    device: torch.device


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
    drafters = [drafter] + [fork_drafter(drafter) for _ in prompts[1:]]

    with torch.inference_mode(), backend.engine_context(config.engine_linears):
        start = time.perf_counter()
        rows = _prefill(backend, prompts, drafters, config.max_new_tokens, _seen_vocab(target, config), images)
        if streamer is not None:
            streamer.put(prompts[0][None].cpu())
        prefill_seconds = time.perf_counter() - start

        run = _decoding(backend, drafter, config, max_len, prompts[0].device, tokenizer, on_tokens, streamer)
        try:
            num_forwards = _decode(run, list(rows))
        finally:
            if config.policy is not None:  # the policy's num_draft is for its own rounds only
                for d in drafters:
                    _limit(d, None)
        if streamer is not None:
            streamer.end()
    return _batch_result(rows, run, num_forwards, prefill_seconds)


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


def _decoding(backend, drafter, config: GenerationConfig, max_len: int | None, device: torch.device, tokenizer, on_tokens, streamer) -> _Decoding:
    """What every round reads; its clock starts now, when the rounds do."""
    generator = None if config.seed is None else torch.Generator().manual_seed(config.seed)
    rules = StopRules(tuple(config.eos_token_ids), tuple(config.stop_strings), config.max_new_tokens)
    decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    want_hidden = bool(drafter.feature_layers) or drafter.needs_last_hidden
    return _Decoding(
        backend, config, want_hidden, generator, rules, decode, on_tokens, streamer, PhaseClock(device, sync=config.profile), max_len, device
    )


def _batch_result(rows: list[_Row], run: _Decoding, num_forwards: int, prefill_seconds: float) -> BatchGenerationResult:
    lossy = run.config.lossy
    return BatchGenerationResult(
        rows=[
            GenerationResult(
                new_tokens=torch.tensor([row.emitted], dtype=torch.long, device=run.device),
                accepted_lengths=row.accepted_lengths,
                finish_reason=row.finish or "length",
                lossy=lossy,
                drafted=row.drafted,
            )
            for row in rows
        ],
        num_forwards=num_forwards,
        timings=dict(run.clock.seconds),
        prefill_seconds=prefill_seconds,
        decode_seconds=sum(run.clock.seconds.values()),
        lossy=lossy,
    )


def _prefill(backend, prompts: list[torch.Tensor], drafters: list, max_new_tokens: int, seen_vocab: int | None, images=None) -> list[_Row]:
    """Every prompt but its last token through the target at once (the backend's `start`); each
    drafter begins on its prompt's features. Returns the rows, ready to decode.
    seen_vocab: track the tokens each row has seen (a repetition penalty), over this vocabulary."""
    device = prompts[0].device
    features_of = drafters[0]
    extra = {} if images is None else {"images": images}  # the llama.cpp backend takes none
    hidden = backend.start(prompts, features_of.feature_layers, features_of.needs_last_hidden, max_new_tokens, **extra)
    rows = []
    for b, (p, d) in enumerate(zip(prompts, drafters)):
        n = p.numel() - 1
        features = None
        if hidden is not None and n > 0:
            # an index tensor, not a slice: copies, so that no view keeps the prefill's L + 1
            # hidden states of the whole padded batch ([B, P, H] x (L + 1)) alive while rows decode
            positions = torch.arange(n, device=device)
            features = select_features(hidden, d.feature_layers, d.needs_last_hidden, positions, row=b)
        d.begin(p[None, :-1], features, p[-1:])
        rows.append(_Row(d, p.numel(), n, seen_mask(p[None], seen_vocab) if seen_vocab is not None else None, int(p[-1])))
    return rows


def _decode(run: _Decoding, active: list[_Row]) -> int:
    """The rounds, until every row has finished; returns the number of verification forwards."""
    config, max_len, device, backend, clock = run.config, run.max_len, run.device, run.backend, run.clock
    num_forwards = 0
    while active:
        # A path of depth d emits d + 1 tokens: stay within max_new_tokens and the context.
        limits = []
        for row in active:
            max_depth = config.max_new_tokens - len(row.emitted) - 1
            if max_len is not None:
                if row.length + 1 >= max_len:
                    row.finish = "context"
                max_depth = min(max_depth, max_len - row.length - 2)
            limits.append(max_depth)
        active, limits = _leave(backend, active, limits)
        if not active:
            break
        stretch = _plain_stretch(run, active, limits[0])
        if stretch:
            num_forwards += stretch
            continue
        policy = config.policy
        round_start = time.perf_counter()
        planned = 0 if policy is None else policy.plan(len(active))  # 0: whole trees, 1: plain
        drafting = planned != 1
        if drafting:
            num_nodes = None if policy is None else policy.draft_limit(len(active), planned)
            for row in active:
                _limit(row.drafter, num_nodes - 1 if num_nodes is not None else None)
                _catch_up(row)
            drafts = [limit_depth(row.drafter.propose(), max_depth) for row, max_depth in zip(active, limits)]
        else:  # plain decoding this round: each tree is its root
            drafts = [(DraftTree(torch.tensor([[row.pending]], device=device), torch.tensor([-1], device=device)), None) for row in active]
        if policy is not None and drafting:
            keep = policy.cut([tree for tree, _ in drafts])
            drafts = [(cut_tree(tree, keep), kept_nodes) for tree, kept_nodes in drafts]
        drafts = [(backend.cut_to_capacity(tree, len(active)), kept_nodes) for tree, kept_nodes in drafts]
        draft_seconds = time.perf_counter() - round_start
        clock.lap("draft")

        trees = [tree for tree, _ in drafts]
        lengths = [row.length for row in active]
        verification = backend.verify(trees, lengths, run.want_hidden)
        num_forwards += 1
        clock.lap("verify")
        verify_end = time.perf_counter()

        results = [
            accept_tree(tree, verification.logits[b : b + 1, : tree.num_nodes], config.sampling, row.seen, run.generator, config.typical)
            for b, (row, tree) in enumerate(zip(active, trees))
        ]
        clock.lap("accept")

        backend.keep([r.path for r in results], lengths)
        clock.lap("cache")

        for b, (row, (tree, kept_nodes), result) in enumerate(zip(active, drafts, results)):
            _advance(run, row, b, tree, kept_nodes, result, verification, not drafting)
        if policy is not None:
            policy.observe(
                [t.num_nodes for t in trees],
                [r.path for r in results],
                fixed_seconds=time.perf_counter() - verify_end,
                draft_seconds=draft_seconds if drafting else None,
                planned=planned,
            )
        clock.lap("other")
    return num_forwards


STREAM_CHUNK = 16  # tokens per library call of plain decoding while the output streams (_plain_stretch)


def _plain_stretch(run: _Decoding, active: list[_Row], max_depth: int) -> int:
    """Plain greedy decoding of one row to its end in one backend call (the llama.cpp backend's
    `greedy_run`), where nothing happens between its rounds: no drafting, no stop strings, no
    repetition penalty. Streamed output goes out STREAM_CHUNK tokens at a time. The row ends as the
    same plain rounds would leave it.
    Returns the forwards it ran: 0 (nothing done) where that does not hold."""
    row, config = active[0], run.config
    greedy_run = getattr(run.backend, "greedy_run", None)
    if (
        greedy_run is None
        or len(active) != 1
        or not isinstance(row.drafter, RootOnlyDrafter)
        or config.policy is not None
        or not config.sampling.greedy
        or row.seen is not None
        or run.rules.stop_strings
        or run.want_hidden
        or max_depth < 0
    ):
        return 0
    streaming = run.on_tokens is not None or run.streamer is not None
    pending = row.pending
    tokens = greedy_run(pending, row.length, min(max_depth + 1, STREAM_CHUNK) if streaming else max_depth + 1, run.rules.eos_token_ids)
    run.clock.lap("verify")
    kept = _emit(run, row, tokens)
    row.accepted_lengths.extend([1] * len(kept))
    row.drafted.extend([0] * len(kept))
    _stream(run, kept)
    row.drafter.commit(
        torch.tensor([[pending] + tokens[:-1]], device=run.device),
        None,
        torch.tensor([tokens[-1]], device=run.device),
        RoundStats(num_draft=0, num_accepted=0, depth=0, path=[0], skipped=False),
    )
    row.length += len(tokens)
    row.pending = tokens[-1]
    return len(tokens)


def _emit(run: _Decoding, row: _Row, tokens: list[int]) -> list[int]:
    """Append a round's tokens to the row's output, cut at the first stop (which sets row.finish);
    returns the tokens kept."""
    before = len(row.emitted)
    row.emitted.extend(tokens)
    stop = first_stop(row.emitted, before, run.rules, run.decode)
    if stop is not None:
        del row.emitted[stop[0] :]
        row.finish = stop[1]
    return row.emitted[before:]


def _stream(run: _Decoding, kept: list[int]) -> None:
    """Hand the kept tokens to the caller's callback and streamer."""
    if run.on_tokens is not None and kept:
        run.on_tokens(kept)
    if run.streamer is not None and kept:
        run.streamer.put(torch.tensor(kept))


def _limit(drafter, num_draft: int | None) -> None:
    """Pass the load policy's num_draft to drafters that can stop early (EAGLE heads; optional)."""
    limit = getattr(drafter, "limit", None)
    if limit is not None:
        limit(num_draft)


def _leave(backend, active: list[_Row], limits: list[int]):
    """Drop finished rows from the batch and their K/V from the cache."""
    keep = [i for i, row in enumerate(active) if row.finish is None]
    if len(keep) == len(active):
        return active, limits
    active = [active[i] for i in keep]
    if active:
        backend.select_rows(keep, [row.length for row in active])
    return active, [limits[i] for i in keep]


def _advance(run: _Decoding, row: _Row, b: int, tree: DraftTree, kept_nodes, result: Acceptance, verification, skipped: bool) -> None:
    """Emit row b's accepted tokens, apply the stop rules and move its drafter on."""
    path_tokens = tree.tokens[0, result.path].tolist()
    round_tokens = path_tokens[1:] + [result.next_token]
    kept = _emit(run, row, round_tokens)
    row.accepted_lengths.append(len(kept))
    row.drafted.append(tree.num_draft)
    row.length += len(result.path)  # the root and the accepted drafts are now in the cache
    row.pending = result.next_token
    device = tree.tokens.device
    if row.seen is not None:
        row.seen[0, torch.tensor(round_tokens, device=device)] = True
    _stream(run, kept)
    if row.finish is not None:
        return
    path_index = torch.tensor(result.path, device=device)
    drafter = row.drafter
    round_features = select_features(verification.hidden_states, drafter.feature_layers, drafter.needs_last_hidden, path_index, row=b)
    if skipped:  # a plain round: the drafter catches up when it next drafts
        row.deferred.append((tree.tokens[:, path_index], round_features, torch.tensor([result.next_token], device=device)))
        return
    depth_of = node_depths(tree.parents)
    depths = depth_of[result.path].tolist()
    drafter.commit(
        tree.tokens[:, path_index],
        round_features,
        torch.tensor([result.next_token], device=device),
        RoundStats(
            num_draft=tree.num_draft,
            num_accepted=len(result.path) - 1,
            depth=int(depth_of.max()),
            accepted_depths=depths[1:],
            # in the drafter's own numbering, before limit_depth
            path=list(result.path) if kept_nodes is None else [kept_nodes[i] for i in result.path],
            skipped=skipped,
        ),
    )


def _catch_up(row: _Row) -> None:
    """Give the drafter the plain rounds it skipped as one commit: their roots as the accepted
    tokens, their features, the last pending token (what a round accepting them all would give)."""
    if not row.deferred:
        return
    tokens = torch.cat([t for t, _, _ in row.deferred], dim=1)  # [1, k]
    parts = [f for _, f, _ in row.deferred]
    features = None
    if parts[0] is not None:
        features = TargetFeatures(
            parts[0].layers,
            tuple(torch.cat(layer, dim=1) for layer in zip(*(f.hidden_states for f in parts))),
            None if parts[0].last is None else torch.cat([f.last for f in parts], dim=1),
        )
    pending = row.deferred[-1][2]
    row.deferred.clear()
    row.drafter.commit(tokens, features, pending, RoundStats(num_draft=0, num_accepted=0, depth=0, path=[0], skipped=True))
