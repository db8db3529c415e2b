"""The load policy (inference/engine/policy.py): the rule's choices on known costs and gains, what a cut
tree would have accepted, and exactness when it cuts trees or decodes plainly."""

import math

import torch

from drafthead.inference.drafters.settings import TreeSettings
from drafthead.inference.engine.cost import CostCurve
from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.head_drafters import EagleDrafter
from drafthead.inference.drafters.merged import MergedDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.generate import speculative_generate
from drafthead.inference.engine.policy import SpeculationPolicy, accepted_within, best_batch_node_count, cut_tree
from drafthead.inference.engine.tree import DraftTree
from drafthead.heads.registry import build_head, make_config
from tests.policy_checks import (
    under,
    FLAT,
    STEEP,
    InjectedCosts,
    assert_drafts_where_drafting_pays,
    assert_plain_where_drafting_does_not_pay,
    assert_trees_are_cut_to_the_policys_count,
    tiny_eagle_drafter,
)
from tests.tiny import left_padded, prompts_of
from tests.tiny import plain_greedy, tiny_causal_lm


def test_accepted_within_counts_the_surviving_prefix_of_the_path():
    path = [0, 2, 5, 9]
    assert [accepted_within(path, cut) for cut in (0, 1, 2, 4, 5, 8, 9, 20)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_rule_keeps_whole_trees_when_verifying_is_flat_and_none_when_it_is_steep():
    gains = [[0.0, 0.6, 0.9, 1.1, 1.2, 1.25]]  # diminishing returns per extra node
    assert best_batch_node_count(gains, FLAT, 0.001, 0.002, 6) == 6
    # batch 16 on the steep curve: 16 tokens already fill the flat part, each extra node per row costs
    # 16 tokens' worth, and drafting costs per row: plain decoding wins
    assert best_batch_node_count(gains * 16, STEEP, 0.001, 16 * 0.002, 6) == 1
    # batch 1 on the steep curve: the tree fits in the flat part and pays
    assert best_batch_node_count(gains, STEEP, 0.001, 0.002, 6) == 6
    # in between, a partial tree: batch 4 gets 4 nodes (16 tokens), no more
    assert best_batch_node_count(gains * 4, STEEP, 0.001, 4 * 0.002, 6) == 4


def test_rule_ignores_spent_drafting_but_not_future_drafting():
    gains = [[0.0, 0.3]] * 8
    curve = CostCurve((1, 64), (0.010, 0.011))
    assert best_batch_node_count(gains, curve, 0.0, 8 * 0.01, 2) == 1  # drafting 10 ms a row does not pay
    assert best_batch_node_count(gains, curve, 0.0, 0.0, 2) == 2  # once drafted, verifying it does


def test_rule_counts_the_cheaper_drafting_of_small_trees():
    gains = [[0.0, 0.6, 0.9, 1.1, 1.2, 1.25]]
    # drafting the whole tree costs 8 ms, a 1-node draft 0.5 ms: the cheap small tree wins
    costs = {2: 0.0005}
    assert best_batch_node_count(gains, STEEP, 0.001, lambda n: costs.get(n, 0.008), 6) == 2
    assert best_batch_node_count(gains, STEEP, 0.001, 0.008, 6) == 6  # one price for all sizes: the whole tree


def test_eagle_drafter_limit_drafts_fewer_and_shallower_nodes():
    target, head, drafter = tiny_eagle_drafter()
    prompt = prompts_of((12,))[0][None]
    calls = []
    original = head.step
    head.step = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    with torch.no_grad():
        out = target(prompt[:, :-1], output_hidden_states=True)
    from drafthead.inference.engine.verify import select_features

    features = select_features(out.hidden_states, drafter.feature_layers, False)
    drafter.begin(prompt[:, :-1], features, prompt[0, -1:])
    drafter.limit(2)
    tree = drafter.propose()
    assert tree.num_draft == 2 and len(calls) == 2  # catch-up + one deeper step, not four
    head.step = original


def test_cut_tree_keeps_a_prefix_of_the_nodes():
    tree = DraftTree(torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([-1, 0, 0, 1, 3]))
    cut = cut_tree(tree, 3)
    assert cut.tokens.tolist() == [[5, 6, 7]] and cut.parents.tolist() == [-1, 0, 0]
    assert cut_tree(tree, 9) is tree


def test_policy_learns_gains_and_turns_drafting_off_under_steep_cost():
    policy = SpeculationPolicy(STEEP, probe_every=4)
    for _ in range(8):  # rows accept one draft token of a 6-node tree, never more
        policy.observe([7] * 16, [[0, 1]] * 16, fixed_seconds=0.001, draft_seconds=16 * 0.002)
    assert policy.gain[:3] == [0.0, 1.0, 1.0]
    policy.rounds = 1  # not a probe round
    assert policy.plan(16) == 1  # decode plainly
    assert policy.plan(1) > 1


def test_greedy_stays_exact_under_the_policy_at_every_batch_size():
    """Rows cut to the policy's node count, some rounds plain, some probing: every row is still
    its own plain greedy output, for a head, a draft model and a merged drafter. Costs are injected:
    on STEEP, drafting costs as much as verifying 16 more tokens, so at batch 6 plain decoding wins
    once the first probe has been seen, whatever the machine."""
    target = tiny_causal_lm("llama", layers=4)
    head = build_head(make_config("eagle3", target, None, name="tiny", draft_vocab_size=64), target, token_counts=torch.arange(96)).eval()
    prompts = prompts_of((3, 9, 14, 20, 6, 11), seed=5)
    refs = [plain_greedy(target, p[None], 30) for p in prompts]
    for curve in (FLAT, STEEP):
        for drafter in (
            EagleDrafter(head, TreeSettings(num_draft=10, depth=4, branch=3)),
            DraftModelDrafter(target, num_draft=4),
            MergedDrafter([EagleDrafter(head, TreeSettings(num_draft=6, depth=3, branch=2)), PromptLookupDrafter(length=4)]),
        ):
            for batch, fresh in ((1, True), (6, True), (6, False)):
                cost = 0.0005 if curve is FLAT else 0.05  # seconds a row: cheap on FLAT, dear on STEEP
                policy = InjectedCosts(curve, probe_every=3, draft_per_row=cost)
                if not fresh:  # estimates from an earlier run: plain first, the first drafting round mid-sequence
                    policy = InjectedCosts(curve, probe_every=3, draft_seconds={0: 1.0}, rounds=1, next_probe=7, draft_per_row=cost)
                ids, mask = left_padded(prompts[:batch])
                config = under(policy, target, drafter, max_new_tokens=30)
                out = speculative_generate(target, drafter, ids, config, attention_mask=mask)
                rows = [out] if batch == 1 else out.rows
                assert [r.new_tokens[0].tolist() for r in rows] == refs[:batch], (curve, type(drafter).__name__, batch, fresh)
                if curve is STEEP and batch == 6:
                    assert 1 in policy.decisions  # the policy decoded plainly in some rounds


def test_probes_back_off_while_plain_decoding_keeps_winning():
    """Under a load where drafting never pays, probes come ever more rarely (gaps 32, 64, 128);
    once the estimates say drafting pays again, every round drafts."""
    policy = SpeculationPolicy(STEEP, probe_every=16, max_probe_every=128, probe_budget=1.0)  # budget: see below
    drafted = []
    for _ in range(300):
        n = policy.plan(16)
        d = n != 1
        drafted.append(d)
        policy.observe([7 if d else 1] * 16, [[0, 1] if d else [0]] * 16, fixed_seconds=0.001, draft_seconds=16 * 0.002 if d else None, planned=n)
    assert [i for i, d in enumerate(drafted) if d] == [0, 32, 96, 224]
    policy.verify_cost, policy.draft_seconds = FLAT, {0: 1e-5}  # the load drops and drafting gets cheap
    for _ in range(300):
        n = policy.plan(16)
        d = n != 1
        drafted.append(d)
        policy.observe([7 if d else 1] * 16, [[0, 1, 2] if d else [0]] * 16, fixed_seconds=0.001, draft_seconds=16 * 1e-5 if d else None, planned=n)
    assert all(drafted[300:])


def test_the_policys_num_draft_limit_does_not_outlive_its_run():
    """A drafter used under the policy and then without it drafts its whole tree again."""
    target, head, drafter = tiny_eagle_drafter()
    prompt = prompts_of((10,))[0][None]
    set_to = []
    original = drafter.limit
    drafter.limit = lambda n: (set_to.append(n), original(n))
    # estimates as if small trees had paid so far (slow to move), no probe due: the plan is a small tree
    policy = SpeculationPolicy(
        CostCurve((1, 2, 64), (0.010, 0.0101, 0.2)),
        gain=[0.0, 0.9, 0.95],
        weight=[1.0, 1e3, 1e3],
        draft_seconds={0: 1e-4},
        rounds=1,
        next_probe=10**9,
    )
    speculative_generate(target, drafter, prompt, under(policy, target, drafter, max_new_tokens=16))
    assert any(n is not None for n in set_to)  # the run did limit the drafter
    assert drafter.num_draft_limit is None


def test_costly_probes_are_spaced_to_the_probe_budget():
    """At batch 16 on the steep curve a whole-tree probe costs many plain rounds: the gap after it
    is at least (probe cost / plain cost - 1) / probe_budget rounds, so probes stay ~2% of the time."""
    policy = SpeculationPolicy(STEEP, probe_every=16, max_probe_every=128, probe_budget=0.02)
    policy.observe([7] * 16, [[0, 1]] * 16, fixed_seconds=0.001, draft_seconds=16 * 0.002, planned=0)  # a probe
    assert policy.plan(16) == 1
    plain = 0.001 + STEEP(16)
    probe = 0.001 + 16 * 0.002 + STEEP(16 * 7)
    assert policy.probe_gap == math.ceil((probe / plain - 1) / 0.02) > 128
    assert policy.next_probe == policy.last_probe + policy.probe_gap


def test_probe_trees_are_capped_where_verifying_them_would_cost_many_plain_rounds():
    """STEEP: 16 tokens cost 1.2 single-token rounds, 64 cost 4.8. A probe at batch 1 keeps at
    most the nodes whose verify costs probe_ratio (4) plain rounds; at batch 16 it keeps 4 (64
    tokens, 4 x the 16 of a plain round); on a flat curve the whole tree."""
    steep, flat = SpeculationPolicy(STEEP), SpeculationPolicy(FLAT)
    assert steep.probing()  # no estimate yet: the first round probes
    n1 = steep.probe_size(1, 60)
    assert STEEP(n1) <= 4 * STEEP(1) < STEEP(n1 + 1) and 16 < n1 < 60
    assert steep.probe_size(16, 60) == 4
    assert flat.probe_size(16, 60) == 60 and flat.probe_size(1, 1) == 1
    trees = [DraftTree(torch.arange(40)[None], torch.tensor([-1] + list(range(39)))) for _ in range(4)]
    assert steep.cut(trees) == steep.probe_size(4, 40) < 40  # a probe's cut is capped too


def test_a_drafter_skipped_by_plain_rounds_catches_up_before_it_drafts():
    """Plain rounds hand the drafter nothing (generate.py `_catch_up`); when it next drafts it has
    taken them all at once: its history is the committed text, pending token last, and it holds
    a feature for every committed position it has not fed to its head yet."""
    target = tiny_causal_lm("llama", layers=4)
    head = build_head(make_config("eagle3", target, None, name="tiny", draft_vocab_size=64), target, token_counts=torch.arange(96)).eval()
    seen = []

    class Watched(EagleDrafter):
        def propose(self):
            buffered = sum(part[0].shape[1] for part in self.unfed)
            seen.append((len(policy.decisions), self.history[0].tolist(), self.fed, buffered))
            return super().propose()

    prompt = prompts_of((9,), seed=2)[0]
    for batch in (1, 3):
        seen.clear()
        policy = InjectedCosts(
            STEEP, probe_every=3, draft_seconds={0: 1.0}, rounds=1, next_probe=7, draft_per_row=0.05
        )  # plain first, drafting again from round 7
        ids = prompt[None].repeat(batch, 1)
        watched = Watched(head, TreeSettings(num_draft=6, depth=3, branch=2))
        out = speculative_generate(target, watched, ids, under(policy, target, watched, max_new_tokens=30), attention_mask=torch.ones_like(ids))
        row = out if batch == 1 else out.rows[0]
        text = prompt.tolist() + row.new_tokens[0].tolist()
        assert policy.decisions[0] == 1 and seen  # plain rounds first, then a drafting one
        for round_, history, fed, buffered in seen:
            committed = len(prompt) + sum(row.accepted_lengths[:round_])  # the pending token included
            assert history == text[:committed]
            assert fed + buffered == committed - 1  # every committed position but the pending one


def test_the_policy_drafts_where_it_pays_and_decodes_plainly_where_it_does_not():
    assert_drafts_where_drafting_pays()
    assert_plain_where_drafting_does_not_pay()
    assert_trees_are_cut_to_the_policys_count()
