"""Greedy speculative decoding replayed on a known greedy continuation: a drafter's tau without
the target's verification rounds (docs/acceptance.md "Replaying greedy rounds").

Greedy speculative output is the target's greedy output (the rule is exact), so once that output
S = prompt + continuation is known, every round the engine would run is determined by the drafter
alone: at a pending token at position `pos`, a tree node at depth d stands for position pos + d,
and the target's argmax there is S[pos + d + 1] for every node whose path matches S, the only
nodes acceptance ever keeps. One target forward over S gives the features the verifier would
hand the drafter at accepted positions. The engine's own acceptance rule (`greedy_accept`) picks
the path, so `replay_greedy` returns the per-round accepted lengths `generate` would, round for
round, up to floating-point differences between one forward over S and the engine's tree-masked
forwards (tests/test_replay.py checks them equal on tiny targets).

It costs one target forward per sequence plus the drafting, where a bench costs one target
forward per round: the 80-prompt x 256-token chain tau of a head takes minutes, not half an hour,
on a 2-core CPU.

Engines count their rounds differently (docs/acceptance.md "Counting as vLLM does"): `Counting`
names the two rules that matter, and `VLLM` replays the steps vLLM's own metrics count, step for
step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.acceptance import greedy_accept
from ..engine.drafter import RootOnlyDrafter
from ..engine.drafter import RoundStats
from ..engine.generate import GenerationConfig, generate_batch
from ..engine.tree import node_depths
from ..engine.verify import select_features

NO_TOKEN = -1  # the target's argmax past the end of the known continuation: matches no node


@dataclass(frozen=True)
class Counting:
    """Which rounds an engine counts, and how many tokens each.

    first_token_drafted: the answer's first token comes from a drafted round (ours: the first round
        drafts from the prompt); False where the prefill emits it undrafted and drafting starts
        after it (vLLM, SGLang).
    whole_chain_at_end: the last round counts every draft the target would accept, also past the
        answer's end (vLLM verifies its full chain and truncates the output after counting); False
        where a round counts only the tokens the answer keeps (ours).
    """

    name: str
    first_token_drafted: bool
    whole_chain_at_end: bool


DRAFTHEAD = Counting("drafthead", first_token_drafted=True, whole_chain_at_end=False)
VLLM = Counting("vllm", first_token_drafted=False, whole_chain_at_end=True)


def sequence_hidden_states(target, sequence: torch.Tensor, drafters) -> tuple[torch.Tensor, ...] | None:
    """The target's hidden states over `sequence` ([1, T]; all L + 1 of them, [1, T, H] each) when
    any of `drafters` reads features, else None: one forward serves every drafter replayed on it."""
    if not any(d.feature_layers or d.needs_last_hidden for d in drafters):
        return None
    with torch.inference_mode():
        return target(input_ids=sequence, output_hidden_states=True).hidden_states


def greedy_continuations(
    target, prompts: list[torch.Tensor], max_new_tokens: int, eos_token_ids=(), batch_size: int = 16, on_batch=None, engine_linears: bool = True
) -> list[list[int]]:
    """Each prompt's ([1, P] ids) plain greedy continuation by our engine, up to `max_new_tokens`
    or an EOS (kept), `batch_size` prompts a batch: the text every replay of that prompt is of.
    on_batch(done): called after each batch with the number of prompts done. engine_linears: as
    GenerationConfig's (False: no CPU kernel to build, for a few short continuations)."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=tuple(eos_token_ids), engine_linears=engine_linears)
    out = []
    for start in range(0, len(prompts), batch_size):
        result = generate_batch(target, RootOnlyDrafter(), [p[0] for p in prompts[start : start + batch_size]], config)
        out += [row.new_tokens[0].tolist() for row in result.rows]
        if on_batch is not None:
            on_batch(len(out))
    return out


