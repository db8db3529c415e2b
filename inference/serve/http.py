"""The HTTP side of `drafthead serve`: OpenAI's endpoints over the standard library's threading
HTTP server, one thread per connection, the engine on a thread of its own (engine.py).

    GET  /health                200 {"status": "ok"} once the target is loaded (503 before, and while stopping)
    GET  /v1/models             the one model served
    POST /v1/chat/completions   chat, streamed (server-sent events) or whole
    POST /v1/completions        text completion, streamed or whole
    GET  /metrics               Prometheus text (metrics.py)

Every error is one JSON body in OpenAI's shape (api.py) and leaves the server and the other
requests as they were. A client that goes away mid-answer cancels its row at the next round.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import queue
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from ..engine.sampling import SamplingConfig
from .api import Answer, ApiError, Ask, chunk, models_reply, parse_ask, reply, usage_chunk
from .engine import Closed, Job, QueueFull, ServingEngine
from .metrics import ServerMetrics
from .text import TextStream

MAX_BODY = 16 * 2**20  # bytes of one request body
POLL = 0.25  # seconds between checks that a waiting client is still there


@dataclass
class ServedModel:
    """The model as the HTTP side sees it: its name, context and text <-> ids (thread-safe)."""

    name: str
    context: int | None
    render_chat: Callable[[list[dict]], list[int]]  # messages -> prompt ids (the chat template)
    encode: Callable[[str], list[int]]  # completion prompt text -> ids
    decode: Callable[[list[int]], str]  # ids -> answer text (special tokens skipped)
    token_text: Callable[[int], str]  # one id -> its text, for logprobs


class DraftheadServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], *, api_key: str | None = None, log: Callable[[str], None] | None = None, traffic_log: Path | None = None
    ):
        super().__init__(address, Handler)
        self.api_key = api_key
        # every answered request and its reply, a JSON line each: the served-traffic log the
        # offline loop trains and gates on (docs/training.md "The loop offline")
        self.traffic = open(traffic_log, "a") if traffic_log is not None else None
        self._traffic_lock = threading.Lock()
        self.model: ServedModel | None = None
        self.engine: ServingEngine | None = None  # None while the target loads
        self.metrics = ServerMetrics()
        self.stopping = False
        self.created = int(time.time())
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._busy = 0  # requests being answered
        self._busy_lock = threading.Condition()

    def ready(self, model: ServedModel, engine: ServingEngine) -> None:
        self.model, self.engine = model, engine

    def log_exchange(self, request: dict, response: dict) -> None:
        if self.traffic is None:
            return
        line = json.dumps({"request": request, "response": response}, ensure_ascii=False)
        with self._traffic_lock:
            self.traffic.write(line + "\n")
            self.traffic.flush()

    def serve_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, name="drafthead-http", daemon=True)
        thread.start()
        return thread

    def server_close(self) -> None:
        super().server_close()
        if self.traffic is not None:
            self.traffic.close()

    def close_door(self) -> None:
        """Stop accepting connections: new ones are refused; requests being answered go on."""
        self.stopping = True
        self.shutdown()
        self.socket.close()

    @contextlib.contextmanager
    def answering(self):
        with self._busy_lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy -= 1
                self._busy_lock.notify_all()

    def wait_answered(self, timeout: float) -> bool:
        """Wait until no request is being answered (True), or `timeout` seconds (False)."""
        deadline = time.monotonic() + timeout
        with self._busy_lock:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._busy_lock.wait(left)
        return True


class Handler(BaseHTTPRequestHandler):
    server: DraftheadServer
    protocol_version = "HTTP/1.1"
    server_version = "drafthead"

    # -- plumbing ----------------------------------------------------------------------------------

    def log_message(self, format: str, *args) -> None:
        if self.path.split("?", 1)[0] in ("/health", "/metrics"):  # probes: every few seconds, nothing to read
            return
        self.server.log(f"serve: {self.address_string()} {format % args}")

    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: ApiError, headers: dict | None = None) -> None:
        self._send_json(error.status, error.body(), headers)

    def _read_json(self) -> object:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length", code="length_required")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self.close_connection = True
            raise ApiError(400, "Content-Length is not a number", code="invalid_request") from None
        if length > MAX_BODY:
            self.close_connection = True
            raise ApiError(413, f"the body has {length} bytes, more than {MAX_BODY}", code="request_too_large")
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None

    def _authorised(self) -> bool:
        key = self.server.api_key
        if not key:
            return True
        given = self.headers.get("Authorization", "")
        token = given[7:] if given.startswith("Bearer ") else ""
        return hmac.compare_digest(token.encode(), key.encode())

    def _client_gone(self) -> bool:
        """Whether the client closed its side (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # -- routes ------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        server = self.server
        if path == "/health":
            if server.stopping:
                return self._send_json(503, {"status": "stopping"})
            if server.engine is None:
                return self._send_json(503, {"status": "loading"})
            if not server.engine.alive:
                return self._send_json(500, {"status": "failed", "reason": str(server.engine.failure)})
            return self._send_json(200, {"status": "ok"})
        if path == "/metrics":
            data = server.metrics.text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if path == "/v1/models":
            if not self._authorised():
                return self._send_error(_unauthorised())
            if server.model is None:
                return self._send_error(_loading())
            return self._send_json(200, models_reply(server.model.name, server.model.context, server.created))
        self._send_error(ApiError(404, f"no route GET {path}", type="not_found_error", code="not_found"))

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path)
        with self.server.answering():
            try:
                if endpoint is None:
                    self.close_connection = True  # its body is left unread
                    raise ApiError(404, f"no route POST {path}", type="not_found_error", code="not_found")
                body = self._read_json()  # before anything else: a kept-alive connection's next request follows it
                if not self._authorised():
                    raise _unauthorised()
                if self.server.engine is None or self.server.model is None:
                    raise _loading()
                self._answer(parse_ask(endpoint, body), body)
            except ApiError as e:
                if e.status not in (401, 404):
                    self.server.metrics.add("drafthead_requests_rejected_total")
                self._send_error(e, {"Retry-After": "1"} if e.status in (429, 503) else None)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

    # -- one request -------------------------------------------------------------------------------

    def _answer(self, ask: Ask, body) -> None:
        model, engine = self.server.model, self.server.engine
        assert model is not None and engine is not None  # checked by do_POST
        if ask.model != model.name:
            raise ApiError(
                404,
                f"the model '{ask.model}' is not served here (this server serves '{model.name}')",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        prompt = self._prompt(ask, model)
        max_tokens = ask.max_tokens
        if model.context is not None:
            room = model.context - len(prompt)
            if room < 1 or (max_tokens is not None and max_tokens > room):
                raise ApiError(
                    400,
                    f"this model's context holds {model.context} tokens; the prompt has {len(prompt)}"
                    + (f" and max_tokens asks for {max_tokens} more" if max_tokens is not None else ", leaving no room for an answer"),
                    param="max_tokens" if room >= 1 else "messages" if ask.endpoint == "chat" else "prompt",
                    code="context_length_exceeded",
                )
            max_tokens = max_tokens or room
        if max_tokens is None:
            raise ApiError(
                400, "'max_tokens' is required: the target states no context length", param="max_tokens", code="missing_required_parameter"
            )
        try:
            sampling = SamplingConfig(temperature=ask.temperature, top_k=ask.top_k, top_p=ask.top_p, repetition_penalty=ask.repetition_penalty)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        job = Job(
            prompt=prompt,
            sampling=sampling,
            max_tokens=max_tokens,
            stop=ask.stop,
            seed=ask.seed,
            ignore_eos=ask.ignore_eos,
            logprobs=ask.top_logprobs if ask.logprobs else None,
        )
        try:
            engine.submit(job)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}; retry later", type="rate_limit_error", code="queue_full") from None
        except Closed as e:
            raise ApiError(503, str(e), type="service_unavailable", code="shutting_down") from None
        self.server.metrics.add("drafthead_requests_total")
        answer = self._stream(ask, job, prompt, model) if ask.stream else self._whole(ask, job, prompt, model)
        if answer is not None:
            self.server.log_exchange(body, reply(ask, answer))

    def _prompt(self, ask: Ask, model: ServedModel) -> list[int]:
        try:
            if ask.messages is not None:
                ids = model.render_chat(list(ask.messages))
            elif ask.prompt is not None:
                ids = model.encode(ask.prompt)
            else:
                assert ask.prompt_ids is not None  # parse_ask gives one of the three
                ids = list(ask.prompt_ids)
                vocab = getattr(self.server.engine.backend, "vocab_size", None) if self.server.engine else None
                if vocab is not None and max(ids) >= vocab:
                    raise ApiError(400, f"token id {max(ids)} is outside the vocabulary of {vocab}", param="prompt")
        except ApiError:
            raise
        except Exception as e:  # a chat template that refuses the conversation
            raise ApiError(400, f"the conversation cannot be rendered: {e}", param="messages") from None
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
        return ids

    def _events(self, job: Job):
        """The job's events as they come; cancels the job when the client goes away (checked
        every POLL seconds, whether or not tokens are coming)."""
        checked = time.monotonic()
        while True:
            try:
                event = job.events.get(timeout=POLL)
            except queue.Empty:
                event = None
            if time.monotonic() - checked >= POLL:
                checked = time.monotonic()
                if self._client_gone():
                    job.cancel()
                    if self.server.engine is not None:
                        self.server.engine.wake()
                    raise ConnectionResetError("the client went away")
            if event is None:
                continue
            yield event
            if event[0] != "tokens":
                return

    def _whole(self, ask: Ask, job: Job, prompt: list[int], model: ServedModel) -> Answer | None:
        ids: list[int] = []
        logprobs: list = []
        first = None
        for event in self._events(job):
            if event[0] == "tokens":
                first = first or time.perf_counter()
                ids += event[1]
                logprobs += event[2] or []
            elif event[0] == "error":
                self.server.metrics.add("drafthead_requests_failed_total")
                raise ApiError(503 if "shut" in event[1] else 500, event[1], type="server_error", code="engine_error")
            else:
                _, finish, rounds = event
                self._timed(job, first)
                if finish == "cancelled":
                    raise _stopping()
                text = TextStream(model.decode, ask.stop)
                text.add(ids)
                answer = Answer(text.text(), ids, prompt, finish, rounds, _logprob_entries(model, ids, logprobs) if ask.logprobs else None)
                self._send_json(200, reply(ask, answer))
                return answer
        return None

    def _stream(self, ask: Ask, job: Job, prompt: list[int], model: ServedModel) -> Answer | None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        answer = None
        try:
            self._sse(chunk(ask, text="", first=True) if ask.endpoint == "chat" else None)
            text = TextStream(model.decode, ask.stop)
            count = 0
            first = None
            for event in self._events(job):
                if event[0] == "tokens":
                    first = first or time.perf_counter()
                    ids, logprobs = event[1], event[2]
                    count += len(ids)
                    piece = text.add(ids)
                    entries = _logprob_entries(model, ids, logprobs) if ask.logprobs and logprobs else None
                    if piece or ask.return_token_ids or entries:
                        self._sse(chunk(ask, text=piece, token_ids=ids, logprobs=entries))
                elif event[0] == "error":
                    self.server.metrics.add("drafthead_requests_failed_total")
                    self._sse(ApiError(500, event[1], type="server_error", code="engine_error").body())
                elif event[1] == "cancelled":  # the server is stopping
                    self._sse(_stopping().body())
                else:
                    _, finish, rounds = event
                    self._timed(job, first)
                    rest = text.finish()
                    self._sse(chunk(ask, text=rest or ("" if ask.endpoint == "chat" else None), finish=finish))
                    if ask.include_usage:
                        self._sse(usage_chunk(ask, len(prompt), count, rounds))
                    answer = Answer(text.text(), text.ids, prompt, finish, rounds)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            job.cancel()
            if self.server.engine is not None:
                self.server.engine.wake()
            answer = None
        self.close_connection = True
        return answer

    def _sse(self, body: dict | None) -> None:
        if body is None:
            return
        self.wfile.write(b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n")
        self.wfile.flush()

    def _timed(self, job: Job, first: float | None) -> None:
        now = time.perf_counter()
        if first is not None:
            self.server.metrics.observe("ttft", first - job.submitted)
        self.server.metrics.observe("request", now - job.submitted)


def _logprob_entries(model: ServedModel, ids: list[int], logprobs) -> list[dict]:
    """OpenAI's chat logprobs `content` entries (with llama-server's `id` beside each token)."""

    def entry(token: int, lp: float) -> dict:
        text = model.token_text(token)
        return {"id": token, "token": text, "logprob": lp, "bytes": list(text.encode())}

    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]} for t, (lp, top) in zip(ids, logprobs or [])]


def _unauthorised() -> ApiError:
    return ApiError(401, "the API key is missing or wrong (send Authorization: Bearer KEY)", type="authentication_error", code="invalid_api_key")


def _stopping() -> ApiError:
    return ApiError(503, "the server shut down before the answer was complete", type="service_unavailable", code="shutting_down")


def _loading() -> ApiError:
    return ApiError(503, "the target is still loading; retry when GET /health answers 200", type="service_unavailable", code="loading")
