"""Packing (train/capture/packing.py, heads/packing.py): several conversations per row. The rules (the
plan, the masks) each equal a slow twin written loop by loop; every head kind's loss and
gradients on a packed batch equal those on the same samples one per row; the target's packed
forward equals its forward on each conversation alone, and a target that mixes them is refused."""

import copy
import functools

import pytest
import torch

from drafthead.heads.dflash import block_attention_mask, sample_anchors
from drafthead.heads.eagle3 import ttt_attention_mask
from drafthead.heads.packing import causal_within, same_segment_shift, segment_ids
from drafthead.heads.peagle import cod_columns, parallel_attention_mask
from drafthead.heads.registry import build_head, make_config
from drafthead.train.loop.config import ConfigError, LoraConfig, load_config
from drafthead.train.capture.features import collate, target_features
from drafthead.train.capture.packing import collate_packed, pack_rows, packing_refusal, row_position_ids
from drafthead.train.loop.run import packed_row_length
from drafthead.train.loop.trainer import JointLoss
from tests.tiny import TARGETS, tiny_causal_lm

V = 96
LENGTHS = (9, 14, 5, 11, 7)  # five conversations: packed into rows of CAPACITY, three rows
CAPACITY = 20


def positions_of(lengths_per_row: list[list[int]], width: int) -> torch.Tensor:
    return torch.stack([row_position_ids(row, width) for row in lengths_per_row])


# ----------------------------------------------------------------------------- the plan


def slots(rows: list[list[int]], lengths: list[int]) -> int:
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


