"""`data regenerate --server` against a real server: llama.cpp's llama-server (built by `make
llamacpp`) on SmolLM2-135M as an f32 GGUF made by llama.cpp's converter, started on 127.0.0.1 for
this module and stopped after it.

At temperature 0 each answer keeps the ids llama-server produced, every prompt is counted as our
chat template and tokenizer count it (the same template), and the answers equal our own engine's
fp32 greedy answers token for token, or part only at a near-tie of our target's logits: llama.cpp
and torch round fp32 differently, and where the two best tokens are closer than that rounding the
engines may pick apart (train/regeneration/compare.py). Marked `llamacpp` (`make test-llamacpp`).
"""

import pytest

from tests.server_answers import assert_server_answers_are_ours

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from drafthead.ground.target.load import load_target
    from drafthead.inference.llamacpp.convert import target_gguf
    from drafthead.inference.llamacpp.tools import llama_server

    loaded = load_target("smollm2-135m", dtype="float32", threads=2)
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with llama_server(target_gguf(loaded.path, "f32"), threads=2, context=4096, slots=2, log=log) as url:
        yield loaded, url


def test_llama_server_answers_keep_its_ids_and_equal_our_greedy_answers(served, tmp_path):
    loaded, url = served
    assert_server_answers_are_ours(loaded, url, tmp_path, prompts=6, concurrency=2)
