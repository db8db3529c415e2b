"""`data regenerate --server` against a real vLLM server: vLLM's CPU build (its own venv) serving
SmolLM2-135M in fp32 on 127.0.0.1 for this module, stopped after it (inference/vllm/server.py).

At temperature 0 each answer keeps the ids vLLM produced (`return_token_ids`), every prompt is
counted as our chat template and tokenizer count it, and the answers equal our own engine's fp32
greedy answers token for token, or part only at a near-tie of our target's logits
(train/regeneration/compare.py). A second server makes two-way data parallelism, and a rerun after
the output was cut answers only what is missing. Marked `vllm` (`make test-vllm`, `make servers`).
"""

import json

import pytest

from drafthead.inference.bench.prompts import load_prompts
from drafthead.train.regeneration.openai_client import ServerSettings
from drafthead.train.regeneration.regenerate import RegenerateSettings
from drafthead.train.regeneration.from_servers import regenerate_from_servers
from tests.server_answers import assert_server_answers_are_ours, read

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from drafthead.ground.target.load import load_target
    from drafthead.inference.vllm.server import vllm_server

    loaded = load_target("smollm2-135m", dtype="float32", threads=2)
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    with vllm_server(loaded.path, name="smollm2-135m", max_num_seqs=4, log=log) as url:
        yield loaded, url


def test_vllm_server_answers_keep_its_ids_and_equal_our_greedy_answers(served, tmp_path):
    loaded, url = served
    assert assert_server_answers_are_ours(loaded, url, tmp_path, prompts=8, concurrency=4) == "smollm2-135m"


def test_two_urls_share_the_work_and_a_cut_output_resumes(served, tmp_path):
    loaded, url = served
    convs = [{"id": p.id, "messages": p.chat_messages()} for p in load_prompts("mt-bench", 6)]
    settings = RegenerateSettings(max_new_tokens=16, batch_size=1, target_name="smollm2-135m")
    path = tmp_path / "server.jsonl"
    servers = ServerSettings(urls=(url, url.replace("127.0.0.1", "localhost")), concurrency=2)
    report, _ = regenerate_from_servers(loaded.tokenizer, convs, path, settings, servers, progress=False)
    assert report.written == len(convs)
    whole = read(path)
    # a run killed after 3 answers: the file holds those lines (each line is written whole)
    path.write_text("".join(json.dumps(r) + "\n" for r in whole[:3]))
    again, _ = regenerate_from_servers(loaded.tokenizer, convs, path, settings, servers, progress=False)
    assert (again.already_done, again.written) == (3, len(convs) - 3)
    resumed = read(path)
    assert sorted(r["id"] for r in resumed) == sorted(str(c["id"]) for c in convs)
    assert {r["id"]: r for r in resumed} == {r["id"]: r for r in whole}  # greedy: the same answers again
