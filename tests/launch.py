"""`accelerate launch` of two CPU processes over gloo, as the multi-process tests start it
(tests/test_distributed.py, tests/test_multiprocess_data.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from drafthead.inference.servers.local import free_port


def accelerate_launch(num_processes: int = 2) -> list[str]:
    """The command up to the script: each call a fresh rendezvous port, never the default 29500,
    which another test's launch may hold at the same time on the other pytest worker."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]


def start_group(cmd: list[str], **kw) -> subprocess.Popen:
    """Start `cmd` as the leader of a process group of its own, so `stop_group` reaches the ranks
    under the launcher too."""
    return subprocess.Popen(cmd, start_new_session=True, **kw)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever of `proc`'s group is still running (no rank outlives a failed test)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_group(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) in a group of its own, killed whole
    when it ends, fails or runs past `timeout`."""
    proc = start_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop_group(proc)
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