def fewest_slots(lengths: list[int], capacity: int) -> int:
    """The slow twin: every assignment of samples to rows, the fewest slots of those that fit."""
    n, best = len(lengths), None
    for code in range(n**n):
        rows: dict[int, list[int]] = {}
        for i in range(n):
            rows.setdefault(code // n**i % n, []).append(i)
        if all(sum(lengths[i] for i in row) <= capacity for row in rows.values()):
            s = slots(list(rows.values()), lengths)
            best = s if best is None else min(best, s)
    return best


def test_rows_hold_every_sample_once_within_capacity_and_near_the_fewest_slots():
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        n = int(torch.randint(1, 6, (1,), generator=g))
        lengths = torch.randint(1, 30, (n,), generator=g).tolist()
        rows = pack_rows(lengths, 30)
        assert sorted(i for row in rows for i in row) == list(range(n))
        assert all(sum(lengths[i] for i in row) <= 30 for row in rows)
        assert slots(rows, lengths) <= n * max(lengths)  # never more than one sample per row
        assert slots(rows, lengths) <= 4 / 3 * fewest_slots(lengths, 30), (lengths, rows)


def test_a_hand_made_plan_and_an_overlong_sample():
    assert pack_rows([9, 14, 5, 11, 7], 20) == [[0, 4], [1], [2, 3]]  # 9 + 7, 14, 5 + 11: 3 x 16 slots, not 5 x 14
    assert pack_rows([191, 143, 122, 105], 512) == [[0, 3], [1, 2]]  # 2 x 296 slots, not 456 + 105 padded
    with pytest.raises(ValueError, match="more than a packed row"):
        pack_rows([3, 21], 20)


# ----------------------------------------------------------------------------- the masks


def slow_segments(pos: torch.Tensor) -> list[list[int]]:
    out = []
    for row in pos.tolist():
        seg, current = [], -1
        for p in row:
            current += p == 0
            seg.append(current)
        out.append(seg)
    return out


def test_segments_and_the_block_diagonal_causal_mask_equal_loops():
    pos = positions_of([[3, 4], [5, 1, 2]], 9)
    seg = slow_segments(pos)
    assert segment_ids(pos).tolist() == seg
    allowed = causal_within(pos)
    for b in range(2):
        for q in range(9):
            for k in range(9):
                assert bool(allowed[b, q, k]) == (k <= q and seg[b][k] == seg[b][q])
    for shift in (1, 2, 3):
        inside = same_segment_shift(pos, shift)
        for b in range(2):
            for t in range(9):
                assert bool(inside[b, t]) == (t + shift < 9 and seg[b][t + shift] == seg[b][t])


def test_ttt_mask_of_packed_rows_equals_a_loop():
    pos = positions_of([[3, 4], [2, 2, 3]], 8)
    seg = slow_segments(pos)
    for step in range(3):
        allowed = ttt_attention_mask(8, step, torch.float32, position_ids=pos)[:, 0] == 0  # [B, 8, (step+1) 8]
        for b in range(2):
            for t in range(8):
                for j in range(step + 1):
                    for s in range(8):
                        want = (s <= t and seg[b][s] == seg[b][t]) if j == 0 else s == t
                        assert bool(allowed[b, t, j * 8 + s]) == want


def test_parallel_mask_of_packed_rows_equals_a_loop():
    pos = positions_of([[4, 3], [2, 5]], 8)
    seg = slow_segments(pos)
    columns = cod_columns(8, 3, 0.7, 0.3, generator=torch.Generator().manual_seed(2))
    allowed = parallel_attention_mask(8, columns, torch.float32, pos)[:, 0] == 0
    keys = [(0, s) for s in range(8)] + [(d, int(c)) for d in (1, 2) for c in columns[d]]
    for b in range(2):
        for qi, c in enumerate(columns[2].tolist()):
            for ki, (d, s) in enumerate(keys):
                want = (s <= c and seg[b][s] == seg[b][c]) if d == 0 else s == c
                assert bool(allowed[b, qi, ki]) == want


def test_dflash_mask_and_anchors_of_packed_rows_stay_in_their_conversation():
    pos = positions_of([[5, 6]], 12)
    seg = slow_segments(pos)[0]
    anchors = torch.tensor([[2, 6, 8]])
    allowed = block_attention_mask(12, anchors, 3, torch.float32, pos)[0, 0] == 0
    for q in range(9):
        a = int(anchors[0, q // 3])
        assert allowed[q, :12].tolist() == [s < a and seg[s] == seg[a] for s in range(12)]
    label_ok = torch.ones(1, 12, dtype=torch.bool)
    label_ok[0, 11] = False  # the padding
    drawn, ok = sample_anchors(label_ok, 2, torch.Generator().manual_seed(0), pos)
    picked = drawn[ok].tolist()
    # two per conversation; each has context before it in its conversation and its next token in it
    assert sorted(seg[p] for p in picked) == [0, 0, 1, 1]
    assert all(int(pos[0, p]) >= 1 and seg[p + 1] == seg[p] for p in picked)


# ----------------------------------------------------------------------------- every head kind

KINDS = {
    "medusa1": {"num_heads": 3},
    "medusa2": {"num_heads": 2},
    "hydra": {"num_heads": 3},
    "eagle1": {},
    "eagle3": {"draft_vocab_size": 64, "ttt_steps": 3, "aux_layers": (1, 2, 3)},
    # a window shorter than the conversations: measured by positions that restart
    "eagle3-window": {"draft_vocab_size": 64, "ttt_steps": 3, "aux_layers": (1, 2, 3), "sliding_window": 4},
    "eagle31": {"draft_vocab_size": 64, "ttt_steps": 2, "aux_layers": (1, 2, 3)},
    # every column at every depth, so that both layouts train on the same elements
    "peagle": {"draft_vocab_size": 64, "parallel_depth": 3, "mask_token_id": V - 1, "aux_layers": (1, 2, 3), "cod_ratio": 1.0, "cod_min_ratio": 1.0},
    "dflash": {"block_size": 4, "mask_token_id": V - 1, "num_anchors": 3},
}


@functools.cache
def target_of(family: str = "llama"):
    return tiny_causal_lm(family, vocab=V, layers=4, hidden=32, attn="eager" if family == "gpt_oss" else "sdpa")


def conversations(lengths=LENGTHS, seed: int = 0, with_hidden: bool = True) -> list[dict]:
    """Samples {input_ids, loss_mask, hidden_states}: each conversation's features from the target
    run on it alone (captured features are made so)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, V - 1, (n,), generator=g)
        sample = {"input_ids": ids, "loss_mask": torch.arange(n) >= n // 3}
        if with_hidden:
            hs = target_features(target_of(), ids[None], torch.ones(1, n, dtype=torch.long), range(5))
            sample["hidden_states"] = {k: v[0] for k, v in hs.items()}
        out.append(sample)
    return out


def head_for(kind: str):
    name = kind.split("-")[0]
    torch.manual_seed(0)
    config = make_config(name, target_of(), None, name="tiny", **KINDS[kind])
    return build_head(config, target_of(), token_counts=torch.arange(V), dtype=torch.float32).train()


def loss_and_grads(module, batch, anchors=None):
    module.zero_grad(set_to_none=True)
    if anchors is not None:  # DFlash: the same blocks in both layouts
        loss, _ = module.block_loss(batch, *anchors)
    else:
        loss, _ = module(batch) if isinstance(module, JointLoss) else module.compute_loss(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def placement(samples, capacity: int) -> dict[int, tuple[int, int]]:
    """Sample index -> (row, first column) where `collate_packed` puts it."""
    lengths = [len(s["input_ids"]) for s in samples]
    where = {}
    for r, row in enumerate(pack_rows(lengths, capacity)):
        offset = 0
        for i in row:
            where[i] = (r, offset)
            offset += lengths[i]
    return where


def packed_anchors(unpacked_anchors, ok, samples):
    """DFlash's anchors of the one-per-row batch, moved to where `collate_packed` puts each sample."""
    where = placement(samples, CAPACITY)
    per_row: dict[int, list[int]] = {}
    for i in range(len(samples)):
        r, offset = where[i]
        per_row.setdefault(r, []).extend(int(a) + offset for a in unpacked_anchors[i][ok[i]])
    A = max(len(v) for v in per_row.values())
    anchors = torch.zeros(len(per_row), A, dtype=torch.long)
    mask = torch.zeros(len(per_row), A, dtype=torch.bool)
    for r, picks in per_row.items():
        anchors[r, : len(picks)] = torch.tensor(sorted(picks))
        mask[r, : len(picks)] = True
    return anchors, mask


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_packed_loss_and_gradients_equal_one_conversation_per_row(kind):
    samples = conversations()
    head = head_for(kind)
    module = head
    if kind == "medusa2":  # the target trains too: its packed forward runs inside the loss
        from drafthead.train.loop.lora import wrap_lora

        target = wrap_lora(copy.deepcopy(target_of()), LoraConfig(r=2, dropout=0.0))
        module = JointLoss(head, target, (4,), lm_weight=1.0, head_weight=0.2)
        samples = [{k: v for k, v in s.items() if k != "hidden_states"} for s in samples]
    unpacked, packed = collate(samples), collate_packed(samples, CAPACITY)
    assert packed.input_ids.shape[0] == 3 < unpacked.input_ids.shape[0]
    anchors = None
    if kind == "dflash":
        drawn = sample_anchors(unpacked.labels_ok, 3, torch.Generator().manual_seed(0))
        anchors = drawn, packed_anchors(*drawn, samples)
    torch.manual_seed(1)
    loss_u, grads_u = loss_and_grads(module, unpacked, anchors and anchors[0])
    torch.manual_seed(1)
    loss_p, grads_p = loss_and_grads(module, packed, anchors and anchors[1])
    assert grads_u.keys() == grads_p.keys() and grads_u
    assert torch.allclose(loss_u, loss_p, rtol=1e-5, atol=1e-6), (loss_u, loss_p)
    for name, g in grads_u.items():
        assert torch.allclose(g, grads_p[name], rtol=1e-4, atol=1e-6), (name, (g - grads_p[name]).abs().max())


def test_a_conversation_shifted_across_a_row_boundary_would_change_the_loss():
    """Negative control: the same packed rows with one conversation's positions not restarted
    (so it reads as the tail of the one before it) give another loss."""
    samples = conversations()
    head = head_for("eagle3")
    packed = collate_packed(samples, CAPACITY)
    loss, _ = loss_and_grads(head, packed)
    merged = copy.copy(packed)
    merged.position_ids = packed.position_ids.clone()
    row = merged.position_ids[0]
    second = int((row == 0).nonzero()[1])  # where the row's second conversation starts
    row[second:] = torch.arange(second, second + len(row) - second)
    wrong, _ = loss_and_grads(head, merged)
    assert not torch.allclose(loss, wrong, rtol=1e-4)


# ----------------------------------------------------------------------------- the target


@pytest.mark.parametrize("family", TARGETS)
def test_the_targets_packed_forward_is_each_conversation_alone_or_refused(family):
    model = target_of(family)
    samples = conversations((7, 12, 4), with_hidden=False)  # one row of 23 beats 2 x 12
    batch = collate_packed(samples, 23)
    refusal = packing_refusal(model)
    if family == "gpt_oss":  # its masks ignore position ids: packed conversations would see each other
        assert refusal is not None and "does not keep packed conversations apart" in refusal
        return
    assert refusal is None
    assert batch.input_ids.shape[0] == 1  # all three in one row
    packed = target_features(model, batch.input_ids, batch.attention_mask, [2, 4], batch.position_ids)
    for i, (row, offset) in placement(samples, 23).items():
        n = len(samples[i]["input_ids"])
        alone = target_features(model, samples[i]["input_ids"][None], torch.ones(1, n, dtype=torch.long), [2, 4])
        for layer in (2, 4):
            assert torch.allclose(packed[layer][row, offset : offset + n], alone[layer][0], atol=1e-5), (family, layer)


def test_packing_is_on_where_exact_and_refused_in_one_line_where_not():
    say = []
    unset = load_config("tiny-eagle3")
    assert unset.data.packing is None
    assert packed_row_length(unset, target_of("llama"), say.append) == unset.data.max_length
    assert packed_row_length(unset, None, say.append) == unset.data.max_length  # captured features
    assert packed_row_length(unset, target_of("gpt_oss"), say.append) is None
    assert len(say) == 1 and say[0].startswith("one conversation per row")
    off = load_config("tiny-eagle3", ["data.packing=false"])
    assert packed_row_length(off, target_of("llama"), say.append) is None
    with pytest.raises(ConfigError, match=r"^data.packing: .*set data.packing=false$"):
        packed_row_length(load_config("tiny-eagle3", ["data.packing=true"]), target_of("gpt_oss"), say.append)
