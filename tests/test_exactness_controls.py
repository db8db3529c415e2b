"""Each exactness mechanism of the engine broken on purpose: the test that guards it must fail.

The mechanisms (docs/testing.md "Negative controls"): the cache keeping the accepted path
(KV compaction), the features a drafter is handed for what was committed (feature catch-up),
rows of one batch at different lengths (ragged rows), the sampling rule's residual below depth 1
and at any node (its exact law), and the load policy's cut. Each test runs the guard as it is, then with the mechanism replaced
by a plausible bug (monkeypatch), and expects the guard to fail; where a weaker guard would miss
the bug (an untrained head that is never accepted), that is shown too.
"""

from __future__ import annotations

import pytest
import torch

from drafthead.inference.drafters.settings import StaticTreeSettings, TreeSettings
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.head_drafters import EagleDrafter, MedusaDrafter
from drafthead.inference.engine import decoder as engine
from drafthead.inference.engine import torch_target
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from tests.oracle import OracleDrafter, RowDrafter, assert_accepts_and_stays_exact, by_row, greedy_continuation
from tests.policy_checks import under
from tests.tiny import left_padded, prompts_of
from tests.tiny import plain_greedy, repetitive_prompt, tiny_causal_lm

NEW = 24
# two branches, the second deeper: the oracle's path (tests/oracle.py `spine`) runs 0 -> 2 -> 4 -> 6,
# which is not a prefix of the node order, so keeping the wrong nodes shows
CHOICES = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]


@pytest.fixture(scope="module")
def setting():
    """A tiny Llama, an untrained EAGLE-3 head, a prompt and a ragged batch with their references."""
    target = tiny_causal_lm("llama", layers=4)
    head = build_head(
        make_config("eagle3", target, None, name="tiny", draft_vocab_size=64, aux_layers=(1, 2, 3)), target, token_counts=torch.arange(96)
    ).eval()
    prompt = repetitive_prompt(96, seed=8)
    prompts = prompts_of((5, 9, 13), seed=2)
    ids, mask = left_padded(prompts)
    return dict(
        target=target,
        head=head,
        prompt=prompt,
        reference=plain_greedy(target, prompt, NEW),
        prompts=prompts,
        references=[plain_greedy(target, p[None], NEW) for p in prompts],
        ids=ids,
        mask=mask,
    )


def medusa_of(target):
    torch.manual_seed(0)
    head = build_head(make_config("medusa1", target, None, name="tiny", num_heads=3), target).eval()
    return lambda: MedusaDrafter(head, StaticTreeSettings(choices=CHOICES))


def exact_when_accepted(s, drafter_of) -> None:
    """The guard: tests/oracle.py's accepted-drafts exactness check, at B=1 and ragged B=3."""
    assert_accepts_and_stays_exact(
        s["target"],
        drafter_of,
        s["prompt"],
        s["reference"],
        s["prompts"],
        s["references"],
        s["ids"],
        s["mask"],
        NEW,
        NEW,
        lambda new: GenerationConfig(max_new_tokens=new),
    )


def exact_when_rejected(s, drafter_of) -> None:
    """The weaker guard the family table had: an untrained drafter, whose drafts are all rejected."""
    out = speculative_generate(s["target"], drafter_of(), s["prompt"], GenerationConfig(max_new_tokens=NEW))
    assert out.new_tokens[0].tolist() == s["reference"]
    assert max(out.accepted_lengths) == 1  # nothing accepted: the path is the root alone


def test_kv_compaction_keeping_the_first_nodes_is_caught(setting, monkeypatch):
    drafter_of = medusa_of(setting["target"])
    exact_when_accepted(setting, drafter_of)
    real = torch_target.keep_paths

    def first_nodes(cache, lengths, past_len, paths):  # the bug: a path taken for a prefix of the nodes
        return real(cache, lengths, past_len, [list(range(len(path))) for path in paths])

    monkeypatch.setattr(torch_target, "keep_paths", first_nodes)
    exact_when_rejected(setting, drafter_of)  # a root-only path is a prefix: the old guard passes
    with pytest.raises(AssertionError):
        exact_when_accepted(setting, drafter_of)


