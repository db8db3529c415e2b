"""Rows decoding together, round by round: the decode loop as an object, so that rows can join
between rounds and leave when done (continuous batching) as well as all start at once.

    decoder = Decoder(backend, settings)      the target's backend and what every row shares
    decoder.join(prompts, drafters, rows)     prefill new rows (after the active ones)
    decoder.step()                            one round for every active row -> the rows it finished
    decoder.cancel(row)                       the row leaves at the next step

A round (docs/trees.md): every row's drafter proposes a tree rooted at the row's pending token,
the trees are padded to one node count and verified in one target forward, each row accepts by
the exact rule under its own sampling settings and keeps its own path. `generate_batch`
(generate.py) runs join + step until no row is left; `drafthead serve` joins requests as they
come (inference/serve/).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .acceptance import Acceptance, TypicalAcceptance, greedy_accept, tree_rejection_sample, typical_accept
from ...ground.clock import PhaseClock
from .drafter import Drafter, RootOnlyDrafter, RoundStats, TargetFeatures
from .policy import SpeculationPolicy, cut_tree
from .sampling import SamplingConfig, apply_repetition_penalty, logits_to_probs, seen_mask
from .stopping import StopRules, first_stop
from .tree import DraftTree, ancestor_mask, node_depths
from .verify import select_features

STREAM_CHUNK = 16  # tokens per library call of plain decoding while the output streams (_plain_stretch)


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
class RowSettings:
    """What one row asks for: how its tokens are chosen and when it stops."""

    sampling: SamplingConfig
    rules: StopRules  # EOS ids, stop strings, max_new_tokens
    generator: torch.Generator | None = None  # the sampling draws (shared by a batch's rows in generate_batch)
    on_tokens: Callable[[list[int]], None] | None = None  # each round's kept tokens, as they are accepted
    seen_vocab: int | None = None  # track the tokens the row has seen over this vocabulary (a repetition penalty)
    # each emitted token's log-probability under the target's raw logits, with this many of the
    # most likely alternatives (Row.logprobs); None: none
    logprobs: int | None = None


@dataclass
class Row:
    """One sequence while it decodes; `emitted`, `accepted_lengths`, `drafted` and `finish` are its
    result so far."""

    drafter: Drafter
    settings: RowSettings
    prompt_len: int
    length: int  # committed tokens whose K/V the cache holds, in slots [0, length); the pending one is not
    seen: torch.Tensor | None  # [1, V] what a repetition penalty sees (prompt + emitted)
    pending: int  # the last committed token, whose K/V the next round computes as the tree root
    emitted: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    finish: str | None = None  # "eos" | "stop_string" | "length" | "context" | "cancelled"
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # per emitted token, when asked
    # plain rounds' (tokens [1, 1], features, pending [1]) not yet given to the drafter: it takes
    # them in one commit when it next drafts (_catch_up), so plain rounds cost no drafter work
    deferred: list = field(default_factory=list)


@dataclass
class DecoderSettings:
    """What every row of a decoder shares."""

    max_len: int | None  # the context limit
    device: torch.device
    typical: TypicalAcceptance | None = None  # LOSSY, opt-in (sampling rows only)
    policy: SpeculationPolicy | None = None  # speculation by load; None: verify whole trees
    decode: Callable[[list[int]], str] | None = None  # token ids -> text, for stop strings
    profile: bool = False  # synchronise the device around each phase so the clock is exact
    # plain greedy runs of one row (_plain_stretch) stop after this many tokens even when nothing
    # streams, so that rows waiting to join wait at most that long; None: a run goes to its end
    stretch_limit: int | None = None


# observe(row, tokens [1, k], the recorded layers at them or None): called with the prompt's
# prefilled tokens when a row joins, then with each round's committed tokens (its root first)
RoundObserver = Callable[[Row, torch.Tensor, TargetFeatures | None], None]


class Decoder:
    def __init__(
        self, backend, settings: DecoderSettings, feature_layers: tuple[int, ...], needs_last_hidden: bool, record_layers: tuple[int, ...] = ()
    ):
        """feature_layers, needs_last_hidden: what the rows' drafters read. record_layers: the
        hidden states (output_hidden_states indices) the observers get at every committed token."""
        self.backend = backend  # the target's forward and cache (torch_target.py, llamacpp/target.py)
        self.settings = settings
        self.record_layers = tuple(record_layers)
        # what the backend returns: the drafters' layers and the recorded ones
        self.feature_layers = tuple(sorted(set(feature_layers) | set(record_layers)))
        self.needs_last_hidden = needs_last_hidden
        self.want_hidden = bool(self.feature_layers) or needs_last_hidden  # the verifier returns hidden states
        self.active: list[Row] = []
        self.clock = PhaseClock(settings.device, sync=settings.profile)
        self.num_forwards = 0  # verification forwards run (a plain stretch counts each of its tokens)
        self.observers: list[RoundObserver] = []
        self._started = False
        self._opened = False
        self._opened_as: tuple[int, int] = (0, 0)
        self._streams = False

    def open(self, rows: int, cells: int, streams: bool = False) -> None:
        """Room for up to `rows` rows of `cells` cached tokens in all, before any row joins (the
        llama.cpp backend fixes its sequences and KV cells here, and with `streams` gives each row
        a stream of its own; the torch one grows as it goes)."""
        self.backend.open(rows, cells, self.feature_layers, self.needs_last_hidden, streams)
        self._opened = True
        self._opened_as, self._streams = (rows, cells), streams

    def join(self, prompts: list[torch.Tensor], drafters: list, settings: list[RowSettings], max_new_tokens: int = 0, images=None) -> list[Row]:
        """Prefill `prompts` [P_b] (every one but its last token) as new rows after the active ones;
        row b drafts with drafters[b], begun on its prompt's features. Returns the new rows."""
        self._leave()
        extra = {} if images is None else {"images": images}  # the llama.cpp backend takes none
        if self._started or self._opened:
            hidden = self.backend.join(prompts, max_new_tokens, **extra)
        else:
            hidden = self.backend.start(prompts, self.feature_layers, self.needs_last_hidden, max_new_tokens, **extra)
            self._started = True
        rows = []
        for b, (p, d, s) in enumerate(zip(prompts, drafters, settings)):
            n = p.numel() - 1
            features = None
            if hidden is not None and n > 0:
                # an index tensor, not a slice: copies, so that no view keeps the prefill's L + 1
                # hidden states of the whole padded batch ([B, P, H] x (L + 1)) alive while rows decode
                positions = torch.arange(n, device=p.device)
                features = select_features(hidden, d.feature_layers, d.needs_last_hidden, positions, row=b)
            d.begin(p[None, :-1], features, p[-1:])
            seen = seen_mask(p[None], s.seen_vocab) if s.seen_vocab is not None else None
            row = Row(d, s, p.numel(), n, seen, int(p[-1]))
            if n > 0 and self.observers:
                self._observe(row, p[None, :-1], hidden, torch.arange(n, device=p.device), b)
            rows.append(row)
        self.active += rows
        return rows

    def reset(self) -> None:
        """No row left, the cache emptied (opened again as it was, or its rows dropped)."""
        self.active = []
        if self._opened:
            self.backend.open(*self._opened_as, self.feature_layers, self.needs_last_hidden, self._streams)
        elif self._started:
            self.backend.select_rows([], [])

    def cancel(self, row: Row) -> None:
        """`row` leaves the batch at the next step, with what it has emitted so far."""
        if row.finish is None:
            row.finish = "cancelled"

    def step(self) -> list[Row]:
        """One round for every active row (or one plain run of a lone row, _plain_stretch).
        Returns the rows that finished, which leave the batch at the next step or join."""
        self._mark_context_ends()
        self._leave()
        if not self.active:
            return []
        limits = [self._max_depth(row) for row in self.active]
        before = [row.finish for row in self.active]
        stretch = self._plain_stretch(limits[0])
        if stretch:
            self.num_forwards += stretch
        else:
            self._round(limits)
            self.num_forwards += 1
        return [row for row, was in zip(self.active, before) if was is None and row.finish is not None]

    # -- a round -----------------------------------------------------------------------------------

    def _mark_context_ends(self) -> None:
        max_len = self.settings.max_len
        if max_len is None:
            return
        for row in self.active:
            if row.finish is None and row.length + 1 >= max_len:
                row.finish = "context"

    def _max_depth(self, row: Row) -> int:
        """The deepest node row's tree may keep: a path of depth d emits d + 1 tokens, within its
        max_new_tokens and the context."""
        max_depth = row.settings.rules.max_new_tokens - len(row.emitted) - 1
        if self.settings.max_len is not None:
            max_depth = min(max_depth, self.settings.max_len - row.length - 2)
        return max_depth

    def _round(self, limits: list[int]) -> None:
        active, backend, clock, policy = self.active, self.backend, self.clock, self.settings.policy
        device = self.settings.device
        round_start = time.perf_counter()
        planned = 0 if policy is None else policy.plan(len(active))  # 0: whole trees, 1: plain
        drafting = planned != 1
        if drafting:
            num_nodes = None if policy is None else policy.draft_limit(len(active), planned)
            for row in active:
                limit_drafter(row.drafter, num_nodes - 1 if num_nodes is not None else None)
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
        verification = backend.verify(trees, lengths, self.want_hidden)
        clock.lap("verify")
        verify_end = time.perf_counter()

        results = [
            accept_tree(
                tree, verification.logits[b : b + 1, : tree.num_nodes], row.settings.sampling, row.seen, row.settings.generator, self.settings.typical
            )
            for b, (row, tree) in enumerate(zip(active, trees))
        ]
        clock.lap("accept")

        backend.keep([r.path for r in results], lengths)
        clock.lap("cache")

        for b, (row, (tree, kept_nodes), result) in enumerate(zip(active, drafts, results)):
            self._advance(row, b, tree, kept_nodes, result, verification, not drafting)
        if policy is not None:
            policy.observe(
                [t.num_nodes for t in trees],
                [r.path for r in results],
                fixed_seconds=time.perf_counter() - verify_end,
                draft_seconds=draft_seconds if drafting else None,
                planned=planned,
            )
        clock.lap("other")

    def _plain_stretch(self, max_depth: int) -> int:
        """Plain greedy decoding of one row in one backend call (the llama.cpp backend's
        `greedy_run`), where nothing happens between its rounds: no drafting, no stop strings, no
        repetition penalty. Streamed output goes out STREAM_CHUNK tokens at a time. The row ends as
        the same plain rounds would leave it.
        Returns the forwards it ran: 0 (nothing done) where that does not hold."""
        active = self.active
        row = active[0]
        greedy_run = getattr(self.backend, "greedy_run", None)
        if (
            greedy_run is None
            or len(active) != 1
            or not isinstance(row.drafter, RootOnlyDrafter)
            or self.settings.policy is not None
            or not row.settings.sampling.greedy
            or row.seen is not None
            or row.settings.rules.stop_strings
            or self.want_hidden
            or self.observers
            or row.settings.logprobs is not None
            or max_depth < 0
        ):
            return 0
        n = max_depth + 1
        if row.settings.on_tokens is not None:
            n = min(n, STREAM_CHUNK)
        if self.settings.stretch_limit is not None:
            n = min(n, self.settings.stretch_limit)
        pending = row.pending
        tokens = greedy_run(pending, row.length, n, row.settings.rules.eos_token_ids)
        self.clock.lap("verify")
        kept = self._emit(row, tokens)
        row.accepted_lengths.extend([1] * len(kept))
        row.drafted.extend([0] * len(kept))
        _stream(row, kept)
        row.drafter.commit(
            torch.tensor([[pending] + tokens[:-1]], device=self.settings.device),
            None,
            torch.tensor([tokens[-1]], device=self.settings.device),
            RoundStats(num_draft=0, num_accepted=0, depth=0, path=[0], skipped=False),
        )
        row.length += len(tokens)
        row.pending = tokens[-1]
        return len(tokens)

    def _emit(self, row: Row, tokens: list[int]) -> list[int]:
        """Append a round's tokens to the row's output, cut at the first stop (which sets row.finish);
        returns the tokens kept."""
        before = len(row.emitted)
        row.emitted.extend(tokens)
        stop = first_stop(row.emitted, before, row.settings.rules, self.settings.decode)
        if stop is not None:
            del row.emitted[stop[0] :]
            row.finish = stop[1]
        return row.emitted[before:]

    def _leave(self) -> None:
        """Drop finished rows from the batch and their K/V from the cache."""
        active = self.active
        keep = [i for i, row in enumerate(active) if row.finish is None]
        if len(keep) == len(active):
            return
        self.active = [active[i] for i in keep]
        if self._started or self._opened:
            self.backend.select_rows(keep, [row.length for row in self.active])

    def _advance(self, row: Row, b: int, tree: DraftTree, kept_nodes, result: Acceptance, verification, skipped: bool) -> None:
        """Emit row b's accepted tokens, apply the stop rules and move its drafter on."""
        path_tokens = tree.tokens[0, result.path].tolist()
        round_tokens = path_tokens[1:] + [result.next_token]
        kept = self._emit(row, round_tokens)
        if row.settings.logprobs is not None and kept:
            row.logprobs += token_logprobs(verification.logits[b, result.path[: len(kept)]], kept, row.settings.logprobs)
        row.accepted_lengths.append(len(kept))
        row.drafted.append(tree.num_draft)
        row.length += len(result.path)  # the root and the accepted drafts are now in the cache
        row.pending = result.next_token
        device = tree.tokens.device
        if row.seen is not None:
            row.seen[0, torch.tensor(round_tokens, device=device)] = True
        _stream(row, kept)
        path_index = torch.tensor(result.path, device=device)
        drafter = row.drafter
        self._observe(row, tree.tokens[:, path_index], verification.hidden_states, path_index, b)
        if row.finish is not None:
            return
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

    def _observe(self, row: Row, tokens: torch.Tensor, hidden, index: torch.Tensor, b: int) -> None:
        """Hand the observers row b's committed `tokens` [1, k] and the recorded layers' hidden
        states at positions `index` of the forward's `hidden`."""
        if not self.observers:
            return
        features = select_features(hidden, self.record_layers, False, index, row=b) if self.record_layers else None
        for observe in self.observers:
            observe(row, tokens, features)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """(log p(token), the `top` most likely (id, log p)) of each token under logits [k, V], row j
    the distribution token j was chosen from."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [k, V]
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, device=lp.device)].tolist()
    if top == 0:
        return [(c, []) for c in chosen]
    values, ids = lp.topk(top, dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


def _stream(row: Row, kept: list[int]) -> None:
    """Hand the kept tokens to the row's callback."""
    if row.settings.on_tokens is not None and kept:
        row.settings.on_tokens(kept)


def limit_drafter(drafter, num_draft: int | None) -> None:
    """Pass the load policy's num_draft to drafters that can stop early (EAGLE heads; optional)."""
    limit = getattr(drafter, "limit", None)
    if limit is not None:
        limit(num_draft)


def _catch_up(row: Row) -> None:
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
