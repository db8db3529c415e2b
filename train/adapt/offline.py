"""The gate offline (`drafthead gate`): two head folders replayed on the same recent traffic, for a
train-serve check in front of every deploy.

The traffic is any conversation file `drafthead train` reads (a served-traffic log of OpenAI
requests and replies included, train/data/sources.py). Each conversation's prompt (its text before the
first answer) is answered by the target once, greedily (our engine), the target's hidden states
over prompt + answer taken in one forward (train/loop/replay_eval.py's held-out path), and each head
drafts for that answer round by round as the caller resolved (its drafting.json, or a chain:
drafthead/commands/gate.py),
the engine's greedy rule keeping what it would keep (inference/bench/replay.py).
"""

from __future__ import annotations

from pathlib import Path

from ...inference.drafters.settings import HeadDrafting
from .gate import GateResult


def gate_heads(
    live: Path,
    candidate: Path,
    loaded,
    samples,
    *,
    sequences: int,
    max_new_tokens: int,
    margin: float,
    drafting: tuple[HeadDrafting, HeadDrafting] = (HeadDrafting(), HeadDrafting()),
) -> GateResult:
    """Replay both heads on the first `sequences` of `samples` (tokenized conversations), each
    drafting as its `drafting` says (live's first)."""
    from ...ground.target.identity import eos_token_ids
    from ...inference.bench.replay import DRAFTHEAD, replay_greedy
    from ...inference.drafters.load import load_head_drafter
    from ...inference.engine.rounds import tau_of
    from ..loop.config import ReplayConfig
    from ..loop.replay_eval import ReplayEval

    drafters = [load_head_drafter(folder, loaded.model, loaded.tokenizer, loaded.name, how)[0] for folder, how in zip((live, candidate), drafting)]
    replay = ReplayEval(
        loaded.model, samples, ReplayConfig(sequences=sequences, max_new_tokens=max_new_tokens), eos_token_ids(loaded.model, loaded.tokenizer)
    )
    held_out = replay.held_out(drafters)
    taus, rounds = [], 0
    for drafter in drafters:
        accepted = [a for h in held_out for a in replay_greedy(drafter, h.sequence, h.prompt_len, h.hidden, h.end, DRAFTHEAD)]
        taus.append(tau_of(accepted))
        rounds = len(accepted)
    return GateResult(taus[0], taus[1], len(held_out), rounds, margin)
