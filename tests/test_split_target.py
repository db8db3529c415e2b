"""The target's forward split by columns across 2 gloo processes (train/capture/split_target.py) gives each
rank the unsplit forward's hidden states for its columns, the final layer with its halo, within
fp32 rounding: plain and packed rows, lengths the ranks do not divide, sliding windows (Mistral,
Gemma 3's alternating layers), attention sinks (gpt-oss), multi-head latent attention (DeepSeek-V3),
M-RoPE positions (Qwen2.5-VL), and query chunks of a few rows. An EAGLE-3 loss on the split
features equals the unsplit one; targets whose layers cannot be split are named."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from drafthead.heads.batch import FeatureBatch
from drafthead.heads.context_split import ContextSplit
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.servers.local import free_port
from drafthead.train.capture import split_target
from drafthead.train.capture.features import collate, target_features
from drafthead.train.capture.packing import collate_packed
from drafthead.train.capture.split_target import split_refusal, split_target_features
from tests.eagle3_rows import V, loss_and_grads, samples_of
from tests.tiny import tiny_causal_lm

pytestmark = pytest.mark.subprocess  # starts processes of its own (pyproject.toml markers)

LAYERS, FINAL, HALO = (1, 2, 3, 4), 4, 3
EVEN, ODD = (23, 17, 30, 9), (23, 17, 31)
CASES = {  # name: (family, packed, sample lengths, query chunk budget in bytes or None)
    "llama": ("llama", False, EVEN, None),
    "llama-packed-chunks": ("llama", True, EVEN, 4 * 4 * 40 * 3),
    "mistral-window-packed-odd": ("mistral", True, ODD, None),
    "gemma3-alternating-odd": ("gemma3", False, ODD, None),
    "gpt_oss-sinks": ("gpt_oss", False, EVEN, None),
    "deepseek_v3-mla": ("deepseek_v3", False, ODD, None),
    "qwen2_5_vl-mrope-packed": ("qwen2_5_vl", True, EVEN, None),
}


LOSS_CASE = "mistral-window-packed-odd"


def eagle3_head(target):
    torch.manual_seed(0)
    return build_head(
        make_config("eagle3", target, None, name="tiny", ttt_steps=HALO, draft_layer="target"),
        target,
        token_counts=torch.arange(V),
        dtype=torch.float32,
    ).train()


def target_and_batch(family: str, packed: bool, lengths):
    target = tiny_causal_lm(family, vocab=V, layers=4, hidden=32)
    samples = samples_of(target, lengths)
    return target, (collate_packed(samples, 40) if packed else collate(samples))


def worker(rank: int, size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        results = {}
        for case, (family, packed, lengths, budget) in CASES.items():
            split_target.CHUNK_BYTES = budget or (64 << 20)
            target, batch = target_and_batch(family, packed, lengths)
            results[case] = split_target_features(
                target, batch.input_ids, batch.attention_mask, LAYERS, ContextSplit(rank, size), batch.position_ids, final=FINAL, halo=HALO
            )
        target, batch = target_and_batch(*CASES[LOSS_CASE][:3])
        head = eagle3_head(target)
        head.context_split = ContextSplit(rank, size)
        local = FeatureBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, results[LOSS_CASE], batch.position_ids, split_columns=True)
        loss, grads = loss_and_grads(head, local)
        dist.all_reduce(loss)
        for g in grads.values():
            dist.all_reduce(g)
        results["loss"] = (loss, grads)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def split_runs(run_once):
    """Each rank's results (one spawn of two ranks a test run)."""

    def spawn(folder):
        mp.start_processes(worker, args=(2, free_port(), str(folder / "features")), nprocs=2, start_method="spawn")

    out = run_once("split-target", spawn) / "features"
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rank_gets_the_unsplit_states_of_its_columns(case, split_runs):
    family, packed, lengths, _ = CASES[case]
    target, batch = target_and_batch(family, packed, lengths)
    whole = target_features(target, batch.input_ids, batch.attention_mask, LAYERS, batch.position_ids)
    T = batch.input_ids.shape[1]
    S = -(-T // 2)
    for rank, got in enumerate(split_runs):
        for layer in LAYERS:
            width = S + (HALO if layer == FINAL else 0)
            want = torch.nn.functional.pad(whole[layer], (0, 0, 0, 2 * S + HALO - T))[:, rank * S : rank * S + width]
            assert got[case][layer].shape == want.shape, (layer, got[case][layer].shape, want.shape)
            torch.testing.assert_close(got[case][layer], want, rtol=1e-4, atol=1e-5, msg=f"{case} rank {rank} layer {layer}")


def test_an_eagle3_loss_on_split_features_equals_the_unsplit_one(split_runs):
    """The head reads a split batch's features as they come and its final states at their halo;
    the ranks' shares add up to the unsplit loss, and so do their gradients."""
    target, batch = target_and_batch(*CASES[LOSS_CASE][:3])
    loss, grads = loss_and_grads(eagle3_head(target), batch)
    split_loss, split_grads = split_runs[0]["loss"]
    torch.testing.assert_close(split_loss, loss, rtol=1e-5, atol=1e-6)
    assert split_grads.keys() == grads.keys() and len(grads) > 5
    for name, g in grads.items():
        torch.testing.assert_close(split_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_targets_whose_layers_do_not_attend_over_every_key_are_named():
    assert split_refusal(tiny_causal_lm("llama")) is None
    assert split_refusal(tiny_causal_lm("gemma3")) is None
    assert "chunked" in split_refusal(tiny_causal_lm("llama4", layers=4))
