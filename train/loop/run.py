"""From a run config to a Trainer (and to captured feature shards): the `build_*` layer between
the CLI and the loop (docs/style.md 7). The target is an argument; `run_training` alone loads it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from ..data.chat_format import FormatReport, tokenize_conversations
from .config import ConfigError, TrainConfig, check_resume
from ..capture.features import CapturedFeatures, OnlineFeaturizer, capture_features, plan_changes, required_layers
from ..data.samples import TokenDataset
from ...ground.target.load import target_folder
from ..data.image_chats import load_processor
from ..data.sources import SourceReport, data_fingerprint, load_conversations
from .checkpoint import check_same_data, checkpoint_root, latest_checkpoint, saved_run_config
from .lora import wrap_lora
from ..capture.packing import packing_refusal
from .trainer import CONFIG_FILE, FINAL_DIR, TrainData, Trainer, TrainResult, check_output_dir, make_accelerator, split_indices


@dataclass
class Samples:
    dataset: TokenDataset | CapturedFeatures
    source_report: SourceReport | None = None
    format_report: FormatReport | None = None


def pad_token_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def head_config_for(config: TrainConfig, target_model, tokenizer, target_name: str | None = None):
    """The run's head config (its head section, parsed when the config was made) for this target."""
    from ...heads.registry import bind_target

    return bind_target(config.head_config, target_model, tokenizer, target_name)


def token_samples(config: TrainConfig, tokenizer) -> Samples:
    """Conversations of `config.data`, chat-formatted with the target's tokenizer."""
    conversations, source_report = load_conversations(config.data.source, config.data.path, config.data.limit)
    processor = None
    if any(conversations["images"]):  # chats with images: the target's processor formats them
        processor = load_processor(str(target_folder(config.target)[0]))
    tokenized, format_report = tokenize_conversations(
        conversations, tokenizer, config.data.max_length, num_proc=config.data.num_proc, processor=processor
    )
    if len(tokenized) == 0:
        raise ValueError(f"no sample left after chat formatting: {format_report.summary()}")
    return Samples(TokenDataset(tokenized, processor), source_report, format_report)


def build_samples(config: TrainConfig, tokenizer, layers: tuple[int, ...], target_model=None) -> Samples:
    """The run's samples: tokenized conversations, or captured features checked against what
    this run would capture (capture_meta; the target's part when `target_model` is given)."""
    if config.features.mode == "captured":
        assert config.features.path is not None  # FeaturesConfig refuses captured features without a path
        captured = CapturedFeatures(config.features.path)
        missing = sorted(set(layers) - set(captured.layers))
        if missing:
            raise ConfigError(
                f"captured features at {config.features.path} hold layers {list(captured.layers)}; "
                f"this head needs {list(layers)} (missing {missing}): capture again for this head"
            )
        changed = stale_capture(captured.index.get("meta", {}), config, target_model, tokenizer)
        if changed:
            raise ConfigError(
                f"captured features at {config.features.path} were made from other inputs than this run's "
                f"({'; '.join(changed)}): capture again (`drafthead data capture --overwrite`) or fix the config"
            )
        return Samples(captured)
    return token_samples(config, tokenizer)


# data settings that change how samples are batched, not what is captured from each
LAYOUT_ONLY = ("packing",)


def capture_meta(config: TrainConfig, target_model=None, tokenizer=None, target_name: str | None = None) -> dict:
    """What a capture is made from, recorded in its plan and index: the data section and the data's
    content hash, and (given the target) its identity with the tokenizer's fingerprint and a
    fingerprint of its weights (ground/target/identity.py)."""
    from ..data.sources import data_fingerprint

    data = {k: v for k, v in config.to_dict()["data"].items() if k not in LAYOUT_ONLY}
    meta: dict[str, Any] = {"data": data, "data_sha256": data_fingerprint(config.data.source, config.data.path)}
    if target_model is not None:
        meta.update(target_meta(target_model, tokenizer, target_name))
    return meta


def target_meta(target_model, tokenizer, target_name: str | None = None) -> dict:
    """The target's part of a capture's meta: its name, identity and weights' fingerprint."""
    from ...ground.target.identity import identify_target, weights_fingerprint

    return {
        "target": target_name,
        "target_identity": identify_target(target_model, tokenizer, target_name).to_dict(),
        "target_weights_sha256": weights_fingerprint(target_model),
    }


def trained_data_fingerprint(config: TrainConfig) -> str:
    """What the run trains on, for the resume check: the data file's content, or for captured
    served traffic (a buffer of train/adapt/, with no data file behind it) the buffer's index."""
    import hashlib
    import json

    from ..capture.features import INDEX_FILE, SERVED_TRAFFIC

    if config.features.mode == "captured" and config.features.path:
        try:
            index = (Path(config.features.path) / INDEX_FILE).read_bytes()
            served = json.loads(index).get("meta", {}).get("source") == SERVED_TRAFFIC
        except (OSError, ValueError, AttributeError):
            served = False  # no readable index: loading the capture says what is wrong with it
        if served:
            return hashlib.sha256(index).hexdigest()
    return data_fingerprint(config.data.source, config.data.path)


