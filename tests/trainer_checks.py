"""A dummy head on learnable random features, and a small run config: what the trainer's, the
checkpoints' and the reliability tests train with, in seconds and without a target."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from torch import nn

from drafthead.heads.batch import FeatureBatch
from drafthead.train.loop.config import TrainConfig

V, H, LAYER = 48, 16, 2


class DummyHead(nn.Module):
    """Head k predicts token t+1+k from hidden_states[LAYER] at t; dropout exercises the RNG."""

    def __init__(self, num_heads: int = 2, nan_at_call: int | None = None):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(H, V) for _ in range(num_heads))
        self.drop = nn.Dropout(0.1)
        self.calls, self.nan_at_call = 0, nan_at_call

    def compute_loss(self, batch: FeatureBatch):
        self.calls += 1
        h = self.drop(batch.hidden_states[LAYER])
        total, metrics = 0.0, {}
        for k, proj in enumerate(self.proj):
            s = k + 1
            valid = (batch.loss_mask & batch.attention_mask.bool())[:, s:]
            logits = proj(h[:, :-s][valid])
            labels = batch.input_ids[:, s:][valid]
            ce = nn.functional.cross_entropy(logits, labels)
            total = total + ce
            metrics[f"acc_{k}"] = (logits.argmax(-1) == labels).float().mean().item()
        if self.calls == self.nan_at_call:
            total = total * float("nan")
        metrics["loss"] = float(total.detach())
        return total, metrics

    def save_pretrained(self, path, adapter_model=None, state=None):
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), path / "head.pt")
        return path


def random_samples(n: int, seed: int = 0, length: int | None = None) -> list[dict]:
    """Learnable features: hidden[t] encodes tokens t+1 and t+2 (plus noise), lengths vary."""
    g = torch.Generator().manual_seed(seed)
    code = torch.randn(V, H, generator=g)
    code2 = torch.randn(V, H, generator=g)
    samples = []
    for _ in range(n):
        T = length or int(torch.randint(8, 20, (1,), generator=g))
        ids = torch.randint(0, V, (T,), generator=g)
        hidden = code[ids.roll(-1)] + code2[ids.roll(-2)] + 0.1 * torch.randn(T, H, generator=g)
        loss_mask = torch.ones(T, dtype=torch.bool)
        loss_mask[: T // 4] = False  # a "prompt" part
        samples.append({"input_ids": ids, "loss_mask": loss_mask, "hidden_states": {LAYER: hidden}})
    return samples


def config(tmp_path, **kw) -> TrainConfig:
    base = dict(
        head={"kind": "medusa1"},
        batch_size=4,
        lr=3e-2,
        max_steps=30,
        warmup_steps=2,
        log_every=5,
        eval_every=10,
        checkpoint_every=10,
        output_dir=str(tmp_path / "run"),
        seed=0,
    )
    base.update(kw)
    return TrainConfig.from_dict(base)


def shards(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a captured-features folder, its shards concatenated (the offsets left out)."""
    index = json.loads((folder / "index.json").read_text())
    parts = [load_file(str(folder / s["file"])) for s in index["shards"]]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0] if key != "offsets"}
