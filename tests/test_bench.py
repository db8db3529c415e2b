"""The benchmark harness: pure metrics against hand-made cases and slow twins, then a real run on
a tiny random target with prompt lookup (fp32 greedy: speculative output == plain output)."""

from __future__ import annotations

import json

import pytest

from drafthead.draft_spec import DraftSpec
from drafthead.inference.bench.run import (
    BenchSettings,
    divergence_detail,
    first_difference,
    is_near_tie,
    repeated_ngrams,
    repetition_fraction,
    run_bench,
    speed_ceiling,
)
from drafthead.inference.engine.rounds import CONTEXT_BUCKETS, acceptance_histogram, per_position_acceptance, tau_by_context, tau_of
from drafthead.inference.bench.prompts import Prompt
from drafthead.inference.bench.report import format_table, plot_report, render_markdown
from drafthead.inference.engine.sampling import SamplingConfig
from drafthead.ground.target.identity import eos_token_ids
from drafthead.ground.target.load import load_target

# -- pure metrics ------------------------------------------------------------------------------


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one is a prefix of the other
    assert first_difference([], []) is None
    assert first_difference([], [4]) == 0


def slow_repeated(tokens, n):
    seen, repeated, total = [], 0, 0
    for i in range(len(tokens) - n + 1):
        gram = list(tokens[i : i + n])
        total += 1
        if gram in seen:
            repeated += 1
        else:
            seen.append(gram)
    return repeated, total


@pytest.mark.parametrize("tokens", [[], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], [7] * 9, list(range(20)) + list(range(10))])
def test_repeated_ngrams_matches_slow_twin(tokens):
    assert repeated_ngrams(tokens, 4) == slow_repeated(tokens, 4)


def test_repetition_fraction_by_hand():
    # 1 2 3 4 1 2 3 4: 4-grams 1234 2341 3412 4123 1234 -> 1 repeated of 5
    assert repetition_fraction([[1, 2, 3, 4, 1, 2, 3, 4]]) == pytest.approx(1 / 5)
    # n-grams never span two outputs: [1,2,3,4] twice -> 1 repeated of 2
    assert repetition_fraction([[1, 2, 3, 4], [1, 2, 3, 4]]) == pytest.approx(0.0)
    assert repetition_fraction([[1, 2]]) == 0.0


def test_acceptance_metrics_by_hand():
    lengths = [1, 3, 2, 1, 4]  # draft tokens accepted per round: 0, 2, 1, 0, 3
    assert tau_of(lengths) == pytest.approx(11 / 5)
    assert per_position_acceptance(lengths) == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert per_position_acceptance(lengths, depth=4)[-1] == 0.0
    assert acceptance_histogram(lengths) == {"1": 2, "2": 1, "3": 1, "4": 1}
    assert per_position_acceptance([]) == [] and tau_of([]) == 0.0


def test_speed_ceiling_by_hand():
    # plain: 100 tokens in 5 s -> 50 ms a step; 40 rounds, 3.6 s verifying (90 ms = 1.8 steps),
    # 4.8 s in all (120 ms = 2.4 steps); tau 3.6
    totals = {"rounds": 40, "plain_new_tokens": 100, "plain_seconds": 5.0, "seconds": 4.8}
    c = speed_ceiling(3.6, totals, {"verify": 3.6, "draft": 1.0})
    assert c["plain_step_seconds"] == pytest.approx(0.05)
    assert c["verify_in_plain_steps"] == pytest.approx(1.8) and c["round_in_plain_steps"] == pytest.approx(2.4)
    assert c["verify_only_ceiling"] == pytest.approx(2.0) and c["round_cost_speedup"] == pytest.approx(1.5)
    assert speed_ceiling(3.6, dict(totals, rounds=0), {"verify": 3.6}) is None
    assert speed_ceiling(3.6, totals, {}) is None


def test_settings_reject_unknown_keys_and_bad_values():
    with pytest.raises(TypeError):
        BenchSettings(max_new_token=5)  # a typo is an error, not ignored
    with pytest.raises(ValueError):
        BenchSettings(max_new_tokens=0)


# -- a real run on a tiny target ---------------------------------------------------------------

