"""Wall seconds per named phase: the one clock of the decode loop (prefill, draft, verify...) and
of the training step (data, target, head, backward, optimizer).

Two ways to mark phases: `lap(phase)` ends the phase that ran since the previous lap (a loop whose
phases follow each other), and `with clock(phase):` times one block. With `sync` on a CUDA device,
each reading first waits for the queued kernels, so they count in the phase that launched them
(exact, and slower: profiling only); without it, CUDA phases are host time, and kernels still
queued when a phase ends count in whichever later phase waits for them.
"""

from __future__ import annotations

import contextlib
import time

import torch


class PhaseClock:
    def __init__(self, device: torch.device | None = None, sync: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self.device = device
        self.sync = sync and device is not None and device.type == "cuda"
        self.last = time.perf_counter()

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def lap(self, phase: str) -> None:
        """Count the time since the previous lap (or the clock's start) as `phase`."""
        now = self._now()
        self._add(phase, now - self.last)
        self.last = now

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = self._now()
        try:
            yield
        finally:
            self._add(phase, self._now() - start)

    def take(self, steps: int) -> dict[str, float]:
        """{"s_<phase>": seconds per step} over the last `steps` steps; then reset."""
        out = {f"s_{k}": v / max(1, steps) for k, v in self.seconds.items()}
        self.seconds = {}
        return out
