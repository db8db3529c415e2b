"""The serving engine: one thread runs the decoder (inference/engine/decoder.py) for every request
in flight; requests join the running batch between rounds and leave when done (continuous
batching).

    submit(job)       a request thread queues a job (QueueFull past max_queue, Closed once stopping)
    the engine loop   between rounds: cancelled rows leave, waiting jobs join while the batch has
                      room (max_batch rows, and the llama.cpp backend's KV cells); then one round
    job.events        what the request thread reads: ("tokens", ids, logprobs) after each round
                      that emitted some, then ("done", finish reason, rounds) or ("error", message)
    stop(grace)       no new jobs; those in flight finish, or are cancelled after `grace` seconds

Exactness is the decoder's: each row accepts by the exact rule under its own sampling settings,
so a greedy answer is the target's own whatever else is in the batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine.decoder import Decoder, DecoderSettings, Row, RowSettings
from ..engine.drafter import fork_drafter
from ..engine.sizing import load_policy, size_drafter
from ..engine.sampling import SamplingConfig
from ..engine.stopping import StopRules
from ..engine.torch_target import TorchTarget
from .metrics import ServerMetrics

_log = logging.getLogger(__name__)

TREE_ROOM = 256  # KV cells per row kept free for one round's tree beyond its prompt and answer


class QueueFull(Exception):
    """The queue holds max_queue jobs already."""


class Closed(Exception):
    """The engine is stopping (or stopped) and takes no job."""


@dataclass
class Job:
    """One request inside the engine."""

    prompt: list[int]
    sampling: SamplingConfig
    max_tokens: int
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    # the engine thread's bookkeeping
    sent: int = 0  # tokens already handed out
    rounds_seen: int = 0  # the row's rounds already counted in the metrics
    last_time: float = 0.0
    head_version: int = 0  # the engine's drafter_version when the job joined

    def cancel(self) -> None:
        """The client went away: the row leaves the batch at the next round."""
        self.cancelled.set()


@dataclass(frozen=True)
class EngineSettings:
    max_batch: int = 16  # rows decoding together
    max_queue: int = 256  # jobs waiting beyond the batch
    max_len: int | None = None  # the context limit per row
    kv_cells: int | None = None  # the llama.cpp backend's KV cells in all (None: torch, which grows)
    streams: bool = True  # the llama.cpp backend: a KV stream per row (its trees become chains)
    engine_linears: bool = True
    # plain greedy runs of a lone row (the llama.cpp backend) stop this often, so a new request
    # waits at most this many tokens to join
    stretch_limit: int = 16


class ServingEngine:
    def __init__(
        self,
        backend,
        drafter,
        settings: EngineSettings,
        *,
        eos_token_ids: tuple[int, ...],
        decode: Callable[[list[int]], str],
        sizing: str = "fixed",
        metrics: ServerMetrics | None = None,
        record_layers: tuple[int, ...] = (),
    ):
        """sizing: how each round's trees are sized (inference/engine/sizing.py), for every row
        and every drafter swapped in; record_layers: the target's hidden states the decoder's
        observers get (an adapting head's training layers, train/adapt/)."""
        self.backend = backend
        self.drafter = drafter  # each row drafts with a fork of it (shared weights, its own state)
        self.settings = settings
        self.eos_token_ids = eos_token_ids
        self.metrics = metrics or ServerMetrics()
        device = getattr(backend, "device", torch.device("cpu"))
        self.sizing = sizing
        # what the sizing rules time: a torch backend's model, or the llama.cpp target itself
        verifier = backend.model if isinstance(backend, TorchTarget) else backend
        row_invariant = bool(getattr(backend, "row_invariant", False))
        size_drafter(verifier, drafter, sizing, row_invariant)
        policy = load_policy(verifier, drafter, row_invariant) if sizing == "policy" else None
        self.decoder = Decoder(
            backend,
            DecoderSettings(max_len=settings.max_len, device=device, policy=policy, decode=decode, stretch_limit=settings.stretch_limit),
            drafter.feature_layers,
            drafter.needs_last_hidden,
            record_layers,
        )
        self._waiting: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # id(row) -> its job
        self._cells: dict[int, int] = {}  # id(row) -> KV cells reserved for it
        self._wake = threading.Condition()
        self._stopping = False
        self._deadline: float | None = None
        self._running, self._ended = threading.Event(), threading.Event()  # run() began, ended
        self.failure: BaseException | None = None  # what ended the loop, if not a stop
        self.on_round: list[Callable[[], None]] = []  # called on the engine thread between rounds
        self.on_finish: list[Callable[[Row, Job], None]] = []  # a row done, on the engine thread
        self.drafter_version = 0  # a tag of `drafter`, given to the jobs that draft with it

    # -- the request threads' side -----------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._stopping:
                raise Closed("the server is shutting down")
            if len(self._waiting) >= self.settings.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue {self.settings.max_queue})")
            self._waiting.append(job)
            self.metrics.set("drafthead_queue_length", len(self._waiting))
            self._wake.notify()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    def start(self) -> threading.Thread:
        """The loop on a thread of its own (tests, Python callers)."""
        thread = threading.Thread(target=self.run, name="drafthead-engine", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        """The loop on the calling thread, until stop() ends it or it fails (`failure`). `drafthead
        serve` runs it on the thread that loaded the target: llama.cpp's forward called from
        another thread took twice as long (44 against 23 ms a token, SmolLM2 f32, 2 threads)."""
        self._running.set()
        try:
            self._loop()
        finally:
            self._ended.set()

    def stop(self, grace: float) -> None:
        """Take no new job; those in flight get `grace` seconds to finish, then are cancelled.
        Returns once the loop has ended (at once if it never ran)."""
        with self._wake:
            self._stopping = True
            self._deadline = time.monotonic() + grace
            self._wake.notify()
        if self._running.is_set():
            self._ended.wait()

    @property
    def alive(self) -> bool:
        return self._running.is_set() and not self._ended.is_set()

    # -- the engine thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with torch.inference_mode(), self.backend.engine_context(self.settings.engine_linears):
                if self.settings.kv_cells is not None:
                    self.decoder.open(self.settings.max_batch, self.settings.kv_cells, self.settings.streams)
                while True:
                    self._call_hooks(self.on_round)
                    if self._past_deadline():
                        self._cancel_everything()
                    try:
                        self._admit()
                        if self.decoder.active:
                            self._step()
                            continue
                    except Exception as e:  # one round's failure fails its rows, not the server
                        _log.exception("a round failed")
                        self._fail_rows(f"the engine failed this request: {type(e).__name__}: {e}")
                        continue
                    with self._wake:
                        if self._stopping and not self._waiting:
                            return
                        if not self._waiting:
                            self._wake.wait(timeout=0.5)
        except BaseException as e:  # the loop must not die silently: fail what is in flight
            self.failure = e
            _log.exception("the serving engine stopped")
            self._fail_everything(f"the engine failed: {type(e).__name__}: {e}")

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline

    def _cancel_everything(self) -> None:
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            job.events.put(("error", "the server shut down before this request started"))
        for row in self.decoder.active:
            self.decoder.cancel(row)

    def _fail_rows(self, message: str) -> None:
        """Every row in flight ends with `message`; the batch starts again empty (the cache as a
        failed round left it is not trusted)."""
        for job in self._jobs.values():
            self.metrics.add("drafthead_requests_failed_total")
            job.events.put(("error", message))
        self._jobs.clear()
        self._cells.clear()
        self.decoder.reset()

    def _fail_everything(self, message: str) -> None:
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting + list(self._jobs.values()):
            job.events.put(("error", message))
        self._jobs.clear()

    def _admit(self) -> None:
        """Cancelled rows leave; waiting jobs join while there is room."""
        for row in self.decoder.active:
            job = self._jobs.get(id(row))  # None: finished and told, leaving at the next step
            if job is not None and job.cancelled.is_set():
                self.decoder.cancel(row)
        self._retire([row for row in self.decoder.active if row.finish is not None])
        room = self.settings.max_batch - sum(1 for row in self.decoder.active if row.finish is None)
        taken: list[Job] = []
        needs = []
        with self._wake:
            # one unified llama.cpp cache: rows share its cells (a stream per row holds a whole request, serve checks)
            cells = self.settings.kv_cells
            free = cells - sum(self._cells.values()) if cells is not None and not self.settings.streams else None
            while self._waiting and len(taken) < room:
                job = self._waiting[0]
                if job.cancelled.is_set():
                    self._waiting.popleft()
                    continue
                need = len(job.prompt) + job.max_tokens + TREE_ROOM
                if free is not None:
                    if need > free:
                        break  # the oldest job waits for cells; FIFO, so no later one overtakes it
                    free -= need
                taken.append(self._waiting.popleft())
                needs.append(need)
            self.metrics.set("drafthead_queue_length", len(self._waiting))
        if not taken:
            return
        prompts = [torch.tensor(job.prompt, dtype=torch.long, device=self.decoder.settings.device) for job in taken]
        drafters = [fork_drafter(self.drafter) for _ in taken]
        settings = [self._row_settings(job) for job in taken]
        rows = self.decoder.join(prompts, drafters, settings, max(job.max_tokens for job in taken))
        now = time.perf_counter()
        for row, job, need in zip(rows, taken, needs):
            self._jobs[id(row)] = job
            self._cells[id(row)] = need
            job.last_time, job.head_version = now, self.drafter_version
            self.metrics.add("drafthead_prompt_tokens_total", len(job.prompt))
        self.metrics.set("drafthead_batch_size", len(self.decoder.active))

    def _row_settings(self, job: Job) -> RowSettings:
        generator = torch.Generator()
        if job.seed is not None:
            generator.manual_seed(job.seed % 2**64)
        else:
            generator.seed()
        rules = StopRules(() if job.ignore_eos else self.eos_token_ids, job.stop, job.max_tokens)
        vocab = self.decoder.backend.vocab_size if job.sampling.repetition_penalty != 1.0 else None
        return RowSettings(job.sampling, rules, generator, None, vocab, job.logprobs)

    def _step(self) -> None:
        rows = [row for row in self.decoder.active if id(row) in self._jobs]  # not the finished ones, leaving now
        forwards = self.decoder.num_forwards
        self.decoder.step()
        now = time.perf_counter()
        counted = []
        for row in rows:
            job = self._jobs[id(row)]
            new = row.emitted[job.sent :]
            if new:
                logprobs = row.logprobs[job.sent :] if job.logprobs is not None else None
                job.events.put(("tokens", new, logprobs))
                per_token = (now - job.last_time) / len(new)
                for _ in new:
                    self.metrics.observe("token", per_token)
                job.sent, job.last_time = len(row.emitted), now
            for emitted, drafted in zip(row.accepted_lengths[job.rounds_seen :], row.drafted[job.rounds_seen :]):
                counted.append((emitted, max(0, emitted - 1), drafted))
            job.rounds_seen = len(row.accepted_lengths)
        self.metrics.round(counted, self.decoder.num_forwards - forwards)
        self._retire([row for row in rows if row.finish is not None])
        self.metrics.set("drafthead_batch_size", len(self._jobs))

    def _retire(self, rows: list[Row]) -> None:
        """Tell the finished rows' jobs; the decoder drops the rows at its next step or join."""
        for row in rows:
            job = self._jobs.pop(id(row), None)
            if job is None:
                continue
            self._cells.pop(id(row), None)
            if row.finish == "cancelled":
                self.metrics.add("drafthead_requests_cancelled_total")
            job.events.put(("done", row.finish, len(row.accepted_lengths)))
            self._call_hooks(self.on_finish, row, job)

    def _call_hooks(self, hooks: list[Callable], *args) -> None:
        """The hooks' failures are logged, never the requests': an answer is the target's whatever
        an observer (the adapting buffer, train/adapt/) does with it."""
        for call in hooks:
            try:
                call(*args)
            except Exception:
                _log.exception("a hook of the engine failed (%s); the answers go on", getattr(call, "__qualname__", call))
