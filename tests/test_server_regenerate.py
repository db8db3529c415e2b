"""`data regenerate --server`: the OpenAI-compatible client (train/regeneration/openai_client.py) and the
regeneration through it (train/regeneration/from_servers.py), against a small chat-completions server
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

from drafthead.ground.target.chat import render_chat
from drafthead.train.data.chat_format import format_conversation
from drafthead.train.regeneration.openai_client import ServerError, ServerSettings, root_url
from drafthead.train.regeneration.regenerate import RegenerateSettings, done_ids
from drafthead.train.regeneration.from_servers import regenerate_from_servers
from drafthead.train.data.sources import load_conversations
from tests.cli_checks import assert_failed_late, assert_refused, run_cli

MODEL = "tiny-served"


class StubServer:
    """A chat-completions server answering `ok <last user text>`, its ids followed by the stop
    token. ids: "vllm" (choices[0].token_ids), "llama" (logprobs.content[i].id) or None (text only).
    `answers` maps a user text to (ids without the stop token, finish_reason[, text sent instead of
    the ids decoded]) for special answers;
    `statuses` is a list of HTTP statuses to send, one per request, before answering normally;
    `bodies` maps a user text to a raw body sent instead of the answer; `fail_user` a user text to
    an HTTP status (or a status and the error message) always sent for it; `breaks` is a list of
    broken replies ("short": cut before its Content-Length, "chunked": a bad chunk size) to send,
    one per chat request, before answering normally, and `broken_user` maps a user text to one
    always sent for it."""

    def __init__(self, tokenizer, ids: str | None = "vllm", delay: float = 0.0, model: str = MODEL):
        self.tok, self.ids, self.delay, self.model = tokenizer, ids, delay, model
        self.answers: dict[str, tuple[list[int], str]] = {}
        self.statuses: list[int] = []
        self.bodies: dict[str, bytes] = {}
        self.fail_user: dict[str, int | tuple[int, str]] = {}  # user text -> HTTP status (and message) always sent for it
        self.breaks: list[str] = []
        self.broken_user: dict[str, str] = {}
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

            def _send_broken(self, how: str):
                """A reply that stops short of its Content-Length, or whose chunk size is no number."""
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if how == "short":
                    self.send_header("Content-Length", "4096")
                    self.end_headers()
                    self.wfile.write(b'{"object": "chat.completion", "choices": [')
                else:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(b"zz\r\n{}\r\n")
                self.wfile.flush()
                self.close_connection = True

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.in_flight += 1
                    stub.most_in_flight = max(stub.most_in_flight, stub.in_flight)
                    status = stub.statuses.pop(0) if stub.statuses else None
                    broken = stub.breaks.pop(0) if stub.breaks else stub.broken_user.get(body["messages"][-1]["content"])
                try:
                    status, reply = stub.respond(body, status)
                finally:  # before the reply goes out: the client may ask again as soon as it has it
                    with stub.lock:
                        stub.in_flight -= 1
                if broken:
                    self._send_broken(broken)
                else:
                    self._send(status, reply)

        return Handler

    def respond(self, body: dict, status: int | None) -> tuple[int, bytes]:
        time.sleep(self.delay)
        user = body["messages"][-1]["content"]
        failure, message = self.fail_user.get(user), None
        if status is None and failure is not None:
            status, message = failure if isinstance(failure, tuple) else (failure, None)
        if status is not None:
            return status, json.dumps({"error": {"message": message or f"stub says {status}"}}).encode()
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
    file, in input order; the rerun asks only for those the file lacked after the kill. The ids
    are integers in the data file, and the file is left as the kill left it, its last line torn
    (the rerun, not this test, must cut it)."""
    n = 24
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({**c, "id": i}) + "\n" for i, c in enumerate(conversations(n))))
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
        kept = done_ids(out, repair=False)
        assert 4 <= len(kept) < n
        if out.read_bytes().endswith(b"\n"):  # killed between two records: tear the last line as a kill inside one does
            with out.open("ab") as f:
                f.write(b'{"id": "' + str(n - 1).encode() + b'", "messages": [{"role": "us')
        asked_before = len(server.asked)
        done = subprocess.run(argv + ["--server", server.url], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        again = server.asked[asked_before:]
    ids = [r["id"] for r in records(out)]
    assert ids == [str(i) for i in range(n)]
    assert not {f"question {i} turn 0" for i in kept} & set(again)
    assert f"already_done={len(kept)}" in done.stdout


def test_first_parting_finds_the_first_difference():
    from drafthead.train.regeneration.compare import first_parting

    assert first_parting([1, 2, 3], [1, 2, 3]) is None
    assert first_parting([1, 2, 3], [1, 5, 3]) == 1
    assert first_parting([1, 2], [1, 2, 3]) == 2  # one stopped earlier


def test_a_parting_is_measured_by_our_targets_logit_gap(tiny_tokenizer):
    """compare_regenerations against its slow twin: the gap is the target's logit of our token
    minus that of theirs after the prompt and our answer up to the parting; a conversation is
    compared up to its first parting only."""
    import torch

    from drafthead.train.regeneration.compare import compare_regenerations
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


# ---------------------------------------------------------------------------------------------- faults and bad settings (issue 54)


def write_chats(path: Path, convs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return path


def regenerate_argv(target, chats, out, *extra) -> list:
    return ["data", "regenerate", "--target", target, "--source", "json", "--path", chats, "--out", out, *extra]


@pytest.mark.parametrize("how", ["short", "chunked"])
def test_a_broken_reply_is_one_line_and_the_answers_beside_it_are_kept(tmp_path, capsys, tiny_tokenizer, tiny_llama_dir, how):
    """A reply cut before its end, or badly chunked (http.client.IncompleteRead), on every try:
    one line naming it after the retries, exit 2; the other conversations, in flight together
    with it, are in the file. Cut once, it is asked again and the run completes."""
    chats = write_chats(tmp_path / "chats.jsonl", conversations(4))
    out = tmp_path / "regen.jsonl"
    with StubServer(tiny_tokenizer, delay=0.2) as server:
        server.broken_user = {"question 2 turn 0": how}
        code, err = run_cli(capsys, *regenerate_argv(tiny_llama_dir, chats, out, "--server", server.url, "--concurrency", "4", "--retries", "1"))
        assert_failed_late(code, err, f"{server.url}/v1/chat/completions: a broken reply (IncompleteRead", "(after 2 tries)")
        assert done_ids(out) == {"c0", "c1", "c3"}
        server.broken_user, server.breaks = {}, [how]
        code, err = run_cli(capsys, *regenerate_argv(tiny_llama_dir, chats, tmp_path / "again.jsonl", "--server", server.url, "--retries", "1"))
    assert code == 0, err
    assert [r["id"] for r in records(tmp_path / "again.jsonl")] == ["c0", "c1", "c2", "c3"]


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--server", "localhost:abc"], ["--server 'localhost:abc'", "Port could not be cast to integer value as 'abc'"]),
        (["--server", "ftp://127.0.0.1:21"], ["--server 'ftp://127.0.0.1:21'", "ftp:// is not http:// or https://"]),
        (["--server", "SERVER", "SERVER/v1/"], ["names SERVER twice"]),
        (["--server", "SERVER", "--request-timeout", "0"], ["--request-timeout must be a number of seconds > 0, got 0.0"]),
        (["--server", "SERVER", "--request-timeout", "-1"], ["--request-timeout must be a number of seconds > 0, got -1.0"]),
        (["--server", "SERVER", "--request-timeout", "nan"], ["--request-timeout must be a number of seconds > 0, got nan"]),
        (["--server", "SERVER", "--temperature", "-1"], ["temperature must be a number >= 0, got -1.0"]),
        (["--server", "SERVER", "--temperature", "nan"], ["temperature must be a number >= 0, got nan"]),
        (["--server", "SERVER", "--top-p", "7"], ["top_p must be in (0, 1], got 7.0"]),
        (["--temperature", "nan"], ["temperature must be a number >= 0, got nan"]),
        (["--top-p", "nan"], ["top_p must be in (0, 1], got nan"]),
        (["--server", "SERVER", "--batch-size", "4"], ["--batch-size sets how our engine answers", "drop --batch-size"]),
        (["--server", "SERVER", "--sizing", "fixed"], ["--sizing sets how our engine answers"]),
        (["--concurrency", "4"], ["--concurrency is a setting of --server"]),
        (["--server", "SERVER", "--api-key", "sk-SECRET-42\n"], ["--api-key", "no HTTP header carries"]),
    ],
    ids=[
        "port-abc",
        "ftp-url",
        "url-twice",
        "timeout-0",
        "timeout-neg",
        "timeout-nan",
        "temperature-neg",
        "temperature-nan",
        "top-p-7",
        "local-temperature-nan",
        "local-top-p-nan",
        "batch-size-with-server",
        "sizing-with-server",
        "concurrency-without-server",
        "api-key-newline",
    ],
)
def test_server_and_sampling_settings_are_checked_at_the_start(tmp_path, capsys, tiny_tokenizer, tiny_llama_dir, extra, fragments):
    """Refused before the data is read or a server asked: one line naming the flag (an ftp:// URL
    at once, not after the retries; a secret key never in the line)."""
    chats = write_chats(tmp_path / "chats.jsonl", conversations(2))
    out = tmp_path / "regen.jsonl"
    with StubServer(tiny_tokenizer) as server:
        extra = [server.url if a == "SERVER" else a.replace("SERVER", server.url) for a in extra]
        fragments = [f.replace("SERVER", server.url) for f in fragments]
        start = time.monotonic()
        line = assert_refused(*run_cli(capsys, *regenerate_argv(tiny_llama_dir, chats, out, *extra)), *fragments)
        assert time.monotonic() - start < 10 and server.asked == []
    assert "SECRET" not in line and not out.exists()


