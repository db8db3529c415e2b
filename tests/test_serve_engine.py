"""The serving engine (inference/serve/engine.py) in-process, on a tiny target: jobs join the
running batch and answer as alone, a round that fails fails its rows and the server goes on, and
the queue and a stop refuse what they must."""

from __future__ import annotations

import queue

import pytest
import torch

from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.backend import target_backend
from drafthead.inference.engine.sampling import SamplingConfig
from drafthead.inference.serve.engine import Closed, EngineSettings, Job, QueueFull, ServingEngine
from tests.tiny import plain_greedy, prompts_of, tiny_causal_lm

NEW = 16
POISON = 95  # a prompt holding this token makes the drafter fail


class FailingOn(PromptLookupDrafter):
    """Prompt lookup that raises while it drafts for a prompt holding POISON."""

    def propose(self):
        assert self.history is not None  # set by begin
        if POISON in self.history[0].tolist():
            raise RuntimeError("the drafter broke")
        return super().propose()


def answer(job: Job, timeout: float = 120) -> tuple[str, list[int]]:
    """('done' or 'error', the tokens the job got)."""
    tokens: list[int] = []
    while True:
        event = job.events.get(timeout=timeout)
        if event[0] == "tokens":
            tokens += event[1]
        else:
            return event[0], tokens


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("qwen2", layers=2)


def engine_for(target, drafter, **settings) -> ServingEngine:
    return ServingEngine(
        target_backend(target), drafter, EngineSettings(max_len=256, **settings), eos_token_ids=(), decode=lambda ids: " ".join(map(str, ids))
    )


def test_a_failed_round_fails_its_rows_and_the_next_requests_are_answered(target):
    engine = engine_for(target, FailingOn(length=4))
    engine.start()
    try:
        good = prompts_of((7, 11), seed=3)
        bad = torch.cat([good[0][:3], torch.tensor([POISON]), good[0][3:]])
        jobs = [Job(p.tolist(), SamplingConfig(), NEW) for p in (good[0], bad)]
        for job in jobs:
            engine.submit(job)
        outcomes = [answer(job) for job in jobs]
        assert outcomes[1][0] == "error" and engine.alive
        later = Job(good[1].tolist(), SamplingConfig(), NEW)
        engine.submit(later)
        assert answer(later) == ("done", plain_greedy(target, good[1][None], NEW))
        assert engine.metrics.snapshot()["drafthead_requests_failed_total"] >= 1
    finally:
        engine.stop(5)


def test_a_full_queue_and_a_stopped_engine_refuse_new_jobs(target):
    engine = engine_for(target, PromptLookupDrafter(length=4), max_queue=1)  # not started: jobs wait
    prompt = prompts_of((5,), seed=1)[0].tolist()
    engine.submit(Job(prompt, SamplingConfig(), NEW))
    with pytest.raises(QueueFull):
        engine.submit(Job(prompt, SamplingConfig(), NEW))
    engine.start()
    engine.stop(5)
    with pytest.raises(Closed):
        engine.submit(Job(prompt, SamplingConfig(), NEW))


def test_sixteen_jobs_in_flight_answer_as_alone_and_a_seeded_sample_repeats(target):
    engine = engine_for(target, PromptLookupDrafter(length=4), max_batch=16)
    engine.start()
    try:
        prompts = prompts_of(tuple(range(3, 35, 2)), seed=7)
        jobs = [Job(p.tolist(), SamplingConfig(), NEW) for p in prompts]
        sampled = [Job(prompts[0].tolist(), SamplingConfig(temperature=0.9), NEW, seed=11) for _ in range(2)]
        for job in jobs + sampled[:1]:
            engine.submit(job)
        assert [answer(job) for job in jobs] == [("done", plain_greedy(target, p[None], NEW)) for p in prompts]
        first = answer(sampled[0])
        engine.submit(sampled[1])  # alone now
        assert answer(sampled[1]) == first
    finally:
        engine.stop(5)
    with pytest.raises(queue.Empty):
        jobs[0].events.get_nowait()  # one `done` each, nothing after it


def test_a_hook_that_raises_fails_no_answer(target):
    """An observer's failure (here: every on_round and on_finish hook raises) is logged; the
    answers still come, equal to plain greedy, and the engine serves the next request."""
    engine = engine_for(target, PromptLookupDrafter(length=4))

    def broken(*_):
        raise RuntimeError("the observer broke")

    engine.on_round.append(broken)
    engine.on_finish.append(broken)
    engine.start()
    try:
        for prompt in prompts_of((7, 11), seed=4):
            job = Job(prompt.tolist(), SamplingConfig(), NEW)
            engine.submit(job)
            assert answer(job, timeout=60) == ("done", plain_greedy(target, prompt[None], NEW))
        assert engine.alive
    finally:
        engine.stop(5)
