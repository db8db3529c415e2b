"""What a decode's rounds say: tau (tokens emitted per verification round, the target's own token
included), acceptance per draft position, and tau by context length. One home for the engine's
results, the benchmark and training's replayed evaluation."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence


def tau_of(accepted_lengths: Sequence[int]) -> float:
    """Mean tokens emitted per verification round."""
    return sum(accepted_lengths) / len(accepted_lengths) if accepted_lengths else 0.0


# lower edges of the context-length buckets tau is reported by: a round falls in the last edge at
# or below its context (tokens before the round's first new one); powers of two from 256 to 128K
CONTEXT_BUCKETS = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def round_contexts(prompt_len: int, accepted_lengths: Sequence[int]) -> list[int]:
    """Context length of each round: the prompt plus every token emitted by the rounds before it."""
    out, context = [], prompt_len
    for a in accepted_lengths:
        out.append(context)
        context += a
    return out


def tau_by_context(sequences: Sequence[tuple[int, Sequence[int]]], edges: Sequence[int] = CONTEXT_BUCKETS) -> dict[int, dict]:
    """{lower edge: {"tau", "rounds"}} over the buckets any round falls in, ascending.
    sequences: (prompt length, tokens emitted per round) of each prompt; a round's bucket is the
    last edge at or below its context (`round_contexts`). Shows whether a head trained on short
    conversations holds on long ones."""
    rounds: dict[int, list[int]] = defaultdict(list)
    for prompt_len, accepted in sequences:
        for context, a in zip(round_contexts(prompt_len, accepted), accepted):
            rounds[max(e for e in edges if e <= context)].append(a)
    return {e: {"tau": tau_of(rounds[e]), "rounds": len(rounds[e])} for e in sorted(rounds)}


def per_position_acceptance(accepted_lengths: Sequence[int], depth: int | None = None) -> list[float]:
    """[d-1] = share of rounds that accepted at least d draft tokens, d = 1..depth.

    accepted_lengths count the target's own token, so a round accepted `a - 1` draft tokens.
    depth defaults to the longest accepted draft seen (at least 1).
    """
    if not accepted_lengths:
        return []
    if depth is None:
        depth = max(1, max(accepted_lengths) - 1)
    rounds = len(accepted_lengths)
    return [sum(1 for a in accepted_lengths if a - 1 >= d) / rounds for d in range(1, depth + 1)]


def acceptance_histogram(accepted_lengths: Sequence[int]) -> dict[str, int]:
    """{tokens emitted in a round: number of rounds}, keys as strings (JSON), ascending."""
    counts = Counter(accepted_lengths)
    return {str(k): counts[k] for k in sorted(counts)}
