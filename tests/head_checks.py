"""Heads drafting: each kind's drafter, a batch of the target's own continuations to train on, and
the two exactness checks every head kind's cells run (its drafts equal a from-scratch
recomputation; greedy decoding with it equals plain decoding, steered too)."""

from __future__ import annotations

import torch

from drafthead.inference.drafters.settings import StaticTreeSettings, TreeSettings
from drafthead.heads.batch import FeatureBatch
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.head_drafters import EagleDrafter, HydraDrafter, MedusaDrafter
from drafthead.inference.drafters.merged import MergedDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.drafters.parallel import ParallelDrafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from tests.oracle import assert_accepts_and_stays_exact
from tests.tiny import plain_greedy, repetitive_prompt, tiny_causal_lm

KINDS = {
    "medusa1": {},
    "hydra": {},
    "eagle1": {},
    "eagle3": {"draft_vocab_size": 64},
    "eagle31": {"draft_vocab_size": 64},
    "peagle": {"draft_vocab_size": 64, "parallel_depth": 4, "mask_token_id": 2},
}


def make_drafter(head):
    if head.kind == "peagle":
        return ParallelDrafter(head, StaticTreeSettings(num_draft=8))
    if head.kind == "hydra":
        return HydraDrafter(head, StaticTreeSettings(num_draft=12))
    if head.kind.startswith("medusa"):
        return MedusaDrafter(head, StaticTreeSettings(num_draft=12))
    return EagleDrafter(head, TreeSettings(num_draft=12, depth=4, branch=3))


def self_generated_batch(target, n=6, length=40):
    """The target's own greedy continuations of random prompts: what a head must learn."""
    seqs = []
    for seed in range(n):
        prompt = repetitive_prompt(96, seed=100 + seed)[:, :8]
        seqs.append(torch.tensor([prompt[0].tolist() + plain_greedy(target, prompt, length - 8)]))
    ids = torch.cat(seqs)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :8] = False
    return FeatureBatch(ids, torch.ones_like(ids), mask, {i: h for i, h in enumerate(hs)})


def train_head(head, batch, steps=80):
    head.train()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, _ = head.compute_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def assert_drafts_match_recomputation(target, drafter, slow, prompt, rounds: int = 3) -> None:
    """Decode `prompt` with `drafter`; every round's drafted chain must equal `slow(history)`, a
    from-scratch recomputation on the committed history (the cached drafter lost nothing)."""
    seen = []
    original_propose = drafter.propose

    def checked_propose():
        history = drafter.history.clone()
        tree = original_propose()
        seen.append((tree.tokens[0, 1:].tolist(), slow(history)))
        return tree

    drafter.propose = checked_propose
    speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=25))
    assert len(seen) > rounds
    for fast, slow_chain in seen:
        assert fast == slow_chain


def assert_greedy_equals_plain(target, drafter_of, max_new_tokens: int = 30, trees=(None, 7)) -> None:
    """Greedy decoding with `drafter_of(**options)` equals plain greedy: at batch 1 with each of
    `trees` (None: the drafter's default tree, n: an n-node static tree), and at batch 3
    (left-padded, a one-token prompt among them) for 2/3 of `max_new_tokens`."""
    from tests.tiny import left_padded, prompts_of

    prompt = repetitive_prompt(96, seed=8)
    for nodes in trees:
        drafter = drafter_of() if nodes is None else drafter_of(num_draft=nodes)
        result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=max_new_tokens))
        assert result.new_tokens[0].tolist() == plain_greedy(target, prompt, max_new_tokens)
    prompts = prompts_of((1, 6, 13), seed=2)
    ids, mask = left_padded(prompts)
    n = max_new_tokens * 2 // 3
    batched = speculative_generate(target, drafter_of(num_draft=5), ids, GenerationConfig(max_new_tokens=n), attention_mask=mask)
    references = [plain_greedy(target, p[None], n) for p in prompts]
    assert [row.new_tokens[0].tolist() for row in batched.rows] == references
    # the same drafters steered to be accepted (tests/oracle.py): cache moves, catch-up, ragged rows
    assert_accepts_and_stays_exact(
        target,
        drafter_of,
        prompt,
        plain_greedy(target, prompt, max_new_tokens),
        prompts,
        references,
        ids,
        mask,
        max_new_tokens,
        n,
        lambda new: GenerationConfig(max_new_tokens=new),
    )


def outputs(head, target):
    """A head's draft logits (Medusa) or (next feature, logits) for 6 random tokens of `target`:
    what an exported and re-imported head must reproduce."""
    ids = torch.randint(3, target.config.get_text_config().vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        if hasattr(head, "draft_logits"):
            return head.draft_logits(hs[-1][:, -1])
        h, logits = head.step(head.fuse([hs[i] for i in head.feature_layers]), ids, torch.arange(6)[None])
        return torch.cat([h, logits], -1)


def target_feature_batch(target, B=3, T=14, seed=0):
    """B random rows of T tokens, about 70% labelled, with every hidden state of `target`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (B, T), generator=g)
    loss_mask = torch.rand(B, T, generator=g) > 0.3
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    return FeatureBatch(ids, torch.ones_like(ids), loss_mask, {i: h for i, h in enumerate(hs)})


def element_loss(log_q, p, loss):
    """One element's soft CE, or -log sum_x min(p, q) (LK^alpha, heads/losses.py)."""
    if loss == "lk_alpha":
        return -torch.log(torch.minimum(p, log_q.exp()).sum())
    return -(p * log_q).sum()


def batch_drafters(target, family):
    """A drafter of every kind the batch tests decode with, for a tiny `family` target."""
    head_e = build_head(make_config("eagle3", target, None, name="tiny", draft_vocab_size=64), target, token_counts=torch.arange(96)).eval()
    head_m = build_head(make_config("medusa1", target, None, name="tiny"), target).eval()
    return {
        "prompt-lookup": PromptLookupDrafter(length=6),
        "prompt-lookup-streak": PromptLookupDrafter(length=3, lookup_streak=12),
        "draft-model-tree": DraftModelDrafter(tiny_causal_lm(family, seed=7, layers=4), choices=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]),
        "self-chain": DraftModelDrafter(target, num_draft=4),
        "eagle3": EagleDrafter(head_e, TreeSettings(num_draft=10, depth=4, branch=3)),
        "medusa1": MedusaDrafter(head_m, StaticTreeSettings(num_draft=8)),
        "eagle3+lookup": MergedDrafter(
            [EagleDrafter(head_e, TreeSettings(num_draft=8, depth=3, branch=3)), PromptLookupDrafter(length=4)], extra_nodes=4
        ),
    }


def slow_dpace_sum(scored, positions: int, alpha: float) -> float:
    """One chain's D-PACE sum, written out: scored [(k, loss, confidence)] at its positions k of
    0..positions-1 (the rest pass the prefix product as 1)."""
    smoothed = {k: (1 - alpha) * c + alpha for k, _, c in scored}
    prefix, run = {}, 1.0
    for k in range(positions):
        run *= smoothed.get(k, 1.0)
        prefix[k] = run
    return sum(sum(prefix[m] for m in smoothed if m >= k) * term for k, term, _ in scored)
