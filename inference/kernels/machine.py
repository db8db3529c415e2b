"""Which machine this is: what timings measured here are keyed by (inference/kernels/target_linears.py's
calibration cache) and what every report records."""

from __future__ import annotations

import functools
import platform


@functools.cache  # read once per process: the CPU does not change under it
def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; else platform's guess): one machine kind can be
    several CPUs, with very different multi-token forward costs (docs/cpu-measurements.md)."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
