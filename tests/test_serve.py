"""`drafthead serve` with real clients: the official `openai` package, curl, `data regenerate
--server`, and a bounded load; every fault of docs/serving.md "Errors" and what the client gets.

Each server is a `drafthead serve` process on a free port of 127.0.0.1 (inference/servers/local.py),
stopped after its tests, on a tiny target whose EOS rows are zeroed so that greedy answers run
their whole length (a random model otherwise often answers EOS at once).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from drafthead.inference.servers.local import free_port, healthy, local_server
from tests.served_target import answering_tiny_target

pytestmark = pytest.mark.subprocess

KEY = "test-key-123"
NEW = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return answering_tiny_target(tmp_path_factory.mktemp("served") / "tiny-served")


def serve(folder: Path, *extra, log: Path):
    return local_server(
        lambda port: [sys.executable, "-m", "drafthead", "serve", "--target", folder, "--port", port, *extra],
        "drafthead serve",
        log=log,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        ready_within=180,
    )


@pytest.fixture(scope="module")
def spec_url(folder, tmp_path_factory):
    """Prompt lookup drafting, 16 rows a batch."""
    with serve(folder, "--proposer", "prompt-lookup", "--max-batch", "16", log=tmp_path_factory.mktemp("logs") / "spec.log") as url:
        yield url


@pytest.fixture(scope="module")
def plain_url(folder, tmp_path_factory):
    """Plain decoding (the reference), an API key, one row a batch and one waiting."""
    with serve(
        folder, "--proposer", "none", "--api-key", KEY, "--max-batch", "1", "--max-queue", "1", log=tmp_path_factory.mktemp("logs") / "plain.log"
    ) as url:
        yield url


def user_texts(folder: Path, n: int) -> list[str]:
    chats = [json.loads(line) for line in (folder / "chats.jsonl").read_text().splitlines()]
    return [c["messages"][0]["content"] + f" ({i})" for i, c in enumerate(chats[:n])]


def client(url: str, key: str = "none"):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat_ids(oa, text: str, **kw):
    """(token ids, text, the reply) of a chat request."""
    kw = {"temperature": 0, **kw}
    r = oa.chat.completions.create(
        model="tiny-served", messages=[{"role": "user", "content": text}], max_tokens=NEW, extra_body={"return_token_ids": True}, **kw
    )
    return r.choices[0].model_extra["token_ids"], r.choices[0].message.content, r


def test_openai_client_answers_equal_plain_decoding_and_the_target_own(folder, spec_url, plain_url):
    """Chat, streamed chat and completions through the `openai` package, at temperature 0: the
    speculative server's answers equal the plain one's and transformers' greedy generate()."""
    from drafthead.inference.bench.prompts import encode_chat
    from drafthead.ground.target.load import load_target

    loaded = load_target(str(folder))
    spec, plain = client(spec_url), client(plain_url, KEY)
    texts = user_texts(folder, 4)
    same = 0
    for text in texts:
        ids, content, r = chat_ids(spec, text)
        ids_plain, content_plain, _ = chat_ids(plain, text)
        prompt = encode_chat(loaded.tokenizer, text)
        own = loaded.model.generate(prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt.shape[1] :].tolist()
        assert ids == ids_plain == own, text
        assert content == content_plain == loaded.tokenizer.decode(own, skip_special_tokens=True)
        figures = r.model_extra["drafthead"]
        assert r.usage.completion_tokens == NEW and r.model_extra["prompt_token_ids"] == prompt[0].tolist()
        assert figures["rounds"] >= 1 and figures["tau"] == pytest.approx(NEW / figures["rounds"], abs=1e-3)
        # streamed: the same text, chunk by chunk, and the usage chunk at the end
        stream = spec.chat.completions.create(
            model="tiny-served",
            messages=[{"role": "user", "content": text}],
            max_tokens=NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == content
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == NEW and not chunks[-1].choices
        # completions: the prompt as text, then as token ids
        done = spec.completions.create(model="tiny-served", prompt=text, max_tokens=NEW, temperature=0, extra_body={"return_token_ids": True})
        done_plain = plain.completions.create(model="tiny-served", prompt=text, max_tokens=NEW, temperature=0)
        assert done.choices[0].text == done_plain.choices[0].text
        by_ids = spec.completions.create(model="tiny-served", prompt=done.model_extra["prompt_token_ids"], max_tokens=NEW, temperature=0)
        assert by_ids.choices[0].text == done.choices[0].text
        same += 1
    assert same == len(texts)


def test_sixteen_in_flight_answer_as_alone(folder, spec_url):
    """64 requests, 16 in flight: each answered once, none lost or duplicated, every answer equal
    to the same request sent alone; the latency percentiles are printed."""
    oa = client(spec_url)
    texts = user_texts(folder, 64)
    # every other request samples, with a seed of its own: its draws follow its own rounds only
    sampling = [{} if i % 2 == 0 else {"temperature": 0.8, "seed": i} for i in range(len(texts))]
    alone = [chat_ids(oa, t, **kw)[0] for t, kw in zip(texts, sampling)]
    before = metric(spec_url, "drafthead_requests_total")

    def timed(i):
        start = time.perf_counter()
        ids, _, _ = chat_ids(oa, texts[i], **sampling[i])
        return ids, time.perf_counter() - start

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(timed, range(len(texts))))
    assert [ids for ids, _ in results] == alone
    assert metric(spec_url, "drafthead_requests_total") - before == len(texts)
    latencies = sorted(s for _, s in results)
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(f"64 requests, 16 in flight: p50 {p50:.3f} s, p99 {p99:.3f} s")
    assert metric(spec_url, "drafthead_batch_rows_count") > 0


