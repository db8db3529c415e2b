#!/usr/bin/env python
"""Fine-tuning a target's own MTP layer: tau before and after, on a tiny DeepSeek-V3, GLM-4.5 or
Qwen3-Next target.

The target (tests/tiny_mtp.py: random weights, its checkpoint carrying a random MTP layer as
the released ones carry a trained one) answers `--train` random prompts greedily; the MTP head
(heads/mtp.py, read from that checkpoint) learns those answers with the target frozen, on the
token CE from its online features. tau is measured with our engine, greedy, a chain of `--chain`
MTP drafts per round (the MTP layer run again on its own output, as vLLM's deepseek_mtp does), on
`--eval` held-out prompts, before and after. The output is the target's either way (asserted).

    .venv/bin/python scripts/studies/mtp_finetune.py --family deepseek_v3 --steps 300 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def answers(target, prompts, n: int) -> list[torch.Tensor]:
    from tests.tiny import plain_greedy

    return [torch.tensor(plain_greedy(target, p[None], n)) for p in prompts]


def tau(target, head, prompts, references, chain: int, n: int) -> float:
    from drafthead.inference.drafters.load import chain_settings, head_drafter
    from drafthead.inference.engine.generate import GenerationConfig, speculative_generate

    emitted = rounds = 0
    for p, ref in zip(prompts, references):
        out = speculative_generate(target, head_drafter(head, chain_settings("mtp", chain)), p[None], GenerationConfig(max_new_tokens=n))
        assert out.new_tokens[0].tolist() == ref.tolist()  # exact, trained or not
        emitted += sum(out.accepted_lengths)
        rounds += len(out.accepted_lengths)
    return emitted / rounds


def main() -> int:
    from drafthead.heads.registry import build_head, make_config
    from drafthead.ground.target.load import load_target
    from drafthead.train.capture.features import OnlineFeaturizer, collate
    from tests.tiny_mtp import save_tiny_mtp_target

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="deepseek_v3", choices=["deepseek_v3", "glm4_moe", "qwen3_next"])
    p.add_argument("--train", type=int, default=96)
    p.add_argument("--eval", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--chain", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="a JSON file for the figures")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_target(save_tiny_mtp_target(Path(tempfile.mkdtemp()), args.family, layers=4).folder)
    target = loaded.model
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompts = [torch.randint(3, vocab, (12,), generator=g) for _ in range(args.train + args.eval)]
    continuations = answers(target, prompts, args.new_tokens)
    train = [
        {"input_ids": torch.cat([p, c]), "loss_mask": torch.arange(len(p) + len(c)) >= len(p)}
        for p, c in zip(prompts[: args.train], continuations[: args.train])
    ]

    head = build_head(make_config("mtp", target, loaded.tokenizer), target, dtype=torch.float32)
    held_out = prompts[args.train :], continuations[args.train :]
    before = tau(target, head.eval(), *held_out, args.chain, args.new_tokens)

    featurize = OnlineFeaturizer(target, head.config.train_hidden_layers)
    head.train()
    opt = torch.optim.AdamW([q for q in head.parameters() if q.requires_grad], lr=args.lr)
    losses = []
    for step in range(args.steps):
        batch = [train[(step * 16 + i) % len(train)] for i in range(16)]
        loss, _ = head.compute_loss(featurize(collate(batch)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = tau(target, head.eval(), *held_out, args.chain, args.new_tokens)
    result = {
        "family": args.family,
        "tau_before": before,
        "tau_after": after,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "steps": args.steps,
        "chain": args.chain,
        "train": args.train,
        "eval": args.eval,
    }
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
