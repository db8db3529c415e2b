"""Replayed acceptance at eval time: the tau an engine would measure, not a product of accuracies.

`tau_est` (train/loop/evaluate.py) multiplies per-depth top-1 accuracies as if they were independent.
At each eval this replays the head the way the engine drafts and verifies (inference/bench/replay.py):
the first `replay.sequences` held-out prompts are greedy-decoded by the target once per run (up to
`replay.max_new_tokens` tokens), and every eval drafts for those continuations with the head's
own drafter and keeps what the engine's greedy acceptance rule keeps. Reported, beside tau_est:

    replay_tau         tokens per round (the target's own included) with a chain of `replay.chain`
                       top-1 drafts
    replay_acc_i       share of those rounds that accepted draft i (0-based) and every one before it
    replay_tree_tau    tokens per round with the head's default drafting tree (`replay.tree`)
    replay_rounds      rounds the chain figures are over
    replay_tau_ctx_E   replay_tau of the chain's rounds whose context (prompt + tokens before the
                       round) is in the bucket from E tokens (inference/engine/rounds.py tau_by_context)
    replay_vllm_tau    the same chain counted as vLLM counts its steps (`replay.vllm`; the prefill
                       emits the first token, the last step counts its whole chain): the mean
                       acceptance length vLLM reports for this head (docs/acceptance.md)

The prompt of a held-out sample is its text before the first assistant (loss-masked) token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ...inference.engine.rounds import per_position_acceptance, tau_by_context, tau_of
from ...inference.drafters.load import chain_settings, head_drafter
from ...inference.bench.replay import DRAFTHEAD, VLLM, Counting, greedy_continuations, kept_hidden_states, replay_greedy, tokens_past_end
from .config import ReplayConfig


class HeldOut(NamedTuple):
    """One replayed prompt: sequence [1, T] is the prompt, the target's greedy answer up to `end`,
    then the target's next `replay.chain` greedy tokens (read by the vLLM counting only); hidden:
    the target's kept hidden states over it (kept_hidden_states)."""

    sequence: torch.Tensor
    prompt_len: int
    end: int
    hidden: list | None


def prompt_of(sample: dict) -> torch.Tensor | None:
    """[1, P]: a sample's tokens before its first loss-masked token; None when it has no such
    token or starts with one (nothing to condition on), and for a sample with images (the replay
    decodes text prompts)."""
    if sample.get("images") is not None:
        return None
    labelled = torch.as_tensor(sample["loss_mask"], dtype=torch.bool).nonzero()
    if labelled.numel() == 0 or int(labelled[0]) == 0:
        return None
    return torch.as_tensor(sample["input_ids"], dtype=torch.long)[: int(labelled[0])][None]


class ReplayEval:
    """Called with the head at each eval; returns the replay_* metrics (module docstring). The
    target's continuations and hidden states are made at the first call and kept for the run."""

    def __init__(self, target: nn.Module, eval_samples, config: ReplayConfig, eos_token_ids=()) -> None:
        self.target, self.samples, self.config, self.eos_token_ids = target, eval_samples, config, tuple(eos_token_ids)
        self._held_out: list[HeldOut] | None = None

    def drafters(self, head: nn.Module) -> dict[str, tuple[object, Counting]]:
        """{metric prefix: (drafter, how its rounds are counted)}: the chain as our engine counts
        it, with replay.vllm the same chain as vLLM counts it, and with replay.tree the default tree."""
        chain = head_drafter(head, chain_settings(str(head.kind), self.config.chain))
        drafters = {"replay": (chain, DRAFTHEAD)}
        if self.config.vllm:
            drafters["replay_vllm"] = (chain, VLLM)  # every replay begins the drafter afresh
        if self.config.tree:
            drafters["replay_tree"] = (head_drafter(head), DRAFTHEAD)
        return drafters

    def held_out(self, drafters) -> list[HeldOut]:
        if self._held_out is None:
            device = next(self.target.parameters()).device
            prompts = [p.to(device) for p in (prompt_of(self.samples[i]) for i in range(len(self.samples))) if p is not None]
            prompts = prompts[: self.config.sequences]
            if not prompts:
                raise ValueError("replay: no held-out sample has a prompt before its first assistant token")
            continuations = greedy_continuations(
                self.target, prompts, self.config.max_new_tokens, self.eos_token_ids, engine_linears=False
            )  # no CPU kernel build inside a training run
            answered = [(p, torch.cat([p, torch.tensor([c], device=device)], dim=1)) for p, c in zip(prompts, continuations) if c]
            past = (
                tokens_past_end(self.target, [a for _, a in answered], self.config.chain, engine_linears=False)
                if self.config.vllm
                else [[] for _ in answered]
            )
            self._held_out = []
            for (prompt, answer), extra in zip(answered, past):
                sequence = torch.cat([answer, torch.tensor([extra], dtype=answer.dtype, device=device)], dim=1)
                self._held_out.append(HeldOut(sequence, prompt.shape[1], answer.shape[1], kept_hidden_states(self.target, sequence, drafters)))
        return self._held_out

    @torch.no_grad()
    def __call__(self, head: nn.Module) -> dict[str, float]:
        was_training = head.training
        head.eval()
        try:
            drafters = self.drafters(head)
            held_out = self.held_out([drafter for drafter, _ in drafters.values()])
            out: dict[str, float] = {}
            for prefix, (drafter, counting) in drafters.items():
                per_sequence = [(h.prompt_len, replay_greedy(drafter, h.sequence, h.prompt_len, h.hidden, h.end, counting)) for h in held_out]
                accepted = [a for _, rounds in per_sequence for a in rounds]
                out[f"{prefix}_tau"] = tau_of(accepted)
                if prefix == "replay":
                    out["replay_rounds"] = float(len(accepted))
                    for i, share in enumerate(per_position_acceptance(accepted, self.config.chain)):
                        out[f"replay_acc_{i}"] = share
                    for edge, bucket in tau_by_context(per_sequence).items():
                        out[f"replay_tau_ctx_{edge}"] = bucket["tau"]
        finally:
            head.train(was_training)
        return out