def tokens_past_end(target, sequences: list[torch.Tensor], count: int, batch_size: int = 16, engine_linears: bool = True) -> list[list[int]]:
    """The target's next `count` greedy tokens after each [1, T] sequence, EOS or not: what an
    engine that verifies its whole chain at the answer's end (Counting.whole_chain_at_end) checks
    the last round's drafts against."""
    return greedy_continuations(target, sequences, count, (), batch_size, engine_linears=engine_linears)


def kept_hidden_states(target, sequence: torch.Tensor, drafters) -> list | None:
    """`sequence_hidden_states` with only the layers some drafter reads (and the final one) kept,
    the rest None: features held for many sequences cost a few layers each, not all L + 1."""
    hidden = sequence_hidden_states(target, sequence, drafters)
    if hidden is None:
        return None
    wanted = {i % len(hidden) for d in drafters for i in d.feature_layers} | {len(hidden) - 1}
    return [h if i in wanted else None for i, h in enumerate(hidden)]


def replay_greedy(
    drafter, sequence: torch.Tensor, prompt_len: int, hidden_states=None, end: int | None = None, counting: Counting = DRAFTHEAD
) -> list[int]:
    """Tokens per round (the target's own included) when `drafter` drafts for the greedy decoding
    whose answer is sequence[0, prompt_len:end], counted by `counting`'s rules.

    sequence: [1, T] prompt + the target's greedy continuation; tokens from `end` (default T) on
    are the target's greedy tokens past the answer's end (an EOS or a token limit), read only by
    counting.whole_chain_at_end; drafts past T count as rejected. hidden_states: the target's
    `output_hidden_states` over the sequence ([1, T, H] each), needed when the drafter reads
    features. A one-token answer under a rule whose prefill emits that token has no rounds: [].
    """
    if sequence.dim() != 2 or sequence.shape[0] != 1:
        raise ValueError(f"sequence must be [1, T], got {tuple(sequence.shape)}")
    total = sequence.shape[1]
    end = total if end is None else end
    if not 1 <= prompt_len < end <= total:
        raise ValueError(f"prompt_len {prompt_len} and end {end} leave no answer in a sequence of {total}")
    if not counting.first_token_drafted:
        prompt_len += 1  # the prefill's token: committed before any draft
        if prompt_len == end:
            return []
    if (drafter.feature_layers or drafter.needs_last_hidden) and hidden_states is None:
        raise ValueError("this drafter reads target features: pass the target's hidden states over the sequence")
    device = sequence.device
    tokens = sequence[0]

    def features(index):
        return select_features(hidden_states, drafter.feature_layers, drafter.needs_last_hidden, index)

    pos = prompt_len - 1  # the pending token: committed, its K/V not yet in the target's cache
    drafter.begin(sequence[:, :pos], None if pos == 0 else features(slice(0, pos)), sequence[:, pos])
    accepted_lengths = []
    with torch.inference_mode():
        while True:
            tree = drafter.propose()
            depth = node_depths(tree.parents)
            ahead = pos + 1 + depth  # [N] where each node's argmax points
            argmax = torch.where(ahead < total, tokens[ahead.clamp(max=total - 1)], torch.full_like(ahead, NO_TOKEN))
            result = greedy_accept(tree.tokens[0], tree.parents, argmax)
            remaining = end - (pos + 1)
            emitted = min(len(result.path), remaining)  # the path's drafts + the target's own token
            accepted_lengths.append(len(result.path) if counting.whole_chain_at_end else emitted)
            if emitted == remaining:  # the answer is complete: the engine stops without a commit
                return accepted_lengths
            path = torch.tensor(result.path, device=device)
            kept = torch.arange(pos, pos + len(result.path), device=device)  # their positions in the sequence
            depths = depth[path].tolist()
            drafter.commit(
                tree.tokens[:, path],
                None if hidden_states is None else features(kept),
                torch.tensor([result.next_token], device=device),
                RoundStats(
                    num_draft=tree.num_draft,
                    num_accepted=len(result.path) - 1,
                    depth=int(depth.max()),
                    accepted_depths=depths[1:],
                    path=list(result.path),
                ),
            )
            pos += len(result.path)
