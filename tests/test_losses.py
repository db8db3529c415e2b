"""LK losses (heads/losses.py): the vectorised objectives equal a plain-Python twin, hand-made p/q
give the known acceptance rate, the gradient moves q toward p, the hybrid's weight has the paper's
endpoints, and EAGLE-3's unrolled loss under each objective equals a position-by-position loop."""

from __future__ import annotations

import math

import pytest
import torch

from drafthead.heads.losses import LOSSES, acceptance_rate, distill_loss, dpace_chain_loss, lk_lambda
from drafthead.heads.registry import build_head, make_config
from tests.head_batches import LAYERS, counts_of, make_batch, make_target
from tests.head_checks import slow_dpace_sum


def slow_objective(logits: list[float], p: list[float], loss: str, lam: float) -> float:
    """One position, written out: q = softmax(logits), alpha = sum min(p, q)."""
    top = max(logits)
    z = sum(math.exp(x - top) for x in logits)
    q = [math.exp(x - top) / z for x in logits]
    alpha = sum(min(a, b) for a, b in zip(p, q))
    ce = -sum(a * math.log(b) for a, b in zip(p, q) if a > 0)
    if loss in ("ce", "dpace"):  # D-PACE weighs soft CE per position: the caller's reduction
        return ce
    if loss == "lk_alpha":
        return -math.log(alpha)
    entropy = -sum(a * math.log(a) for a in p if a > 0)
    return lam * (ce - entropy) + (1 - lam) * (1 - alpha)


def slow_alpha(logits: list[float], p: list[float]) -> float:
    q = torch.softmax(torch.tensor(logits, dtype=torch.float64), -1).tolist()
    return sum(min(a, b) for a, b in zip(p, q))


def random_pair(N=6, V=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * 2
    p = torch.softmax(torch.randn(N, V, generator=g) * 3, -1)
    p[0, :4] = 0  # a target with zeros
    return logits, p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("loss", LOSSES)
def test_objectives_equal_the_position_by_position_twin(loss):
    logits, p = random_pair()
    each, alpha = distill_loss(logits, p, loss, lk_eta=2.0)
    alphas = [slow_alpha(lg, q) for lg, q in zip(logits.tolist(), p.tolist())]
    lam = math.exp(-2.0 * sum(alphas) / len(alphas))  # one weight for the call: the mean acceptance
    assert alpha.tolist() == pytest.approx(alphas, rel=1e-5)
    want = [slow_objective(lg, q, loss, lam) for lg, q in zip(logits.tolist(), p.tolist())]
    assert each.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_hand_made_distributions_have_the_known_acceptance():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5], [0.0, 0.5, 0.5]])
    assert acceptance_rate(p, q).tolist() == pytest.approx([0.5, 1.0, 0.0])
    # q = softmax(log q) up to the zeros: -log alpha of the first row is log 2
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    each, alpha = distill_loss(logits, torch.tensor([[1.0, 0.0, 0.0]]), "lk_alpha")
    assert alpha.item() == pytest.approx(0.5) and each.item() == pytest.approx(math.log(2))


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda"])
def test_gradient_steps_move_q_toward_p(loss):
    """A small gradient step on the logits raises the acceptance rate at every position, and plain
    gradient descent ends near p from a start far from it (alpha 0.1 to 0.3)."""
    _, p = random_pair(seed=1)
    logits = (-3 * p).requires_grad_()  # q is largest where p is smallest
    start = distill_loss(logits, p, loss)[1]
    assert float(start.max()) < 0.3

    def step(lr):
        (grad,) = torch.autograd.grad(distill_loss(logits, p, loss)[0].sum(), logits)
        with torch.no_grad():
            logits.sub_(lr * grad)

    step(0.05)
    assert (distill_loss(logits, p, loss)[1] > start).all()
    for _ in range(200):
        step(0.5)
    assert float(distill_loss(logits, p, loss)[1].min()) > 0.9


