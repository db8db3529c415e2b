"""An answer's text as its tokens arrive: what may be sent now, and the whole text at the end.

The text is always the decode of every token so far (decoding token by token would split
multi-byte characters and merged spaces). Held back while streaming:
- a trailing U+FFFD, an incomplete UTF-8 sequence that the next token completes;
- the last len(longest stop string) - 1 characters, which may be the start of a stop string:
  OpenAI's stop strings are not part of the answer, so none of one may have gone out.
At the end the text is cut where the first stop string begins.
"""

from __future__ import annotations

from typing import Callable


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """`text` up to where the first of `stop` begins (all of it when none occurs)."""
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(ends)] if ends else text


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self.decode = decode  # token ids -> text, special tokens skipped
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out

    def add(self, ids: list[int]) -> str:
        """Take the new tokens; the text that may go out now."""
        self.ids.extend(ids)
        text = self.decode(self.ids)
        safe = len(text.rstrip("\ufffd"))
        if self.stop:
            cut = cut_at_stop(text, self.stop)
            safe = min(safe, len(cut), len(text) - (max(len(s) for s in self.stop) - 1))
        return self._take(text, safe)

    def finish(self) -> str:
        """The rest of the text (cut at a stop string)."""
        text = cut_at_stop(self.decode(self.ids), self.stop)
        return self._take(text, len(text))

    def text(self) -> str:
        """The whole answer's text (cut at a stop string)."""
        return cut_at_stop(self.decode(self.ids), self.stop)

    def _take(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = text[self.sent : upto]
        self.sent = upto
        return out