def test_curl_chat_and_stream(spec_url):
    body = json.dumps({"model": "tiny-served", "messages": [{"role": "user", "content": "continue: red green"}], "max_tokens": 8, "temperature": 0})
    whole = subprocess.run(
        ["curl", "-sS", "--max-time", "60", f"{spec_url}/v1/chat/completions", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True,
        text=True,
        check=True,
    )
    answer = json.loads(whole.stdout)
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 8
    streamed = subprocess.run(
        [
            "curl",
            "-sSN",
            "--max-time",
            "60",
            f"{spec_url}/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            body[:-1] + ', "stream": true}',
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    events = [line[6:] for line in streamed.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == answer["choices"][0]["message"]["content"]


def post(url: str, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON reply, headers) of a POST; `body` bytes are sent as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


CHAT = {"model": "tiny-served", "messages": [{"role": "user", "content": "continue: one two"}], "max_tokens": 4}
FAULTS = [
    ("malformed JSON", b"{not json", 400, "invalid_json", None),
    ("messages missing", {"model": "tiny-served"}, 400, "missing_required_parameter", "messages"),
    ("temperature of the wrong type", {**CHAT, "temperature": "hot"}, 400, "invalid_value", "temperature"),
    ("messages of the wrong type", {**CHAT, "messages": "hello"}, 400, "invalid_value", "messages"),
    ("unknown model", {**CHAT, "model": "gpt-9"}, 404, "model_not_found", "model"),
    ("max_tokens < 1", {**CHAT, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("max_tokens past the context", {**CHAT, "max_tokens": 5000}, 400, "context_length_exceeded", "max_tokens"),
    (
        "a prompt longer than the context",
        {**CHAT, "messages": [{"role": "user", "content": "cat " * 2000}]},
        400,
        "context_length_exceeded",
        "messages",
    ),
    ("an unsupported parameter", {**CHAT, "logit_bias": {"5": 10}}, 400, "unsupported_parameter", "logit_bias"),
    ("an unknown parameter", {**CHAT, "guided_json": {}}, 400, "unsupported_parameter", "guided_json"),
    ("n > 1", {**CHAT, "n": 2}, 400, "unsupported_parameter", "n"),
]


@pytest.mark.parametrize("case", FAULTS, ids=[f[0] for f in FAULTS])
def test_bad_requests_get_one_openai_error_and_the_server_stays_up(spec_url, case):
    _, body, status, code, param = case
    got, reply, _ = post(spec_url, "/v1/chat/completions", body)
    assert got == status, reply
    error = reply["error"]
    assert error["code"] == code and error["param"] == param and error["message"] and error["type"]
    assert post(spec_url, "/v1/chat/completions", CHAT)[0] == 200  # nothing else affected


def test_api_key_queue_full_and_retry_after(plain_url):
    assert post(plain_url, "/v1/chat/completions", CHAT)[0] == 401
    status, reply, _ = post(plain_url, "/v1/chat/completions", CHAT, {"Authorization": "Bearer wrong"})
    assert status == 401 and reply["error"]["code"] == "invalid_api_key" and KEY not in json.dumps(reply)
    auth = {"Authorization": f"Bearer {KEY}"}
    # a refused request leaves its kept-alive connection ready for the next one
    host, port = plain_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    for headers, status in (({}, 401), (auth, 200)):
        connection.request("POST", "/v1/chat/completions", json.dumps(CHAT), {"Content-Type": "application/json", **headers})
        response = connection.getresponse()
        response.read()
        assert response.status == status
    connection.close()
    # one long answer decoding, one waiting: a third is refused with 429 and Retry-After
    long = {**CHAT, "max_tokens": 900, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(post, plain_url, "/v1/chat/completions", long, auth)]
        wait_for(lambda: metric(plain_url, "drafthead_batch_size") == 1)
        running.append(pool.submit(post, plain_url, "/v1/chat/completions", long, auth))
        wait_for(lambda: metric(plain_url, "drafthead_queue_length") == 1)
        status, reply, headers = post(plain_url, "/v1/chat/completions", CHAT, auth)
        assert status == 429 and reply["error"]["code"] == "queue_full" and headers.get("Retry-After") == "1"
        assert [f.result()[0] for f in running] == [200, 200]
    assert post(plain_url, "/v1/chat/completions", CHAT, auth)[0] == 200


def wait_for(condition, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_disconnects_mid_answer_leaves_the_batch(spec_url, stream):
    before = metric(spec_url, "drafthead_requests_cancelled_total")
    host, port = spec_url.removeprefix("http://").split(":")
    body = json.dumps({**CHAT, "max_tokens": 900, "ignore_eos": True, "stream": stream}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        if stream:
            got = b""
            while got.count(b"data: ") < 3:
                got += s.recv(4096)
        else:
            wait_for(lambda: metric(spec_url, "drafthead_batch_size") == 1)
    wait_for(lambda: metric(spec_url, "drafthead_requests_cancelled_total") == before + 1)
    assert metric(spec_url, "drafthead_batch_size") == 0
    assert post(spec_url, "/v1/chat/completions", CHAT)[0] == 200


def test_sigterm_finishes_the_answers_in_flight_and_exits_zero(folder, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "drafthead", "serve", "--target", str(folder), "--port", str(port), "--proposer", "prompt-lookup"],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(url), within=180)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, url, "/v1/chat/completions", {**CHAT, "max_tokens": 200, "ignore_eos": True})
            wait_for(lambda: metric(url, "drafthead_batch_size") == 1)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status, reply, _ = answer.result()
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert time.monotonic() - start < 30
        assert status == 200 and reply["usage"]["completion_tokens"] == 200  # finished, not cut
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url + "/health", timeout=5)
    finally:
        proc.kill()


def test_data_regenerate_through_drafthead_serve_keeps_ids_and_equals_local(folder, spec_url, tmp_path, capsys):
    """Our own client against our own server: the ids kept, the answers equal to `data regenerate`
    with the local engine."""
    from tests.cli_checks import run_cli

    common = ["data", "regenerate", "--target", folder, "--source", "json", "--path", folder / "chats.jsonl", "--limit", "6", "--max-new-tokens", NEW]
    code, err = run_cli(capsys, *common, "--out", tmp_path / "served.jsonl", "--server", spec_url)
    assert code == 0, err
    code, err = run_cli(capsys, *common, "--out", tmp_path / "local.jsonl")
    assert code == 0, err
    served = [json.loads(line) for line in (tmp_path / "served.jsonl").read_text().splitlines()]
    local = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    assert len(served) == len(local) == 6
    assert [r["messages"] for r in served] == [r["messages"] for r in local]
    assert [answer_ids(r) for r in served] == [answer_ids(r) for r in local]
    assert all(answer_ids(r) for r in served)


def answer_ids(record: dict) -> list:
    return [m.get("token_ids") for m in record["messages"] if m["role"] == "assistant"]
