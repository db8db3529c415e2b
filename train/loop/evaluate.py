"""Held-out evaluation: top-1 accuracy per head / unroll step and the chain acceptance estimate.

A greedy chain drafted by heads 0..K-1 is accepted up to the first miss; if position k is
accepted with probability acc_k independently, the expected number of tokens per target
forward (the target's own token included, docs/acceptance.md convention) is

    tau_est = 1 + sum_{k=0}^{K-1} prod_{j<=k} acc_j

It ignores the correlation between positions (a head that is right after a right one is more
likely right), so it is a rough guide; the benchmark's measured tau is the real figure.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Mapping

_ACC = re.compile(r"^acc_(\d+)$")


def estimate_tau(accs: Iterable[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j for per-position top-1 accuracies acc_0, acc_1, ..."""
    tau, run = 1.0, 1.0
    for a in accs:
        run *= float(a)
        tau += run
    return tau


def accuracies(metrics: Mapping[str, float]) -> list[float]:
    """[acc_0, acc_1, ...] from a metrics dict, in order of k (stops at the first gap)."""
    found = {int(m.group(1)): v for k, v in metrics.items() if (m := _ACC.match(k))}
    out: list = []
    while len(out) in found:
        out.append(float(found[len(out)]))
    return out


WEIGHT_KEY = "num_labels"  # a count, not a rate: summed (reported as `labels`), never averaged


class MetricMean:
    """Weighted means of per-batch metrics (weight = labelled tokens in the batch).

    `sums` and `weight` add up across processes before `means()`.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weight = 0.0

    def add(self, metrics: Mapping[str, float], weight: float) -> None:
        if weight <= 0:
            return
        for k, v in metrics.items():
            if k == WEIGHT_KEY:
                continue
            v = float(v)
            if math.isfinite(v):
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
        self.weight += weight

    def means(self) -> dict[str, float]:
        if self.weight <= 0:
            return {}
        return dict({k: v / self.weight for k, v in self.sums.items()}, labels=self.weight)


def summarize(means: Mapping[str, float]) -> dict[str, float]:
    """Add tau_est (from acc_k) to averaged metrics."""
    out = dict(means)
    accs = accuracies(out)
    if accs:
        out["tau_est"] = estimate_tau(accs)
    return out
