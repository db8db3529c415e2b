"""Does ggml give a token the same logits alone as among a tree's nodes? SmolLM2 on the llama.cpp
backend (`make llamacpp`): 8 trees of 17 nodes (a spine of 4 drafts and 12 branches) after
prompts of 40-131 tokens, against one-token forwards of the spine; docs/llamacpp-backend.md
"Exactness" has what it printed.

    .venv/bin/python scripts/studies/llamacpp_row_invariance.py bf16   # or f32
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ of this checkout
from drafthead.draft_spec import llamacpp_target
from drafthead.ground.target.load import load_target
from drafthead.inference.engine.tree import DraftTree
from tests.test_row_invariance import spine_and_branches

gguf = sys.argv[1] if len(sys.argv) > 1 else "bf16"
loaded = load_target("smollm2-135m", dtype="bfloat16" if gguf == "bf16" else "float32", threads=2)
backend = llamacpp_target(loaded, gguf, 2)
g = torch.Generator().manual_seed(0)
results = []
for trial in range(8):
    prompt = torch.randint(3, 49152, (40 + 13 * trial,), generator=g)
    spine = torch.randint(3, 49152, (4,), generator=g).tolist()
    backend.start([prompt], (), False, 64)
    length = prompt.numel() - 1
    tree = spine_and_branches(int(prompt[-1]), spine, 12, seed=trial)
    together = backend.verify([tree], [length], False).logits[0, : len(spine) + 1].float()
    backend.discard(length)
    alone = []
    for token in [int(prompt[-1]), *spine]:
        one = DraftTree(torch.tensor([[token]]), torch.tensor([-1]))
        alone.append(backend.verify([one], [length], False).logits[0, 0].float())
        backend.keep([[0]], [length])
        length += 1
    alone = torch.stack(alone)
    results.append((bool(torch.equal(together, alone)), float((together - alone).abs().max()), int((together.argmax(-1) != alone.argmax(-1)).sum())))
print(
    gguf,
    "bitwise equal:",
    sum(r[0] for r in results),
    "of",
    len(results),
    "trials;",
    "max abs logit diff:",
    max(r[1] for r in results),
    "; argmax flips:",
    sum(r[2] for r in results),
    "of",
    5 * len(results),
)
