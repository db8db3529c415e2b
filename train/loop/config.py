"""The run config: small typed dataclasses, YAML presets, `key=value` / `a.b=value` overrides.

Unknown keys are errors naming the key and the valid ones (docs/style.md 5). The head section is a
dict `{kind, ...}` parsed once, when the run config is made, by the head kind's own config class
(heads/config.py; `TrainConfig.head_config`), so head options have one home and a typo fails
before any model loads.

    cfg = load_config("configs/eagle3.yaml", ["lr=3e-4", "data.limit=2000"])
    cfg = load_config("eagle3")   # a preset name: configs/eagle3.yaml
"""

from __future__ import annotations

import importlib.resources

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from ...heads.config import KINDS, HeadConfig, check_context_parallel, config_from_dict
from ...ground.files import not_utf8
from ...ground.target.load import DTYPES

DTYPE_NAMES = tuple(DTYPES)

# Presets live in the repository's configs/ folder (one home for run settings), installed as the
# data package drafthead.configs (pyproject.toml), so a preset name works from any folder.
PRESET_DIR = Path(str(importlib.resources.files("drafthead.configs")))

SCHEDULES = ("cosine", "linear", "constant")
MIXED_PRECISION = ("no", "bf16", "fp16", "auto")  # auto: bf16 where the hardware runs it natively (train/loop/trainer.py)
REPORT_TO = ("none", "wandb")
PARALLELISM = ("ddp", "fsdp")  # train/loop/sharding.py
FEATURE_MODES = ("online", "captured")
KEEP_BEST = ("none", "tau_est", "replay_tau")  # eval metrics a best head may be kept by


class ConfigError(ValueError):
    pass


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


@dataclass
class DataConfig:
    source: str = "sharegpt"  # sharegpt | json | jsonl | regenerated | file (format from the path; train/data/sources.py)
    path: str | None = None  # file for json/regenerated; overrides the package file for sharegpt
    limit: int | None = None  # first N usable conversations
    max_length: int = 1024  # tokens per sample after the chat template (longer ones are cut)
    eval_fraction: float = 0.02  # held-out share of samples ...
    eval_size: int | None = 64  # ... capped at this many
    # streaming: read the file lazily, never whole (train/data/streaming.py, docs/models-and-data.md);
    # the eval set is then the first eval_size usable samples, and eval_fraction is unused
    streaming: bool = False
    shuffle_buffer: int = 1000  # streaming: samples in the seeded shuffle buffer (<= 1: file order)
    num_proc: int | None = None  # processes for the chat-template `.map` (the cached, non-streaming path)
    # several conversations per row, up to max_length tokens, each attending only to itself
    # (train/capture/packing.py): true, false, or unset: on wherever it is exact (always on captured
    # features; online, where the target's forward keeps packed conversations apart)
    packing: bool | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in [0, 1); got {self.eval_fraction}")
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be >= 2; got {self.max_length}")
        if self.shuffle_buffer < 0:
            raise ConfigError(f"data.shuffle_buffer must be >= 0; got {self.shuffle_buffer}")
        if self.num_proc is not None and self.num_proc < 1:
            raise ConfigError(f"data.num_proc must be >= 1; got {self.num_proc}")
        if self.streaming and self.eval_size is None:
            raise ConfigError("data.streaming needs data.eval_size (a count): a stream's length is unknown, so eval_fraction cannot apply")


@dataclass
class FeaturesConfig:
    # online: run the frozen target inside every step; captured: read shards written by
    # `drafthead data capture` (docs/cpu-measurements.md: capture once, reuse across epochs on CPU).
    mode: str = "online"
    path: str | None = None  # captured shard folder
    dtype: str = "bfloat16"  # storage dtype of captured hidden states
    shard_samples: int = 256

    def __post_init__(self) -> None:
        _choice("features.mode", self.mode, FEATURE_MODES)
        _choice("features.dtype", self.dtype, DTYPE_NAMES)
        if self.mode == "captured" and not self.path:
            raise ConfigError("features.mode=captured needs features.path (a `drafthead data capture` folder)")


