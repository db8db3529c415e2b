"""From a run config to a Trainer (and to captured feature shards): the `build_*` layer between
the CLI and the loop (docs/style.md 7). The target is an argument; `run_training` alone loads it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

from .chat_format import FormatReport, tokenize_conversations
from .config import ConfigError, TrainConfig, check_resume, head_config_dict
from .features import CapturedFeatures, OnlineFeaturizer, TokenDataset, capture_features, required_layers
from .sources import SourceReport, load_conversations
from .checkpoint import latest_checkpoint, saved_run_config
from .lora import wrap_lora
from .trainer import CONFIG_FILE, TrainData, Trainer, TrainResult, check_output_dir, make_accelerator, split_indices


@dataclass
class Samples:
    dataset: torch.utils.data.Dataset  # TokenDataset or CapturedFeatures
    source_report: SourceReport | None = None
    format_report: FormatReport | None = None


def pad_token_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def head_config(config: TrainConfig, target_model, tokenizer, target_name: str | None = None):
    """The head's typed config for this target (heads.registry.make_config + the run's head options)."""
    from ..heads.registry import make_config

    return make_config(config.head_kind, target_model, tokenizer, name=target_name, **head_config_dict(config))


def token_samples(config: TrainConfig, tokenizer) -> Samples:
    """Conversations of `config.data`, chat-formatted with the target's tokenizer."""
    conversations, source_report = load_conversations(config.data.source, config.data.path, config.data.limit)
    tokenized, format_report = tokenize_conversations(conversations, tokenizer, config.data.max_length, num_proc=config.data.num_proc)
    if len(tokenized) == 0:
        raise ValueError(f"no sample left after chat formatting: {format_report.summary()}")
    return Samples(TokenDataset(tokenized), source_report, format_report)


def build_samples(config: TrainConfig, tokenizer, layers: tuple[int, ...]) -> Samples:
    if config.features.mode == "captured":
        captured = CapturedFeatures(config.features.path)
        missing = sorted(set(layers) - set(captured.layers))
        if missing:
            raise ConfigError(
                f"captured features at {config.features.path} hold layers {list(captured.layers)}; "
                f"this head needs {list(layers)} (missing {missing}): capture again for this head"
            )
        made_from = captured.index.get("meta", {}).get("data")
        if made_from is not None and made_from != config.to_dict()["data"]:
            raise ConfigError(
                f"captured features at {config.features.path} were made from data {made_from}, this run's data is "
                f"{config.to_dict()['data']}: the train/eval split would not match; capture again or fix the data section"
            )
        return Samples(captured)
    return token_samples(config, tokenizer)


def saved_head(config: TrainConfig, hcfg, target_model, tokenizer, target_name: str | None = None):
    """The head at `config.init_from` as float32 trainable weights, to continue training: same
    target (load_head checks the fingerprint), same architecture as this run's head section;
    loss-only fields (ttt_steps, loss weights) come from this run. Its draft vocab is kept."""
    from ..heads.registry import load_head

    if config.joint_lora:
        raise ConfigError("init_from is not supported for medusa2 (its saved adapter would be merged into the target)")
    head, _ = load_head(config.init_from, target_model, tokenizer, target_name, dtype=torch.float32)
    diffs = hcfg.architecture_diff(head.config)
    if diffs:
        raise ConfigError(f"init_from {config.init_from} holds a different head than this run's head section "
                          "(run != saved):\n  " + "\n  ".join(diffs))
    head.config = hcfg
    made_by = Path(config.init_from).parent / CONFIG_FILE  # the config.yaml of the run that saved it
    if made_by.exists():
        for line in split_differences(yaml.safe_load(made_by.read_text()) or {}, config):
            warnings.warn(f"init_from {config.init_from}: {line}", stacklevel=2)
    return head.train()


