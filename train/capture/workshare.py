"""Sharing a data job (capture, regenerate) between the processes of `accelerate launch` or
`torchrun`: who does which part, barriers that never wait for ever, and atomic writes
(docs/launching.md "Data work on several processes").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

from ...ground.files import atomic_write

# How long a process of a data job waits at a barrier for the others. A rank that died is noticed
# at once (its connections close) and the launcher ends the others; this bounds the wait for one
# that hangs. The slowest rank can be up to one shard (capture) or one batch (regenerate) of work
# behind the others, so the bound is generous.
BARRIER_TIMEOUT_S = 3600.0


def _alone_barrier() -> None:
    pass


def _alone_gather(obj: Any) -> list[Any]:
    return [obj]


@dataclass(frozen=True)
class WorkShare:
    """This process's place in a data job run by `world` processes (capture here, regenerate in
    train/regeneration/regenerate.py; docs/launching.md "Data work on several processes").

    barrier(): returns once every rank has called it; raises, never waits for ever, when a rank
    died or stays away past the timeout. gather(obj): every rank's obj, in rank order (a barrier
    too). The default is a process alone, for which both are trivial: code written against a
    WorkShare runs unchanged as one process (docs/style.md 8). Tests pass threads with a
    threading.Barrier."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = _alone_barrier
    gather: Callable[[Any], list[Any]] = _alone_gather

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mine(self, items: Sequence[Any]) -> list[Any]:
        """This rank's part of `items`, dealt round-robin (item j to rank j % world). Every rank must
        deal the same list: build it from what was on disk before a barrier that no rank passes
        before all have looked, as capture_features and regenerate do."""
        return list(items)[self.rank :: self.world]


def end_process_group() -> None:
    """At the end of a job: the process group is destroyed when the process exits normally, before
    the interpreter shuts down. Left to that shutdown, gloo's threads can abort a process whose
    work is done and saved (exit -6, "terminate called without an active exception"). Not at once:
    a process may run further jobs on the same group (the CLI's `main` called again)."""
    global _END_REGISTERED
    import atexit

    if not _END_REGISTERED:
        atexit.register(_destroy_process_group)
        _END_REGISTERED = True


_END_REGISTERED = False


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def detect_work_share(timeout_s: float = BARRIER_TIMEOUT_S) -> WorkShare:
    """The WorkShare of this process: torch.distributed's, when a group is set up or the launcher
    (`accelerate launch`, `torchrun`) set WORLD_SIZE > 1 with RANK and MASTER_ADDR/PORT; else alone.

    The barriers run over gloo whatever the device: data jobs only synchronise (no tensor
    travels), and gloo's monitored barrier times out naming the missing ranks."""
    import torch.distributed as dist

    if not dist.is_available() or (not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) <= 1):
        return WorkShare()
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)
    if dist.get_world_size() == 1:
        return WorkShare()
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)

    def barrier() -> None:
        dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=True)

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=group)
        return out

    return WorkShare(dist.get_rank(), dist.get_world_size(), barrier, gather)


def write_atomically(path: Path, data: str | bytes) -> None:
    """`data` into `path` through ground/files.py's atomic_write (a temp file beside it, then a rename),
    synced to disk before the rename: a reader, or a rerun after a kill, sees the old file or the
    new one, never half of one."""
    payload = data.encode() if isinstance(data, str) else data

    def write(tmp) -> None:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    atomic_write(Path(path), write)
