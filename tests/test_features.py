"""Target features: online (inside the step) and captured (shards) feed the trainer the same batches."""

from __future__ import annotations

import json

import pytest
import torch

from drafthead.train.data.chat_format import tokenize_conversations
from drafthead.train.loop.config import TrainConfig
from drafthead.train.data.samples import TokenDataset
from drafthead.train.capture.features import (
    CapturedFeatures,
    OnlineFeaturizer,
    capture_features,
    collate,
    required_layers,
    target_features,
)
from drafthead.train.data.sources import load_conversations
from drafthead.train.data.tiny import tiny_target, tiny_tokenizer, write_tiny_jsonl
from drafthead.train.loop.trainer import Trainer, TrainData

LAYERS = (1, 2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("features")
    tok = tiny_tokenizer()
    model = tiny_target(tok)
    ds, _ = load_conversations("json", str(write_tiny_jsonl(tmp / "c.jsonl", 20)), use_cache=False)
    tokenized, _ = tokenize_conversations(ds, tok, max_length=48)
    return tmp, tok, model, TokenDataset(tokenized)


def test_target_features_match_the_full_forward(setup):
    _, tok, model, samples = setup
    batch = collate([samples[i] for i in range(3)], tok.pad_token_id)
    feats = target_features(model, batch.input_ids, batch.attention_mask, LAYERS)
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True).hidden_states
    assert sorted(feats) == list(LAYERS)
    real = batch.attention_mask.bool()
    for layer in LAYERS:
        assert torch.equal(feats[layer][real], full[layer][real])
        assert (feats[layer][~real] == 0).all()  # padding zeroed, as collate pads captured states
        assert not feats[layer].requires_grad


def _trainer(data):
    head = torch.nn.Linear(64, 4)  # only _batch is used: the head sets the feature dtype
    cfg = TrainConfig.from_dict({"head": {"kind": "medusa1"}, "batch_size": 4, "max_steps": 1, "report_to": "none"})
    return Trainer(cfg, head, data)


@pytest.fixture(scope="module")
def cap32(setup):
    """The samples' features captured in fp32, shards of 8 samples (made once per worker)."""
    tmp, tok, model, samples = setup
    capture_features(model, samples, LAYERS, tmp / "cap32", batch_size=4, shard_samples=8, dtype="float32", pad_token_id=tok.pad_token_id)
    return tmp / "cap32"


