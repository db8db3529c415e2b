"""Self-distillation data from the user's own serving engine: `data regenerate --server URL ...`
asks OpenAI-compatible chat-completions servers (train/regeneration/openai_client.py) instead of our engine,
and writes the same records as train/regeneration/regenerate.py.

- Each conversation is answered turn by turn by one worker thread, turn k's prompt holding the
  server's own answers to turns 1..k-1; `concurrency` threads per server, each server drawn by
  its threads in turn, so several servers share the work (data parallelism).
- A conversation's record is appended and flushed to disk (fsync) as soon as its last turn is
  answered, in the order they finish; a complete run then rewrites the file in input order.
  After a kill, even `kill -9`, the rerun cuts a torn last line, skips the ids in the file and asks
  only for the rest: no conversation is written twice or lost. Turns of conversations that were
  in flight are asked again.
- Token ids: when the server returns the answer's ids, the record keeps them (the stop token left
  out) and the text is those ids decoded with the target's tokenizer. Those ids must decode to
  the text the server sent, else the server holds another tokenizer than --target and the run
  stops. A server without ids gives text, which training re-tokenizes; the report counts both.
- Each prompt's length as the server counts it (usage.prompt_tokens) is compared with ours; the
  report counts those that differ, a sign of another chat template than the --target tokenizer's.
- A server error stops the run with one line (ServerError) once the requests in flight have
  finished; every answer already received is in the file, also those that finished together with
  the failed request. A refusal for the server's context says so, with the way out
  (--max-prompt-tokens).
- A rerun continues a file only when its records were made the same way (regenerate.py
  check_continuation: the same target, server model, sampling and data).
"""

from __future__ import annotations

import threading
import zlib
from contextlib import contextmanager
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterable

from ...ground.target.chat import render_chat
from ..data.chat_format import decode_answer, stop_token_ids
from .openai_client import ChatServer, ContextLimitError, Sampling, ServedAnswer, ServerError, ServerRing, ServerSettings, served_model
from .regenerate import (
    Answer,
    RegenerateReport,
    RegenerateSettings,
    _append_records,
    _split_turns,
    add_turn,
    check_continuation,
    done_ids,
    merge_parts,
    strip_stop,
)


def served_reply(served: ServedAnswer, tokenizer, stop_ids: list[int], reasoning: str, where: str) -> Answer:
    """A server's answer as an Answer: with its ids (module docstring) when it sent them, unless the
    reasoning is stripped (the ids cover it: the text alone is kept then)."""
    ended = served.finish_reason == "stop"
    ids = served.token_ids
    if ids is not None and not (reasoning == "strip" and served.reasoning):
        own = strip_stop(ids, stop_ids)
        if any(i >= len(tokenizer) for i in own):
            raise ServerError(
                f"{where}: token id {max(own)} is past the --target tokenizer's {len(tokenizer)} tokens: the server holds another tokenizer"
            )
        text = decode_answer(tokenizer, own)
        if not _decodes_to(text, served):
            raise ServerError(
                f"{where}: its token ids decode to {text[:40]!r} with the --target tokenizer, but it "
                f"sent {served.text[:40]!r}: the server holds another tokenizer"
            )
        return Answer(text, ended, own)
    return Answer(served.text, ended, None, served.reasoning if reasoning == "keep" else None, served.completion_tokens)


def _decodes_to(decoded: str, served: ServedAnswer) -> bool:
    """Whether our decoding of the served ids holds the text (and reasoning) the server sent: the
    server may trim whitespace, drop the bytes of a character cut at the end (we decode them as
    U+FFFD, and so may it) and hand reasoning apart."""
    decoded = decoded.rstrip("\ufffd")
    return all(part.strip().rstrip("\ufffd") in decoded for part in (served.text, served.reasoning or ""))