@dataclass
class LoraConfig:
    """Medusa-2: the target is fine-tuned jointly through LoRA (Cai et al. 2024, sec. 2.3.2).

    loss = lm_loss_weight * CE(target LM, assistant tokens) + head_loss_weight * sum_k heads' loss.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    lr: float | None = None  # LoRA learning rate; None: the run's lr times lr_scale
    lr_scale: float = 0.25  # backbone learns slower than fresh heads
    lm_loss_weight: float = 1.0
    head_loss_weight: float = 0.2


@dataclass
class ReplayConfig:
    """At each eval, the head drafts for held-out prompts' greedy target continuations under the
    engine's own acceptance rule (train/loop/replay_eval.py, docs/training.md "Replayed acceptance")."""

    sequences: int = 0  # held-out prompts replayed; 0: off
    max_new_tokens: int = 64  # target greedy tokens per prompt, decoded once per run
    chain: int = 3  # replay_tau: a chain of this many top-1 drafts a round
    tree: bool = True  # also replay_tree_tau: the head's default drafting tree
    vllm: bool = True  # also replay_vllm_tau: the chain counted as vLLM counts its steps

    def __post_init__(self) -> None:
        if self.sequences < 0:
            raise ConfigError(f"replay.sequences must be >= 0; got {self.sequences}")
        for name in ("max_new_tokens", "chain"):
            if getattr(self, name) < 1:
                raise ConfigError(f"replay.{name} must be >= 1; got {getattr(self, name)}")