def split_differences(earlier: dict, config: TrainConfig) -> list[str]:
    """Why this run's train/eval split may differ from the run (config dict `earlier`) that made
    its init_from head: the split follows `seed` and the data section, and a different split
    lets eval score samples the head was trained on. [] when both match."""
    now = config.to_dict()
    return [f"{key} {earlier[key]!r} -> {now[key]!r}: the eval split differs from the earlier run's, "
            "so eval may include samples the head was trained on" for key in ("seed", "data")
            if key in earlier and earlier[key] != now[key]]


def build_trainer(
    config: TrainConfig,
    target_model,
    tokenizer,
    *,
    target_name: str | None = None,
    accelerator=None,
    say: Callable[[str], None] = lambda message: None,
) -> Trainer:
    """Everything a run needs, built from the config around an already loaded target."""
    accelerator = accelerator or make_accelerator(config)
    hcfg = head_config(config, target_model, tokenizer, target_name)
    layers = required_layers(hcfg, hcfg.final_layer)
    if config.joint_lora and config.features.mode == "captured":
        raise ConfigError("medusa2 trains the target jointly: its features change every step, so features.mode must be online")

    if config.data.streaming:
        return _streaming_trainer(config, hcfg, layers, target_model, tokenizer, target_name, accelerator, say)
    with accelerator.main_process_first():  # the first process fills the data caches, the others read them
        samples = build_samples(config, tokenizer, layers)
    for report in (samples.source_report, samples.format_report):
        if report is not None:
            say(report.summary())
    train_idx, eval_idx = split_indices(len(samples.dataset), config.data.eval_fraction, config.data.eval_size, config.seed)

    head = new_or_saved_head(config, hcfg, target_model, tokenizer, target_name, say,
                             lambda: samples.dataset.token_counts(hcfg.vocab_size, train_idx))
    target = None
    featurize = None
    if config.joint_lora:
        target = wrap_lora(target_model, config.lora)
    elif config.features.mode == "online":
        featurize = OnlineFeaturizer(target_model, layers)
    data = TrainData(
        train=torch.utils.data.Subset(samples.dataset, train_idx),
        eval=torch.utils.data.Subset(samples.dataset, eval_idx) if eval_idx else None,
        featurize=featurize,
        pad_token_id=pad_token_id(tokenizer),
    )
    return Trainer(config, head, data, accelerator=accelerator, target=target, layers=layers,
                   frozen_target=target_model if featurize is not None else None,
                   replay=build_replay(config, target_model, tokenizer, data.eval, head))


def build_replay(config: TrainConfig, target_model, tokenizer, eval_samples, head):
    """The replayed-acceptance eval (train/replay_eval.py) when `replay.sequences` > 0, else None.
    Its drafters are built around `head` once now, so settings the head cannot draft fail here."""
    if not config.replay.sequences:
        return None
    if not eval_samples:
        raise ConfigError("replay.sequences > 0 needs held-out samples: set data.eval_fraction (or data.eval_size) above 0")
    from ..heads.identity import eos_token_ids
    from .replay_eval import ReplayEval

    replay = ReplayEval(target_model, eval_samples, config.replay, eos_token_ids(target_model, tokenizer))
    try:
        replay.drafters(head)
    except ValueError as e:
        raise ConfigError(f"replay: {e}; set replay.chain to a depth this head drafts") from None
    return replay


def new_or_saved_head(config: TrainConfig, hcfg, target_model, tokenizer, target_name, say, token_counts: Callable[[], torch.Tensor]):
    """The head a run starts from: `init_from`'s, or a fresh one seeded by `config.seed`.
    token_counts: the training split's assistant-token counts, asked for only by EAGLE-3's reduced
    draft vocabulary (its most frequent assistant tokens)."""
    if config.init_from is not None:
        head = saved_head(config, hcfg, target_model, tokenizer, target_name)
        say(f"head initialised from {config.init_from}")
        return head
    from ..heads.registry import build_head

    counts = token_counts() if getattr(hcfg, "draft_vocab_size", hcfg.vocab_size) < hcfg.vocab_size else None
    torch.manual_seed(config.seed)  # the head's random init
    return build_head(hcfg, target_model, token_counts=counts, dtype=torch.float32)