def stale_capture(made_from: dict, config: TrainConfig, target_model=None, tokenizer=None) -> list[str]:
    """How the inputs a capture was made from (its meta) differ from this config's (and this
    target's, when given): 'what: then -> now' lines; [] when they agree. The target's name is
    not compared (a path or a hub id for the same model)."""
    from ...ground.target.identity import TargetIdentity, identity_diff
    from ..capture.features import SERVED_TRAFFIC

    changed = []
    if made_from.get("source") != SERVED_TRAFFIC:  # a served-traffic buffer (train/adapt/) has no data section behind it
        now = capture_meta(config)
        if made_from.get("data") != now["data"]:
            changed += [f"{line} (the train/eval split would differ)" for line in plan_changes(made_from.get("data") or {}, now["data"], "data.")]
        if made_from.get("data_sha256") != now["data_sha256"]:
            changed.append(f"the content of {config.data.path or config.data.source} (it changed since the capture)")
    if target_model is not None:
        now = target_meta(target_model, tokenizer)
        then = made_from.get("target_identity")
        if then is None:
            changed.append("the target (the capture does not record it)")
        else:
            changed += identity_diff(TargetIdentity.from_dict(then), TargetIdentity.from_dict(now["target_identity"]), expects="captured from")
            if made_from.get("target_weights_sha256") != now["target_weights_sha256"]:
                changed.append(f"the target's weights (captured from {made_from.get('target')!r}, a different model than this run's target)")
    return changed


def saved_head(config: TrainConfig, hcfg, target_model, tokenizer, target_name: str | None = None):
    """The head at `config.init_from` as float32 trainable weights, to continue training: same
    target (load_head checks the fingerprint), same architecture as this run's head section;
    loss-only fields (ttt_steps, loss weights) come from this run. Its draft vocab is kept."""
    from ...heads.registry import load_head

    if config.joint_lora:
        raise ConfigError("init_from is not supported for medusa2 (its saved adapter would be merged into the target)")
    assert config.init_from is not None  # called for a run with init_from
    head, _ = load_head(config.init_from, target_model, tokenizer, target_name, dtype=torch.float32)
    diffs = hcfg.architecture_diff(head.config)
    if diffs:
        raise ConfigError(
            f"init_from {config.init_from} holds a different head than this run's head section (run != saved):\n  " + "\n  ".join(diffs)
        )
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
    return [
        f"{key} {earlier[key]!r} -> {now[key]!r}: the eval split differs from the earlier run's, so eval may include samples the head was trained on"
        for key in ("seed", "data")
        if key in earlier and earlier[key] != now[key]
    ]


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
    hcfg = head_config_for(config, target_model, tokenizer, target_name)
    layers = required_layers(hcfg, hcfg.final_layer)
    say_if_not_exportable(hcfg, say)
    if config.joint_lora and config.features.mode == "captured":
        raise ConfigError("medusa2 trains the target jointly: its features change every step, so features.mode must be online")

    if config.data.streaming:
        return _streaming_trainer(config, hcfg, layers, target_model, tokenizer, target_name, accelerator, say)
    with accelerator.main_process_first():  # the first process fills the data caches, the others read them
        samples = build_samples(config, tokenizer, layers, target_model)
    for report in (samples.source_report, samples.format_report):
        if report is not None:
            say(report.summary())
    train_idx, eval_idx = split_indices(len(samples.dataset), config.data.eval_fraction, config.data.eval_size, config.seed)
    check_eval_split(config, len(eval_idx), f"{len(samples.dataset)} samples", say)

    head = new_or_saved_head(
        config, hcfg, target_model, tokenizer, target_name, say, lambda: samples.dataset.token_counts(hcfg.vocab_size, train_idx)
    )
    target = None
    featurize = None
    online = config.joint_lora or config.features.mode == "online"
    with_images = getattr(samples.dataset, "processor", None) is not None  # a TokenDataset of chats with images
    if config.joint_lora and with_images:
        raise ConfigError("medusa2 adapts the target on text rows; this data has images (not built): train medusa1 or another kind on it")
    if online and with_images:
        if config.data.packing:
            raise ConfigError("data.packing: rows with images are not packed (the target numbers their positions itself); set data.packing=false")
        say("one conversation per row: the data has images")
        pack_length = None
    else:
        pack_length = packed_row_length(config, target_model if online else None, say)
    if config.joint_lora:
        target = wrap_lora(target_model, config.lora)
    elif online:
        featurize = OnlineFeaturizer(target_model, layers)
    data = TrainData(
        train=torch.utils.data.Subset(samples.dataset, train_idx),
        eval=torch.utils.data.Subset(samples.dataset, eval_idx) if eval_idx else None,
        featurize=featurize,
        pad_token_id=pad_token_id(tokenizer),
        pack_length=pack_length,
    )
    return Trainer(
        config,
        head,
        data,
        accelerator=accelerator,
        target=target,
        layers=layers,
        frozen_target=target_model if featurize is not None else None,
        replay=build_replay(config, target_model, tokenizer, data.eval, head),
    )


