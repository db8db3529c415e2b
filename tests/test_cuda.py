"""The engine, acceptance and training paths on a CUDA device (docs/testing.md "On a GPU").

Every test here runs on DRAFTHEAD_TEST_DEVICE: by default the GPU where there is one, else the
CPU, so `make test` runs their code on every commit and `scripts/gpu/check.sh` on the GPU. Set to
cuda on a machine without one, they skip:

- tree-masked verification with drafts accepted along a path that is not a prefix of the nodes
  (KV compaction), at batch 1 and in a ragged batch of 3, fp32, equal to plain greedy decoding;
- the same engine in bf16 on a target of bf16 weights: it decodes, accepts and keeps the batch's
  rows apart (bf16 output equals plain decoding only on the CPU's row-invariant kernels);
- an EAGLE-3 training step on packed rows: the device's loss and gradients equal the CPU's;
- what EAGLE-3's backward keeps grows linearly with the row (the long-context memory bound);
- the captured steps (inference/engine/graphs.py), replayed from CUDA graphs on a GPU and eager
  on the CPU: the round forward with the graphed EAGLE chain, steered to accept, at batch 1 and
  in a ragged batch of 3, and the batched greedy loop, each equal to plain greedy in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.chain_graph import GraphedChainDrafter
from drafthead.inference.drafters.load import head_drafter
from drafthead.inference.engine.compiled import StaticDecoding
from drafthead.inference.engine.greedy_graph import GreedyDecoder
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.train.capture.features import collate
from drafthead.train.capture.packing import collate_packed
from tests.eagle3_rows import V, loss_and_grads, samples_of
from tests.oracle import OracleDrafter, assert_accepts_and_stays_exact, by_row, known_continuation
from tests.tiny import left_padded, plain_greedy, prompts_of, repetitive_prompt, tiny_causal_lm

DEVICE = os.environ.get("DRAFTHEAD_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="DRAFTHEAD_TEST_DEVICE is cuda: no CUDA device")
NEW = 24


def on_device(dtype=torch.float32):
    """A tiny Llama and an untrained EAGLE-3 head on DEVICE, a prompt and a ragged batch there."""
    target = tiny_causal_lm("llama", layers=4).to(DEVICE, dtype)
    head = (
        build_head(
            make_config("eagle3", target, None, name="tiny", draft_vocab_size=64, aux_layers=(1, 2, 3)),
            target,
            token_counts=torch.arange(96),
            dtype=dtype,
        )
        .to(DEVICE)
        .eval()
    )
    prompt = repetitive_prompt(96, seed=8).to(DEVICE)
    prompts = [p.to(DEVICE) for p in prompts_of((5, 9, 13), seed=2)]
    ids, mask = (t.to(DEVICE) for t in left_padded(prompts))
    return target, head, prompt, prompts, ids, mask


def test_tree_verify_with_accepted_paths_equals_plain_greedy_at_batch_1_and_ragged_3():
    target, head, prompt, prompts, ids, mask = on_device()
    reference = plain_greedy(target, prompt, NEW)
    references = [plain_greedy(target, p[None], NEW) for p in prompts]
    assert_accepts_and_stays_exact(
        target,
        lambda: head_drafter(head),
        prompt,
        reference,
        prompts,
        references,
        ids,
        mask,
        NEW,
        NEW,
        lambda new: GenerationConfig(max_new_tokens=new),
    )


def test_bf16_decodes_accepts_and_keeps_rows_apart():
    target, head, prompt, prompts, ids, mask = on_device(torch.bfloat16)
    references = [plain_greedy(target, p[None], NEW) for p in prompts]
    continuation = known_continuation([p.tolist() + r for p, r in zip(prompts, references)])
    out = speculative_generate(
        target, OracleDrafter(head_drafter(head), continuation, 96, by_row), ids, GenerationConfig(max_new_tokens=NEW), attention_mask=mask
    )
    assert [row.new_tokens.shape[1] for row in out.rows] == [NEW] * 3
    assert max(n for row in out.rows for n in row.accepted_lengths) > 1  # drafts were accepted
    assert out.rows[2].new_tokens.device.type == torch.device(DEVICE).type


def test_a_training_step_on_packed_rows_equals_the_cpus():
    target = tiny_causal_lm("llama", vocab=V, layers=4, hidden=32)
    torch.manual_seed(0)
    config = make_config("eagle3", target, None, name="tiny", ttt_steps=3)
    head = build_head(config, target, token_counts=torch.arange(V), dtype=torch.float32).train()
    batch = collate_packed(samples_of(target, (23, 17, 30, 9)), 40)
    loss, grads = loss_and_grads(head, batch)
    head.to(DEVICE)
    target.to(DEVICE)
    device_loss, device_grads = loss_and_grads(head, batch.to(DEVICE))
    assert torch.allclose(device_loss.cpu(), loss, rtol=1e-4, atol=1e-5), (device_loss, loss)
    for name, g in grads.items():
        assert torch.allclose(device_grads[name].cpu(), g, rtol=1e-3, atol=1e-5), name


def test_what_the_backward_keeps_grows_linearly_on_the_device(monkeypatch):
    from drafthead.heads import ttt_attention as ttt

    target = tiny_causal_lm("llama", vocab=V, layers=4, hidden=32)
    torch.manual_seed(0)
    head = build_head(
        make_config("eagle3", target, None, name="tiny", ttt_steps=3), target, token_counts=torch.arange(V), dtype=torch.float32
    ).train()
    monkeypatch.setattr(ttt, "CHUNK_BYTES", 4 * 4 * 64 * 32)  # 32 query rows at T = 64
    samples = {T: collate(samples_of(target, (T,))) for T in (256, 1024)}
    head.to(DEVICE)
    target.to(DEVICE)

    def saved_bytes(T):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            head.compute_loss(samples[T].to(DEVICE))
        return sum(seen.values())

    small, large = saved_bytes(256), saved_bytes(1024)
    assert large < 4.4 * small, (small, large)


def test_captured_steps_equal_plain_greedy():
    target, head, prompt, prompts, ids, mask = on_device()
    reference = plain_greedy(target, prompt, NEW)
    references = [plain_greedy(target, p[None], NEW) for p in prompts]
    drafters = []

    def chain():
        drafters.append(GraphedChainDrafter(head, 3))
        return drafters[-1]

    assert_accepts_and_stays_exact(
        target, chain, prompt, reference, prompts, references, ids, mask, NEW, NEW, lambda new: GenerationConfig(max_new_tokens=new, compile="graphs")
    )
    decoder = GreedyDecoder(target, rows=4, slots=max(p.numel() for p in prompts) + NEW)
    assert decoder.run(prompts, NEW) == references
    if DEVICE.startswith("cuda"):  # recorded and replayed, not run eagerly
        assert StaticDecoding.of(target, "graphs").forward.replays > 0 and drafters[0].replays > 0
        assert decoder.step is not None and decoder.step.graph is not None