def test_hybrid_weight_endpoints():
    """lambda = exp(-eta * mean alpha): all KL when the draft is disjoint from the target or eta is
    0, exp(-eta) on the KL (which is 0 there) when the draft equals the target."""
    p = torch.tensor([[0.7, 0.3, 0.0, 0.0]])
    far = torch.tensor([[-30.0, -30.0, 5.0, 5.0]])  # q's mass where p has none: alpha ~ 0
    kl_far = distill_loss(far, p, "ce")[0] - torch.special.entr(p).sum(-1)
    assert lk_lambda(distill_loss(far, p, "ce")[1], 3.0) == pytest.approx(1.0, abs=1e-9)
    assert distill_loss(far, p, "lk_lambda", 3.0)[0].item() == pytest.approx(kl_far.item(), rel=1e-6)
    mid = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    assert distill_loss(mid, p, "lk_lambda", 0.0)[0].item() == pytest.approx(
        (distill_loss(mid, p, "ce")[0] - torch.special.entr(p).sum(-1)).item(), rel=1e-6
    )
    same = torch.log(torch.tensor([[0.7, 0.3, 1e-30, 1e-30]]))
    _, alpha = distill_loss(same, p, "lk_lambda", 3.0)
    assert alpha.item() == pytest.approx(1.0) and lk_lambda(alpha, 3.0) == pytest.approx(math.exp(-3.0))
    assert distill_loss(same, p, "lk_lambda", 3.0)[0].item() == pytest.approx(0.0, abs=1e-6)
    assert lk_lambda(torch.empty(0), 3.0) == 1.0


def test_config_checks_the_objective():
    target = make_target()
    with pytest.raises(ValueError, match="loss must be one of ce, lk_alpha, lk_lambda"):
        make_config("eagle3", target, None, loss="tv")
    with pytest.raises(ValueError, match="lk_eta"):
        make_config("eagle31", target, None, loss="lk_lambda", lk_eta=-1.0)
    with pytest.raises(ValueError, match="loss must be one of"):
        make_config("dflash", target, None, mask_token_id=2, loss="kl")
    config = make_config("eagle3", target, None, loss="lk_lambda", lk_eta=1.5)
    assert type(config).from_dict(config.to_dict()).loss == "lk_lambda"
    # a loss-only field: a saved head continues under another objective
    assert config.architecture_diff(make_config("eagle3", target, None)) == []


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda", "dpace"])
def test_eagle3_unrolled_loss_equals_the_position_loop(loss):
    """sum_i 0.8**i * mean over labelled (b, t) of the objective of q_i(b, t) against p(b, t + 1 + i),
    lk_lambda's weight from step i's own mean acceptance; under dpace, each (b, t)'s chain of steps
    weighted by D-PACE (smoothed prefix products of q_i's probability of the target's top token)."""
    target = make_target()
    batch = make_batch(target)
    config = make_config("eagle3", target, None, draft_vocab_size=64, ttt_steps=3, loss=loss, lk_eta=2.5)
    head = build_head(config, target, token_counts=counts_of(batch))
    total, metrics = head.compute_loss(batch)
    with torch.no_grad():
        W = target.lm_head.weight[head.draft_target_ids]  # [Vd, H]
        unrolled = list(head.ttt_unroll(head.fuse([batch.hidden_states[i] for i in head.feature_layers]), batch.input_ids, 3))
        B, T = batch.input_ids.shape
        slow = 0.0
        chains = {}  # dpace: (b, t) -> [(step, objective, confidence)]
        for i in range(3):
            pairs = []
            for b in range(B):
                for t in range(T):
                    j = t + 2 + i
                    if j < T and batch.loss_mask[b, j] and batch.attention_mask[b, j]:
                        p = torch.softmax(batch.hidden_states[LAYERS][b, t + 1 + i] @ W.T, -1).double()
                        logits = head.logits(unrolled[i][b, t]).double()
                        pairs.append((logits.tolist(), p.tolist()))
                        chains.setdefault((b, t), []).append(
                            (i, slow_objective(logits.tolist(), p.tolist(), "ce", 1.0), float(torch.softmax(logits, -1)[p.argmax()]))
                        )
            if loss == "dpace":
                continue
            alphas = [slow_alpha(lg, p) for lg, p in pairs]
            lam = math.exp(-2.5 * sum(alphas) / len(alphas))
            step = sum(slow_objective(lg, p, loss, lam) for lg, p in pairs) / len(pairs)
            assert metrics[f"loss_{i}"] == pytest.approx(step, rel=1e-4)
            assert metrics[f"alpha_{i}"] == pytest.approx(sum(alphas) / len(alphas), rel=1e-4)
            slow += 0.8**i * step
    if loss == "dpace":
        slow = sum(slow_dpace_sum(chain, 3, 0.5) for chain in chains.values()) / len(chains)
    assert total.item() == pytest.approx(slow, rel=1e-4)


