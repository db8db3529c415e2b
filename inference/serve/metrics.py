"""The server's figures in Prometheus' text format (GET /metrics): counters, gauges and
histograms, thread-safe, standard library only.

tau = drafthead_tokens_total / drafthead_rounds_total: tokens emitted per row and verify round
(a batch's round counts once for every row in it). Acceptance at draft position k is
drafthead_accepted_total{position="k"} / drafthead_draft_rounds_total.
"""

from __future__ import annotations

import bisect
import threading

# seconds; time to first token and per-token latency share the buckets of a CPU-sized server
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ACCEPT_POSITIONS = 16  # draft positions whose acceptance is counted one by one


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out += [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


class ServerMetrics:
    """What GET /metrics reports. The engine thread and the request threads update it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {
            "drafthead_requests_total": 0,
            "drafthead_requests_failed_total": 0,
            "drafthead_requests_cancelled_total": 0,
            "drafthead_requests_rejected_total": 0,
            "drafthead_prompt_tokens_total": 0,
            "drafthead_tokens_total": 0,
            "drafthead_rounds_total": 0,
            "drafthead_forwards_total": 0,
            "drafthead_draft_rounds_total": 0,
            "drafthead_draft_tokens_total": 0,
        }
        self.accepted = [0] * ACCEPT_POSITIONS  # rounds that accepted draft position k + 1
        self.gauges: dict[str, float] = {"drafthead_queue_length": 0, "drafthead_batch_size": 0}
        self.extra_gauges: dict[str, float] = {}  # set by others (the adapting head's figures)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.token_latency = Histogram(LATENCY_BUCKETS)
        self.request_latency = Histogram(LATENCY_BUCKETS)
        self.batch_sizes = Histogram((1, 2, 4, 8, 16, 32, 64, 128))

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self.counters[name] += value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            if name in self.gauges:
                self.gauges[name] = value
            else:
                self.extra_gauges[name] = value

    def round(self, rows: list[tuple[int, int, int]], forwards: int) -> None:
        """One engine step: per row (tokens emitted, draft tokens accepted, draft nodes verified)
        for each of its rounds, and the verify forwards the step ran."""
        with self._lock:
            self.counters["drafthead_forwards_total"] += forwards
            self.batch_sizes.observe(len(rows))
            for emitted, accepted, drafted in rows:
                self.counters["drafthead_tokens_total"] += emitted
                self.counters["drafthead_rounds_total"] += 1
                if drafted:
                    self.counters["drafthead_draft_rounds_total"] += 1
                    self.counters["drafthead_draft_tokens_total"] += drafted
                for k in range(min(accepted, ACCEPT_POSITIONS)):
                    self.accepted[k] += 1

    def observe(self, which: str, seconds: float) -> None:
        with self._lock:
            {"ttft": self.ttft, "token": self.token_latency, "request": self.request_latency}[which].observe(seconds)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {**self.counters, **self.gauges, **self.extra_gauges}

    def text(self) -> str:
        """The Prometheus exposition text."""
        with self._lock:
            lines = []
            for name, value in self.counters.items():
                lines += [f"# TYPE {name} counter", f"{name} {value:g}"]
            lines.append("# TYPE drafthead_accepted_total counter")
            lines += [f'drafthead_accepted_total{{position="{k + 1}"}} {n}' for k, n in enumerate(self.accepted)]
            for name, value in {**self.gauges, **self.extra_gauges}.items():
                lines += [f"# TYPE {name} gauge", f"{name} {value:g}"]
            for name, hist in (
                ("drafthead_time_to_first_token_seconds", self.ttft),
                ("drafthead_time_per_output_token_seconds", self.token_latency),
                ("drafthead_request_seconds", self.request_latency),
                ("drafthead_batch_rows", self.batch_sizes),
            ):
                lines += [f"# TYPE {name} histogram", *hist.lines(name)]
            return "\n".join(lines) + "\n"