def packed_row_length(config: TrainConfig, target_model, say: Callable[[str], None]) -> int | None:
    """The row length of packed batches (data.max_length), or None for one sample per row.
    target_model: the target whose forward runs on the rows (online features, medusa2), None for
    captured features. `data.packing` unset packs wherever it is exact; true where it is not is
    refused in one line (train/capture/packing.py packing_refusal)."""
    setting = config.data.packing
    if setting is False:
        return None
    why = packing_refusal(target_model) if target_model is not None else None
    if why is not None:
        if setting:
            raise ConfigError(f"data.packing: {why}; set data.packing=false")
        say(f"one conversation per row: {why}")
        return None
    return config.data.max_length


def check_eval_split(config: TrainConfig, n_eval: int, samples: str, say: Callable[[str], None]) -> None:
    """A run whose data leaves no eval split: refused when it keeps the best head (best/ would
    never be written), else said at the start (no eval metric would appear)."""
    if n_eval:
        return
    d = config.data
    why = f"{samples} with data.eval_fraction={d.eval_fraction}, data.eval_size={d.eval_size} leave none for eval"
    if config.keep_best != "none":
        raise ConfigError(
            f"keep_best={config.keep_best} needs held-out samples, but {why}: raise data.eval_fraction "
            "or data.eval_size, add data, or set keep_best=none"
        )
    say(f"no eval: {why}; only training metrics are reported")


def build_replay(config: TrainConfig, target_model, tokenizer, eval_samples, head):
    """The replayed-acceptance eval (train/loop/replay_eval.py) when `replay.sequences` > 0, else None.
    Its drafters are built around `head` once now, so settings the head cannot draft fail here."""
    if not config.replay.sequences:
        return None
    if not eval_samples:
        raise ConfigError("replay.sequences > 0 needs held-out samples: set data.eval_fraction (or data.eval_size) above 0")
    from ...ground.target.identity import eos_token_ids
    from .replay_eval import ReplayEval

    replay = ReplayEval(target_model, eval_samples, config.replay, eos_token_ids(target_model, tokenizer))
    try:
        replay.drafters(head)
    except ValueError as e:
        raise ConfigError(f"replay: {e}; set replay.chain to a depth this head drafts") from None
    return replay


def say_if_not_exportable(hcfg, say: Callable[[str], None]) -> None:
    """Before the work: an EAGLE-3-family head whose features no engine can fuse (a target too
    shallow for 3 distinct decoder-layer outputs, or aux_layers set so) trains and runs here, but
    every engine export will refuse it."""
    from ...heads.config import Eagle3Config, engine_layer_problem

    if not isinstance(hcfg, Eagle3Config):
        return
    problem = engine_layer_problem(hcfg.feature_layers, hcfg.final_layer)
    if problem is not None:
        say(
            f"note: this head will run in drafthead only, no engine export will take it: {problem} "
            f"(a target of {hcfg.final_layer} layers; the engines need 3 distinct indices in 1..L-1, so L >= 4)"
        )


def new_or_saved_head(config: TrainConfig, hcfg, target_model, tokenizer, target_name, say, token_counts: Callable[[], torch.Tensor]):
    """The head a run starts from: `init_from`'s, or a fresh one seeded by `config.seed`.
    token_counts: the training split's assistant-token counts, asked for only by EAGLE-3's reduced
    draft vocabulary (its most frequent assistant tokens)."""
    if config.init_from is not None:
        head = saved_head(config, hcfg, target_model, tokenizer, target_name)
        say(f"head initialised from {config.init_from}")
        return head
    from ...heads.registry import build_head

    counts = token_counts() if getattr(hcfg, "draft_vocab_size", hcfg.vocab_size) < hcfg.vocab_size else None
    torch.manual_seed(config.seed)  # the head's random init
    return build_head(hcfg, target_model, token_counts=counts, dtype=torch.float32)


