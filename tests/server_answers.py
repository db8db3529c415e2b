"""The check both real-server tests make (llama-server, vLLM): a server's greedy answers to MT-bench
prompts keep its token ids, count the prompts as our chat template does, and equal our engine's fp32
greedy answers token for token or part only at a near-tie of our target's logits: two fp32 engines
round apart, and where the two best tokens are closer than that the engines may pick apart
(train/regeneration/compare.py)."""

import json

from drafthead.inference.bench.prompts import load_prompts
from drafthead.train.regeneration.openai_client import ServerSettings
from drafthead.train.regeneration.regenerate import RegenerateSettings, regenerate
from drafthead.train.regeneration.compare import compare_regenerations
from drafthead.train.regeneration.from_servers import regenerate_from_servers

NEAR_TIE = 0.1  # logits; fp32 engines round apart by ~1e-3, a different model by whole units


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_server_answers_are_ours(loaded, url, tmp_path, prompts: int, concurrency: int) -> str:
    """-> the model name the server was asked for."""
    convs = [{"id": p.id, "messages": p.chat_messages()} for p in load_prompts("mt-bench", prompts)]
    settings = RegenerateSettings(max_new_tokens=48, batch_size=1, target_name="smollm2-135m")
    theirs_path, ours_path = tmp_path / "server.jsonl", tmp_path / "ours.jsonl"
    report, model = regenerate_from_servers(
        loaded.tokenizer, convs, theirs_path, settings, ServerSettings(urls=(url,), concurrency=concurrency), progress=False
    )
    assert report.written == len(convs) and report.answers_with_ids == len(convs) and report.answers_without_ids == 0
    assert report.prompt_tokens_differ == 0  # the server renders the prompts as our template does
    regenerate(loaded.model, loaded.tokenizer, convs, ours_path, settings, progress=False)
    comparison = compare_regenerations(loaded.model, loaded.tokenizer, read(ours_path), read(theirs_path))
    print(comparison.summary(), [p.to_dict() for p in comparison.partings])
    assert comparison.answers == len(convs)
    assert all(abs(p.gap) < NEAR_TIE for p in comparison.partings), comparison.partings
    assert comparison.identical >= len(convs) // 2
    return model
