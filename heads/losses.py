"""Distillation objectives of a draft distribution q against the target's p, per position.

    alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)

is the chance that speculative sampling accepts a token drawn from q (Leviathan et al. 2023,
sec. 3), so it is the acceptance rate the draft is trained for (docs/training.md "LK losses").
LK losses (Samarin et al. 2026, arXiv 2602.23881) train on it directly:

    ce         soft cross-entropy -sum_x p log q = KL(p || q) + H(p): KL's gradient (the default)
    lk_alpha   LK^alpha = -log alpha: the acceptance rate itself, with a 1 / alpha boost to the
               gradient, so a draft far from the target (alpha ~ 0) still learns
    lk_lambda  LK^lambda = lambda KL(p || q) + (1 - lambda) (1 - alpha), lambda = exp(-eta * mean
               alpha): mostly KL while the draft is far from the target, mostly the acceptance rate
               once it is close; the mean is over the positions of one call (one draft depth) and
               is detached, so lambda weighs the terms without being trained itself

With a reduced draft vocabulary p is the target's distribution restricted to the draft tokens
and renormalised (heads/eagle3.py `_target_distribution`), the same p for every objective: that
renormalised p is at least the target's probability on every draft token, so q = p is still a
draft that reaches the highest acceptance a draft over those tokens can (the target's mass on
them), and alpha here overstates the engine's by at most the mass outside them.
"""

from __future__ import annotations

import math

import torch

LOSSES = ("ce", "lk_alpha", "lk_lambda", "dpace")
_LOG_FLOOR = 1e-12  # -log alpha is clamped here: alpha = 0 exactly has no gradient to give anyway


def check_loss(loss: str, lk_eta: float, dpace_alpha: float = 0.5) -> None:
    """Raise ValueError for an unknown objective, a negative eta or a D-PACE smoothing outside
    (0, 1] (head configs call it)."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    if not (lk_eta >= 0 and math.isfinite(lk_eta)):
        raise ValueError(f"lk_eta must be a finite number >= 0, got {lk_eta}")
    if not 0 < dpace_alpha <= 1:
        raise ValueError(f"dpace_alpha must be in (0, 1] (0 lets the prefix products vanish), got {dpace_alpha}")


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's position weights [C, K] (module docstring) of C chains of K positions, detached.

    confidence [C, K]: the draft's probability of each position's label; valid [C, K] bool: the
    positions with a label. An invalid position passes the prefix product unchanged (factor 1)
    and gets weight 0."""
    with torch.no_grad():
        smoothed = torch.where(valid, (1.0 - alpha) * confidence.float() + alpha, torch.ones_like(confidence, dtype=torch.float32))
        prefix = smoothed.cumprod(-1) * valid  # [C, K]: prod_{i<=m} q~_i where position m counts
        return prefix.flip(-1).cumsum(-1).flip(-1) * valid  # suffix sums