class FeatureSpy(RowDrafter):
    """Records the features a drafter is handed, by row and sequence position: begin's at
    0..P-2, each commit's from the old pending token's position on."""

    def __init__(self, inner, seen: list, sequence: int = 0):
        super().__init__(inner, sequence)
        self.seen, self.offset = seen, 0

    def wrap(self, inner, sequence: int) -> "FeatureSpy":
        return FeatureSpy(inner, self.seen, sequence)

    def _record(self, features, start: int) -> None:
        if features is not None:
            for layer, h in zip(features.layers, features.hidden_states):
                for i in range(h.shape[1]):
                    self.seen.append((self.sequence, (layer, start + i), h[0, i].clone()))

    def begin(self, tokens, features, pending):
        super().begin(tokens, features, pending)
        self._record(features, 0)
        self.offset = tokens.shape[1]

    def commit(self, tokens, features, pending, stats):
        super().commit(tokens, features, pending, stats)
        self._record(features, self.offset)
        self.offset += tokens.shape[1]


def features_are_the_targets_own(s, policy=None) -> None:
    """The guard: every feature an EAGLE-3 drafter was handed, after accepted trees (the oracle's,
    over a top-2 tree) in a ragged batch, equals the target's hidden state at that position in
    one plain forward over the finished sequence. With `policy`, plain rounds come in between and
    reach the drafter in one catch-up commit."""
    target = s["target"]
    continuation = greedy_continuation(target)
    seen: list = []
    inner = EagleDrafter(s["head"], TreeSettings(num_draft=8, depth=3, branch=2))
    drafter = FeatureSpy(OracleDrafter(inner, continuation, 96, by_row), seen)
    out = speculative_generate(target, drafter, s["ids"], under(policy, target, drafter, max_new_tokens=NEW), attention_mask=s["mask"])
    assert max(max(row.accepted_lengths) for row in out.rows) >= 3  # paths of depth >= 2 were accepted
    for b, (prompt, row) in enumerate(zip(s["prompts"], out.rows)):
        text = torch.cat([prompt, row.new_tokens[0]])[None]
        with torch.no_grad():
            hidden = target(text, output_hidden_states=True).hidden_states
        mine = [(key, h) for sequence, key, h in seen if sequence == b]
        # every position up to the last commit (the last round ends the row: it commits nothing)
        positions = sorted(t for (layer, t), _ in mine if layer == inner.feature_layers[0])
        assert positions == list(range(len(positions))) and len(positions) > len(prompt) + 2, positions
        for (layer, t), h in mine:
            torch.testing.assert_close(h, hidden[layer][0, t], atol=1e-4, rtol=1e-4, msg=f"row {b} layer {layer} t {t}")


def test_features_from_the_wrong_nodes_are_caught(setting, monkeypatch):
    from tests.policy_checks import FLAT, InjectedCosts

    features_are_the_targets_own(setting)
    # estimates from an earlier run: plain rounds first, then drafting again, with a catch-up
    policy = InjectedCosts(FLAT, probe_every=3, draft_seconds={0: 1.0}, rounds=1, next_probe=4, draft_per_row=0.0005)
    features_are_the_targets_own(setting, policy)
    assert policy.decisions[0] == 1 and any(d != 1 for d in policy.decisions), policy.decisions
    real = engine.select_features

    def first_nodes(hidden, layers, need_last, index=None, row=None):  # the bug: the path's length, not its nodes
        if isinstance(index, torch.Tensor):
            index = torch.arange(index.numel(), device=index.device)
        return real(hidden, layers, need_last, index, row)

    monkeypatch.setattr(engine, "select_features", first_nodes)
    with pytest.raises(AssertionError):
        features_are_the_targets_own(setting)


def test_rows_verified_at_one_length_are_caught(setting, monkeypatch):
    drafter_of = medusa_of(setting["target"])
    exact_when_accepted(setting, drafter_of)
    real = torch_target.TorchTarget.verify

    def longest_row(self, trees, lengths, want_hidden):  # the bug: every row taken to be as long as the longest
        return real(self, trees, [max(lengths)] * len(lengths), want_hidden)

    monkeypatch.setattr(torch_target.TorchTarget, "verify", longest_row)
    with pytest.raises(AssertionError):
        exact_when_accepted(setting, drafter_of)


