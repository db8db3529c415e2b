"""The gate: a candidate head replaces the live one only when its replayed acceptance on the same
held-out traffic beats the live head's by a margin.

Replayed acceptance is inference/bench/replay.py's: the drafter drafts round by round for the
known continuation and the engine's own greedy rule keeps what it would keep, counted as the
server counts its rounds (tokens per round, the target's own included). On recorded traffic the
continuation is the served answer and the features are the ones the verify forwards computed
(train/adapt/buffer.py), so the gate runs no target forward. A greedy answer is the target's greedy
continuation, so its replay is exactly the rounds the server would run; a sampled answer is
replayed as if it were greedy (how well the head predicts what was served).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...inference.bench.replay import DRAFTHEAD, replay_greedy
from ...inference.engine.rounds import tau_of


@dataclass(frozen=True)
class GateResult:
    live_tau: float
    candidate_tau: float
    sequences: int  # held-out answers replayed
    rounds: int  # the candidate's replayed rounds
    margin: float  # the relative gain asked for

    @property
    def passed(self) -> bool:
        return self.candidate_tau >= self.live_tau * (1 + self.margin) and self.candidate_tau > self.live_tau

    @property
    def reason(self) -> str:
        verdict = "beats" if self.passed else "does not beat"
        return (
            f"candidate tau {self.candidate_tau:.3f} {verdict} live tau {self.live_tau:.3f} by {self.margin:.0%} on {self.sequences} held-out answers"
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def recorded_sequence(sample: dict, num_layers: int) -> tuple[torch.Tensor, int, list] | None:
    """(sequence [1, T], prompt length, hidden states indexed as output_hidden_states, None where
    not recorded) of a recorded sample; None when it has no answer token to replay."""
    ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)
    answer = torch.as_tensor(sample["loss_mask"], dtype=torch.bool).nonzero()
    if answer.numel() == 0 or int(answer[0]) == 0 or int(answer[0]) >= ids.numel():
        return None
    hidden: list = [None] * (num_layers + 1)
    for layer, h in sample["hidden_states"].items():
        hidden[layer] = torch.as_tensor(h).float()[None]
    return ids[None], int(answer[0]), hidden


def replayed_tau(drafter, samples: list[dict], num_layers: int) -> tuple[float, int]:
    """(tokens per round, rounds) of `drafter` replayed over recorded samples."""
    accepted: list[int] = []
    with torch.inference_mode():
        for sample in samples:
            recorded = recorded_sequence(sample, num_layers)
            if recorded is None:
                continue
            sequence, prompt_len, hidden = recorded
            accepted += replay_greedy(drafter, sequence, prompt_len, hidden, None, DRAFTHEAD)
    return tau_of(accepted), len(accepted)


def gate(live_drafter, candidate_drafter, samples: list[dict], num_layers: int, margin: float) -> GateResult:
    live_tau, _ = replayed_tau(live_drafter, samples, num_layers)
    candidate_tau, rounds = replayed_tau(candidate_drafter, samples, num_layers)
    return GateResult(live_tau, candidate_tau, len(samples), rounds, margin)
