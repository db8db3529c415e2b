"""Every target linear forced onto one kernel, whatever this CPU's timings choose
(tests/test_target_linears.py, tests/test_kernels.py)."""

from __future__ import annotations

from drafthead.inference.kernels import panel_kernel, target_linears
from drafthead.inference.kernels.target_linears import ROW_BUCKETS


def force_kernel(monkeypatch, kernel: str) -> None:
    """Every layer takes `kernel` at every measured row count, whatever this CPU's timings say, so
    the tests exercise that path on tiny shapes too."""
    if kernel == "panel":
        assert panel_kernel.load(), panel_kernel.why_unavailable()
        monkeypatch.setenv(panel_kernel.ENV_SWITCH, "1")  # forced on, even in a run with the switch off
    monkeypatch.setattr(target_linears, "calibrate", lambda layers: (kernel,) * len(ROW_BUCKETS))