def test_a_residual_wrong_only_at_depth_two_is_caught(monkeypatch):
    """The sampling guard (tests/law.py `assert_law_at_depth_two`, here on
    Medusa's static tree, the case with the fewest depth-2 rows) under a rule that is right at
    depth 1 and wrong below it: when every child of an accepted depth-1 node is rejected, the
    token is drawn from that node's p instead of the residual (the rejected draft removed). The
    guard as it is passes in that test file; the wrong rule must read p < ALPHA."""
    from drafthead.inference.engine.acceptance import Acceptance
    from drafthead.inference.engine.sampling import SamplingConfig
    from tests.law import assert_law_at_depth_two, steered_case

    real = engine.tree_rejection_sample

    def residual_ignored_at_depth_two(tokens, parents, p, q, generator=None):
        out = real(tokens, parents, p, q, generator)
        node = out.path[-1]
        if len(out.path) == 2 and bool((parents == node).any()):  # its children were all rejected
            return Acceptance(out.path, int(torch.multinomial(p[node].float(), 1, generator=generator)))
        return out

    monkeypatch.setattr(engine, "tree_rejection_sample", residual_ignored_at_depth_two)
    target, drafter, _ = steered_case("medusa1")
    with pytest.raises(AssertionError):
        assert_law_at_depth_two(target, drafter, torch.tensor([[3, 4, 5, 3, 4]]), SamplingConfig(temperature=0.9))


def test_a_residual_left_unnormalised_is_caught_by_the_exact_law(monkeypatch):
    """The tree rule's exact law (tests/test_acceptance.py): after a rejection, the residual
    max(0, p - q) is kept without normalising it. Sampled, on the chi-square test's own case, that
    moved the first token's law from 0.324/0.305 to 0.296/0.331, unseen in 6000 draws; the
    enumerated law must differ from the target's."""
    from drafthead.inference.engine import acceptance
    from tests.law import assert_tree_law_exact

    assert_tree_law_exact(acceptance.tree_rejection_walk, 4, (2, 2), True, seed=0)
    real = acceptance.after_rejection

    def unnormalised(p, q, x):
        p_next, q_next = real(p, q, x)
        residual = (p - q).clamp(min=0) if q is not None else p_next
        return (residual if residual.sum() > 0 else p), q_next

    monkeypatch.setattr(acceptance, "after_rejection", unnormalised)
    with pytest.raises(AssertionError, match="differs from the target's"):
        assert_tree_law_exact(acceptance.tree_rejection_walk, 4, (2, 2), True, seed=0)


def test_a_policy_that_never_drafts_or_never_cuts_is_caught(monkeypatch):
    """The load policy's guards (tests/test_policy.py): it drafts where drafting pays, decodes
    plainly where it does not, and verifies trees cut to its count. A policy that always decodes
    plainly, one that always verifies whole trees, and an engine that skips the cut each fail one."""
    from drafthead.inference.engine.policy import SpeculationPolicy
    from tests.policy_checks import (
        assert_drafts_where_drafting_pays,
        assert_plain_where_drafting_does_not_pay,
        assert_trees_are_cut_to_the_policys_count,
    )

    always_plain = [(SpeculationPolicy, "plan", lambda self, batch: 1)]
    always_whole = [
        (SpeculationPolicy, "plan", lambda self, batch: 0),
        (SpeculationPolicy, "cut", lambda self, trees: max(t.num_nodes for t in trees)),
    ]
    no_cut = [(engine, "cut_tree", lambda tree, num_nodes: tree)]
    for guard, patches in (
        (assert_drafts_where_drafting_pays, always_plain),
        (assert_plain_where_drafting_does_not_pay, always_whole),
        (assert_trees_are_cut_to_the_policys_count, no_cut),
    ):
        with monkeypatch.context() as patch:
            for where, name, value in patches:
                patch.setattr(where, name, value)
            with pytest.raises(AssertionError):
                guard()
