"""`data regenerate --server` against a real server: llama.cpp's llama-server (built by `make
llamacpp`) on SmolLM2-135M as an f32 GGUF made by llama.cpp's converter, started on 127.0.0.1 for
this module and stopped after it.

At temperature 0 each answer keeps the ids llama-server produced, every prompt is counted as our
chat template and tokenizer count it (the same template), and the answers equal our own engine's
fp32 greedy answers token for token, or part only at a near-tie of our target's logits: llama.cpp
and torch round fp32 differently, and where the two best tokens are closer than that rounding the
engines may pick apart (train/regenerate_compare.py). Marked `llamacpp` (`make test-llamacpp`).
"""
import json

import pytest

from drafthead.inference.bench.prompts import load_prompts
from drafthead.train.openai_server import ServerSettings
from drafthead.train.regenerate import RegenerateSettings, regenerate
from drafthead.train.regenerate_compare import compare_regenerations
from drafthead.train.regenerate_server import regenerate_from_servers

pytestmark = pytest.mark.llamacpp

NEAR_TIE = 0.1  # logits; fp32 engines round apart by ~1e-3, a different model by whole units


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from drafthead.inference.engine.targets import load_target
    from drafthead.inference.llamacpp.convert import target_gguf
    from drafthead.inference.llamacpp.tools import llama_server

    loaded = load_target("smollm2-135m", dtype="float32", threads=2)
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with llama_server(target_gguf(loaded.path, "f32"), threads=2, context=4096, slots=2, log=log) as url:
        yield loaded, url


def test_llama_server_answers_keep_its_ids_and_equal_our_greedy_answers(served, tmp_path):
    loaded, url = served
    convs = [{"id": p.id, "messages": p.chat_messages()} for p in load_prompts("mt-bench", 6)]
    settings = RegenerateSettings(max_new_tokens=48, batch_size=1, target_name="smollm2-135m")
    theirs_path, ours_path = tmp_path / "server.jsonl", tmp_path / "ours.jsonl"
    report, model = regenerate_from_servers(loaded.tokenizer, convs, theirs_path, settings,
                                            ServerSettings(urls=(url,), concurrency=2), progress=False)
    assert report.written == len(convs) and report.answers_with_ids == len(convs) and report.answers_without_ids == 0
    assert report.prompt_tokens_differ == 0  # llama-server renders the prompts as our template does
    regenerate(loaded.model, loaded.tokenizer, convs, ours_path, settings, progress=False)
    read = lambda path: [json.loads(line) for line in path.read_text().splitlines()]  # noqa: E731
    comparison = compare_regenerations(loaded.model, loaded.tokenizer, read(ours_path), read(theirs_path))
    print(comparison.summary(), [p.to_dict() for p in comparison.partings])
    assert comparison.answers == len(convs)
    assert all(abs(p.gap) < NEAR_TIE for p in comparison.partings), comparison.partings
    assert comparison.identical >= len(convs) // 2