def label_confidence(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[N]: the draft's probability (softmax of logits [N, V]) of the target's top token under
    p [N, V], detached: D-PACE's q_j when the label is the target's own choice."""
    with torch.no_grad():
        return torch.softmax(logits.float(), dim=-1).gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1)


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[N]: sum_x min(p, q) for distributions p, q [N, V]."""
    return torch.minimum(p, q).sum(-1)


def lk_lambda(alpha: torch.Tensor, eta: float) -> float:
    """LK^lambda's KL weight exp(-eta * mean alpha) over the positions alpha [N] (1 when N = 0)."""
    return lk_lambda_of_mean(float(alpha.detach().mean()), eta) if alpha.numel() else 1.0


def lk_lambda_of_mean(mean_alpha: float, eta: float) -> float:
    """LK^lambda's KL weight from the positions' mean acceptance rate."""
    return math.exp(-eta * mean_alpha)


LOSS_CHUNK_BYTES = 256 << 20  # one chunk of positions' [c, V] fp32 logits and the tensors made from them
# a loss's [N, V] tensors up to this size are kept for the backward; past it they are recomputed
# there, chunk by chunk (activation checkpointing): a 2K-token row's 7 TTT steps would keep 1.3 GB
LOSS_KEEP_BYTES = 64 << 20


def loss_chunk_rows(vocab: int, budget: int | None = None) -> int:
    """Positions per chunk of a chunked loss: the ~4 [c, V] fp32 tensors one chunk makes (logits,
    log-softmax, the target's p, a temporary) within `budget` (default LOSS_CHUNK_BYTES)."""
    budget = LOSS_CHUNK_BYTES if budget is None else budget
    return max(1, budget // (16 * max(1, vocab)))


def recompute_loss(rows: int, vocab: int) -> bool:
    """Whether a loss over `rows` positions of a `vocab`-wide distribution recomputes its [N, V]
    tensors in the backward rather than keep them (LOSS_KEEP_BYTES)."""
    return 16 * rows * vocab > LOSS_KEEP_BYTES


def entropy_of(p: torch.Tensor) -> torch.Tensor:
    """[N]: the entropy of each distribution p [N, V] (0 log 0 = 0)."""
    return torch.special.entr(p).sum(-1)


def distill_loss(logits: torch.Tensor, p: torch.Tensor, loss: str = "ce", lk_eta: float = 3.0, lam: float | None = None):
    """Per-position losses [N] of draft logits [N, V] against target distributions p [N, V]
    under objective `loss` (module docstring), and alpha [N], each position's acceptance rate
    (detached; a metric). The caller reduces (mean, decay weights, curricula). lam: LK^lambda's
    weight when the caller computed it over more positions than these (a chunked loss)."""
    logits = logits.float()
    log_q = torch.log_softmax(logits, dim=-1)  # [N, V]
    ce = -(p * log_q).sum(-1)  # [N]
    if loss in ("ce", "dpace"):  # D-PACE weighs soft CE per position (the caller's reduction)
        with torch.no_grad():  # one [N, V] temporary, overwritten in place: alpha is only a metric here
            q = log_q.exp()
            return ce, torch.minimum(q, p, out=q).sum(-1)
    alpha = acceptance_rate(p, log_q.exp())  # [N], differentiable
    if loss == "lk_alpha":
        return -torch.log(alpha.clamp_min(_LOG_FLOOR)), alpha.detach()
    if loss == "lk_lambda":
        lam = lk_lambda(alpha, lk_eta) if lam is None else lam
        kl = ce - entropy_of(p)  # KL(p || q) = CE - H(p)
        return lam * kl + (1.0 - lam) * (1.0 - alpha), alpha.detach()
    raise ValueError(f"unknown loss {loss!r} (known: {', '.join(LOSSES)})")


def dpace_chain_loss(chains, num_cells: int, alpha: float) -> torch.Tensor:
    """The D-PACE loss of chains laid over `num_cells` start positions: `chains` lists, for each
    draft position k = 0..K-1 in order, (cells [N_k] long: the start position of each scored
    element, each [N_k]: its loss, confidence [N_k] or None: exp(-each), the draft's probability
    of a hard label). A cell's chain is its K positions; the loss is the sum of w * each over the
    chains scored, divided by their number (the reference's per-chain reduction)."""
    device = chains[0][1].device
    valid = torch.zeros(num_cells, len(chains), dtype=torch.bool, device=device)
    grid = torch.zeros(num_cells, len(chains), device=device)
    for k, (cells, each, conf) in enumerate(chains):
        valid[cells, k] = True
        grid[cells, k] = (torch.exp(-each.detach()) if conf is None else conf).float()
    w = dpace_weights(grid, valid, alpha)
    total = sum((w[cells, k] * each).sum() for k, (cells, each, _) in enumerate(chains))
    return total / valid.any(-1).sum().clamp_min(1)
