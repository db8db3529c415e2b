"""Every version of the served head, and which one is live: one append-only log whose lines the
server and the trainer each write whole (a line is one write of an O_APPEND file), so a
kill -9 at any point leaves a log whose complete lines say what is live.

    DIR/versions/v0000/        the head the server started with (our layout, its drafting.json)
    DIR/versions/v0001/ ...    each candidate the gate accepted, renamed into place whole before
                               its `accepted` line is written, so no line names a half-written one
    DIR/versions.jsonl         events, oldest first:
        {"event": "start",    "version": 0, "source": the head folder served first}
        {"event": "rejected", "parent": p, "gate": {...}, "reason": ...}    a candidate the gate refused
        {"event": "accepted", "version": n, "parent": p, "gate": {...}}     the trainer's: n may go live
        {"event": "swap",     "version": n, "previous": p, "window": {...}} the server's: n serves now
        {"event": "rollback", "version": p, "from": n, "window": {...}}     the server's: back to p
        {"event": "trainer-exit", "code": c, "log": worker.log}            the server's: the trainer exited; started again

`fold(events)` is the live version: the last accepted or rolled-back-to one. A restart serves it,
and the trainer trains from it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

VERSIONS_DIR = "versions"
LOG_FILE = "versions.jsonl"


def version_dir(folder: Path, version: int) -> Path:
    return Path(folder) / VERSIONS_DIR / f"v{version:04d}"


def read_events(folder: Path) -> list[dict]:
    """The log's complete lines (a line a kill cut short is not one)."""
    path = Path(folder) / LOG_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # the torn last line of a killed write
    return events


def append_event(folder: Path, event: dict) -> None:
    """One line, in one write, synced: both processes append, neither tears the other's line."""
    event = {"time": round(time.time(), 3), **event}
    path = Path(folder) / LOG_FILE
    data = (json.dumps(event) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and _ends_torn(path, size):
            data = b"\n" + data  # a killed write left half a line: end it, so this one stands alone
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _ends_torn(path: Path, size: int) -> bool:
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) != b"\n"


@dataclass(frozen=True)
class LiveState:
    version: int  # what serves
    previous: int | None  # what served before the last swap (a rollback's target)
    latest: int  # the highest version number used


def fold(events: list[dict]) -> LiveState:
    live, previous, latest = 0, None, 0
    for e in events:
        kind = e.get("event")
        if kind in ("accepted", "swap"):
            if e["version"] != live:
                live, previous = e["version"], live
            latest = max(latest, e["version"])
        elif kind == "rollback":
            live, previous = e["version"], None
    return LiveState(live, previous, latest)


def live_version(folder: Path) -> LiveState:
    return fold(read_events(folder))


def install_version(folder: Path, version: int, head_folder: Path) -> Path:
    """Copy a finished head folder to versions/vNNNN whole (a temp folder renamed into place)."""
    final = version_dir(folder, version)
    if final.exists():
        raise FileExistsError(f"{final} exists already: the log and the folders disagree")
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(head_folder, tmp)
    os.replace(tmp, final)
    return final


def remove_partial_versions(folder: Path) -> None:
    """The temp folders a killed copy left (never named in the log, never loaded)."""
    for tmp in (Path(folder) / VERSIONS_DIR).glob(".v*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
