"""Run configs: typed dataclasses, YAML presets, key=value overrides, unknown keys rejected."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from drafthead.train.loop.config import (
    PRESET_DIR,
    ConfigError,
    DataConfig,
    FeaturesConfig,
    LoraConfig,
    ReplayConfig,
    TrainConfig,
    apply_overrides,
    load_config,
)

SMOLLM2_PRESETS = ("medusa1", "medusa2", "hydra", "eagle1", "eagle3", "eagle31", "peagle", "dflash", "dspark")
SECTIONS = {"data": DataConfig, "features": FeaturesConfig, "lora": LoraConfig, "replay": ReplayConfig}


def names(cls):
    return [f.name for f in dataclasses.fields(cls)]


def test_unknown_keys_name_the_key_and_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown config key 'lrr'; valid keys: .*\blr\b.*warmup_steps"):
        load_config(None, ["lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'data.limt'; valid keys under data: source, path, limit"):
        load_config(None, ["data.limt=5"])
    with pytest.raises(ConfigError, match=r"head: unknown MedusaConfig key\(s\): num_head\b"):
        load_config(None, ["head.kind=medusa1", "head.num_head=3"])


def test_overrides_types_and_nesting(tmp_path):
    cfg = load_config(
        None,
        [
            "lr=1e-3",
            "data.limit=7",
            "head={kind: eagle3, ttt_steps: 3}",
            "betas=[0.8, 0.9]",
            "max_steps=5",
            "clip_norm=null",
            "report_to=none",
            "lora.target_modules=[q_proj]",
        ],
    )
    assert cfg.lr == 1e-3 and isinstance(cfg.lr, float)  # YAML reads 1e-3 as a string; coerced
    assert cfg.data.limit == 7 and cfg.head == {"kind": "eagle3", "ttt_steps": 3}
    assert cfg.betas == [0.8, 0.9] and cfg.clip_norm is None and cfg.lora.target_modules == ["q_proj"]
    assert cfg.head_config.kind == "eagle3" and cfg.head_config.ttt_steps == 3 and cfg.head_config.target is None
    # overrides act on a copy and on nested keys of a file
    path = tmp_path / "c.yaml"
    path.write_text("head: {kind: medusa1, num_heads: 2}\ndata: {limit: 3}\n")
    cfg = load_config(path, ["head.num_heads=5", "data.max_length=64"])
    assert cfg.head == {"kind": "medusa1", "num_heads": 5} and cfg.data.limit == 3 and cfg.data.max_length == 64
    base = {"a": {"b": 1}}
    assert apply_overrides(base, ["a.b=2"]) == {"a": {"b": 2}} and base == {"a": {"b": 1}}
    for bad, pattern in [
        (["lr=fast"], "lr must be a number"),
        (["schedule=step"], "schedule must be one of"),
        (["batch_size=0"], "batch_size must be >= 1"),
        (["features.mode=captured"], "needs features.path"),
        (["data=3"], "data must be a mapping"),
        (["noequals"], "not key=value"),
        (["max_steps=null", "epochs=null"], "max_steps or epochs"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            load_config(None, bad)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config("eagle3", ["lr=5e-4", "data.limit=10"])
    cfg.save(tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg


@pytest.mark.parametrize("name", SMOLLM2_PRESETS)
def test_smollm2_presets_mirror_the_dataclasses(name):
    raw = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
    assert list(raw) == names(TrainConfig)  # every field, in declaration order
    for section, cls in SECTIONS.items():
        assert list(raw[section]) == names(cls), section
    cfg = load_config(name)
    assert cfg.target == "smollm2-135m" and cfg.head_kind == name
    assert cfg.head_config.kind == name  # the head section is valid for its kind
    # docs/cpu-measurements.md: capture once, bf16 where native (medusa2's target trains: online)
    assert cfg.mixed_precision == "auto" and cfg.target_dtype == "auto"
    assert cfg.features.mode == ("online" if name == "medusa2" else "captured")


def test_replay_and_keep_best_are_checked():
    for bad, pattern in [
        (["replay.sequences=-1"], "replay.sequences must be >= 0"),
        (["replay.chain=0"], "replay.chain must be >= 1"),
        (["keep_best=acc_0"], "keep_best must be one of none, tau_est, replay_tau"),
        (["keep_best=replay_tau"], "needs replay.sequences > 0"),
        (["replay.sequences=4", "head.kind=medusa2"], "not supported for medusa2"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            load_config(None, bad)
    cfg = load_config("eagle3", ["keep_best=replay_tau"])
    assert cfg.replay.sequences == 8 and cfg.replay.chain == 3  # the presets replay a few prompts at each eval
    assert load_config("tiny-eagle3").replay.sequences == 0  # tiny runs stay cheap unless a test turns it on


def test_tiny_presets_load():
    tiny = sorted(p.stem for p in PRESET_DIR.glob("tiny-*.yaml"))
    assert tiny == [f"tiny-{k}" for k in sorted(SMOLLM2_PRESETS)]
    for name in tiny:
        cfg = load_config(name)
        assert cfg.head_config.kind == name.removeprefix("tiny-")
        assert cfg.max_steps is not None and cfg.report_to == "none"


def test_accelerate_configs():
    expected = {"single": "NO", "cpu_2proc": "MULTI_CPU", "multi_gpu": "MULTI_GPU", "fsdp": "FSDP"}
    for name, kind in expected.items():
        cfg = yaml.safe_load((PRESET_DIR / "accelerate" / f"{name}.yaml").read_text())
        assert cfg["distributed_type"] == kind
    assert yaml.safe_load((PRESET_DIR / "accelerate" / "cpu_2proc.yaml").read_text())["use_cpu"] is True


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="presets: .*eagle3"):
        load_config("eagle9")