PROMPTS = [
    Prompt("hello world, hello there, hello world", "greeting", "p1"),
    Prompt("one two three four five six seven", "counting", "p2"),
    Prompt("the quick brown fox jumps over the lazy dog", "counting", "p3"),
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_target(tiny_llama_dir)


@pytest.fixture(scope="module")
def greedy_report(tiny):
    factory = DraftSpec(proposer="prompt-lookup").build(tiny, note=lambda line: None).factory
    settings = BenchSettings(
        max_new_tokens=48,
        eos_token_ids=eos_token_ids(tiny.model, tiny.tokenizer),
        compare_hf_prompt_lookup=True,
        progress=False,
        keep_text=True,
        info={"target": tiny.name, "proposer": "prompt-lookup"},
    )
    return run_bench(tiny.model, tiny.tokenizer, factory, PROMPTS, settings)


def test_report_has_every_key(greedy_report):
    for key in [
        "tau",
        "tokens_per_s",
        "baseline_tokens_per_s",
        "speedup",
        "identical_fraction",
        "num_prompts",
        "per_position_acceptance",
        "acceptance_length_histogram",
        "peak_rss_mb",
        "repetition",
        "per_category_tau",
        "profile",
        "hf_prompt_lookup_tokens_per_s",
        "settings",
        "prompts",
        "ceiling",
        "divergences",
    ]:
        assert key in greedy_report, key
    assert set(greedy_report["peak_rss_mb"]) == {"plain", "speculative", "ratio"}
    settings = greedy_report["settings"]
    for key in ["target", "proposer", "max_new_tokens", "torch", "transformers", "model_dtype", "torch_threads"]:
        assert key in settings, key
    record = greedy_report["prompts"][0]
    for key in ["id", "category", "tau", "tokens_per_s", "plain_tokens_per_s", "identical", "first_difference"]:
        assert key in record, key
    json.dumps(greedy_report)  # JSON-ready


def test_fp32_greedy_outputs_are_identical(greedy_report):
    assert greedy_report["identical_fraction"] == 1.0
    assert greedy_report["divergences"]["count"] == 0 and greedy_report["divergences"]["example"] is None
    assert greedy_report["hf_prompt_lookup_identical_fraction"] == 1.0
    for record in greedy_report["prompts"]:
        assert record["identical"] and record["first_difference"] is None
        assert record["output"] == record["plain_output"]
        assert record["new_tokens"] == record["plain_new_tokens"] > 0


def test_divergence_detail_reads_the_targets_logits_there(tiny):
    import torch

    ids = tiny.tokenizer("hello there", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = tiny.model(ids).logits[0, -1].float()
    order = torch.argsort(logits, descending=True).tolist()
    # plain took the argmax, "speculative" the runner-up, at position 0
    d = divergence_detail(tiny.model, tiny.tokenizer, ids, [order[0], 5], [order[1], 5], 0)
    assert d["speculative_rank"] == 1 and d["position"] == 0
    assert d["gap"] == pytest.approx(float(logits[order[0]] - logits[order[1]]), abs=1e-4)
    assert is_near_tie(d) == (d["gap"] <= 0.5)
    d = divergence_detail(tiny.model, tiny.tokenizer, ids, [order[0]], [order[0], 7], 1)
    assert d["reason"] == "length" and not is_near_tie(d)
    assert is_near_tie({"speculative_rank": 2, "gap": 0.125}) and is_near_tie({"gap": -0.25})
    assert not is_near_tie({"speculative_rank": 1, "gap": 0.75})


def test_aggregates_agree_with_the_records(greedy_report):
    r = greedy_report
    records = r["prompts"]
    lengths = [a for rec in records for a in rec["accepted_lengths"]]
    assert r["num_prompts"] == len(PROMPTS) == len(records)
    # every emitted token belongs to a round: tau = tokens / rounds
    assert sum(lengths) == r["totals"]["new_tokens"] == sum(rec["new_tokens"] for rec in records)
    assert r["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert r["tau"] >= 1.0
    assert sum(r["acceptance_length_histogram"].values()) == len(lengths)
    ppa = r["per_position_acceptance"]
    assert all(a >= b for a, b in zip(ppa, ppa[1:]))  # deeper positions are accepted no more often
    assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["baseline_tokens_per_s"])
    assert set(r["per_category_tau"]) == {"greeting", "counting"}
    assert r["profile"]["fractions"] and sum(r["profile"]["fractions"].values()) == pytest.approx(1.0)
    assert 0.0 <= r["repetition"]["plain"] <= 1.0 and r["repetition"]["plain"] == r["repetition"]["speculative"]


def test_shared_text_timing(greedy_report):
    """Each side's seconds to its last token shared with the other (all of them here: fp32 output
    is identical) are within its wall time, and the shared speedup sums them."""
    for r in greedy_report["prompts"]:
        assert r["shared_tokens"] == r["new_tokens"] == r["plain_new_tokens"]
        assert 0 < r["seconds_shared"] <= r["seconds"] and 0 < r["plain_seconds_shared"] <= r["plain_seconds"]
    expected = sum(r["plain_seconds_shared"] for r in greedy_report["prompts"]) / sum(r["seconds_shared"] for r in greedy_report["prompts"])
    assert greedy_report["shared_speedup"] == pytest.approx(expected)


def test_token_clock_and_the_difference_warning_by_hand(greedy_report):
    import copy

    import torch

    from drafthead.inference.bench.run import TokenClock

    clock = TokenClock()
    clock.start = 10.0
    clock.put(torch.zeros(1, 7))  # the prompt
    clock.arrivals = [(1, 10.5), (4, 11.0), (5, 12.0)]  # rounds of 1, 3 and 1 tokens
    assert [clock.seconds_to(k) for k in (0, 1, 2, 4, 5, 9)] == [0.0, 0.5, 1.0, 1.0, 2.0, 2.0]
    assert not format_table(greedy_report).startswith("outputs differ")  # identical: no warning
    differing = copy.deepcopy(greedy_report)
    differing["identical_fraction"], differing["shared_speedup"] = 0.5, 1.25
    table, md = format_table(differing), render_markdown(differing)
    assert table.startswith("outputs differ from plain generate() on 50% of prompts") and "1.25x" in table.splitlines()[0]
    assert md.startswith("**outputs differ")
    on_llamacpp = copy.deepcopy(greedy_report)
    on_llamacpp["settings"]["backend"] = "llama.cpp"
    assert "llama.cpp's forward rounds a token differently alone" in format_table(on_llamacpp)
    assert "llama.cpp's forward" not in format_table(greedy_report)


def test_rendering(greedy_report, tmp_path):
    table = format_table(greedy_report, profile=True)
    assert "plain generate()" in table and "HF prompt lookup" in table and "drafthead: prompt-lookup" in table
    assert "engine time" in table and "repeated 4-grams" in table
    md = render_markdown(greedy_report)
    assert md.startswith("| method |") and "| greeting |" in md
    png = plot_report(greedy_report, tmp_path / "fig" / "bench.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampling_run_completes(tiny):
    factory = DraftSpec(proposer="prompt-lookup").build(tiny, note=lambda line: None).factory
    settings = BenchSettings(
        max_new_tokens=16,
        sampling=SamplingConfig(temperature=0.8, top_k=20),
        eos_token_ids=eos_token_ids(tiny.model, tiny.tokenizer),
        progress=False,
        warmup_tokens=0,
    )
    report = run_bench(tiny.model, tiny.tokenizer, factory, PROMPTS[:1], settings)
    assert report["settings"]["sampling"]["temperature"] == 0.8
    assert 1 <= report["prompts"][0]["new_tokens"] <= 16


def test_prompt_over_the_context_is_refused(tiny_target_dir):
    short = load_target(tiny_target_dir("llama", max_position_embeddings=16))
    factory = DraftSpec(proposer="prompt-lookup").build(short, note=lambda line: None).factory
    long_prompt = Prompt(" ".join(["hello world"] * 20))
    with pytest.raises(ValueError, match="context of 16"):
        run_bench(short.model, short.tokenizer, factory, [long_prompt], BenchSettings(progress=False))


def test_the_run_accepted_drafts(greedy_report):
    """Identity must hold through multi-token rounds, not only one-token ones: the tiny random
    model repeats itself, so prompt lookup gets drafts accepted."""
    assert max(int(k) for k in greedy_report["acceptance_length_histogram"]) > 1
    assert greedy_report["per_position_acceptance"][0] > 0


def test_batch_bench_rows_are_identical_and_the_report_adds_up(tiny):
    """`bench --batch-size`: fixed tree and load policy on batches of 2 (one batch ragged: three
    prompts), fp32 greedy rows equal their batch-1 plain outputs; the totals match the records."""
    from drafthead.inference.bench.batch import format_batch_table, run_batch_bench, until_eos
    from drafthead.inference.engine.cost import CostCurve
    from drafthead.inference.engine.policy import SpeculationPolicy
    from drafthead.inference.engine.sizing import set_policy

    factory = DraftSpec(proposer="prompt-lookup").build(tiny, note=lambda line: None).factory
    set_policy(tiny.model, factory(), SpeculationPolicy(CostCurve((1, 8, 64), (0.01, 0.011, 0.05)), probe_every=4))
    settings = BenchSettings(max_new_tokens=24, eos_token_ids=eos_token_ids(tiny.model, tiny.tokenizer), progress=False)
    report = run_batch_bench(
        tiny.model, tiny.tokenizer, {"fixed": (factory, "fixed"), "policy": (factory, "policy")}, PROMPTS, settings, batch_size=2
    )
    assert report["num_prompts"] == 3 and set(report["methods"]) == {"fixed", "policy"}
    for name, method in report["methods"].items():
        records = report["prompts"][name]
        assert method["identical_fraction"] == 1.0, name
        assert method["per_row_tau"] == [r["tau"] for r in records]
        rounds = sum(r["rounds"] for r in records)
        assert method["tau"] == pytest.approx(sum(r["new_tokens"] for r in records) / rounds)
        assert method["num_forwards"] <= rounds  # rows of a batch share forwards
    assert report["methods"]["policy"]["policy"]["mean_nodes"] >= 1
    assert report["baseline_tokens_per_s"] > 0 and report["engine_plain_tokens_per_s"] > 0
    assert "policy" in format_batch_table(report)
    json.dumps(report)
    assert until_eos([5, 6, 1, 2, 2], (1,)) == [5, 6, 1] and until_eos([5, 6], (1,)) == [5, 6]


def test_tau_by_context_length_equals_a_token_by_token_count():
    """The slow twin walks each sequence token by token: a round starts at the context it finds,
    and the bucket is the largest edge not above it."""
    sequences = [(200, [1, 3, 2, 4, 1] * 20), (900, [2, 2, 1]), (3000, [4, 4])]
    got = tau_by_context(sequences)
    twin: dict[int, list[int]] = {}
    for prompt_len, accepted in sequences:
        context = prompt_len
        for a in accepted:
            edge = [e for e in CONTEXT_BUCKETS if e <= context][-1]
            twin.setdefault(edge, []).append(a)
            context += a
    assert list(got) == sorted(twin) == [0, 256, 512, 2048]
    for edge, rounds in twin.items():
        assert got[edge] == {"tau": sum(rounds) / len(rounds), "rounds": len(rounds)}
    # the first sequence's rounds emit 11 tokens per 5: after 25 rounds its context is 255, so the
    # 26th round still starts below 256
    assert got[0]["rounds"] == 26


def test_peak_memory_sees_a_freed_allocation_and_each_block_starts_afresh():
    """In a process of its own: the kernel's peak mark of a process that already ran the suite's
    other tests (threads, big heaps, mallopt settings) is not this test's to read."""
    import subprocess
    import sys

    code = """
import numpy as np, torch
from drafthead.inference.bench.run import PeakMemory
first, second = PeakMemory(torch.device("cpu")), PeakMemory(torch.device("cpu"))
with first:
    before = first.rss_mb
    block = np.ones(200 * 2**20 // 8)  # 200 MB, touched
    del block
with second:
    pass
assert first.rss_mb - before > 150, (before, first.rss_mb)
assert second.rss_mb < first.rss_mb - 150, (first.rss_mb, second.rss_mb)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-600:]
