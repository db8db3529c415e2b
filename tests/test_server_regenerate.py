"""`data regenerate --server`: the OpenAI-compatible client (train/openai_server.py) and the
regeneration through it (train/regenerate_server.py), against a small chat-completions server
started here on 127.0.0.1 from the standard library (`StubServer`). Covers both forms of returned
token ids, text-only servers, several servers sharing the work, retries, every error case (one
line, exit 2, answers already received kept) and a SIGKILLed run resumed.

A real server (llama.cpp's llama-server) is tests/test_llamacpp_server.py, marked `llamacpp`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from drafthead.inference.engine.chat import render_chat
from drafthead.train.chat_format import format_conversation
from drafthead.train.openai_server import ServerError, ServerSettings, root_url
from drafthead.train.regenerate import RegenerateSettings, done_ids
from drafthead.train.regenerate_server import regenerate_from_servers
from drafthead.train.sources import load_conversations
from tests.cli_checks import assert_failed_late, run_cli

MODEL = "tiny-served"


class StubServer:
    """A chat-completions server answering `ok <last user text>`, its ids followed by the stop
    token. ids: "vllm" (choices[0].token_ids), "llama" (logprobs.content[i].id) or None (text only).
    `answers` maps a user text to (ids without the stop token, finish_reason[, text sent instead of
    the ids decoded]) for special answers;
    `statuses` is a list of HTTP statuses to send, one per request, before answering normally;
    `bodies` maps a user text to a raw body sent instead of the answer."""

    def __init__(self, tokenizer, ids: str | None = "vllm", delay: float = 0.0, model: str = MODEL):
        self.tok, self.ids, self.delay, self.model = tokenizer, ids, delay, model
        self.answers: dict[str, tuple[list[int], str]] = {}
        self.statuses: list[int] = []
        self.bodies: dict[str, bytes] = {}
        self.fail_user: dict[str, int] = {}  # user text -> HTTP status always sent for it
        self.prompt_offset = 0  # added to the prompt's token count (a server with another template)
        self.reasoning = False  # send each answer's first word apart, as reasoning_content
        self.asked: list[str] = []  # the last user text of every chat request that was answered
        self.prompts: list[list[dict]] = []  # the messages of each of those requests
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, json.dumps({"object": "list", "data": [{"id": stub.model, "object": "model"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.in_flight += 1
                    stub.most_in_flight = max(stub.most_in_flight, stub.in_flight)
                    status = stub.statuses.pop(0) if stub.statuses else None
                try:
                    status, reply = stub.respond(body, status)
                finally:  # before the reply goes out: the client may ask again as soon as it has it
                    with stub.lock:
                        stub.in_flight -= 1
                self._send(status, reply)

        return Handler

    def respond(self, body: dict, status: int | None) -> tuple[int, bytes]:
        time.sleep(self.delay)
        user = body["messages"][-1]["content"]
        status = status or self.fail_user.get(user)
        if status is not None:
            return status, json.dumps({"error": {"message": f"stub says {status}"}}).encode()
        if user in self.bodies:
            return 200, self.bodies[user]
        with self.lock:
            self.asked.append(user)
            self.prompts.append(body["messages"])
        return 200, json.dumps(self.reply(body, user)).encode()

    def reply(self, body: dict, user: str) -> dict:
        assert body["model"] == self.model and body["max_tokens"] > 0
        ids, finish, *text = self.answers.get(user, (self.tok.encode(f"ok {user}", add_special_tokens=False), "stop"))
        served = ids + ([self.tok.eos_token_id] if finish == "stop" else [])
        content = text[0] if text else self.tok.decode(ids, skip_special_tokens=True)
        message = {"role": "assistant", "content": content}
        if self.reasoning:  # the first word of the answer is its reasoning, sent apart
            message["reasoning_content"], message["content"] = content.split(" ", 1)
        choice = {"index": 0, "finish_reason": finish, "message": message}
        if self.ids == "vllm":
            choice["token_ids"] = served
        elif self.ids == "llama":
            choice["logprobs"] = {"content": [{"id": t, "token": self.tok.decode([t]), "logprob": 0.0} for t in served]}
        prompt = render_chat(self.tok, body["messages"], add_generation_prompt=True)
        prompt_tokens = len(self.tok(prompt, add_special_tokens=False)["input_ids"]) + self.prompt_offset
        return {
            "object": "chat.completion",
            "model": self.model,
            "choices": [choice],
            "usage": {"completion_tokens": len(served), "prompt_tokens": prompt_tokens},
        }

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def conversations(n: int, turns: int = 1) -> list[dict]:
    out = []
    for i in range(n):
        messages = []
        for k in range(turns):
            messages += [{"role": "user", "content": f"question {i} turn {k}"}, {"role": "assistant", "content": "old"}]
        out.append({"id": f"c{i}", "messages": messages})
    return out


def fast(*urls, **kw) -> ServerSettings:
    """Server settings with a short backoff (tests wait 10 ms, not seconds, between tries)."""
    return ServerSettings(urls=tuple(urls), **{"backoff": 0.01, "retries": 2, "concurrency": 2, **kw})


SETTINGS = RegenerateSettings(max_new_tokens=16)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_root_url_takes_the_usual_spellings():
    assert {root_url(u) for u in ("127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1/")} == {"http://127.0.0.1:8000"}


@pytest.mark.parametrize("form", ["vllm", "llama"])
def test_served_ids_are_kept_and_label_the_answers(tmp_path, tiny_tokenizer, form):
    """Both forms of returned ids: each answer keeps the served ids without the stop token, its text
    is those ids decoded, turn 2 is asked with answer 1, and training labels the answers with the
    served ids, also where re-tokenizing the text gives others (a non-canonical split, an answer
    cut inside a character)."""
    tok = tiny_tokenizer
    convs = conversations(3, turns=2)
    split = [i for ch in "the answer" for i in tok.encode(ch, add_special_tokens=False)]  # one token per letter
    cut = tok.encode("café", add_special_tokens=False)[:-1]  # "é" is two bytes: its first one only
    assert tok.encode(tok.decode(split), add_special_tokens=False) != split
    assert tok.decode(cut).endswith("\ufffd")
    out = tmp_path / "regen.jsonl"
    with StubServer(tok, ids=form) as server:
        server.answers = {"question 1 turn 0": (split, "stop"), "question 2 turn 1": (cut, "length")}
        report, model = regenerate_from_servers(tok, convs, out, SETTINGS, fast(server.url), progress=False)
    assert model == MODEL and report.written == 3 and report.turns_answered == 6
    assert report.answers_with_ids == 6 and report.answers_without_ids == 0 and report.answers_cut == 1
    assert report.ids_retokenize_differ == 2 and report.prompt_tokens_differ == 0
    written = records(out)
    assert [r["id"] for r in written] == ["c0", "c1", "c2"]  # input order
    answers = [[m for m in r["messages"] if m["role"] == "assistant"] for r in written]
    assert answers[1][0]["token_ids"] == split and answers[2][1]["token_ids"] == cut
    assert answers[0][0]["token_ids"] == tok.encode("ok question 0 turn 0", add_special_tokens=False)
    assert all(m["content"] == tok.decode(m["token_ids"]) for a in answers for m in a)
    assert len(server.asked) == 6
    second = next(p for p in server.prompts if p[-1]["content"] == "question 0 turn 1")
    assert second[1] == {"role": "assistant", "content": "ok question 0 turn 0"}  # its own first answer, no ids

    ds, _ = load_conversations("regenerated", str(out), use_cache=False)
    row = ds[1]
    formatted = format_conversation(tok, row["messages"], 4096, row["answer_token_ids"])
    labels = [t for t, m in zip(formatted.input_ids, formatted.loss_mask) if m]
    assert formatted.ids_kept == 2 and labels[: len(split)] == split
    plain = format_conversation(tok, row["messages"], 4096)  # the text re-tokenized: other labels
    assert [t for t, m in zip(plain.input_ids, plain.loss_mask) if m] != labels


def test_a_server_without_ids_gives_text_and_other_counts_are_noted(tmp_path, tiny_tokenizer):
    out = tmp_path / "regen.jsonl"
    with StubServer(tiny_tokenizer, ids=None) as server:
        server.prompt_offset = 3  # and it renders prompts otherwise: counted
        report, _ = regenerate_from_servers(tiny_tokenizer, conversations(2), out, SETTINGS, fast(server.url), progress=False)
    assert report.answers_without_ids == 2 and report.answers_with_ids == 0 and report.prompt_tokens_differ == 2
    assert report.answer_tokens == sum(len(tiny_tokenizer.encode(f"ok question {i} turn 0")) + 1 for i in range(2))
    assert all("token_ids" not in m for r in records(out) for m in r["messages"])


@pytest.mark.parametrize("form, reasoning", [("vllm", "keep"), ("vllm", "strip"), (None, "keep"), (None, "strip")])
def test_reasoning_is_kept_or_stripped(tmp_path, tiny_tokenizer, form, reasoning):
    """A reasoning text sent apart: kept, it is in the answer the ids decode to (with ids) or beside
    the content (without); stripped, the answer is the content alone and the ids (which cover the
    reasoning) are dropped."""
    out = tmp_path / "regen.jsonl"
    with StubServer(tiny_tokenizer, ids=form) as server:
        server.reasoning = True
        report, _ = regenerate_from_servers(tiny_tokenizer, conversations(1), out, SETTINGS, fast(server.url, reasoning=reasoning), progress=False)
    answer = records(out)[0]["messages"][-1]
    if reasoning == "strip":
        assert answer == {"role": "assistant", "content": "question 0 turn 0"} and report.answers_without_ids == 1
    elif form is None:
        assert answer == {"role": "assistant", "content": "question 0 turn 0", "reasoning_content": "ok"}
    else:
        assert answer["content"] == "ok question 0 turn 0" and "token_ids" in answer and "reasoning_content" not in answer


def test_several_servers_share_the_work_with_bounded_concurrency(tmp_path, tiny_tokenizer):
    out = tmp_path / "regen.jsonl"
    with StubServer(tiny_tokenizer, delay=0.05) as a, StubServer(tiny_tokenizer, delay=0.05) as b:
        report, _ = regenerate_from_servers(tiny_tokenizer, conversations(16), out, SETTINGS, fast(a.url, b.url, concurrency=3), progress=False)
    assert report.written == 16 and len(a.asked) + len(b.asked) == 16
    assert a.asked and b.asked
    assert 2 <= a.most_in_flight <= 3 and 2 <= b.most_in_flight <= 3
    assert [r["id"] for r in records(out)] == [f"c{i}" for i in range(16)]


def test_failed_requests_are_retried(tmp_path, tiny_tokenizer):
    with StubServer(tiny_tokenizer) as server:
        server.statuses = [503, 429]  # the first two requests of the run (the models list is a GET)
        report, _ = regenerate_from_servers(
            tiny_tokenizer, conversations(3), tmp_path / "r.jsonl", SETTINGS, fast(server.url, concurrency=1), progress=False
        )
    assert report.written == 3 and len(server.asked) == 3


def test_a_4xx_stops_the_run_and_keeps_what_was_answered(tmp_path, tiny_tokenizer):
    out = tmp_path / "regen.jsonl"
    with StubServer(tiny_tokenizer) as server:
        server.fail_user = {"question 3 turn 0": 400}
        with pytest.raises(ServerError, match="HTTP 400: stub says 400"):
            regenerate_from_servers(tiny_tokenizer, conversations(6), out, SETTINGS, fast(server.url, concurrency=1), progress=False)
        assert done_ids(out) == {"c0", "c1", "c2"}  # one worker: those before the refused one, none after
        server.fail_user = {}
        report, _ = regenerate_from_servers(tiny_tokenizer, conversations(6), out, SETTINGS, fast(server.url), progress=False)
    assert report.already_done == 3 and report.written == 3
    assert sorted(server.asked) == sorted(f"question {i} turn 0" for i in range(6))  # none asked twice


@pytest.mark.parametrize(
    "case, match",
    [
        ("down", "no answer"),
        ("5xx", "HTTP 500: stub says 500 (after 3 tries)"),
        ("model", f"serves {MODEL}, not other"),
        ("malformed", "not a chat completion"),
        ("not-json", "the reply is not JSON"),
        ("tokenizer", "holds another tokenizer"),
    ],
)
def test_each_server_error_is_one_line_and_exit_2(tmp_path, capsys, tiny_tokenizer, tiny_llama_dir, case, match):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in conversations(4)))
    out = tmp_path / "regen.jsonl"
    with StubServer(tiny_tokenizer) as server:
        url, extra = server.url, []
        if case == "down":
            url = "http://127.0.0.1:9"  # the discard port: nothing listens there
        elif case == "5xx":
            server.fail_user = {"question 2 turn 0": 500}
        elif case == "model":
            extra = ["--model", "other"]
        elif case == "malformed":
            server.bodies = {"question 2 turn 0": b'{"choices": []}'}
        elif case == "not-json":
            server.bodies = {"question 2 turn 0": b"<html>bad gateway</html>"}
        elif case == "tokenizer":  # ids of another vocabulary: ours decodes them to other text
            server.answers = {"question 2 turn 0": ([i + 7 for i in tiny_tokenizer.encode("ok x")], "stop", "ok x")}
        code, err = run_cli(
            capsys,
            "data",
            "regenerate",
            "--target",
            tiny_llama_dir,
            "--source",
            "json",
            "--path",
            chats,
            "--out",
            out,
            "--server",
            url,
            "--concurrency",
            "1",
            "--retries",
            "2",
            *extra,
        )
    assert_failed_late(code, err, match)  # after the data is read: a fault met at the first request
    if case in ("5xx", "malformed", "not-json", "tokenizer"):
        assert done_ids(out) == {"c0", "c1"}  # what came before the failure is kept


def test_a_sigkilled_run_resumes_with_nothing_lost_or_asked_twice(tmp_path, tiny_tokenizer, tiny_llama_dir):
    """kill -9 of `data regenerate --server` mid-run, then a rerun: every conversation once in the
    file, in input order; the rerun asks only for those the file lacked after the kill."""
    n = 24
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in conversations(n)))
    out = tmp_path / "regen.jsonl"
    argv = [
        sys.executable,
        "-m",
        "drafthead",
        "data",
        "regenerate",
        "--target",
        str(tiny_llama_dir),
        "--source",
        "json",
        "--path",
        str(chats),
        "--out",
        str(out),
        "--concurrency",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with StubServer(tiny_tokenizer, delay=0.1) as server:
        proc = subprocess.Popen(argv + ["--server", server.url], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while len(done_ids(out, repair=False)) < 4 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
        kept = done_ids(out)
        assert 4 <= len(kept) < n
        asked_before = len(server.asked)
        done = subprocess.run(argv + ["--server", server.url], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        again = server.asked[asked_before:]
    ids = [r["id"] for r in records(out)]
    assert ids == [f"c{i}" for i in range(n)]
    assert not {f"question {i[1:]} turn 0" for i in kept} & set(again)
    assert f"already_done={len(kept)}" in done.stdout


def test_first_parting_finds_the_first_difference():
    from drafthead.train.regenerate_compare import first_parting

    assert first_parting([1, 2, 3], [1, 2, 3]) is None
    assert first_parting([1, 2, 3], [1, 5, 3]) == 1
    assert first_parting([1, 2], [1, 2, 3]) == 2  # one stopped earlier


def test_a_parting_is_measured_by_our_targets_logit_gap(tiny_tokenizer):
    """compare_regenerations against its slow twin: the gap is the target's logit of our token
    minus that of theirs after the prompt and our answer up to the parting; a conversation is
    compared up to its first parting only."""
    import torch

    from drafthead.train.regenerate_compare import compare_regenerations
    from tests.tiny import tiny_causal_lm

    tok = tiny_tokenizer
    model = tiny_causal_lm("llama", vocab=len(tok), layers=2).eval()
    ours_ids, theirs_ids = [40, 41, 42, 43], [40, 41, 50, 43]

    def record(ids, second):
        return {
            "id": "a",
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "x", "token_ids": ids},
                {"role": "user", "content": "r"},
                {"role": "assistant", "content": "y", "token_ids": second},
            ],
        }

    same = {"id": "b", "messages": [{"role": "user", "content": "s"}, {"role": "assistant", "content": "z", "token_ids": [7]}]}
    result = compare_regenerations(model, tok, [record(ours_ids, [1]), same], [record(theirs_ids, [2]), same])
    assert result.answers == 2 and result.identical == 1 and len(result.partings) == 1
    parting = result.partings[0]
    assert (parting.id, parting.turn, parting.position, parting.ours, parting.theirs) == ("a", 0, 2, 42, 50)
    prompt = render_chat(tok, [{"role": "user", "content": "q"}], add_generation_prompt=True)
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(prompt, add_special_tokens=False) + [40, 41]])).logits[0, -1]
    assert parting.gap == pytest.approx(float(logits[42] - logits[50]), abs=1e-5)
