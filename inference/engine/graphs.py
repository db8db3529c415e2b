"""Captured steps: fixed-shape work over static buffers, recorded once as a CUDA graph and
replayed (docs/trees.md "Captured steps").

A small target decodes launch-bound on a GPU: SmolLM2-135M's eager forward issues some 400
kernels for one token, and Python between them costs more than the kernels do. A CUDA graph
replays the recorded kernels with one launch. What it records must have fixed shapes and fixed
addresses, and must not read a value back to the host, so a step here is a function of static
buffers: a call copies its inputs into them, replays, and reads the static outputs.

    mode "graph"    on a CUDA device: the first call runs the body once eagerly on a side stream
                    (kernels pick their algorithms and workspaces outside the capture), sets back
                    the state it changed, records it, then replays; later calls replay
    mode "eager"    everywhere else: the body runs as it is, on the same buffers, so the CPU runs
                    the code a GPU replays, the padding and write positions included
    mode "traced"   the body through dynamo with fullgraph=True (the CPU's check that it holds no
                    host read-back or data-dependent Python, which a graph cannot record;
                    tests/test_graphs.py also counts that rounds never retrace it)

`GraphedForward` is the target's round forward over a static cache (inference/engine/compiled.py)
at node counts padded up to NODE_BUCKETS: plain decoding is the bucket of 1, trees and chains
the others.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Sequence

import torch

from .cache import _layers

GRAPH, EAGER, TRACED = "graph", "eager", "traced"
MODES = (GRAPH, EAGER, TRACED)
# False: never capture, eager on a GPU too (a run whose capture failed carries on without it)
CAPTURE_ON_CUDA = True

NODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # node counts a round forward is recorded for
KEPT_CACHES = 4  # caches whose recorded steps are kept (a generation's cache is reused by the next)


def step_mode(device: torch.device, mode: str | None = None) -> str:
    """`mode` itself, or by default "graph" on a CUDA device and "eager" elsewhere."""
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"step mode is one of {', '.join(MODES)}, got {mode!r}")
        return mode
    return GRAPH if device.type == "cuda" and CAPTURE_ON_CUDA else EAGER


def node_bucket(n: int) -> int | None:
    """The recorded node count a forward of `n` nodes is padded to; None above the largest."""
    return next((b for b in NODE_BUCKETS if b >= n), None)


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: attend) as the additive float mask a target takes (the dtype's minimum
    where it may not attend: finite, so a query that sees nothing stays finite)."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


class CapturedStep:
    """`body()` (reading the buffers it closes over, returning tensors) run in `mode`. `keep`:
    tensors the body changes in place that the warm-up before a capture must leave as it found
    them (a cache's write counters; K/V it writes at slots past them are written again by the
    replay)."""

    def __init__(self, body: Callable[[], Any], mode: str, keep: Sequence[torch.Tensor] = ()):
        if mode not in MODES:
            raise ValueError(f"step mode is one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.keep = tuple(keep)
        self.body = torch.compile(body, backend="eager", fullgraph=True, dynamic=False) if mode == TRACED else body
        self.graph: Any = None  # torch.cuda.CUDAGraph once recorded
        self.outputs: Any = None  # the recorded body's outputs, rewritten by every replay

    def __call__(self):
        if self.mode != GRAPH:
            return self.body()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.outputs

    def _capture(self) -> None:
        saved = [t.clone() for t in self.keep]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.body()
        torch.cuda.current_stream().wait_stream(side)
        for tensor, value in zip(self.keep, saved):
            tensor.copy_(value)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records; nothing runs until the replay
            self.outputs = self.body()
        self.graph = graph


class RoundOutput(NamedTuple):
    """What forward_trees reads of a target's output (inference/engine/verify.py)."""

    logits: torch.Tensor  # [B, N, V]
    hidden_states: tuple[torch.Tensor, ...] | None  # L + 1 of [B, N, H]


def cache_address(cache) -> tuple[int, ...]:
    """Where a static cache's tensors live: a recorded step is valid for these addresses only."""
    return tuple(t.data_ptr() for layer in _layers(cache) for t in (layer.keys, layer.values, layer.cumulative_length))


