"""Packing (`data.packing`): a micro-batch's conversations laid several to a row, up to
`data.max_length` tokens, instead of one per row padded to the longest.

A step trains on the same conversations either way; only the layout changes. Position ids restart
at each conversation, and every head derives from them the masks that keep a conversation to
itself (heads/packing.py), so loss and gradients are the unpacked ones (tests/test_packing.py).
What packing saves is the padding: a batch's rows are padded to its longest row, and a short
conversation can share a row with others instead of filling the rest of its own with padding.

    pack_rows        the plan: which samples share a row (the fewest token slots)
    collate_packed   samples -> FeatureBatch with position_ids
    packing_refusal  whether a target's own forward keeps packed conversations apart (online features)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...heads.batch import FeatureBatch
from ...ground.target.identity import text_config
from .features import collate, target_features

# tokens of each conversation in the probe of `packing_refusal`
PROBE_TOKENS = 12


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices, each row's lengths summing to at most `capacity`, laid out to take
    the fewest token slots (rows x the longest row: what a right-padded batch computes over).

    For each row count R from 1 to len(lengths): longest first (ties by index), each sample into
    the least-filled of R rows (Graham's LPT rule, whose longest row is within 4/3 of the best);
    the R whose rows fit `capacity` with the fewest slots wins, the most rows on a tie (shorter
    rows: less attention). R = len(lengths) is one sample per row, so packing never costs slots.
    The indices of a row in increasing order; rows by their first index. A sample longer than
    `capacity` is an error (samples are cut to data.max_length before).
    """
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sample {i} has {n} tokens, more than a packed row's {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    best: list[list[int]] = []
    best_slots = None
    for R in range(1, len(lengths) + 1):
        rows: list[list[int]] = [[] for _ in range(R)]
        load = [0] * R
        for i in order:
            r = min(range(R), key=lambda r: (load[r], r))
            rows[r].append(i)
            load[r] += lengths[i]
        if max(load) > capacity:
            continue
        slots = R * max(load)
        if best_slots is None or slots <= best_slots:
            best, best_slots = rows, slots
    return sorted(sorted(row) for row in best)


def row_position_ids(lengths: Sequence[int], width: int) -> torch.Tensor:
    """[width] long: 0..n-1 for each conversation of a row in turn, then 0.. over the padding."""
    parts = [torch.arange(n) for n in lengths]
    return torch.cat(parts + [torch.arange(width - sum(lengths))])


def collate_packed(samples: Sequence[dict[str, Any]], capacity: int, pad_token_id: int = 0) -> FeatureBatch:
    """Samples {input_ids [T], loss_mask [T], hidden_states {l: [T, H]}?} packed by `pack_rows` into
    a right-padded FeatureBatch [R, T] with position_ids restarting at each conversation."""
    lengths = [len(s["input_ids"]) for s in samples]
    rows = pack_rows(lengths, capacity)
    joined = []
    for row in rows:
        parts = [samples[i] for i in row]
        sample: dict[str, Any] = {key: torch.cat([torch.as_tensor(p[key]) for p in parts]) for key in ("input_ids", "loss_mask")}
        if parts[0].get("hidden_states"):
            sample["hidden_states"] = {layer: torch.cat([p["hidden_states"][layer] for p in parts]) for layer in parts[0]["hidden_states"]}
        joined.append(sample)
    batch = collate(joined, pad_token_id)
    width = batch.input_ids.shape[1]
    batch.position_ids = torch.stack([row_position_ids([lengths[i] for i in row], width) for row in rows])
    return batch


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest per-token distance |a - b| / |b| over tokens: a [T, H], b [T, H]."""
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-12)).max())


def packing_refusal(model) -> str | None:
    """None when the target's forward, given packed rows the way `target_features` passes them,
    computes each conversation as if alone; else why not, in one line.

    Asks the model rather than a table of families: two conversations of PROBE_TOKENS ordinary
    text ids (the low half of the vocabulary, below the image and special tokens multimodal
    targets keep at its top) run alone and packed in one row. The second one's final hidden
    states packed must match its states alone far closer than those of a plain causal forward
    over both (what a mask leaking across the conversations gives): below a tenth of that gap,
    which leaves room for bf16 rounding and catches any leak.
    """
    cfg = text_config(model)
    L = cfg.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    first, second = torch.randint(3, max(4, cfg.vocab_size // 2), (2, PROBE_TOKENS), generator=g)
    both = torch.cat([first, second])[None]
    ones = torch.ones_like(both)
    alone = target_features(model, second[None], ones[:, :PROBE_TOKENS], [L])[L][0]
    packed = target_features(model, both, ones, [L], row_position_ids([PROBE_TOKENS] * 2, 2 * PROBE_TOKENS)[None])[L][0]
    leaky = target_features(model, both, ones, [L])[L][0]
    gap, leak = _relative_gap(packed[PROBE_TOKENS:], alone), _relative_gap(leaky[PROBE_TOKENS:], alone)
    if gap <= 0.1 * leak:
        return None
    return (
        f"the target ({type(model).__name__}) does not keep packed conversations apart in its forward: "
        f"a conversation packed after another differs from it alone by {gap:.2g} (relative), "
        "so its features would not be the unpacked ones"
    )
