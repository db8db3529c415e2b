"""Continuous batching (inference/engine/decoder.py): rows join a batch between rounds and leave
when done, and every row is still its prompt's own output: token for token in fp32 greedy, and in
distribution under sampling at tree depth 2, whatever joined before or after it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.backend import target_backend
from drafthead.inference.engine.decoder import Decoder, DecoderSettings, RowSettings
from drafthead.inference.engine.drafter import fork_drafter
from drafthead.ground.target.load import context_limit
from drafthead.inference.engine.sampling import SamplingConfig
from drafthead.inference.engine.stopping import StopRules
from tests.head_checks import batch_drafters
from tests.law import ALPHA, COPIES, MIN_DEEP, RUNS, VOCAB, exact_first_three
from tests.oracle import OracleDrafter, greedy_continuation
from tests.stats import chi_square_pvalue
from tests.tiny import FAMILIES, HYBRID_TARGETS, plain_greedy, prompts_of, tiny_causal_lm

LENGTHS = (9, 1, 14, 6, 21, 3)
# step -> the prompts (indices into LENGTHS) that join before it: the batch grows, drains to one
# row and grows again, and a row joins an empty decoder after every row has left
SCHEDULE = {0: [0], 2: [1, 2], 3: [3], 6: [4], 30: [5]}
NEW = 20


def run_schedule(target, drafter, prompts, schedule, settings_of, max_steps=200):
    """Decode `prompts` joining as `schedule` says; -> the rows, in the prompts' order."""
    backend = target_backend(target)
    decoder = Decoder(
        backend, DecoderSettings(max_len=context_limit(target.config), device=torch.device("cpu")), drafter.feature_layers, drafter.needs_last_hidden
    )
    rows = {}
    with torch.inference_mode():
        for step in range(max_steps):
            for i in schedule.get(step, []):
                (rows[i],) = decoder.join([prompts[i]], [fork_drafter(drafter)], [settings_of(i)], NEW)
            if not decoder.active and step > max(schedule):
                break
            decoder.step()
    assert not decoder.active, "rows still decoding"
    return [rows[i] for i in range(len(prompts))]


def greedy(i):
    return RowSettings(SamplingConfig(), StopRules((), (), NEW))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rows_joining_between_rounds_equal_their_own_plain_greedy(family):
    target = tiny_causal_lm(family, layers=4)
    prompts = prompts_of(LENGTHS, seed=len(family))
    refs = [plain_greedy(target, p[None], NEW) for p in prompts]
    drafters = batch_drafters(target, family)
    for name in ("prompt-lookup", "eagle3", "medusa1", "draft-model-tree"):
        rows = run_schedule(target, drafters[name], prompts, SCHEDULE, greedy)
        assert [row.emitted for row in rows] == refs, (family, name)
        assert all(row.finish == "length" for row in rows)


@pytest.mark.parametrize("family", HYBRID_TARGETS[:2])
def test_rows_joining_a_hybrid_target_equal_their_own_plain_greedy(family):
    """Recurrent states of the rows already decoding and of the joining ones stack (recurrent.py)."""
    target = tiny_causal_lm(family, layers=4)
    prompts = prompts_of(LENGTHS, seed=3)
    refs = [plain_greedy(target, p[None], NEW) for p in prompts]
    rows = run_schedule(target, PromptLookupDrafter(length=5), prompts, SCHEDULE, greedy)
    assert [row.emitted for row in rows] == refs, family


def test_a_cancelled_row_leaves_and_the_others_are_unchanged():
    target = tiny_causal_lm("qwen2", layers=4)
    prompts = prompts_of(LENGTHS, seed=5)
    refs = [plain_greedy(target, p[None], NEW) for p in prompts]
    backend = target_backend(target)
    drafter = PromptLookupDrafter(length=5)
    decoder = Decoder(backend, DecoderSettings(max_len=None, device=torch.device("cpu")), (), False)
    with torch.inference_mode():
        rows = decoder.join(prompts, [fork_drafter(drafter) for _ in prompts], [greedy(i) for i in range(len(prompts))], NEW)
        decoder.step()
        decoder.cancel(rows[2])
        while decoder.active:
            decoder.step()
    assert rows[2].finish == "cancelled" and len(rows[2].emitted) < NEW
    assert rows[2].emitted == refs[2][: len(rows[2].emitted)]
    assert [r.emitted for i, r in enumerate(rows) if i != 2] == [r for i, r in enumerate(refs) if i != 2]


def test_sampled_rows_joining_a_running_batch_follow_the_target_law():
    """Rows join every round beside rows already mid-answer (other prompts, longer answers), their
    trees steered to the target's greedy path (tests/oracle.py) so that depth-2 paths are
    accepted: the first three tokens of the joining rows follow the target's exact law."""
    sampling = SamplingConfig(temperature=0.6)
    target = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=3, layers=4)
    prompt = torch.tensor([3, 4, 5, 3, 4])
    others = prompts_of((7, 2, 11), seed=9)
    others = [p % VOCAB for p in others]
    drafter = OracleDrafter(PromptLookupDrafter(length=3), greedy_continuation(target), VOCAB, last=False)
    generator = torch.Generator().manual_seed(0)
    backend = target_backend(target)
    decoder = Decoder(backend, DecoderSettings(max_len=None, device=torch.device("cpu")), (), False)
    rows = []
    with torch.inference_mode():
        while len(rows) < RUNS or decoder.active:
            if len(rows) < RUNS:
                joining = [prompt] * COPIES + others
                settings = [RowSettings(sampling, StopRules((), (), 3 if b < COPIES else 9), generator) for b in range(len(joining))]
                rows += decoder.join(joining, [fork_drafter(drafter) for _ in joining], settings, 9)[:COPIES]
            decoder.step()
    counts = Counter(tuple(row.emitted) for row in rows)
    deep = sum(1 for row in rows if row.accepted_lengths[0] == 3)
    assert deep >= MIN_DEEP, deep
    assert chi_square_pvalue(counts, exact_first_three(target, prompt[None], sampling), RUNS) > ALPHA
