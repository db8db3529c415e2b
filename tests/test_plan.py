"""`drafthead train --plan`: the meta-device build counts what a real build holds, and the memory
model splits what FSDP shards and keeps what DDP replicates."""

import json

import pytest
import torch

from drafthead.heads.registry import build_head
from drafthead.train.loop.config import load_config
from drafthead.train.loop.plan import activation_bytes, memory_per_rank, plan_table, run_shapes
from drafthead.train.loop.run import head_config_for
from tests.tiny import tiny_causal_lm


# a causal LM, and a multimodal target whose decoder layers are its language model's
@pytest.fixture(scope="module", params=["llama", "qwen2_5_vl"])
def tiny_config_json(tmp_path_factory, request):
    model = tiny_causal_lm(request.param, layers=4)
    path = tmp_path_factory.mktemp("plan") / f"tiny-{request.param}.json"
    path.write_text(json.dumps(model.config.to_dict()))
    return model, path


@pytest.mark.parametrize("kind", ["eagle3", "medusa1"])
def test_meta_build_counts_what_a_real_build_holds(tiny_config_json, kind):
    model, path = tiny_config_json
    config = load_config(f"tiny-{kind}")
    shapes = run_shapes(config, path)
    real = build_head(head_config_for(config, model, None, "tiny-llama"), model, token_counts=torch.ones(96, dtype=torch.long), dtype=torch.float32)
    assert shapes.head_trainable == sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert shapes.target_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert shapes.largest_layer_bytes == sum(p.numel() * 4 for p in model.get_decoder().layers[0].parameters()) > 0
    assert shapes.tokens == config.batch_size * config.data.max_length


def test_fsdp_shards_what_ddp_replicates(tiny_config_json):
    _, path = tiny_config_json
    shapes = run_shapes(load_config("tiny-eagle3"), path)
    one = memory_per_rank(shapes, "ddp", 1)
    for n in (2, 8):
        ddp, fsdp = memory_per_rank(shapes, "ddp", n), memory_per_rank(shapes, "fsdp", n)
        assert {k: ddp[k] for k in one} == one  # DDP: every rank holds everything
        for part in ("params", "grads", "optimizer"):
            assert fsdp[part] == one[part] // n
        # the decoder layers are sharded; embedding, final norm and LM head stay whole (train/loop/sharding.py)
        whole = shapes.target_bytes - shapes.layers_bytes
        assert 0 < whole < shapes.target_bytes and fsdp["target"] == whole + shapes.layers_bytes // n
        assert fsdp["activations"] == one["activations"] == activation_bytes(shapes)
        assert fsdp["gathered"] > 0 and ddp["gathered"] == 0
        assert fsdp["total"] == sum(v for k, v in fsdp.items() if k != "total")
    with pytest.raises(ValueError):
        memory_per_rank(shapes, "zero", 2)


def test_plan_table_and_the_shipped_large_shapes(tiny_config_json):
    _, path = tiny_config_json
    table = plan_table(load_config("tiny-eagle3"), path, ranks=(1, 4))
    assert table.count("| ddp |") == 2 and table.count("| fsdp |") == 2
    # the shipped large configs build on the meta device (no weights) with their real sizes
    shapes = run_shapes(load_config("eagle3", ["target_dtype=bfloat16"]), "configs/targets/llama-3.1-8b.json")
    assert 7.9e9 < shapes.target_bytes / 2 < 8.1e9  # Llama-3.1-8B: 8.03B parameters


def test_split_rows_hold_a_share_of_the_columns_plus_the_gathered_keys(tiny_config_json):
    _, path = tiny_config_json
    one = run_shapes(load_config("tiny-eagle3"), path)
    split = run_shapes(load_config("tiny-eagle3", ["context_parallel=4"]), path)
    assert split.tokens == -(-one.tokens // 4) and one.gathered_keys == 0
    kv_width = split.gathered_keys // (2 * one.tokens)
    assert 0 < kv_width <= one.hidden and split.gathered_keys == 2 * one.tokens * kv_width
    extra = 4 * split.steps * split.gathered_keys  # each step's whole-row keys and values, fp32
    assert activation_bytes(split) - extra < activation_bytes(one)
    assert "split across 4 ranks" in plan_table(load_config("tiny-eagle3", ["context_parallel=4"]), path, ranks=(4,))