@dataclass
class TrainConfig:
    target: str = "smollm2-135m"  # built-in name or local folder (drafthead.ground.target.load.load_target)
    target_dtype: str = "float32"  # dtype the target is loaded in; auto: bfloat16 where native, else float32
    head: dict = field(default_factory=lambda: {"kind": "medusa1"})  # {kind, ...} -> heads/config.py
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # used only when head.kind == medusa2
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    init_from: str | None = None  # a saved head folder to continue training from (same target and architecture)

    batch_size: int = 4  # per process
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0  # the schedule decays to lr * min_lr_ratio
    max_steps: int | None = None  # optimizer steps; takes precedence over epochs
    epochs: float | None = 1.0
    clip_norm: float | None = 1.0
    mixed_precision: str = "no"
    # ddp: every rank holds the whole head and target; fsdp: fully_shard the head and the target's
    # decoder layers across ranks (train/loop/sharding.py, docs/scaling.md). One process ignores it.
    parallelism: str = "ddp"
    shard_target: bool = True  # under fsdp, shard the frozen target's decoder layers too
    # ranks that share each batch, its rows' columns split between them (EAGLE-3 and EAGLE-3.1
    # under ddp; heads/context_split.py, docs/scaling.md "Context parallelism"); 1: off
    context_parallel: int = 1

    checkpoint_every: int = 200  # optimizer steps (and at the end); 0: never
    keep_checkpoints: int = 2
    # none, or the eval metric whose highest value keeps its head in output_dir/best (train/loop/best.py)
    keep_best: str = "none"
    eval_every: int = 200  # optimizer steps; 0: only at the end
    eval_batches: int | None = None  # cap per evaluation
    log_every: int = 10
    output_dir: str = "runs/run"
    seed: int = 0
    report_to: str = "none"
    wandb_project: str = "drafthead"
    run_name: str | None = None
    threads: int | None = None  # torch threads per process; None: leave as is

    def __post_init__(self) -> None:
        _choice("target_dtype", self.target_dtype, DTYPE_NAMES + ("auto",))
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        _choice("report_to", self.report_to, REPORT_TO)
        _choice("parallelism", self.parallelism, PARALLELISM)
        _choice("keep_best", self.keep_best, KEEP_BEST)
        if self.keep_best == "replay_tau" and self.replay.sequences == 0:
            raise ConfigError("keep_best: replay_tau needs replay.sequences > 0 (the held-out prompts it is measured on)")
        if not isinstance(self.head, dict) or "kind" not in self.head:
            raise ConfigError(f"head must be a mapping with a 'kind' ({', '.join(KINDS)})")
        head = self.head_config  # parsed now, once: a bad head section fails before anything loads
        try:
            check_context_parallel(head.kind, head.loss, self.context_parallel)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in ("batch_size", "grad_accum", "log_every", "keep_checkpoints", "context_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name, zero in (("warmup_steps", "none"), ("checkpoint_every", "never"), ("eval_every", "only at the end")):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: {zero}); got {getattr(self, name)}")
        for name in ("max_steps", "eval_batches", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.max_steps is None and self.epochs is None:
            raise ConfigError("set max_steps or epochs")
        # written so that nan fails each test (every comparison with nan is False)
        if self.epochs is not None and not 0 < self.epochs < math.inf:
            raise ConfigError(f"epochs must be a number > 0; got {self.epochs}")
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"lr must be a number > 0; got {self.lr}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"weight_decay must be a number >= 0; got {self.weight_decay}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio}")
        if self.clip_norm is not None and not 0 <= self.clip_norm < math.inf:
            raise ConfigError(f"clip_norm must be a number >= 0 (0 or null: off); got {self.clip_norm}")
        if len(self.betas) != 2:
            raise ConfigError(f"betas must be two numbers; got {self.betas}")
        if self.replay.sequences and self.joint_lora:
            raise ConfigError(
                "replay is not supported for medusa2: its target changes every step, so the greedy "
                "continuations replayed on would too; use replay.sequences=0"
            )
        if self.data.streaming and self.features.mode == "captured":
            raise ConfigError(
                "data.streaming reads samples lazily while training; captured features are already on disk: "
                "use features.mode=online, or data.streaming=false"
            )

    @property
    def head_kind(self) -> str:
        return self.head["kind"]

    @functools.cached_property
    def head_config(self) -> HeadConfig:
        """The head section as its kind's config (heads/config.py), not yet bound to a target
        (heads/registry.py bind_target binds it)."""
        try:
            return config_from_dict(dict(self.head))
        except ValueError as e:
            raise ConfigError(f"head: {e}") from None

    @property
    def joint_lora(self) -> bool:
        """Medusa-2 trains the target with LoRA alongside the heads."""
        kind = KINDS.get(self.head_kind)
        return kind is not None and kind.adapts_target

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        return _build(cls, data, "")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def data_replicas(processes: int, context_parallel: int) -> int:
    """The data-parallel replicas of a run on `processes` processes: each group of
    `context_parallel` consecutive ranks reads the same batches, so it must divide them."""
    if processes % context_parallel:
        raise ConfigError(f"context_parallel: {context_parallel} does not divide the {processes} processes")
    return processes // context_parallel


# ----------------------------------------------------------------------------------------------
# Building dataclasses from dicts with checks
# ----------------------------------------------------------------------------------------------


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Check/convert a YAML value against an annotation (int, float, str, bool, list, dict, Optional)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: bad value {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list; got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false; got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name} must be an integer; got {value!r}")
    if tp is float:
        # YAML 1.1 reads "1e-3" as a string: accept numeric strings for float fields
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number; got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name} must be a string; got {value!r}")
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping; got {value!r}")
        return dict(value)
    return value


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping; got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(
            f"unknown config key '{prefix}{unknown[0]}'; valid keys{' under ' + prefix.rstrip('.') if prefix else ''}: " + ", ".join(fields)
        )
    kwargs = {}
    for k, v in data.items():
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _build(tp, v, f"{prefix}{k}.")
        else:
            kwargs[k] = _coerce(f"{prefix}{k}", v, tp)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(str(e)) from None


