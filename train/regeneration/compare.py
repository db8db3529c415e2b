"""Two regenerations of the same conversations, compared token for token: our engine's records and
a serving engine's (`data regenerate --server`), both with their token ids kept.

At temperature 0 two engines give the same answer until the target's two best next tokens are so
close that the engines' rounding orders them differently. So for each answer that parts, the
first parting is located and measured with our target: `gap` is its logit of our token minus its
logit of the server's token, at that position, given the same prefix. A near-tie (a gap of the
size of fp32/bf16 rounding, ~1e-3 to 1e-1) explains a parting; a large gap means the engines do
not compute the same model (another template, weights or sampling).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ...ground.target.chat import render_chat
from ..data.chat_format import stop_token_ids


@dataclass(frozen=True)
class Parting:
    id: str
    turn: int  # the answer's turn, from 0
    position: int  # the first answer token that differs
    ours: int  # token ids there (a stop token where that answer had ended)
    theirs: int
    gap: float  # our target's logit of `ours` minus that of `theirs`, after the same prefix

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Comparison:
    answers: int = 0  # answers compared (in conversations that both files hold)
    identical: int = 0
    partings: list[Parting] = field(default_factory=list)

    def summary(self) -> str:
        gaps = [p.gap for p in self.partings]
        worst = f", largest gap at a parting {max(gaps):.4f}" if gaps else ""
        return f"{self.identical}/{self.answers} answers identical token for token{worst}"


def first_parting(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two answers differ (a length counts), None when they are equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def _answers(record: dict) -> list[tuple[int, list[int]]]:
    """(index of its user message, ids) of each answer of a record with ids."""
    messages = record["messages"]
    return [(i - 1, m["token_ids"]) for i, m in enumerate(messages) if m["role"] == "assistant" and "token_ids" in m]


@torch.no_grad()
def compare_regenerations(model, tokenizer, ours: list[dict], theirs: list[dict]) -> Comparison:
    """Compare the answers of the records both lists hold (by id, with token ids), each
    conversation up to its first parting: later turns are asked after different answers."""
    stop = stop_token_ids(tokenizer)[0]
    by_id = {r["id"]: r for r in theirs}
    result = Comparison(partings=[])
    device = next(model.parameters()).device
    for record in ours:
        other = by_id.get(record["id"])
        if other is None:
            continue
        for turn, ((user_at, a), (_, b)) in enumerate(zip(_answers(record), _answers(other))):
            result.answers += 1
            at = first_parting(a, b)
            if at is None:
                result.identical += 1
                continue
            prompt = render_chat(tokenizer, record["messages"][: user_at + 1], add_generation_prompt=True)
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] + a[:at]
            logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()
            mine, their = (a[at] if at < len(a) else stop), (b[at] if at < len(b) else stop)
            result.partings.append(Parting(record["id"], turn, at, mine, their, float(logits[mine] - logits[their])))
            break
    return result