def _streaming_trainer(config: TrainConfig, hcfg, layers, target_model, tokenizer, target_name, accelerator, say) -> Trainer:
    """A Trainer reading `config.data` lazily (train/streaming.py): online features only."""
    from .streaming import TokenStream

    if config.joint_lora:
        raise ConfigError("data.streaming is not supported for medusa2 yet: use data.streaming=false")
    data = config.data
    stream = TokenStream(data.source, data.path, tokenizer, data.max_length, eval_size=data.eval_size,
                         shuffle_buffer=data.shuffle_buffer, limit=data.limit)
    eval_samples = stream.eval_samples()
    say(f"streaming {stream.file} ({stream.format}): {len(eval_samples)} eval samples held out, the rest read lazily")
    head = new_or_saved_head(config, hcfg, target_model, tokenizer, target_name, say, lambda: stream.token_counts(hcfg.vocab_size))
    train_data = TrainData(train=stream, eval=eval_samples or None, featurize=OnlineFeaturizer(target_model, layers),
                           pad_token_id=pad_token_id(tokenizer))
    return Trainer(config, head, train_data, accelerator=accelerator, layers=layers, frozen_target=target_model,
                   replay=build_replay(config, target_model, tokenizer, train_data.eval, head))


def run_training(config: TrainConfig, *, resume: bool = False, overwrite: bool = False,
                 say: Callable[[str], None] = print) -> TrainResult:
    """Load the target named by the config on this process's device, build, train (resume and
    overwrite: Trainer.fit). The output_dir is checked before the target loads, so a refusal is quick."""
    from ..inference.engine.targets import load_target

    out = Path(config.output_dir)
    existing = latest_checkpoint(out)
    check_output_dir(out, existing, resume=resume, overwrite=overwrite)
    if resume and existing is not None:  # Trainer.fit checks again; here it costs no target load
        check_resume(saved_run_config(existing, out / CONFIG_FILE), config, str(existing))
    accelerator = make_accelerator(config)
    loaded = load_target(config.target, dtype=config.target_dtype, device=accelerator.device, threads=config.threads)
    main_say = say if accelerator.is_main_process else (lambda message: None)
    trainer = build_trainer(config, loaded.model, loaded.tokenizer, target_name=loaded.name, accelerator=accelerator, say=main_say)
    return trainer.fit(resume=resume, overwrite=overwrite)


def capture_from_config(
    config: TrainConfig,
    target_model,
    tokenizer,
    out_dir: str | Path,
    *,
    target_name: str | None = None,
    batch_size: int | None = None,
    progress: Callable[[int], None] | None = None,
    say: Callable[[str], None] = lambda message: None,
    share=None,
    engine=None,
) -> Path:
    """Capture the hidden states the config's head needs, over all of the config's samples (the
    trainer splits train/eval by index, the same way for online and captured data).
    share: this process's part of a capture run by several (train/workshare.py; default alone).
    engine: another engine's target with `hidden_states(input_ids, attention_mask, layers)` (the
    llama.cpp backend) in place of `target_model`'s forward; the capture's meta names it."""
    hcfg = head_config(config, target_model, tokenizer, target_name)
    layers = required_layers(hcfg, hcfg.final_layer)
    samples = token_samples(config, tokenizer)
    for report in (samples.source_report, samples.format_report):
        say(report.summary())
    meta = {"target": target_name, "data": config.to_dict()["data"]}
    if engine is not None:
        meta["engine"] = type(engine).__name__
    return capture_features(
        target_model, samples.dataset, layers, out_dir,
        batch_size=batch_size or config.batch_size, shard_samples=config.features.shard_samples,
        dtype=config.features.dtype, pad_token_id=pad_token_id(tokenizer), meta=meta, progress=progress, share=share,
        featurize=engine.hidden_states if engine is not None else None,
    )