# ----------------------------------------------------------------------------------------------
# YAML + overrides
# ----------------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        return key.split("."), load_yaml_text(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e}); quote it") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each `a.b=value` in a nested dict (copying); unknown keys are caught when building."""
    data = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def _deep_copy(d):
    return {k: _deep_copy(v) for k, v in d.items()} if isinstance(d, dict) else d


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A YAML path, or a preset name looked up in configs/."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"config file {path} does not exist")
        return path
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if not preset.exists():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ConfigError(f"no config file or preset named {name_or_path!r}; presets: {', '.join(names)}")
    return preset


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (yaml keeps the last one
    silently: `lr:` twice would train at whichever came second)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges; its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key '{key}' is given twice (first at line {first[key].line + 1})", key_node.start_mark
                )
            first.setdefault(key, key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: str) -> Any:
    """yaml.safe_load, with a key given twice refused (_UniqueKeyLoader)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def read_yaml(path: Path) -> Any:
    """A YAML file's value; a file that does not parse, gives a key twice or is not UTF-8 is a
    ConfigError naming the file and the place (yaml's own message spans several lines)."""
    try:
        return load_yaml_text(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}; fix the file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(str(not_utf8(path, e))) from None


def load_config(name_or_path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    data: dict = {}
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        data = read_yaml(path)
        if data is None:  # an empty file, or comments only: every setting at its default would run
            raise ConfigError(
                f"{path} holds no settings (it is empty or all comments): write the run's settings "
                "in it, or start from a preset (--config eagle3; configs/ lists them)"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    return TrainConfig.from_dict(apply_overrides(data, list(overrides)))


# ----------------------------------------------------------------------------------------------
# What a resume may change
# ----------------------------------------------------------------------------------------------

# Fields a `--resume` may change: how the run is watched, saved and how long it goes. Every other
# field (data, features, batch, optimizer and schedule, target, head, LoRA, seed, init_from)
# decides what the checkpoint's weights and optimizer state mean, so a change is refused
# (docs/reliability.md "Resume"). A longer or shorter run stretches the LR schedule to the new end.
RESUME_MAY_CHANGE = (
    "max_steps",
    "epochs",
    "checkpoint_every",
    "keep_checkpoints",
    "eval_every",
    "eval_batches",
    "log_every",
    "report_to",
    "wandb_project",
    "run_name",
    "threads",
    "output_dir",
    "data.num_proc",  # processes for the chat-template map: the same samples either way
    "data.packing",
)  # the same conversations per step, laid out in fewer rows


def flatten(data: dict, prefix: str = "") -> dict:
    """{'data': {'path': p}} -> {'data.path': p}; the head section is flattened too."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def may_change(key: str) -> bool:
    """Whether a resume may change the flattened field `key` (it or a section above it is in
    RESUME_MAY_CHANGE)."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in RESUME_MAY_CHANGE for n in range(1, len(parts) + 1))


def resume_changes(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """(refused, applied): the fields that differ between the config a checkpoint was written
    with (`saved`) and this run's (`now`), as 'key: old -> new' lines, split by `may_change`.
    A field missing on one side counts as changed."""
    a, b = flatten(saved), flatten(now)
    refused: list[str] = []
    applied: list[str] = []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, "<unset>"), b.get(key, "<unset>")
        if old != new:
            (applied if may_change(key) else refused).append(f"{key}: {old!r} -> {new!r}")
    return refused, applied


def check_resume(saved: dict | None, config: TrainConfig, where: str) -> list[str]:
    """The applied changes of a resume from the checkpoint at `where`, whose config is `saved`
    (None: unknown, nothing to compare); a change of meaning raises ConfigError with the diff."""
    if saved is None:
        return []
    # a field the saved config does not name ran at its default
    refused, applied = resume_changes(_with_defaults(saved, TrainConfig().to_dict()), config.to_dict())
    if refused:
        raise ConfigError(
            f"--resume: {where} was written with another config; these fields change what the run means: "
            + "; ".join(refused)
            + ". Resume with the saved values, or start a new phase from a saved head: "
            "init_from=HEAD_DIR output_dir=NEW_DIR"
        )
    return applied


def _with_defaults(data: dict, defaults: dict) -> dict:
    """`data` with every key of `defaults` it lacks filled in, section by section."""
    out = dict(data)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict) and key != "head":  # head: its kind's own fields
            out[key] = _with_defaults(out[key], value)
    return out
