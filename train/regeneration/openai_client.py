"""A client of OpenAI-compatible chat-completions servers (vLLM, SGLang, llama.cpp's llama-server):
what `data regenerate --server` asks them, standard library only.

Token ids: the answer's ids are asked for in the two forms servers give them, and read from
whichever comes back:
- vLLM: `return_token_ids: true` puts the generated ids in `choices[0].token_ids`;
- llama-server: `logprobs: true, top_logprobs: 1` lists each generated token in
  `choices[0].logprobs.content[i]` with its `id` (the OpenAI form itself carries no id).
A server that returns neither gives text only (`ServedAnswer.token_ids` None).

Errors: a failed request is retried with exponential backoff when trying again can help (no
connection, a timeout, a reply cut short or badly chunked, HTTP 408, 429, 500, 502, 503 and
504: RETRY_STATUS); anything else (another 5xx such as 501 included), and the last failed try, raises ServerError, one line naming
the server and what it said, never the API key. A refusal that names the server's context
length (its messages say "context length", "context size" or "n_ctx") is a ContextLimitError.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

RETRY_STATUS = (408, 429, 500, 502, 503, 504)  # worth asking again: overload, restart, timeouts
# how vLLM, SGLang and llama-server word a request longer than the model's context
_CONTEXT_LIMIT = re.compile(r"context (length|size|window)|n_ctx", re.IGNORECASE)


class ServerError(ValueError):
    """A server that is down, refuses, serves another model or answers in another form (one line)."""


class ContextLimitError(ServerError):
    """A server refused a request as longer than its context."""


@dataclass(frozen=True)
class ServerSettings:
    """Where and how `data regenerate --server` asks; checked when made (the CLI's flags named),
    its URLs kept as their roots (root_url)."""

    urls: tuple[str, ...]
    model: str | None = None  # None: the one model every server serves
    api_key: str | None = None
    concurrency: int = 8  # requests in flight per server
    retries: int = 4  # tries after the first one fails
    backoff: float = 1.0  # seconds before the first retry, doubling each time
    request_timeout: float = 600.0  # seconds for one request
    reasoning: str = "keep"  # keep | strip a `reasoning_content` the server returns apart

    def __post_init__(self) -> None:
        # every comparison with nan is False: each test below is written so that nan fails it
        if not 0 < self.request_timeout < math.inf:
            raise ValueError(f"--request-timeout must be a number of seconds > 0, got {self.request_timeout}")
        for flag, value, low in (("--concurrency", self.concurrency, 1), ("--retries", self.retries, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag} must be a whole number >= {low}, got {value!r}")
        if not 0 <= self.backoff < math.inf:
            raise ValueError(f"backoff must be a number of seconds >= 0, got {self.backoff}")
        if self.reasoning not in ("keep", "strip"):
            raise ValueError(f"--reasoning must be keep or strip, got {self.reasoning!r}")
        if self.api_key is not None and not re.fullmatch(r"[\x21-\x7e]*", self.api_key):
            # urllib would refuse it with the key in its message: say what is wrong, not the key
            raise ValueError("--api-key (or $OPENAI_API_KEY) holds a space, a line break or a non-ASCII character, which no HTTP header carries")
        if not self.urls:
            raise ValueError("--server needs at least one URL")
        seen: dict[str, str] = {}
        for url in self.urls:
            root = root_url(url)
            if root in seen:  # one server counted twice would get twice the requests in flight
                raise ValueError(
                    f"--server names {root} twice ({seen[root]!r} and {url!r}): give each server once "
                    "(--concurrency sets the requests in flight per server)"
                )
            seen[root] = url
        object.__setattr__(self, "urls", tuple(seen))  # frozen: set once, here


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of one request."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def fields(self) -> dict:
        body = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p}
        if self.seed is not None:
            body["seed"] = self.seed
        return body


@dataclass(frozen=True)
class ServedAnswer:
    text: str
    finish_reason: str | None  # "stop": ended by the model; "length": cut by max_tokens
    token_ids: list[int] | None  # as generated, the stop token included where the server keeps it
    reasoning: str | None
    completion_tokens: int | None  # the server's usage counts
    prompt_tokens: int | None = None


def root_url(url: str) -> str:
    """`host:port`, `http://host:port/` or `http://host:port/v1` -> `http://host:port`; ValueError
    for anything else (another scheme, no host, a port that is not a number, a path)."""
    given = url
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/").removesuffix("/v1")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:  # "Port could not be cast to integer value as 'abc'", "Invalid IPv6 URL"
        raise ValueError(f"--server {given!r}: {e}") from None
    if parts.scheme.lower() not in ("http", "https"):
        why = f"{parts.scheme}:// is not http:// or https://, which the servers answer"
    elif not parts.hostname or re.search(r"[\s\x00-\x1f]", url):
        why = "no host name in it, or a space"
    elif port == 0:
        why = "port 0"
    elif parts.path or parts.query or parts.fragment:
        why = "a path after the port; give http://HOST:PORT (or .../v1)"
    else:
        return f"{parts.scheme.lower()}://{parts.netloc.lower()}"
    raise ValueError(f"--server {given!r}: {why}")


class ChatServer:
    """One server: its root URL and the settings every request uses. Thread-safe (no state kept
    between requests)."""

    def __init__(self, url: str, settings: ServerSettings, sleep: Callable[[float], None] = time.sleep):
        self.url = root_url(url)
        self.settings = settings
        self._sleep = sleep

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        return headers

    @contextmanager
    def _keeping_the_key(self) -> Iterator[None]:
        """A ServerError from the block with the API key blanked out wherever it appears (a server
        may quote the request it refuses)."""
        try:
            yield
        except ServerError as e:
            key = self.settings.api_key
            if not key or key not in str(e):
                raise
            raise type(e)(str(e).replace(key, "<api key>")) from None

    def request(self, path: str, body: dict | None = None) -> dict:
        """GET (no body) or POST JSON to `path`, retried as the module docstring says -> the JSON reply."""
        data = None if body is None else json.dumps(body, allow_nan=False).encode()
        where = f"{self.url}{path}"
        with self._keeping_the_key():
            for attempt in range(self.settings.retries + 1):
                why = self._try(where, data)
                if isinstance(why, dict):
                    return why
                if attempt == self.settings.retries:
                    raise ServerError(f"{where}: {why} (after {attempt + 1} tries)")
                self._sleep(self.settings.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def _try(self, where: str, data: bytes | None) -> dict | str:
        """The reply, or why a retry may help (a string); raises ServerError when it cannot."""
        req = urllib.request.Request(where, data=data, headers=self._headers(), method="GET" if data is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=self.settings.request_timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            said = _error_text(e)
            if e.code in RETRY_STATUS:
                return f"HTTP {e.code}: {said}"
            refused = ContextLimitError if _CONTEXT_LIMIT.search(said) else ServerError
            raise refused(f"{where}: HTTP {e.code}: {said}") from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            return f"no answer ({reason})"
        except http.client.HTTPException as e:  # a reply cut short (IncompleteRead), badly chunked or garbled
            return f"a broken reply ({type(e).__name__}: {str(e)[:120] or 'no detail'})"
        try:
            reply = json.loads(raw)
        except ValueError:
            raise ServerError(f"{where}: the reply is not JSON: {raw[:120]!r}") from None
        if not isinstance(reply, dict):
            raise ServerError(f"{where}: the reply is not a JSON object: {raw[:120]!r}")
        return reply

    def models(self) -> list[dict]:
        """The entries of GET /v1/models (each has an `id`; vLLM adds `max_model_len`)."""
        reply = self.request("/v1/models")
        data = reply.get("data")
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise ServerError(f"{self.url}/v1/models: no list of models with ids in the reply: {json.dumps(reply)[:160]}")
        return data

    def chat(self, model: str, messages: list[dict], sampling: Sampling) -> ServedAnswer:
        body = {
            "model": model,
            "messages": messages,
            "stream": False,
            **sampling.fields(),
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 1,
        }
        reply = self.request("/v1/chat/completions", body)
        with self._keeping_the_key():
            return parse_chat_reply(reply, f"{self.url}/v1/chat/completions")


def _error_text(e: urllib.error.HTTPError) -> str:
    """What a server said with its error status: the `error.message` of an OpenAI-form body, else
    the body's first line."""
    try:
        raw = e.read().decode(errors="replace")
    except OSError:
        raw = ""
    try:
        error = json.loads(raw).get("error")
        said = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        said = None
    said = str(said or raw or e.reason).strip()
    return said.splitlines()[0][:200] if said else str(e.reason)


def _ids_of(choice: dict) -> list[int] | None:
    """The generated token ids of a choice in either form the module docstring names, else None."""
    ids = choice.get("token_ids")
    if ids is None:
        content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
        if isinstance(content, list) and content and all(isinstance(t, dict) and "id" in t for t in content):
            ids = [t["id"] for t in content]
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(f"token ids that are not a list of non-negative integers: {str(ids)[:80]}")
    return ids


def parse_chat_reply(reply: dict, where: str) -> ServedAnswer:
    """A chat-completions reply -> ServedAnswer; ServerError when it is not in that form."""
    try:
        choice = reply["choices"][0]
        message = choice["message"]
        text = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if not isinstance(text, str) or not isinstance(reasoning, (str, type(None))):
            raise ValueError("content that is not text")
        usage = reply.get("usage")
        if not isinstance(usage, dict):
            usage = {}
        return ServedAnswer(text, choice.get("finish_reason"), _ids_of(choice), reasoning, usage.get("completion_tokens"), usage.get("prompt_tokens"))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        raise ServerError(f"{where}: not a chat completion ({type(e).__name__}: {e}): {json.dumps(reply)[:160]}") from None


def served_model(servers: list[ChatServer], wanted: str | None) -> tuple[str, int | None]:
    """(the model to ask for, its context length when a server says it): `wanted`, which every
    server must serve, or else the one model they all serve. ServerError otherwise."""
    lengths: list[int] = []
    for server in servers:
        models = server.models()
        ids = [m["id"] for m in models]
        if wanted is None:
            if len(ids) != 1:
                raise ServerError(f"{server.url} serves {len(ids)} models ({', '.join(ids) or 'none'}); pass --model NAME")
            wanted = ids[0]
        if wanted not in ids:
            raise ServerError(f"{server.url} serves {', '.join(ids) or 'no model'}, not {wanted}")
        lengths += [m["max_model_len"] for m in models if m["id"] == wanted and isinstance(m.get("max_model_len"), int)]
    assert wanted is not None  # set from the first server when not given; servers hold at least one
    return wanted, min(lengths) if lengths else None


class ServerRing:
    """Deals the servers out to worker threads: each thread keeps the server it first drew, so with
    `concurrency` threads per server every server has `concurrency` requests in flight."""

    def __init__(self, servers: list[ChatServer]):
        self.servers = servers
        self._next = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    def mine(self) -> ChatServer:
        server = getattr(self._local, "server", None)
        if server is None:
            with self._lock:
                server = self._local.server = self.servers[self._next % len(self.servers)]
                self._next += 1
        return server
