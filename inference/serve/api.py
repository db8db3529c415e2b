"""The OpenAI API's request and reply shapes, as pure functions: a request body becomes a typed
`Ask` or an `ApiError` naming the field; an answer becomes the reply or stream chunk OpenAI's
clients read (docs/serving.md lists every field and what it gets).

A field the server does not honour is refused with a 400 that names it, never ignored: the
answer would not be the one asked for. Fields that do not change the answer (`user`,
`stream_options`, `metadata`) are accepted.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """An error reply: HTTP `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Ask:
    """One request, checked: what to generate and how to answer."""

    endpoint: str  # "chat" | "completion"
    model: str
    messages: tuple[dict, ...] | None  # chat: [{"role", "content"}] with text content
    prompt: str | None  # completion: the prompt text
    prompt_ids: tuple[int, ...] | None  # completion: the prompt as token ids
    max_tokens: int | None  # None: up to the context limit
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# The fields each endpoint reads, and the ones it accepts as long as they ask for the default
# (value: what counts as the default). Anything else is an unknown or unsupported field.
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "return_token_ids",
    "ignore_eos",
    "user",
    "metadata",
    "n",
}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_COMPLETION = _COMMON | {"prompt", "logprobs"}
_DEFAULT_ONLY = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({}, None),
    "best_of": (1, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (0, None),
    "min_p": (0, 0.0, None),
    "service_tier": (None, "auto", "default"),
    "store": (False, None),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
}


def parse_ask(endpoint: str, body: object) -> Ask:
    """The checked request of `endpoint` ("chat" or "completion"); ApiError(400) naming the first
    field that is missing, of the wrong type, out of range or not honoured."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    known = _CHAT if endpoint == "chat" else _COMPLETION
    for name, value in body.items():
        if name in known:
            continue
        if name in _DEFAULT_ONLY:
            if value not in _DEFAULT_ONLY[name]:
                raise bad(f"'{name}' is not supported by this server (only its default is accepted)", name, "unsupported_parameter")
            continue
        raise bad(f"'{name}' is not a field this server honours", name, "unsupported_parameter")
    model = _string(body, "model", required=True)
    n = _integer(body, "n", 1, low=1)
    if n != 1:
        raise bad("'n' must be 1: this server returns one choice a request", "n", "unsupported_parameter")
    messages = prompt = prompt_ids = None
    logprobs, top_logprobs = False, 0
    if endpoint == "chat":
        messages = _messages(body.get("messages"))
        max_tokens = _integer(body, "max_completion_tokens", None, low=1)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", None, low=1)
        logprobs = _boolean(body, "logprobs", False)
        top_logprobs = _integer(body, "top_logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)
        if top_logprobs and not logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        prompt, prompt_ids = _prompt(body.get("prompt"))
        max_tokens = _integer(body, "max_tokens", 16, low=1)  # the completions API's default
        if body.get("logprobs") not in (None, 0, False):
            raise bad("'logprobs' is served on /v1/chat/completions only", "logprobs", "unsupported_parameter")
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("'stream_options' must be an object, with 'stream': true", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    temperature = _number(body, "temperature", 1.0, low=0.0, high=2.0)
    top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0:
        raise bad("'top_p' must be > 0", "top_p")
    top_k = _integer(body, "top_k", 0, low=-1)
    repetition_penalty = _number(body, "repetition_penalty", 1.0, low=0.0, high=math.inf)
    if repetition_penalty == 0:
        raise bad("'repetition_penalty' must be > 0", "repetition_penalty")
    return Ask(
        endpoint=endpoint,
        model=model,
        messages=messages,
        prompt=prompt,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),  # -1: off, as vLLM spells it
        repetition_penalty=repetition_penalty,
        seed=_integer(body, "seed", None, low=-(2**63), high=2**64 - 1),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_boolean(body, "return_token_ids", False),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=_boolean(body, "ignore_eos", False),
    )


def _string(body: dict, name: str, required: bool = False) -> str:
    value = body.get(name)
    if value is None and required:
        raise bad(f"'{name}' is required", name, "missing_required_parameter")
    if not isinstance(value, str) or not value:
        raise bad(f"'{name}' must be a non-empty string", name)
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {_show(value)}", name)
    return value


def _integer(body: dict, name: str, default, low: int | None = None, high: int | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {_show(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(f"'{name}' must be {_range(low, high)}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"'{name}' must be a number, got {_show(value)}", name)
    if not low <= value <= high:
        raise bad(f"'{name}' must be {_range(low, high)}, got {value}", name)
    return float(value)


def _range(low, high) -> str:
    if high is None or high == math.inf:
        return f">= {low}"
    return f"between {low} and {high}"


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _messages(messages) -> tuple[dict, ...]:
    if messages is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"{where} must be an object with a string 'role'", where)
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise bad(f"{where}: role '{m['role']}' is not served (system, developer, user, assistant)", where, "unsupported_parameter")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"{where}: '{extra[0]}' is not a message field this server honours", where, "unsupported_parameter")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": _content(m.get("content"), where)})
    return tuple(out)


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}: content parts of type {kind!r} are not served (text only)", where, "unsupported_parameter")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}: 'content' must be a string or a list of text parts", where)


def _prompt(prompt) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, None) or (None, token ids): one prompt per request."""
    if prompt is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return None, tuple(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("one prompt a request: send the others as requests of their own", "prompt", "unsupported_parameter")
    raise bad("'prompt' must be a string or a list of token ids", "prompt")


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} strings, got {len(stop)}", "stop")
    if any(s == "" for s in stop):
        raise bad("'stop' holds an empty string, which matches any text", "stop")
    return tuple(stop)


# -- replies -----------------------------------------------------------------------------------

FINISH_REASON = {"eos": "stop", "stop_string": "stop", "length": "length", "context": "length", "cancelled": "abort"}


@dataclass
class Answer:
    """What the engine produced for one request, in the terms of a reply."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish: str  # the engine's finish reason (FINISH_REASON's keys)
    rounds: int  # verify rounds the request took part in
    logprobs: list[dict] | None = None  # chat logprobs content entries


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def drafthead_figures(completion_tokens: int, rounds: int) -> dict:
    """The `drafthead` object beside `usage`: verify rounds and tokens per round (tau)."""
    return {"rounds": rounds, "tau": round(completion_tokens / rounds, 4) if rounds else 0.0}


def reply(ask: Ask, answer: Answer) -> dict:
    """The whole (non-streamed) reply: a chat.completion or a text_completion."""
    choice: dict = {"index": 0, "finish_reason": FINISH_REASON[answer.finish]}
    if ask.endpoint == "chat":
        choice["message"] = {"role": "assistant", "content": answer.text}
        choice["logprobs"] = {"content": answer.logprobs} if ask.logprobs else None
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice["text"] = answer.text
        choice["logprobs"] = None
        kind, prefix = "text_completion", "cmpl-"
    if ask.return_token_ids:
        choice["token_ids"] = answer.token_ids
    out = {
        "id": prefix + ask.id,
        "object": kind,
        "created": ask.created,
        "model": ask.model,
        "system_fingerprint": None,
        "choices": [choice],
        "usage": usage(len(answer.prompt_ids), len(answer.token_ids)),
        "drafthead": drafthead_figures(len(answer.token_ids), answer.rounds),
    }
    if ask.return_token_ids:
        out["prompt_token_ids"] = answer.prompt_ids
    return out


def chunk(
    ask: Ask, *, text: str | None = None, token_ids: list[int] | None = None, finish: str | None = None, first: bool = False, logprobs=None
) -> dict:
    """One streamed chunk: chat.completion.chunk (the first carries the role) or text_completion."""
    choice: dict = {"index": 0, "finish_reason": None if finish is None else FINISH_REASON[finish]}
    if ask.endpoint == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
        choice["logprobs"] = {"content": logprobs} if ask.logprobs and logprobs is not None else None
        kind, prefix = "chat.completion.chunk", "chatcmpl-"
    else:
        choice["text"] = text or ""
        choice["logprobs"] = None
        kind, prefix = "text_completion", "cmpl-"
    if ask.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": prefix + ask.id, "object": kind, "created": ask.created, "model": ask.model, "system_fingerprint": None, "choices": [choice]}


def usage_chunk(ask: Ask, prompt_tokens: int, completion_tokens: int, rounds: int) -> dict:
    """The last chunk when `stream_options.include_usage` asks for it: no choices, the usage."""
    kind, prefix = ("chat.completion.chunk", "chatcmpl-") if ask.endpoint == "chat" else ("text_completion", "cmpl-")
    return {
        "id": prefix + ask.id,
        "object": kind,
        "created": ask.created,
        "model": ask.model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
        "drafthead": drafthead_figures(completion_tokens, rounds),
    }


def models_reply(name: str, context: int | None, created: int) -> dict:
    entry: dict = {"id": name, "object": "model", "created": created, "owned_by": "drafthead"}
    if context is not None:
        entry["max_model_len"] = context
    return {"object": "list", "data": [entry]}
