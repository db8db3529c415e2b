"""Plain greedy decoding of a batch with one recorded step per token (inference/engine/graphs.py):
what regenerating training answers on a GPU runs (scripts/gpu/run.py), where the decode
loop's per-row host work (generate.py) would cost more than the target's forward.

    prefill     the prompts left-padded to the longest, P, into slots [0, P) of a static cache;
                its last logits give every row's first token
    step i      each row's last token at slot P + i (position P + i - pad_b), attending to its
                own slots [pad_b, P + i]; the argmax is written into the output and fed to step
                i + 1, and a row that emitted a stop token is marked done, all on the device

The host reads back only whether every row is done, every `check_every` steps. A `GreedyDecoder`
keeps its cache, buffers and recorded step for batches of the same rows and slots, so a run of
batches records once. The output of each row is its greedy continuation up to and including its
first stop token: the same tokens as the engine's plain decoding in float32 (tests/test_graphs.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .cache import _layers, cache_kwargs, crop, new_cache
from .graphs import CapturedStep, additive, step_mode


MAX_STOPS = 8  # stop ids a decoder checks for


class GreedyDecoder:
    """Batches of `rows` prompts, prompt + new tokens within `slots` cache slots. Every tensor a
    step reads or writes is made here once, so the step is recorded once for all batches."""

    def __init__(self, target, rows: int, slots: int, mode: str | None = None, check_every: int = 16):
        self.target, self.rows, self.slots, self.check_every = target, rows, slots, check_every
        device = next(target.parameters()).device
        self.mode = step_mode(device, mode)
        self.cache = new_cache(target.config.get_text_config().num_hidden_layers, slots)
        long = dict(dtype=torch.long, device=device)
        self.token = torch.zeros(rows, 1, **long)  # the token each row feeds next
        self.pad = torch.zeros(rows, **long)  # left padding per row
        self.slot = torch.zeros((), **long)  # where the next token's K/V go
        self.made = torch.zeros((), **long)  # tokens emitted so far: the next one's column
        self.emitted = torch.zeros(rows, slots, **long)  # [rows, new tokens]
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.stops = torch.full((MAX_STOPS,), -1, **long)  # -1: no token
        self.step: CapturedStep | None = None  # recorded at the first decode step, once the cache holds K/V

    @torch.no_grad()
    def run(self, prompts: Sequence[torch.Tensor], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[list[int]]:
        """Each prompt's ([P_b] ids) greedy continuation: up to its first stop token (kept) or
        `max_new_tokens`. Fewer prompts than `rows` are padded with copies of the last one."""
        if not 0 < len(prompts) <= self.rows:
            raise ValueError(f"a batch holds 1 to {self.rows} prompts, got {len(prompts)}")
        if len(set(stop_ids)) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop ids, got {len(set(stop_ids))}")
        longest = max(p.numel() for p in prompts)
        if longest + max_new_tokens > self.slots:
            raise ValueError(f"a prompt of {longest} tokens and {max_new_tokens} new ones need more than the decoder's {self.slots} slots")
        stops = sorted(set(stop_ids))
        self.stops.fill_(-1)
        self.stops[: len(stops)] = torch.tensor(stops, dtype=torch.long)
        self._prefill(list(prompts) + [prompts[-1]] * (self.rows - len(prompts)), longest)
        made = 1
        while made < max_new_tokens:
            if self.step is None:
                counters = [layer.cumulative_length for layer in _layers(self.cache)]
                self.step = CapturedStep(self._body, self.mode, keep=[*counters, self.token, self.slot, self.made, self.emitted, self.done])
            self.step()
            made += 1
            if made % self.check_every == 0 and bool(self.done.all()):  # the one read-back
                break
        out = []
        for row in self.emitted[: len(prompts), :made].tolist():
            stop = next((i for i, t in enumerate(row) if t in stops), None)
            out.append(row if stop is None else row[: stop + 1])
        return out

    def _prefill(self, rows: list[torch.Tensor], longest: int) -> None:
        """The rows through the target at once (eagerly: the prompt length varies), their first
        tokens emitted, the step's state set for slot `longest`."""
        device = self.token.device
        ids = torch.zeros(self.rows, longest, dtype=torch.long, device=device)
        for b, p in enumerate(rows):
            ids[b, longest - p.numel() :] = p
        self.pad.copy_(torch.tensor([longest - p.numel() for p in rows]))
        queries, keys = torch.arange(longest, device=device), torch.arange(self.slots, device=device)
        positions = (queries[None, :] - self.pad[:, None]).clamp(min=0)  # [rows, P]
        # [rows, P, slots]: a key is seen from its row's first real token up to the query (a static
        # cache's masks span all its slots); a padding query sees itself
        seen = (keys[None, None, :] >= self.pad[:, None, None]) & (keys[None, None, :] <= queries[None, :, None])
        seen |= (keys[None, :] == queries[:, None])[None]
        crop(self.cache, 0)
        out = self.target(
            input_ids=ids,
            attention_mask=additive(seen[:, None], self._dtype()),
            position_ids=positions,
            **cache_kwargs(self.target, self.cache),
            use_cache=True,
            logits_to_keep=1,
        )
        first = out.logits[:, -1].argmax(dim=-1)  # [rows]
        self.emitted[:, 0] = first
        self.token[:, 0] = first
        self.done.copy_(self._stopped(first))
        self.slot.fill_(longest)
        self.made.fill_(1)

    def _body(self) -> None:
        """One token for every row (module docstring), on the device alone."""
        cols = torch.arange(self.slots, device=self.slot.device)
        seen = (cols[None, :] >= self.pad[:, None]) & (cols[None, :] <= self.slot)  # [rows, slots]
        out = self.target(
            input_ids=self.token,
            attention_mask=additive(seen[:, None, None], self._dtype()),
            position_ids=(self.slot - self.pad)[:, None],
            **cache_kwargs(self.target, self.cache),
            use_cache=True,
        )
        nxt = out.logits[:, -1].argmax(dim=-1)  # [rows]
        self.token.copy_(nxt[:, None])
        self.emitted.index_copy_(1, self.made[None], nxt[:, None])
        self.done |= self._stopped(nxt)
        self.slot.add_(1)
        self.made.add_(1)

    def _stopped(self, tokens: torch.Tensor) -> torch.Tensor:
        """[rows] bool: the token is a stop id. A comparison against every stop id, not
        torch.isin, whose CUDA path for larger inputs sorts through a unique() of data-dependent
        size: a read-back no graph can record."""
        return (tokens[:, None] == self.stops[None, :]).any(dim=-1)

    def _dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype


def greedy_batch(
    target, prompts: Sequence[torch.Tensor], max_new_tokens: int, stop_ids: Sequence[int] = (), mode: str | None = None
) -> list[list[int]]:
    """Each prompt's greedy continuation through a GreedyDecoder made for this one batch."""
    slots = max(p.numel() for p in prompts) + max_new_tokens
    return GreedyDecoder(target, len(prompts), slots, mode).run(prompts, max_new_tokens, stop_ids)