def test_an_api_key_the_server_quotes_is_not_echoed(tmp_path, capsys, tiny_tokenizer, tiny_llama_dir, monkeypatch):
    chats = write_chats(tmp_path / "chats.jsonl", conversations(2))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-SECRET-42")
    with StubServer(tiny_tokenizer) as server:
        server.fail_user = {"question 0 turn 0": (401, "Incorrect API key provided: sk-SECRET-42")}
        # the key from $OPENAI_API_KEY: the parser reads it when it is built
        code, err = run_cli(capsys, *regenerate_argv(tiny_llama_dir, chats, tmp_path / "regen.jsonl", "--server", server.url, "--concurrency", "1"))
    line = assert_failed_late(code, err, "HTTP 401: Incorrect API key provided: <api key>")
    assert "SECRET" not in err and line


def test_the_servers_context_limit_is_named(tmp_path, capsys, tiny_tokenizer, tiny_llama_dir):
    """A server refusing a prompt as longer than its context: the line says so and gives the way
    out; the answers before it are kept."""
    chats = write_chats(tmp_path / "chats.jsonl", conversations(3))
    out = tmp_path / "regen.jsonl"
    with StubServer(tiny_tokenizer) as server:
        server.fail_user = {"question 1 turn 0": (400, "This model's maximum context length is 64 tokens. However, you requested 80 tokens")}
        code, err = run_cli(
            capsys, *regenerate_argv(tiny_llama_dir, chats, out, "--server", server.url, "--concurrency", "1", "--max-new-tokens", "16")
        )
    assert_failed_late(
        code,
        err,
        "maximum context length is 64 tokens",
        "conversation 'c1', turn 1",
        "--max-new-tokens 16 are more than the server's context",
        "--max-prompt-tokens",
    )
    assert done_ids(out) == {"c0"}