class _ConversationAnswerer:
    """Answers one conversation through the server its thread drew (module docstring)."""

    def __init__(self, ring: ServerRing, model: str, tokenizer, settings: RegenerateSettings, reasoning: str, limit: int | None):
        self.ring, self.model, self.tokenizer, self.settings = ring, model, tokenizer, settings
        self.reasoning, self.limit = reasoning, limit
        self.stop_ids = stop_token_ids(tokenizer)
        self.failed = threading.Event()  # an error: no worker starts another conversation

    def __call__(self, conversation: dict) -> tuple[list[dict], RegenerateReport] | None:
        """(the conversation's messages with the server's answers, its counts); None when an error
        elsewhere stopped the run before it started."""
        if self.failed.is_set():
            return None
        try:
            return self._answer(conversation)
        except BaseException:
            self.failed.set()
            raise

    def _answer(self, conversation: dict) -> tuple[list[dict], RegenerateReport]:
        server = self.ring.mine()
        report = RegenerateReport()
        system, users = _split_turns(conversation["messages"])
        history = list(system)
        seed = self.settings.seed + zlib.crc32(str(conversation["id"]).encode())  # a rerun samples the same answers
        for k, user in enumerate(users[: self.settings.max_turns] if self.settings.max_turns else users):
            messages = history + [{"role": "user", "content": user}]
            prompt_tokens = self._prompt_tokens(messages)
            if self.limit is not None and prompt_tokens + self.settings.max_new_tokens > self.limit:
                report.prompts_too_long += 1
                break
            sampling = Sampling(self.settings.max_new_tokens, self.settings.temperature, self.settings.top_p, seed + k)
            try:
                served = server.chat(self.model, _plain(messages), sampling)
            except ContextLimitError as e:
                raise ContextLimitError(
                    f"{e}: conversation {conversation['id']!r}, turn {k + 1}: its prompt ({prompt_tokens} tokens by the --target "
                    f"tokenizer) and --max-new-tokens {self.settings.max_new_tokens} are more than the server's context; "
                    "pass --max-prompt-tokens (the context less --max-new-tokens) so that such conversations end before that turn"
                ) from None
            report.prompt_tokens_differ += served.prompt_tokens not in (None, prompt_tokens)
            reply = served_reply(served, self.tokenizer, self.stop_ids, self.reasoning, f"{server.url} (conversation {conversation['id']!r})")
            if not add_turn(history, user, reply, self.tokenizer, report):
                break
        return history, report

    def _prompt_tokens(self, messages: list[dict]) -> int:
        """The prompt's length as our template and tokenizer make it: the server's own count
        should be the same, else it renders chats otherwise (report.prompt_tokens_differ)."""
        prompt = render_chat(self.tokenizer, messages, add_generation_prompt=True)
        return len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _plain(messages: list[dict]) -> list[dict]:
    """The messages as a server takes them: role and content only (our records add token ids)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@contextmanager
def _cancelling(pool: ThreadPoolExecutor):
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def regenerate_from_servers(
    tokenizer,
    conversations: Iterable[dict],
    out_path: str | Path,
    settings: RegenerateSettings,
    server: ServerSettings,
    *,
    progress: bool = True,
) -> tuple[RegenerateReport, str]:
    """Re-answer `conversations` ({id, messages}) through the servers; append records to `out_path`
    (module docstring) -> (the job's report, the model asked for). `tokenizer` is the target's:
    it decodes the served ids and renders prompts for `settings.max_prompt_tokens`."""
    servers = [ChatServer(url, server) for url in server.urls]
    model, context = served_model(servers, server.model)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    conversations = list(conversations)
    generation = settings.generation(engine=f"server {model}")
    check_continuation([out_path], generation)
    done = done_ids(out_path)  # a torn last line is cut here, before anything is appended
    report = RegenerateReport(already_done=len(done))
    todo = [c for c in conversations if str(c["id"]) not in done]
    answerer = _ConversationAnswerer(ServerRing(servers), model, tokenizer, settings, server.reasoning, settings.max_prompt_tokens or context)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="regenerate", unit="conv", dynamic_ncols=True)
    error: BaseException | None = None
    pool = ThreadPoolExecutor(server.concurrency * len(servers))
    # on any way out (an error, Ctrl-C) the conversations not started are dropped, not answered
    with open(out_path, "a", encoding="utf-8") as f, _cancelling(pool):
        pending = {pool.submit(answerer, c): c for c in todo}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:  # every one: those that finished beside a failure are written too
                conversation = pending.pop(future)
                try:
                    answered = future.result()
                except Exception as e:  # the requests in flight still finish and are kept
                    error = error or e
                    continue
                if answered is None:
                    continue
                history, part = answered
                report = RegenerateReport.combine([report, part])
                _append_records(f, [conversation], [history], generation, report)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    if error is not None:
        raise error
    merge_parts(out_path, [str(c["id"]) for c in conversations])  # no part files: the input's order
    return report, model
