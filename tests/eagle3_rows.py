"""Rows for EAGLE-3 loss tests: random tokens with a tiny target's features, and a head's loss with
its gradients (tests/test_ttt_attention.py, tests/test_context_parallel.py, tests/test_cuda.py)."""

from __future__ import annotations

import torch

from drafthead.train.capture.features import target_features

V = 96  # the tiny targets' vocabulary


def samples_of(target, lengths, seed=0):
    """One sample per length: random tokens, every one a label, with the target's hidden states at
    indices 1-4 (EAGLE-3's three capture points and the final state of a 4-layer target)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, V, (1, n), generator=g)
        hidden = target_features(target, ids, torch.ones(1, n, dtype=torch.long), (1, 2, 3, 4))
        out.append({"input_ids": ids[0], "loss_mask": torch.ones(n, dtype=torch.bool), "hidden_states": {k: v[0] for k, v in hidden.items()}})
    return out


def loss_and_grads(head, batch):
    """(loss, {parameter name: gradient}) of one compute_loss and backward."""
    head.zero_grad(set_to_none=True)
    loss, _ = head.compute_loss(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
