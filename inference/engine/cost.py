"""How many draft nodes a round should verify, from the measured cost of the target's forward.

A round emits 1 + (accepted drafts) tokens and costs (drafting + the rest) + verify(N) seconds,
where verify(N) is the target's forward over N tree nodes. On a CPU verify(N) is nearly flat up
to a few dozen nodes and then rises (weights are read once per forward; past that, compute
dominates); on a GPU it stays flat far longer. The best N therefore depends on the machine, so
we measure verify(N) once on the loaded target and choose N per round:

    N* = argmax_n  (1 + sum_{i<n} a_i) / (fixed + verify(1 + n + extra))

with a_i the estimated acceptance probability of the i-th best candidate node (EAGLE-2: a node is
accepted iff its whole path is, so a_i ~ its path's cumulative draft probability), `extra` nodes
other drafters add (merged prompt lookup), and `fixed` the per-round time outside verification.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .backend import target_backend
from .tree import DraftTree, chain_parents

DEFAULT_NODE_COUNTS = (1, 8, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one target forward over n tree nodes, measured at `nodes` (ascending) and
    linearly interpolated between them (below the first: its value; beyond the last: the last
    slope)."""

    nodes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.nodes) < 2 or len(self.nodes) != len(self.seconds):
            raise ValueError("a cost curve needs at least two (nodes, seconds) points")
        if list(self.nodes) != sorted(set(self.nodes)) or self.nodes[0] < 1:
            raise ValueError(f"node counts must be distinct, ascending and >= 1: {self.nodes}")
        if min(self.seconds) <= 0:
            raise ValueError(f"forward times must be positive: {self.seconds}")

    def __call__(self, n: int) -> float:
        xs, ys = self.nodes, self.seconds
        if n <= xs[0]:
            return ys[0]
        i = next((j for j in range(1, len(xs)) if n <= xs[j]), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


def best_node_count(accept_probs: Sequence[float], verify_cost, fixed_cost: float, extra_nodes: int = 0) -> int:
    """The n (1 <= n <= len(accept_probs)) maximising expected tokens per second of one round.

    accept_probs: estimated acceptance probability of each candidate node, best first (the order
    in which nodes are kept); verify_cost(N): seconds to verify N nodes (root included);
    fixed_cost: seconds of a round outside verification; extra_nodes: nodes other drafters add.
    Ties go to the smaller tree.
    """
    if not accept_probs:
        raise ValueError("no candidate nodes to choose from")
    best_n, best_rate, expected = 1, -1.0, 1.0
    for n, a in enumerate(accept_probs, start=1):
        expected += a
        rate = expected / (fixed_cost + verify_cost(1 + n + extra_nodes))
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
    return best_n


def sync_device(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock reads time it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_verify_cost(
    target,
    node_counts: Sequence[int] = DEFAULT_NODE_COUNTS,
    context: int = 128,
    repeats: int = 5,
    want_hidden: bool = True,
    linears: bool = True,
    feature_layers: Sequence[int] = (),
    row_invariant: bool | None = False,
) -> CostCurve:
    """Time the target's tree forward at each node count after `context` cached tokens (median of
    `repeats`, one untimed warm-up each), through the backend the decode loop drives (a
    transformers model's TorchTarget, or a LlamaCppTarget). want_hidden: also return hidden
    states, as drafters that read target features make the verifier do (a llama.cpp target
    extracts `feature_layers`, which cost time too); linears: with the engine's linears
    (GenerationConfig.engine_linears), as the engine's rounds run them; row_invariant: through the
    row-invariant kernels (GenerationConfig.row_invariant; None: where they are the default)."""
    backend = target_backend(target, row_invariant=row_invariant)
    device = backend.device
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, backend.vocab_size, (context + 1,), generator=generator).to(device)
    seconds = []
    with torch.inference_mode(), backend.engine_context(linears):
        backend.start([prompt], tuple(feature_layers) if want_hidden else (), False, max(node_counts))
        for n in node_counts:
            # a chain: the shape of the tree does not change the cost
            tree = DraftTree(torch.randint(0, backend.vocab_size, (1, n), generator=generator).to(device), chain_parents(n - 1, device=device))
            times = []
            for r in range(repeats + 1):
                sync_device(device)
                start = time.perf_counter()
                backend.verify([tree], [context], want_hidden)
                sync_device(device)
                if r:  # the first call warms up kernels and allocations for this shape
                    times.append(time.perf_counter() - start)
                backend.discard(context)
            seconds.append(statistics.median(times))
    return CostCurve(tuple(node_counts), tuple(seconds))