def _streaming_trainer(config: TrainConfig, hcfg, layers, target_model, tokenizer, target_name, accelerator, say) -> Trainer:
    """A Trainer reading `config.data` lazily (train/data/streaming.py): online features only."""
    from ..data.streaming import TokenStream

    if config.joint_lora:
        raise ConfigError("data.streaming is not supported for medusa2 yet: use data.streaming=false")
    data = config.data
    assert data.eval_size is not None  # DataConfig refuses streaming without eval_size
    stream = TokenStream(
        data.source, data.path, tokenizer, data.max_length, eval_size=data.eval_size, shuffle_buffer=data.shuffle_buffer, limit=data.limit
    )
    eval_samples = stream.eval_samples()
    check_eval_split(config, len(eval_samples), "the stream", say)
    say(f"streaming {stream.file} ({stream.format}): {len(eval_samples)} eval samples held out, the rest read lazily")
    head = new_or_saved_head(config, hcfg, target_model, tokenizer, target_name, say, lambda: stream.token_counts(hcfg.vocab_size))
    train_data = TrainData(
        train=stream,
        eval=eval_samples or None,
        featurize=OnlineFeaturizer(target_model, layers),
        pad_token_id=pad_token_id(tokenizer),
        pack_length=packed_row_length(config, target_model, say),
    )
    return Trainer(
        config,
        head,
        train_data,
        accelerator=accelerator,
        layers=layers,
        frozen_target=target_model,
        replay=build_replay(config, target_model, tokenizer, train_data.eval, head),
    )


def run_training(
    config: TrainConfig, *, resume: bool = False, overwrite: bool = False, say: Callable[[str], None] = print, inputs: tuple = ()
) -> TrainResult:
    """Load the target named by the config on this process's device, build, train (resume and
    overwrite: Trainer.fit), holding output_dir's lock (ground/outdir.py output_lock) throughout.
    output_dir is checked before the target loads, so a refusal is quick: what it holds, what
    --overwrite would delete (inputs: files the caller read besides the config's, such as the
    YAML), and that it can be written."""
    from ...ground.outdir import check_replaceable, output_lock, probe_writable, reported_as
    from ...ground.target.load import load_target
    from .allocator import map_large_blocks_for

    map_large_blocks_for(config.data.max_length)  # long rows would fragment the C heap (train/loop/allocator.py)
    out = Path(config.output_dir)
    accelerator = make_accelerator(config)
    with output_lock(out, enabled=accelerator.is_main_process):
        # the main process alone: the probe's short-lived files would make another rank's look at
        # output_dir refuse it. Trainer.fit checks again on every rank, before anything is written.
        data_sha256 = None  # the data's content, kept in the checkpoints the main process writes
        if accelerator.is_main_process:
            existing = latest_checkpoint(out)
            check_output_dir(out, existing, resume=resume, overwrite=overwrite)
            if overwrite:
                check_replaceable(
                    out,
                    what="output_dir",
                    inputs=[config.target, config.data.path, config.features.path, config.init_from, *inputs],
                )
            if resume and existing is not None:  # here it costs no target load
                check_resume(saved_run_config(existing), config, str(existing))
            data_sha256 = trained_data_fingerprint(config)
            if resume and existing is not None:
                check_same_data(existing, data_sha256, config.data.path or config.data.source)
                # the run ends by replacing final/: a file no drafthead command wrote there is refused now, not then
                check_replaceable(out / FINAL_DIR, what="the run's final head folder")
            probe_writable(checkpoint_root(out) if config.checkpoint_every else out)
        loaded = load_target(config.target, dtype=config.target_dtype, device=accelerator.device, threads=config.threads)
        main_say = say if accelerator.is_main_process else (lambda message: None)
        trainer = build_trainer(config, loaded.model, loaded.tokenizer, target_name=loaded.name, accelerator=accelerator, say=main_say)
        trainer.data_sha256 = data_sha256
        with reported_as(out):  # a log or config write on a full disk names no file of its own
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
    share: this process's part of a capture run by several (train/capture/workshare.py; default alone).
    engine: another engine's target with `hidden_states(input_ids, attention_mask, layers)` (the
    llama.cpp backend) in place of `target_model`'s forward; the capture's meta names it."""
    hcfg = head_config_for(config, target_model, tokenizer, target_name)
    layers = required_layers(hcfg, hcfg.final_layer)
    samples = token_samples(config, tokenizer)
    for report in (samples.source_report, samples.format_report):
        assert report is not None  # token_samples makes both
        say(report.summary())
    meta = capture_meta(config, target_model, tokenizer, target_name)
    if engine is not None:
        meta["engine"] = type(engine).__name__
    return capture_features(
        target_model,
        samples.dataset,
        layers,
        out_dir,
        batch_size=batch_size or config.batch_size,
        shard_samples=config.features.shard_samples,
        dtype=config.features.dtype,
        pad_token_id=pad_token_id(tokenizer),
        meta=meta,
        progress=progress,
        share=share,
        featurize=engine.hidden_states if engine is not None else None,
    )