def test_a_rerun_with_integer_ids_asks_only_for_the_rest(tmp_path, tiny_tokenizer):
    """Conversations whose ids are integers (as a Python caller may pass them): a rerun over more
    of them asks the server only for those the file lacks; the file holds each once, as text ids."""
    convs = [{**c, "id": i} for i, c in enumerate(conversations(6))]
    out = tmp_path / "regen.jsonl"
    with StubServer(tiny_tokenizer) as server:
        regenerate_from_servers(tiny_tokenizer, convs[:3], out, SETTINGS, fast(server.url), progress=False)
        asked = len(server.asked)
        report, _ = regenerate_from_servers(tiny_tokenizer, convs, out, SETTINGS, fast(server.url), progress=False)
        again = server.asked[asked:]
    assert report.already_done == 3 and report.written == 3
    assert sorted(again) == [f"question {i} turn 0" for i in (3, 4, 5)]
    assert [r["id"] for r in records(out)] == [str(i) for i in range(6)]


def test_a_torn_last_line_is_cut_by_the_rerun(tmp_path, capsys, tiny_tokenizer, tiny_llama_dir):
    """An output whose last line a kill cut in half: the rerun cuts it and asks again for that
    conversation; nothing else is lost or asked twice. A broken line before the last is a hand
    edit: refused, naming the line, the file kept as it is."""
    chats = write_chats(tmp_path / "chats.jsonl", conversations(4))
    out = tmp_path / "regen.jsonl"
    argv = regenerate_argv(tiny_llama_dir, chats, out, "--concurrency", "1")
    with StubServer(tiny_tokenizer) as server:
        assert run_cli(capsys, *argv, "--server", server.url)[0] == 0
        whole = out.read_bytes()
        lines = whole.splitlines(keepends=True)
        out.write_bytes(b"".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # c2 torn, c3 never written
        asked = len(server.asked)
        code, err = run_cli(capsys, *argv, "--server", server.url)
        assert code == 0, err
        assert sorted(server.asked[asked:]) == ["question 2 turn 0", "question 3 turn 0"]
        assert out.read_bytes() == whole
        out.write_bytes(lines[0] + b'{"id": "c1", "messages": [\n' + b"".join(lines[2:]))
        with_a_bad_line = out.read_bytes()
        code, err = run_cli(capsys, *argv, "--server", server.url)
    assert_failed_late(code, err, f"{out}: line 2 is not a record with an id", "mend or delete that line")
    assert out.read_bytes() == with_a_bad_line and len(server.asked) == asked + 2  # refused before asking


def test_a_rerun_over_answers_made_otherwise_is_refused(tmp_path, capsys, tiny_tokenizer, tiny_llama_dir, monkeypatch):
    """A rerun continues only a file written the same way: other sampling settings, the local
    engine over a server's answers (and the other way round), another data file whose ids
    overlap: one line listing what differs, the file unchanged. The same settings continue it."""
    import drafthead.train.regeneration.regenerate as regenerate

    chats = write_chats(tmp_path / "chats.jsonl", conversations(4))
    other = tmp_path / "other.jsonl"  # the same ids, other questions
    other.write_text(chats.read_text().replace("question", "query"))
    served, local = tmp_path / "served.jsonl", tmp_path / "local.jsonl"
    monkeypatch.setattr(regenerate, "answer", lambda model, tokenizer, prompts, **kw: [regenerate.Answer("fine", True)] * len(prompts))
    assert run_cli(capsys, *regenerate_argv(tiny_llama_dir, chats, local, "--max-new-tokens", "16"))[0] == 0
    with StubServer(tiny_tokenizer) as server:
        first = regenerate_argv(tiny_llama_dir, chats, served, "--server", server.url, "--max-new-tokens", "16")
        assert run_cli(capsys, *first, "--limit", "2")[0] == 0
        kept = served.read_bytes()
        cases = [
            ([*first, "--temperature", "0.5"], ["temperature: 0.0 -> 0.5"]),
            (regenerate_argv(tiny_llama_dir, chats, served, "--max-new-tokens", "16"), ["engine: 'server tiny-served' -> 'local'"]),
            (regenerate_argv(tiny_llama_dir, other, served, "--server", server.url, "--max-new-tokens", "16"), ["data_sha256: "]),
            (
                regenerate_argv(tiny_llama_dir, chats, local, "--server", server.url, "--max-new-tokens", "16"),
                ["engine: 'local' -> 'server tiny-served'"],
            ),
        ]
        for argv, fragments in cases:
            code, err = run_cli(capsys, *argv)
            assert_failed_late(code, err, "holds answers made otherwise (", *fragments, "--overwrite")
        assert served.read_bytes() == kept and len(server.asked) == 2
        assert run_cli(capsys, *first)[0] == 0  # the same settings: continued
    assert [r["id"] for r in records(served)] == ["c0", "c1", "c2", "c3"] and len(server.asked) == 4
