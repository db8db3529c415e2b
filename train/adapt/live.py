"""The server's side of `--adapt DIR`: the traffic recorded, the background trainer run, accepted
heads swapped in, and a swap that serves worse rolled back.

    Adaptation(folder, engine, loaded, head_source, settings)   prepares DIR, restores the live version
    .start()                                                    the buffer records; the trainer starts
    .poll()                                                     on the engine thread between rounds
    .stop()

Swaps: a version the trainer logged `accepted` is loaded into a drafter of its own on a loader
thread, then becomes the engine's template drafter between two rounds: requests that join from
then on draft with it, the ones in flight finish with the drafter they began with. Exactness never
depends on the head (docs/serving.md), so answers stay the target's own before, during and after.

Rollback: after a swap from p to n, once the requests that drafted with n have run `window` rounds,
their tau is compared with p's over its last `window` rounds before the swap; below it by more than
`margin`, p is served again and the rollback logged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .buffer import BUFFER_DIR, TrafficBuffer
from .versions import append_event, live_version, read_events, remove_partial_versions, version_dir
from .worker import WORK_DIR, AdaptSettings


RESTART_DELAY = 30.0  # seconds a trainer runs before an exit of its is answered by a restart


@dataclass(frozen=True)
class BufferCaps:
    max_tokens: int = 200_000
    max_bytes: int = 2 * 2**30


class Adaptation:
    def __init__(self, folder: Path, engine, loaded, head, head_source: Path, settings: AdaptSettings, *, window: int = 400, caps=BufferCaps()):
        """engine: the ServingEngine; loaded: the LoadedTarget; head: the served drafter's head
        module (version 0); head_source: the folder it was loaded from (its drafting.json)."""
        from ...ground.target.identity import text_config
        from ..capture.features import required_layers

        self.folder, self.engine, self.loaded, self.settings, self.window = Path(folder), engine, loaded, settings, window
        self.folder.mkdir(parents=True, exist_ok=True)
        remove_partial_versions(self.folder)
        self.num_layers = text_config(loaded.model).num_hidden_layers
        self.layers = required_layers(head.config, self.num_layers)
        self._prepare_first_version(head, Path(head_source))
        self.buffer = TrafficBuffer(
            self.folder / BUFFER_DIR, self.layers, meta=_identity(loaded), max_tokens=caps.max_tokens, max_bytes=caps.max_bytes
        )
        self.version = 0
        self.drafters = {0: engine.drafter}  # version -> its loaded template drafter
        self.served: dict[int, deque] = {}  # version -> (tokens, rounds) of its finished requests, newest last
        self.swapped: tuple[int, int] | None = None  # (from, to) of the swap under watch for a rollback
        self._loading: threading.Thread | None = None
        self._loaded: tuple[int, object] | None = None
        self._worker: subprocess.Popen | None = None
        self._last_poll = 0.0
        self._seen_events = 0
        self.swaps = self.rollbacks = self.trainer_restarts = 0
        self._worker_started = 0.0
        self.last_gate: dict = {}  # the figures of the trainer's last accepted or rejected candidate
        live = live_version(self.folder)
        if live.version != 0:  # a restart: serve what was live
            self.drafters[live.version] = self._load_drafter(live.version)
            self._swap_to(live.version, log=False)

    # -- setup ---------------------------------------------------------------------------------

    def _prepare_first_version(self, head, source: Path) -> None:
        """versions/v0000 is the head the server started with; a folder made for another head is refused."""
        first = version_dir(self.folder, 0)
        fingerprint = _head_fingerprint(head)
        events = read_events(self.folder)
        if events:
            start = next((e for e in events if e.get("event") == "start"), {})
            if start.get("fingerprint") != fingerprint:
                raise ValueError(
                    f"{self.folder} holds the versions of another head (started from {start.get('source')}): "
                    "pass the head it started from, or another --adapt folder"
                )
            return
        tmp = first.with_name(".v0000.tmp")
        head.save_pretrained(tmp)
        drafting = source / "drafting.json"
        if drafting.exists():
            (tmp / "drafting.json").write_text(drafting.read_text())
        tmp.replace(first)
        append_event(self.folder, {"event": "start", "version": 0, "source": str(source), "fingerprint": fingerprint})

    def start(self) -> None:
        self.settings.save(self.folder)
        self.engine.decoder.observers.append(self.buffer.record)
        self.engine.on_finish.append(self._finished)
        self.engine.on_round.append(self.poll)
        (self.folder / WORK_DIR).mkdir(parents=True, exist_ok=True)
        self._start_worker()

    @property
    def _worker_log(self) -> Path:
        return self.folder / WORK_DIR / "worker.log"

    def _start_worker(self) -> None:
        with open(self._worker_log, "a") as log:  # the child keeps its own handle
            self._worker = subprocess.Popen(
                [sys.executable, "-m", "drafthead.train.adapt.worker", str(self.folder)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": str(self.settings.threads)},
            )
        self._worker_started = time.monotonic()

    def _watch_worker(self) -> None:
        """A trainer that exited is logged and started again (it resumes from the log and the
        buffer), at most once a RESTART_DELAY; serving never waits on it."""
        worker = self._worker
        if worker is None or worker.poll() is None or time.monotonic() - self._worker_started < RESTART_DELAY:
            return
        self.trainer_restarts += 1
        append_event(self.folder, {"event": "trainer-exit", "code": worker.returncode, "log": str(self._worker_log)})
        print(
            f"drafthead serve: the adapting trainer exited with code {worker.returncode} (see {self._worker_log}); starting it again",
            file=sys.stderr,
            flush=True,
        )
        self._start_worker()

    def stop(self) -> None:
        if self._worker is not None:
            self._worker.terminate()
            try:
                self._worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._worker.kill()
        self.buffer.close()

    # -- the engine thread ---------------------------------------------------------------------

    def _finished(self, row, job) -> None:
        self.buffer.finish(row, keep=row.finish != "cancelled")
        rounds = len(row.accepted_lengths)
        if rounds:
            self.served.setdefault(job.head_version, deque(maxlen=10_000)).append((len(row.emitted), rounds))

    def poll(self) -> None:
        """Between rounds: a loaded version goes live; new log lines; the rollback check."""
        if self._loaded is not None:
            version, drafter = self._loaded
            self._loaded = None
            self.drafters[version] = drafter
            self._swap_to(version, log=True)
        now = time.monotonic()
        if now - self._last_poll < 1.0:
            return
        self._last_poll = now
        self.buffer.flush_due()
        self._watch_worker()
        self._read_log()
        self._check_rollback()
        self._publish()

    def _read_log(self) -> None:
        events = read_events(self.folder)
        new, self._seen_events = events[self._seen_events :], len(events)
        for e in new:
            if e.get("event") in ("accepted", "rejected"):
                self.last_gate = e.get("gate", {})
        live = live_version(self.folder).version
        if live != self.version and self._loading is None:
            if live in self.drafters:
                self._swap_to(live, log=True)
            else:
                self._loading = threading.Thread(target=self._load_in_background, args=(live,), daemon=True)
                self._loading.start()

    def _load_in_background(self, version: int) -> None:
        try:
            self._loaded = (version, self._load_drafter(version))
        finally:
            self._loading = None

    def _load_drafter(self, version: int):
        from ...inference.drafters.load import load_head_drafter
        from ...inference.drafters.settings import HeadDrafting

        drafting = HeadDrafting.from_dict(self.settings.drafting) if self.settings.drafting else HeadDrafting()
        drafter, _ = load_head_drafter(version_dir(self.folder, version), self.loaded.model, self.loaded.tokenizer, self.loaded.name, drafting)
        return drafter

    def _swap_to(self, version: int, *, log: bool) -> None:
        previous = self.version
        self.engine.drafter = self.drafters[version]
        self.engine.drafter_version = self.version = version
        if log and version != previous:
            self.swaps += 1
            self.swapped = (previous, version)
            append_event(self.folder, {"event": "swap", "version": version, "previous": previous, "window": self._window_of(previous)})

    def _window_of(self, version: int) -> dict:
        """tau over `version`'s last `window` rounds of finished requests."""
        tokens = rounds = 0
        for t, r in reversed(self.served.get(version, ())):
            tokens, rounds = tokens + t, rounds + r
            if rounds >= self.window:
                break
        return {"tokens": tokens, "rounds": rounds, "tau": round(tokens / rounds, 4) if rounds else None}

    def _check_rollback(self) -> None:
        if self.swapped is None:
            return
        before, after = self.swapped
        now = self._window_of(after)
        then = self._window_of(before)
        if now["rounds"] < self.window or then["tau"] is None:
            return
        self.swapped = None  # judged once
        if now["tau"] < then["tau"] * (1 - self.settings.margin):
            self.rollbacks += 1
            append_event(self.folder, {"event": "rollback", "version": before, "from": after, "window": now, "before": then})
            self._swap_to(before, log=False)

    def _publish(self) -> None:
        metrics = self.engine.metrics
        metrics.set("drafthead_head_version", self.version)
        metrics.set("drafthead_head_swaps_total", self.swaps)
        metrics.set("drafthead_head_rollbacks_total", self.rollbacks)
        metrics.set("drafthead_adapt_trainer_restarts_total", self.trainer_restarts)
        metrics.set("drafthead_adapt_buffered_tokens", self.buffer.tokens)
        for key in ("live_tau", "candidate_tau"):
            if self.last_gate.get(key) is not None:
                metrics.set(f"drafthead_gate_{key}", self.last_gate[key])


def _identity(loaded) -> dict:
    """The buffer's meta: served traffic (no data section to compare) and the target it was served by."""
    from ..capture.features import SERVED_TRAFFIC
    from ..loop.run import target_meta

    return {"source": SERVED_TRAFFIC, **target_meta(loaded.model, loaded.tokenizer, loaded.name)}


def _head_fingerprint(head) -> str:
    from ...ground.target.identity import weights_fingerprint

    return weights_fingerprint(head)