def test_eagle3_trains_its_acceptance_up_under_lk():
    """30 AdamW steps on one batch under the hybrid raise every unroll step's acceptance rate."""
    torch.manual_seed(0)
    target = make_target()
    batch = make_batch(target)
    config = make_config("eagle3", target, None, draft_vocab_size=64, ttt_steps=2, loss="lk_lambda")
    head = build_head(config, target, token_counts=counts_of(batch))
    first = head.compute_loss(batch)[1]
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(30):
        loss, _ = head.compute_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = head.compute_loss(batch)[1]
    for i in range(2):
        assert last[f"alpha_{i}"] > first[f"alpha_{i}"] + 0.1, (first, last)


def test_eagle1_token_term_under_lk_equals_the_position_loop():
    """EAGLE-1 with the target's distribution as its token target: loss_ce is the mean over labelled
    (b, t) of -log sum_x min(p, q), p = softmax(lm_head(f_{t+1})), q from the head at t."""
    target = make_target()
    batch = make_batch(target)
    with pytest.raises(ValueError, match="set ce_to_target_dist: true"):
        make_config("eagle1", target, None, loss="lk_alpha")
    head = build_head(make_config("eagle1", target, None, ce_to_target_dist=True, loss="lk_alpha"), target)
    _, metrics = head.compute_loss(batch)
    f, W = batch.hidden_states[LAYERS], target.lm_head.weight
    B, T = batch.input_ids.shape
    terms, alphas = [], []
    with torch.no_grad():
        for b in range(B):
            nxt = torch.cat([batch.input_ids[b, 1:], torch.zeros(1, dtype=torch.long)])
            h, _ = head.step(f[b : b + 1], nxt[None], torch.arange(T)[None])
            for t in range(T - 2):
                if batch.loss_mask[b, t + 2] and batch.attention_mask[b, t + 2]:
                    p = torch.softmax(f[b, t + 1] @ W.T, -1).double().tolist()
                    logits = (h[0, t] @ W.T).double().tolist()
                    terms.append(slow_objective(logits, p, "lk_alpha", 0.0))
                    alphas.append(slow_alpha(logits, p))
    assert metrics["loss_ce"] == pytest.approx(sum(terms) / len(terms), rel=1e-4)
    assert metrics["alpha_0"] == pytest.approx(sum(alphas) / len(alphas), rel=1e-4)


def test_dpace_chain_loss_equals_a_chain_by_chain_loop():
    g = torch.Generator().manual_seed(0)
    each = [torch.rand(n, generator=g) * 3 for n in (4, 3, 2)]  # positions 0, 1, 2 of 5 cells' chains
    cells = [torch.tensor([0, 1, 2, 4]), torch.tensor([0, 2, 4]), torch.tensor([2, 4])]
    conf = [None, torch.rand(3, generator=g), None]
    got = dpace_chain_loss(list(zip(cells, each, conf)), 5, 0.3)
    total, chains = 0.0, 0
    for cell in range(5):
        scored = [
            (k, float(e[list(c).index(cell)]), float(torch.exp(-e[list(c).index(cell)]) if q is None else q[list(c).index(cell)]))
            for k, (c, e, q) in enumerate(zip(cells, each, conf))
            if cell in c.tolist()
        ]
        if not scored:
            continue  # cell 3: no chain
        chains += 1
        total += slow_dpace_sum(scored, 3, 0.3)
    assert chains == 4 and got.item() == pytest.approx(total / chains, rel=1e-6)


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("medusa1", {"num_heads": 1}),
        ("hydra", {"num_heads": 1}),
        ("eagle3", {"draft_vocab_size": 64, "ttt_steps": 1}),
        ("peagle", {"draft_vocab_size": 64, "parallel_depth": 1, "mask_token_id": 2}),
        ("dflash", {"block_size": 2, "mask_token_id": 5}),
    ],
)
def test_dpace_over_one_position_is_the_mean_loss(kind, extra):
    """With dpace_alpha 1 every smoothed confidence is 1, so a chain of one position weighs each
    element 1 and divides by their number: every kind's dpace path scores the same elements as its
    plain one. A config asking for dpace over one position is refused (heads/config.py
    _check_chain_loss); the loss still meets such chains (EAGLE-3's first steps under ttt_ramp),
    so the loss is set past the check."""
    target = make_target()
    batch = make_batch(target)
    losses = {}
    for loss in ("ce", "dpace"):
        torch.manual_seed(0)
        config = make_config(kind, target, None, dpace_alpha=1.0, **extra)
        config.loss = loss
        head = build_head(config, target, token_counts=counts_of(batch))
        torch.manual_seed(1)  # P-EAGLE's and DFlash's sampled columns and anchors alike in both runs
        losses[loss] = head.compute_loss(batch)[0]
    assert losses["dpace"].item() == pytest.approx(losses["ce"].item(), rel=1e-5)
    losses["dpace"].backward()