class _RoundStep:
    """One recorded round forward: `rows` x `bucket` nodes over `slots` cache slots."""

    def __init__(self, target, cache_kwargs: dict, rows: int, bucket: int, mask: torch.Tensor, hidden: bool, mode: str):
        device = mask.device
        self.tokens = torch.zeros(rows, bucket, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, bucket, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, 1, bucket, mask.shape[-1], dtype=mask.dtype, device=device)

        def body():
            out = target(
                input_ids=self.tokens,
                attention_mask=self.mask,
                position_ids=self.positions,
                use_cache=True,
                output_hidden_states=hidden,
                **cache_kwargs,
            )
            return out.logits, (torch.stack(out.hidden_states) if hidden else None)  # [B, n, V], [L + 1, B, n, H]

        counters = [layer.cumulative_length for layer in _layers(next(iter(cache_kwargs.values())))]
        self.step = CapturedStep(body, mode, keep=counters)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> RoundOutput:
        n = input_ids.shape[1]
        # padding nodes repeat the root: its token and position, and its mask row (the row's prefix
        # and itself), so they attend to something and stay finite; their K/V land in slots after
        # the tree's, which keep_paths leaves behind the write position
        for buffer, value in ((self.tokens, input_ids), (self.positions, position_ids)):
            buffer[:, :n].copy_(value)
            buffer[:, n:].copy_(value[:, :1].expand(-1, buffer.shape[1] - n))
        self.mask[:, :, :n].copy_(attention_mask)
        self.mask[:, :, n:].copy_(attention_mask[:, :, :1].expand(-1, -1, self.mask.shape[2] - n, -1))
        logits, hidden = self.step()
        # copies: the next replay rewrites the outputs, and the engine keeps features across rounds
        return RoundOutput(logits[:, :n].clone(), None if hidden is None else tuple(hidden[:, :, :n].clone().unbind(0)))


class GraphedForward:
    """The target's round forward over a static cache (what StaticDecoding calls, compiled.py),
    the nodes padded up to a NODE_BUCKETS count and each (rows, bucket, slots, hidden states)
    shape one CapturedStep. A forward runs eagerly, unrecorded, where no step can serve it: before
    its cache holds K/V (a one-token prompt's first round), for a tree over the largest bucket, and
    for a family whose layer types take different masks (a dict of masks).

    The forward writes K/V for the padding too, so after it a layer's write position is past the
    padding; the decode loop always sets it to the kept length next (keep_paths)."""

    def __init__(self, target, mode: str | None = None):
        self.target = target
        self.mode = mode  # None: step_mode's default for the device the inputs are on
        self._steps: OrderedDict[tuple[int, ...], dict[tuple, _RoundStep]] = OrderedDict()  # cache address -> steps
        self.eager_calls = 0  # forwards no step served
        self.replays = 0  # forwards replayed from a recorded graph

    def __call__(self, *, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor, output_hidden_states: bool = False, **kwargs):
        cache_kwargs = {name: value for name, value in kwargs.items() if name in ("cache", "past_key_values")}
        cache = next(iter(cache_kwargs.values()))
        bucket = node_bucket(input_ids.shape[1])
        if bucket is None or not isinstance(attention_mask, torch.Tensor) or not all(layer.is_initialized for layer in _layers(cache)):
            self.eager_calls += 1
            return self.target(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, output_hidden_states=output_hidden_states, **kwargs
            )
        address = cache_address(cache)
        steps = self._steps.pop(address, {})
        self._steps[address] = steps  # most recent last
        while len(self._steps) > KEPT_CACHES:
            self._steps.popitem(last=False)
        key = (input_ids.shape[0], bucket, attention_mask.shape[-1], bool(output_hidden_states), attention_mask.dtype)
        step = steps.get(key)
        if step is None:
            mode = step_mode(input_ids.device, self.mode)
            step = steps[key] = _RoundStep(self.target, cache_kwargs, input_ids.shape[0], bucket, attention_mask, bool(output_hidden_states), mode)
        self.replays += step.step.mode == GRAPH
        return step(input_ids, attention_mask, position_ids)
