"""EAGLE-3's training-time-test attention chunk by chunk (heads/ttt_attention.py) equals the dense
mask it replaces (heads/eagle3.py ttt_attention_mask), in loss and gradients: one row or packed
rows, GQA, a sliding window, one chunk or chunks of a few rows under checkpointing. And what it
keeps for the backward grows linearly with the sequence, where the dense mask's grew with T^2."""

from __future__ import annotations

import pytest
import torch

from drafthead.heads import ttt_attention as ttt
from drafthead.heads.eagle import window_mask
from drafthead.heads.eagle3 import ttt_attention_mask
from drafthead.heads.io import shift_left
from drafthead.heads.packing import row_positions
from drafthead.heads.registry import build_head, make_config
from drafthead.train.capture.features import collate
from drafthead.train.capture.packing import collate_packed
from tests.eagle3_rows import V, loss_and_grads, samples_of
from tests.tiny import tiny_causal_lm


def dense_unroll(self, fused, input_ids, steps, position_ids=None, split=None):
    """The unroll with the whole dense mask and the draft layer's own attention (sdpa): the rule
    as written in ttt_attention_mask, the reference here."""
    B, T = input_ids.shape
    cache = self.new_cache()
    positions = row_positions(position_ids, B, T, fused.device)
    window = self.config.sliding_window
    hidden = fused
    for i in range(steps):
        tokens = shift_left(input_ids, 1 + i)
        pos = positions + i
        mask = ttt_attention_mask(T, i, hidden.dtype, hidden.device, position_ids).expand(B, -1, -1, -1)
        if window is not None and position_ids is not None:
            mask = window_mask(mask, pos, window, torch.cat([positions] + [pos] * i, dim=1))
        out = self._hidden(hidden, tokens, pos, cache, mask)
        yield out
        hidden = self.feedback(out)


@pytest.mark.parametrize("family,packed", [("llama", False), ("llama", True), ("mistral", True), ("qwen3", False)])
def test_chunked_ttt_attention_equals_the_dense_mask(family, packed, monkeypatch):
    target = tiny_causal_lm(family, vocab=V, layers=4, hidden=32)
    torch.manual_seed(0)
    config = make_config("eagle3", target, None, name="tiny", ttt_steps=3, draft_layer="target")
    head = build_head(config, target, token_counts=torch.arange(V), dtype=torch.float32).train()
    samples = samples_of(target, (23, 17, 30, 9))
    batch = collate_packed(samples, 40) if packed else collate(samples)
    assert (batch.position_ids is not None) == packed
    results = {}
    for how, budget in (("one chunk", None), ("chunks of 3 rows", 3 * 4 * batch.input_ids.shape[0] * 4 * 40)):
        monkeypatch.setattr(ttt, "CHUNK_BYTES", budget or ttt.CHUNK_BYTES)
        results[how] = loss_and_grads(head, batch)
    monkeypatch.setattr(type(head), "ttt_unroll", dense_unroll)
    results["dense"] = loss_and_grads(head, batch)
    loss_d, grads_d = results["dense"]
    for how in ("one chunk", "chunks of 3 rows"):
        loss, grads = results[how]
        assert torch.allclose(loss, loss_d, rtol=1e-5, atol=1e-6), (how, loss, loss_d)
        assert grads.keys() == grads_d.keys() and grads
        for name, g in grads.items():
            assert torch.allclose(g, grads_d[name], rtol=1e-4, atol=1e-6), (how, name, (g - grads_d[name]).abs().max())


@pytest.mark.parametrize("loss,entropy_ramp", [("ce", 0.0), ("lk_lambda", 0.0), ("lk_alpha", 0.5)])
def test_the_loss_chunk_by_chunk_equals_the_loss_in_one_piece(loss, entropy_ramp, monkeypatch):
    """heads/eagle3.py distill_rows: chunks of 7 positions under checkpointing against one chunk;
    LK^lambda's weight and the entropy curriculum's cut are over all positions either way."""
    from drafthead.heads import losses

    target = tiny_causal_lm("llama", vocab=V, layers=4, hidden=32)
    torch.manual_seed(0)
    config = make_config("eagle3", target, None, name="tiny", ttt_steps=2, loss=loss, entropy_ramp=entropy_ramp)
    head = build_head(config, target, token_counts=torch.arange(V), dtype=torch.float32).train()
    head.train_progress = 0.2
    batch = collate(samples_of(target, (23, 30)))
    whole = loss_and_grads(head, batch)
    monkeypatch.setattr(losses, "LOSS_CHUNK_BYTES", 16 * head.config.draft_vocab_size * 7)
    monkeypatch.setattr(losses, "LOSS_KEEP_BYTES", 0)  # and recomputed in the backward
    chunked = loss_and_grads(head, batch)
    assert torch.allclose(chunked[0], whole[0], rtol=1e-5, atol=1e-6), (chunked[0], whole[0])
    for name, g in whole[1].items():
        assert torch.allclose(chunked[1][name], g, rtol=1e-4, atol=1e-6), (name, (chunked[1][name] - g).abs().max())


def test_chunk_rows_keeps_one_chunk_within_the_budget():
    assert ttt.chunk_rows(1, 9, 1000, budget=4 * 9 * 1000 * 10) == 10
    assert ttt.chunk_rows(2, 9, 32768, budget=64 << 20) * 4 * 2 * 9 * 32768 <= 64 << 20
    assert ttt.chunk_rows(1, 1, 10) == 10  # never more rows than the sequence
    assert ttt.chunk_rows(64, 64, 1 << 20) == 1  # never fewer than one


def test_what_the_backward_keeps_grows_linearly(monkeypatch):
    """Saved-tensor bytes of the loss's forward at T and 4T, chunked: about 4 times (linear; 3.96
    measured), where the dense mask made it 7.9 times (its [T, (i + 1) T] masks grow with T^2)."""
    target = tiny_causal_lm("llama", vocab=V, layers=4, hidden=32)
    torch.manual_seed(0)
    config = make_config("eagle3", target, None, name="tiny", ttt_steps=3)
    head = build_head(config, target, token_counts=torch.arange(V), dtype=torch.float32).train()
    monkeypatch.setattr(ttt, "CHUNK_BYTES", 4 * 4 * 64 * 32)  # 32 query rows at T = 64

    def saved_bytes(T):
        batch = collate(samples_of(target, (T,)))
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            head.compute_loss(batch)
        return sum(seen.values())

    small, large = saved_bytes(256), saved_bytes(1024)
    assert large < 4.4 * small, (small, large)


def test_training_sets_a_fixed_mmap_threshold_where_the_c_library_has_one():
    """train/loop/allocator.py: glibc takes the setting (its heap would fragment under long rows);
    elsewhere the call says it did nothing rather than fail."""
    import platform
    import sys

    from drafthead.train.loop.allocator import LONG_ROW_TOKENS, map_large_blocks, map_large_blocks_for

    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert map_large_blocks_for(LONG_ROW_TOKENS - 1) is False  # short rows keep glibc's defaults
    assert map_large_blocks() is glibc and map_large_blocks_for(LONG_ROW_TOKENS) is glibc
