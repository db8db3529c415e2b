"""Stop conditions, as pure functions over the stream of emitted tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopRules:
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    max_new_tokens: int = 128


def check_stop_strings(stop_strings) -> None:
    """Refuse an empty stop string: "" is in every text, so it would end the output after its
    first token."""
    if any(s == "" for s in stop_strings):
        raise ValueError('--stop "": an empty stop string matches any text and would stop after the first token; pass the text to stop at')


def first_stop(emitted: list[int], start: int, rules: StopRules, decode=None) -> tuple[int, str] | None:
    """Where the stream must end, looking at tokens emitted[start:] (the ones added this round).

    Returns (number of tokens to keep, reason) for the first stop at or after `start`, or None.
    An EOS token is kept (as `generate()` keeps it); a stop string ends the output after the token
    that completes it. `decode` maps a list of ids to text (needed only for stop strings).
    """
    for j in range(start, len(emitted)):
        if emitted[j] in rules.eos_token_ids:
            return j + 1, "eos"
        if rules.stop_strings:
            if decode is None:
                raise ValueError("stop strings need a tokenizer to decode the output")
            text = decode(emitted[: j + 1])
            if any(s in text for s in rules.stop_strings):
                return j + 1, "stop_string"
        if j + 1 >= rules.max_new_tokens:
            return j + 1, "length"
    return None
