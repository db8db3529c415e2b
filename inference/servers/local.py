"""A server process on a free port of 127.0.0.1, up (its /health answers 200) inside a block and
stopped on the way out, whatever the block does."""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message names its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """The server at `url` answers 200 on /health (llama-server, vLLM)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def _stop_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started it dies, so a killed
    test or study leaves no server behind (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


@contextmanager
def local_server(
    command: Callable[[int], Sequence],
    name: str,
    *,
    log: Path | None = None,
    env: dict | None = None,
    ready_within: float = 120.0,
    stop_within: float = 30.0,
):
    """Runs command(port) on a free port; the block gets the base URL once /health answers. On the
    way out the process gets SIGTERM, and SIGKILL after `stop_within` seconds; on Linux it also gets
    SIGTERM when this process dies without reaching that point (a kill -9)."""
    port = free_port()
    log_file = open(log, "w") if log else None
    out = log_file if log_file is not None else subprocess.DEVNULL
    proc = subprocess.Popen(
        [str(c) for c in command(port)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=_stop_with_parent if sys.platform == "linux" else None,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_within
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServerStartError(f"{name} did not come up on {url} within {ready_within:.0f} s (rc {proc.poll()}; log: {log or 'none'})")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_within)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_file is not None:
            log_file.close()