def test_online_and_captured_batches_are_identical(setup, cap32):
    tmp, tok, model, samples = setup
    captured = CapturedFeatures(cap32)
    assert len(captured) == len(samples) == 20 and captured.layers == LAYERS and captured.hidden_size == 64
    assert len(captured.index["shards"]) == 3

    online = _trainer(TrainData(train=samples, featurize=OnlineFeaturizer(model, LAYERS), pad_token_id=tok.pad_token_id))
    offline = _trainer(TrainData(train=captured, pad_token_id=tok.pad_token_id))
    for idx in ([0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]):  # the capture's own batches: bit-identical
        a, b = online._batch([samples[i] for i in idx]), offline._batch([captured[i] for i in idx])
        for name in ("input_ids", "attention_mask", "loss_mask"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.hidden_states.keys() == b.hidden_states.keys()
        for layer in LAYERS:
            assert torch.equal(a.hidden_states[layer], b.hidden_states[layer]), (idx, layer)
    # another batch composition changes only float rounding of the padded matmuls
    mixed = [3, 11, 5, 17]
    a, b = online._batch([samples[i] for i in mixed]), offline._batch([captured[i] for i in mixed])
    for layer in LAYERS:
        torch.testing.assert_close(a.hidden_states[layer], b.hidden_states[layer], atol=1e-5, rtol=1e-5)
    assert torch.equal(captured.token_counts(len(tok)), samples.token_counts(len(tok)))


def test_bf16_storage_halves_disk_and_rounds_only(setup, cap32):
    tmp, tok, model, samples = setup
    capture_features(model, samples, LAYERS, tmp / "cap16", batch_size=4, shard_samples=8, dtype="bfloat16", pad_token_id=tok.pad_token_id)
    full = CapturedFeatures(cap32)
    half = CapturedFeatures(tmp / "cap16")
    s32, s16 = full[5], half[5]
    assert s16["hidden_states"][1].dtype == torch.bfloat16
    assert torch.equal(s16["hidden_states"][1], s32["hidden_states"][1].to(torch.bfloat16))
    size = lambda d: sum(f.stat().st_size for f in d.glob("shard-*"))  # noqa: E731
    assert size(tmp / "cap16") < 0.6 * size(cap32)


def test_another_engines_features_are_what_the_capture_stores(setup):
    """capture_features(featurize=...) (the llama.cpp backend's path): the shards hold what the
    engine returned at each sample's real tokens, asked for with the same batches and layers."""
    tmp, tok, model, samples = setup
    asked = []

    def engine(input_ids, attention_mask, layers):  # another engine: twice the target's states
        asked.append((input_ids.shape, tuple(layers)))
        return {k: 2 * v for k, v in target_features(model, input_ids, attention_mask, layers).items()}

    capture_features(
        model, samples, LAYERS, tmp / "cap-engine", batch_size=4, shard_samples=8, dtype="float32", pad_token_id=tok.pad_token_id, featurize=engine
    )
    capture_features(model, samples, LAYERS, tmp / "cap-torch", batch_size=4, shard_samples=8, dtype="float32", pad_token_id=tok.pad_token_id)
    ours = CapturedFeatures(tmp / "cap-torch")
    theirs = CapturedFeatures(tmp / "cap-engine")
    assert len(asked) == 5 and all(layers == LAYERS for _, layers in asked)  # 20 samples in batches of 4
    for i in (0, 7, 19):
        for layer in LAYERS:
            torch.testing.assert_close(theirs[i]["hidden_states"][layer], 2 * ours[i]["hidden_states"][layer])


def test_capture_resumes_and_refuses_other_settings(setup):
    tmp, tok, model, samples = setup
    out = tmp / "cap-resume"
    capture_features(model, samples, LAYERS, out, batch_size=4, shard_samples=8, pad_token_id=tok.pad_token_id)
    first = out / "shard-00000.safetensors"
    stamp = first.stat().st_mtime_ns
    (out / "shard-00002.safetensors").unlink()  # as if interrupted before the last shard
    (out / "index.json").unlink()
    seen = []
    capture_features(model, samples, LAYERS, out, batch_size=4, shard_samples=8, pad_token_id=tok.pad_token_id, progress=seen.append)
    assert first.stat().st_mtime_ns == stamp  # complete shards are kept
    assert sum(seen) == 20 and len(CapturedFeatures(out)) == 20
    with pytest.raises(ValueError, match=r"made otherwise \(layers: \[1, 2\] -> \[0, 2\]\)"):
        capture_features(model, samples, (0, 2), out, batch_size=4, shard_samples=8)
    with pytest.raises(FileNotFoundError, match="data capture"):
        CapturedFeatures(tmp / "nothing")


def test_required_layers_from_head_configs(setup):
    _, tok, model, _ = setup
    from drafthead.heads.registry import make_config

    L = model.config.num_hidden_layers
    assert required_layers(make_config("medusa1", model, tok), L) == (L,)
    eagle3 = make_config("eagle3", model, tok, aux_layers=[0, 1])
    assert required_layers(eagle3, L) == tuple(sorted({0, 1, L}))
    with pytest.raises(ValueError, match="out of range"):
        required_layers(make_config("eagle3", model, tok, aux_layers=[0, 1]), 1)


def test_cli_capture_then_train_on_captured_features(tmp_path, isolated_cache, capsys):
    """`drafthead data capture` writes what `drafthead train features.mode=captured` reads."""
    from drafthead.cli import main
    from drafthead.train.data.tiny import save_tiny_target

    target = save_tiny_target(tmp_path / "target")
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 40)
    common = ["--config", "tiny-eagle3", f"target={target}", f"data.path={chats}", f"output_dir={tmp_path / 'run'}"]
    assert main(["data", "capture", *common, "--device", "cpu", "--out", str(tmp_path / "feats")]) == 0
    index = json.loads((tmp_path / "feats" / "index.json").read_text())
    assert index["layers"] == [1, 2, 3, 4] and index["num_samples"] == 40  # eagle3 aux layers (1, 2, 3) for L=4, plus L
    assert main(["train", *common, "features.mode=captured", f"features.path={tmp_path / 'feats'}", "features.dtype=float32"]) == 0
    assert (tmp_path / "run" / "final" / "config.json").exists()
    assert "head saved to" in capsys.readouterr().out
    # features captured from other data are refused: the train/eval split would not match
    rc = main(["train", *common, "data.limit=10", "features.mode=captured", f"features.path={tmp_path / 'feats'}", f"output_dir={tmp_path / 'run2'}"])
    assert rc == 2 and "capture again" in capsys.readouterr().err
    if not torch.cuda.is_available():  # capture runs on the GPU when there is one; asked for one without, it says so
        assert main(["data", "capture", *common, "--device", "cuda", "--out", str(tmp_path / "feats2")]) == 2
        assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "feats2").exists()
