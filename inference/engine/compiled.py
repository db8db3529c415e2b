"""Static-shape decoding: a static KV cache and, optionally, a compiled target forward
(docs/trees.md "Static cache").

    cache slots S     fixed for a whole generation: prompt + new tokens + TREE_ROOM, rounded up to
                      CAPACITY_STEP, so that generations of similar length reuse one cache
    round forward     tokens [B, N], mask [B, 1, N, S], position ids [B, N], K/V written in place

The compiled forward is traced with dynamic shapes: one graph serves every node count N > 1 and
every S, and dynamo adds one for N = 1 (plain rounds). Graphs specialised per node bucket were
the first design: on the 2-core CPU each took a minute or more to compile, and a generation met
several (docs/cpu-measurements.md "Our round forward by engine setting", which also shows that
compiling does not speed this CPU's rounds up: they are bound by the weights' bytes). Prefill
runs eagerly (its length is the prompt's).

`compile="graphs"` (GRAPHS) is no torch.compile backend: the round forward is replayed from CUDA
graphs recorded per node count bucket (inference/engine/graphs.py), and runs the same padded
steps eagerly off a GPU; "graphs-traced" runs them through dynamo instead, the CPU's check that
they could be recorded.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache

from .cache import _layers, crop, new_cache
from .graphs import EAGER, TRACED, GraphedForward

# `compile` modes beyond torch.compile's own backend names: "inductor-frozen" is inductor with
# the weights frozen into the graph as constants (folded, pre-packed for the CPU's matmul
# library) and the C++ wrapper, which calls the kernels from generated C++ with no Python between
# them (docs/cpu-measurements.md "A whole-round compiled graph")
MODES: dict[str, tuple[str, dict[str, str | int | bool | Callable[..., Any]] | None]] = {
    "inductor-frozen": ("inductor", {"freezing": True, "cpp_wrapper": True})
}

GRAPHS = "graphs"  # the round forward from recorded CUDA graphs (eager off a GPU)
GRAPH_MODES = {GRAPHS: None, "graphs-eager": EAGER, "graphs-traced": TRACED}  # None: graphs.step_mode's default

CAPACITY_STEP = 512
TREE_ROOM = 128  # slots kept free after the longest committed text for one round's tree


def static_capacity(longest_prompt: int, max_new_tokens: int) -> int:
    """Cache slots per row for a generation: every committed token plus one round's tree."""
    need = longest_prompt + max_new_tokens + TREE_ROOM
    return -(-need // CAPACITY_STEP) * CAPACITY_STEP


class StaticDecoding:
    """The static caches and (with a torch.compile `backend`) the compiled forward of one target,
    kept across generations: a compiled graph is reused, and so is a cache of the same shape
    (rewound to slot 0) rather than allocated anew."""

    _of: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str | None, StaticDecoding]]" = weakref.WeakKeyDictionary()

    def __init__(self, target, backend: str | None):
        self.num_layers = target.config.get_text_config().num_hidden_layers
        self.compiled = backend is not None
        self.forward: Callable[..., Any]
        if backend is None:
            self.forward = target
        elif backend in GRAPH_MODES:
            self.forward = GraphedForward(target, GRAPH_MODES[backend])
        else:
            name, options = MODES.get(backend, (backend, None))
            self.forward = torch.compile(target, backend=name, dynamic=True, options=options)
        self._caches: dict[tuple[int, int], Cache] = {}

    @classmethod
    def of(cls, target, backend: str | None) -> "StaticDecoding":
        per_target = cls._of.setdefault(target, {})
        if backend not in per_target:
            per_target[backend] = cls(target, backend)
        return per_target[backend]

    def cache(self, batch: int, capacity: int):
        """An empty static cache of `batch` rows and `capacity` slots."""
        cache = self._caches.get((batch, capacity))
        layers = [] if cache is None else _layers(cache)
        # rows that left a batch narrowed the cache's tensors (select_rows): then start afresh
        if cache is None or any(layer.is_initialized and layer.keys.shape[0] != batch for layer in layers):
            cache = self._caches[(batch, capacity)] = new_cache(self.num_layers, capacity)
            return cache
        crop(cache, 0)  # rewind; the stale slots are masked until overwritten
        return cache
